"""Host copies of swapped-out KV pages. The scheduler decides who swaps
(jserve.scheduler.swap) and puts the page moves in the plan; this store carries them out
before the plan's step runs."""
from __future__ import annotations

import numpy as np

from jserve.scheduler import BatchPlan


class HostKVStore:
    def __init__(self, runner):
        self.runner = runner
        self.copies: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def apply(self, plan: BatchPlan) -> None:
        """Swap-outs first: the plan may reuse the pages they free."""
        for rid, pages in plan.swap_out:
            self.copies[rid] = self.runner.read_pages(pages)
        for rid, pages in plan.swap_in:
            self.runner.write_pages(pages, self.copies.pop(rid))

    def drop(self, request_id: str) -> None:
        self.copies.pop(request_id, None)
