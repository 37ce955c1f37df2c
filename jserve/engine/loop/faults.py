"""Per-request fault isolation inside a step.

A step does some work for every request in it: its sampler row and grammar mask before the
forward, its token's output processing (detokenization, stop strings, grammar advance,
logprobs) after. A failure in one request's part is that request's, not the step's: the
engine runs each such part through ``RequestFaults.run``, which logs the traceback, notes the
request, and hands back a neutral value so the step goes on for the others; the engine then
finishes every noted request with an error (its pages freed, its output carrying the
message) before the step returns. What is not per request (scheduling, the device step) still
fails the step as a whole (``LLMEngine._step_failed``).
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from jserve.scheduler import Request

log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestFaults:
    def __init__(self):
        self._noted: dict[str, tuple[Request, str]] = {}

    def run(self, req: Request, stage: str, fn: Callable[..., T], *args, default: T = None
            ) -> T:
        """``fn(*args)``, or ``default`` once ``req`` is noted as failed (then or before)."""
        if req.request_id in self._noted:
            return default
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
            log.exception("request %s failed in %s", req.request_id, stage)
            self._noted[req.request_id] = (req, f"internal error in {stage}: "
                                                f"{type(e).__name__}: {e}")
            return default

    def failed(self, req: Request) -> bool:
        return req.request_id in self._noted

    def take(self) -> list[tuple[Request, str]]:
        """The requests noted since the last call, with their messages."""
        if not self._noted:  # every step asks: nothing to allocate when nothing failed
            return []
        noted, self._noted = list(self._noted.values()), {}
        return noted
