"""Swap or recompute: the scheduler's choice for each preemption victim, and the host memory
the swapped requests reserve. Pure Python; the engine supplies the costs (a copy's time
depends on the platform, a recompute's on the runtime predictor) and moves the pages."""
from __future__ import annotations

from typing import Callable, Literal

from jserve.scheduler.request import Request


class SwapPolicy:
    """``mode`` "swap" swaps whenever the copy fits ``capacity_bytes``; "auto" also needs
    the copy there and back (``round_trip_seconds(bytes)``) to be predicted cheaper than
    recomputing the victim's KV (``recompute_seconds(tokens)``). A request that must see
    every token go through the model (``Request.cacheable`` False: penalties rebuild their
    state from the tokens a recompute feeds through) always recomputes."""

    def __init__(self, mode: Literal["swap", "auto"], *, capacity_bytes: int, page_bytes: int,
                 round_trip_seconds: Callable[[int], float],
                 recompute_seconds: Callable[[int], float]):
        if mode not in ("swap", "auto"):
            raise ValueError(f"swap mode must be 'swap' or 'auto', got {mode!r}")
        self.mode = mode
        self.capacity_bytes = capacity_bytes
        self.page_bytes = page_bytes
        self._round_trip_seconds = round_trip_seconds
        self._recompute_seconds = recompute_seconds
        self.reserved: dict[str, int] = {}  # host bytes by swapped request id

    def swaps(self, req: Request, num_pages: int) -> bool:
        """Whether to swap ``req``'s ``num_pages`` KV pages out (reserving their host
        bytes until ``release``) rather than drop them for recompute."""
        if not req.cacheable:
            return False
        nbytes = num_pages * self.page_bytes
        if sum(self.reserved.values()) + nbytes > self.capacity_bytes:
            return False
        if self.mode == "auto" and \
                self._round_trip_seconds(nbytes) >= self._recompute_seconds(req.num_computed):
            return False
        self.reserved[req.request_id] = nbytes
        return True

    def release(self, request_id: str) -> None:
        """The request's host copy went back to the device or was dropped."""
        self.reserved.pop(request_id, None)
