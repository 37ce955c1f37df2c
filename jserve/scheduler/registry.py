"""Scheduling policies by name: one table that the engine, the simulator, the router reports
and the CLI all read, so a name means the same policy everywhere and a new policy is one
entry here (plus its scheduler class)."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from jserve.cache.allocator import PageAllocator
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import RuntimePredictor
from jserve.scheduler.sarathi import SarathiScheduler
from jserve.scheduler.sprpt import SPRPTScheduler


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a policy name means to everything that takes one."""

    name: str
    summary: str
    predictor: bool = False       # times chunks with a runtime predictor (deadline policies)
    deadline_order: bool = False  # ranks waiting requests by deadline (routing reports say so)
    length_probe: bool = False    # ranks by predicted output length (needs a length probe)
    engine: bool = True           # the live engine runs it
    simulated: bool = True        # the simulator runs it
    runs: str | None = None       # the scheduler it is, under another setting (lars-ss)
    space_sharing: bool | None = None  # forced on or off; None: the configuration's


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("fcfs", "first come, first served; whole prompts, no preemption", predictor=True),
    Policy("sarathi", "first come, first served in fixed chunks, decodes first "
                      "(Sarathi-Serve)"),
    Policy("edf", "earliest TTFT deadline first, adaptive chunks", predictor=True,
           deadline_order=True),
    Policy("lrs", "least remaining slack first, adaptive chunks", predictor=True,
           deadline_order=True),
    Policy("lars", "length-aware relative slack first, adaptive chunks (Medha)",
           predictor=True, deadline_order=True),
    Policy("lars-ss", "lars with space sharing (one long prefill beside short ones)",
           predictor=True, deadline_order=True, engine=False, runs="lars",
           space_sharing=True),
    Policy("sprpt", "shortest predicted remaining processing time (a length probe)",
           length_probe=True, simulated=False),
    Policy("loongserve", "LoongServe's elastic sequence parallelism (simulator baseline)",
           engine=False),
)}
ENGINE_POLICIES = tuple(n for n, p in POLICIES.items() if p.engine)
SIMULATED_POLICIES = tuple(n for n, p in POLICIES.items() if p.simulated)


def policy(name: str, where: str = "engine") -> Policy:
    """The registry's entry for ``name``; ValueError naming the choices ``where`` (``engine``
    or ``simulator``) has when it has no such policy."""
    names = ENGINE_POLICIES if where == "engine" else SIMULATED_POLICIES
    if name not in names:
        what = "scheduler" if where == "engine" else "policy"
        raise ValueError(f"{what} must be one of {names}, got {name!r}")
    return POLICIES[name]


@dataclasses.dataclass(frozen=True)
class Limits:
    """The batch limits every scheduler takes (``SchedulerBase``): one value, so a policy
    built anywhere gets the three together."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_seqs: int


@dataclasses.dataclass(frozen=True)
class SchedulerSpec:
    """What a scheduler is, by policy ``name``: its ``limits`` and the knobs of the policies
    that read them (``deadline`` for the deadline policies; ``sprpt_c``, the preemption
    window, and ``fallback_remaining``, the remaining length assumed before a prediction,
    for ``sprpt``). ``max_context``: the longest context, for the prefill-time cache a
    deadline policy builds when given none. ``where``: whose policy names it takes
    (``engine`` or ``simulator``)."""

    name: str
    limits: Limits
    deadline: DeadlineConfig = DeadlineConfig()
    sprpt_c: float = 0.8
    fallback_remaining: float | None = None
    max_context: int | None = None
    where: str = "engine"


def build_scheduler(spec: SchedulerSpec, allocator: PageAllocator, *,
                    predictor: RuntimePredictor | None = None,
                    prefill_cache: PrefillTimeCache | None = None,
                    clock: Callable[[], float] = time.monotonic) -> SchedulerBase:
    """Policies with a predictor need it and either ``spec.max_context`` (to build the
    prefill-time cache) or a ready ``prefill_cache``; ``sarathi`` and ``sprpt`` need none of
    them."""
    p = policy(spec.name, spec.where)
    limits = dataclasses.asdict(spec.limits)
    if p.name == "sarathi":
        return SarathiScheduler(allocator, **limits)
    if p.name == "sprpt":
        return SPRPTScheduler(allocator, c=spec.sprpt_c,
                              fallback_remaining=spec.fallback_remaining, **limits)
    if not p.predictor:
        raise ValueError(f"policy {spec.name!r} is not a scheduler (it runs through its own "
                         f"simulator)")
    if predictor is None or (spec.max_context is None and prefill_cache is None):
        raise ValueError(f"policy {spec.name!r} needs a runtime predictor and max_context")
    deadline = spec.deadline
    if p.space_sharing is not None:
        deadline = dataclasses.replace(deadline, space_sharing=p.space_sharing)
    cache = prefill_cache or PrefillTimeCache(predictor, spec.max_context, deadline.t_target,
                                              chunk_granularity=deadline.chunk_granularity,
                                              max_chunk=spec.limits.max_num_batched_tokens)
    return DeadlineScheduler(allocator, policy=p.runs or p.name, predictor=predictor,
                             prefill_cache=cache, config=deadline, clock=clock, **limits)
