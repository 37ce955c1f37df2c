"""Plans on the device: the batch queue of the engine step (one slot per pipeline stage) and,
under async scheduling, the plan that left the device last step whose tokens the host has
not read yet."""
from __future__ import annotations

import collections
import dataclasses

from jserve.engine.batch.builder import BuiltStep
from jserve.scheduler import BatchPlan, Request


@dataclasses.dataclass(eq=False)
class Launched:
    """A plan on the device: its chunks' requests as launched (an id may be reused once a
    request is aborted), its built step (rows that sample, run-time switches) and, once it
    has left the device, the step's outputs."""

    plan: BatchPlan
    requests: list[Request]
    built: BuiltStep
    want_logprobs: bool
    capture: object = None  # the length probe's captured layer state (device arrays)
    prompt_logprobs: object = None  # its step's PromptLogprobs when it asked for them
    launched_at: float = 0.0  # time.perf_counter() when its step was launched
    out: object = None      # the SampleResult of the step it left the device in
    # (row, request) of structured outputs whose mask is sent after the forward
    # (``jserve.engine.loop.late_masks``); ``out`` holds the forward's SampleInputs until then.
    late: list = dataclasses.field(default_factory=list)


class InFlight:
    """``depth`` slots, newest first (``None``: an empty pipeline slot): a plan pushed into a
    full queue pushes the oldest out, which is the plan whose tokens that step samples.
    ``unread`` is such a plan kept for the host to read one step later."""

    def __init__(self, depth: int):
        self.depth = depth
        # Whether a lone batch passes every stage in one step (``lone``); settable.
        self.lone_passes = True
        self.slots: collections.deque[Launched | None] = collections.deque()
        self.unread: Launched | None = None
        self.log: list[dict] | None = None  # one record per push when on (spp > 1 tests)

    def lone(self, launched: Launched | None, more: bool) -> bool:
        """Whether ``launched`` runs as a pass through every pipeline stage rather than a
        tick: spp > 1, the pipeline holds no batch and the scheduler has nothing ``more``
        that could join it there (a waiting request, a running one not in flight, the next
        chunk of a prefill). A pipeline left empty by a pass stays empty, so while more
        work is ready the batches tick and fill the stages instead."""
        return (self.lone_passes and self.depth > 1 and launched is not None and not more
                and not self.busy)

    def push(self, launched: Launched | None, out, lone: bool = False) -> Launched | None:
        """Enters ``launched`` (``out``: the outputs of the step it was launched in) and
        returns the plan leaving the device in that step, if any: ``launched`` itself after
        a pass (``lone``), which never takes a slot."""
        if lone:
            launched.out = out
            if self.log is not None:
                self.log.append({"in_flight": 1, "stages": self.stages([launched]),
                                 "lone": True})
            return launched
        self.slots.appendleft(launched)
        if self.log is not None:
            stages = self.stages()
            self.log.append({"in_flight": sum(map(bool, stages)), "stages": stages})
        done = self.slots.pop() if len(self.slots) == self.depth else None
        if done is not None:
            done.out = out
        return done

    def take_unread(self) -> Launched | None:
        done, self.unread = self.unread, None
        return done

    @property
    def busy(self) -> bool:
        """Whether a slot holds a plan (a pipeline tick still has work)."""
        return any(b is not None for b in self.slots)

    @property
    def pending(self) -> bool:
        return self.busy or self.unread is not None

    def drain(self, reading: Launched | None = None) -> list[Launched]:
        """Every plan on the device, oldest first (``reading``, being read, is older than all
        of them), and empties the queue."""
        entries = [b for b in (reading, self.unread) if b is not None]
        entries += [b for b in reversed(self.slots) if b is not None]
        self.unread = None
        self.slots.clear()
        return entries

    def stages(self, slots=None) -> list[list[tuple]]:
        """Per slot, newest first: (request id, start, tokens, samples) of its chunks."""
        return [[(c.request_id, c.start, c.num_tokens, c.samples)
                 for c in b.plan.decodes + b.plan.prefills] if b is not None else []
                for b in (self.slots if slots is None else slots)]
