"""BatchPlan: the only thing that crosses from scheduler to engine."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    start: int        # first token position computed in this step
    num_tokens: int   # tokens computed in this step (1 for a decode)
    samples: bool     # the chunk reaches the end of the known tokens: sample a new one


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    decodes: tuple[ScheduledChunk, ...]
    prefills: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills
