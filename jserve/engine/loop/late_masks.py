"""Structured outputs under async scheduling (docs/structured_output.md, "Async scheduling"):
a constrained request decodes every step. Its row joins a step before the host has read its
previous token; that step's forward is launched alone, and its sampling follows once the host
has read the token and computed the request's next mask, while the forward runs."""
from __future__ import annotations

import numpy as np

from jserve.engine.batch.builder import BuiltStep
from jserve.engine.loop.faults import RequestFaults
from jserve.engine.loop.in_flight import Launched
from jserve.engine.requests.state import mask_pending
from jserve.scheduler import Request


def late_rows(built: BuiltStep, requests: dict[str, Request]) -> list[tuple[int, Request]]:
    """(row, request) of ``built``'s sampled rows whose mask is not known yet."""
    return [(row, requests[c.request_id]) for row, c in built.sample_rows
            if mask_pending(requests[c.request_id])]


def late_bitmask(done: Launched, requests: dict[str, Request], faults: RequestFaults
                 ) -> np.ndarray:
    """The allowed-token bitmask of every padded sampling row of ``done``'s forward: as
    built, with its late rows' masks now that their previous tokens are read (a request
    that token finished, or whose grammar it completed, keeps all ones: its token is
    dropped; so does one whose grammar failed, noted in ``faults``)."""
    built = done.built.arrays.sampling.allowed
    allowed = np.full((done.out.rows, built.shape[1]), -1, np.int32)
    allowed[:len(built)] = built
    for row, req in done.late:
        c = req.payload.constraint
        if requests.get(req.request_id) is req and not c.done:
            mask = faults.run(req, "its grammar mask", c.mask)
            if mask is not None:
                allowed[row] = mask
    return allowed
