"""The engine's side of embeddings (``EngineConfig.runner = "pooling"``; the values it
shares with the serving layer are ``jserve.pooling``): every request is a prompt pooled into
one vector by its prefill; nothing is generated.

The step captures the final norm's output (``decoder.forward_stream``'s last capture layer):
at each sequence's last token of the step (``Capture.rows``) and summed over its prompt
tokens (``Capture.prompt_sum``). ``Pooler.observe`` keeps, per request, the sums across its
prefill chunks and, at the chunk that ends its prompt, its vector. The request then ends
(``OutputProcessor``: the prefill's sampled token is dropped) with that raw vector. Mean
pooling needs every prompt token computed, so it runs with the prefix cache off;
last-token pooling reads the last token, which a cache hit still computes. No JAX here."""
from __future__ import annotations

import numpy as np

from jserve.pooling import PoolingSpec


class Pooler:
    """``observe`` runs after every step (before its tokens are appended), on the step's
    ``Capture``: sets ``payload.embedding`` of each request whose prompt the step ended."""

    def __init__(self, spec: PoolingSpec, num_layers: int):
        self.spec = spec
        self.layer = num_layers  # the capture layer of the final norm's output
        # A sequence classifier's head [num_labels, hidden] (``ModelConfig.num_labels``):
        # the vector is then its logits of the last token's state.
        self.head: np.ndarray | None = None
        self._sum: dict[str, np.ndarray] = {}
        self._count: dict[str, int] = {}

    def observe(self, plan, built, requests, capture) -> None:
        if not plan.prefills:
            return
        mean = self.spec.mode == "mean"
        sums = np.asarray(capture.prompt_sum) if mean else None
        rows = None if mean else np.asarray(capture.rows)
        sampled = {c.request_id: row for row, c in built.sample_rows}
        bd = built.shape[0]
        for j, c in enumerate(plan.prefills):
            rid, req = c.request_id, requests.get(c.request_id)
            if req is None:
                continue
            end = c.start + c.num_tokens
            if mean:
                if c.start == 0:  # a first chunk, or a recompute from scratch
                    self._sum.pop(rid, None)
                    self._count.pop(rid, None)
                n = min(end, req.num_prompt_tokens) - c.start
                if n > 0:
                    self._sum[rid] = self._sum.get(rid, 0.0) + sums[bd + j]
                    self._count[rid] = self._count.get(rid, 0) + n
            if end >= req.num_prompt_tokens:
                v = (self._sum.pop(rid) / self._count.pop(rid) if mean
                     else rows[sampled[rid]].copy())
                req.payload.embedding = v if self.head is None else self.head @ v

    def forget(self, request_id: str) -> None:
        self._sum.pop(request_id, None)
        self._count.pop(request_id, None)
