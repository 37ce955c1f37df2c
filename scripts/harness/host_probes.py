"""Probes on a live engine's host loop (``scripts/profile_step.py``): whether the device
waits for the host at each step's dispatch (``DispatchProbe``), and the engine thread's CPU
time per step split by phase (``HostPhases``). Both wrap the engine's own methods."""
from __future__ import annotations

import time

import jax
import numpy as np

from jserve.engine.engine import LLMEngine


class DispatchProbe:
    """Watches the device through the engine's own calls. At each step's dispatch: is the
    previous step still running (then the device goes on to this one without waiting for
    the host: no idle gap), and if not, how long since the host saw the previous step's
    tokens (synchronous: the host waits for them, so that is the idle gap; async: a lower
    bound of it)."""

    def __init__(self, eng: LLMEngine):
        self.records: list[tuple[bool, float]] = []  # (device busy at dispatch, gap seconds)
        self._last, self._ready_at = None, None
        self._execute, self._read = eng.runner.execute_packed, eng._read
        eng.runner.execute_packed, eng._read = self.execute, self.read

    def execute(self, *args, **kwargs):
        now = time.perf_counter()
        if self._last is not None and self._ready_at is not None:
            busy = not self._last.tokens.is_ready()
            self.records.append((busy, 0.0 if busy else now - self._ready_at))
        self._last = out = self._execute(*args, **kwargs)
        return out

    def read(self, done):
        jax.block_until_ready(done.out.tokens)
        self._ready_at = time.perf_counter()
        return self._read(done)

    def take(self) -> list[tuple[bool, float]]:
        records, self.records, self._last, self._ready_at = self.records, [], None, None
        return records


class HostPhases:
    """The engine thread's CPU time per step, split by phase: each phase is a method of the
    engine or one of its parts, wrapped so that time goes to the innermost phase running
    (exclusive times; ``other`` is the step's time outside every phase). Only the steps
    ``decode_steps`` keeps are recorded."""

    PHASES = (  # (label, owner attribute path, method)
        ("schedule", "scheduler", "schedule"),
        ("launch (rows, flags)", "", "_launch"),
        ("build", "builder", "build"),
        ("pack", "_slots", "buffers"),
        ("step executable call", "runner", "execute_packed"),
        ("sampler call", "runner", "sample"),
        ("sampled_on_device", "scheduler", "sampled_on_device"),
        ("token read", "", "_read"),
        ("complete: update", "scheduler", "update"),
        ("complete: outputs", "", "_complete"),
    )

    def __init__(self, eng: LLMEngine):
        self.runs: list[list[dict[str, float]]] = []  # per ``decode_steps`` run, per step
        self._stack: list[str] = []
        self._mark = 0.0
        self._now: dict[str, float] | None = None
        for label, path, method in self.PHASES:
            owner = eng
            for name in filter(None, path.split(".")):
                owner = getattr(owner, name)
            setattr(owner, method, self._wrap(label, getattr(owner, method)))

    def _charge(self) -> None:
        now = time.thread_time()
        if self._now is not None:
            top = self._stack[-1] if self._stack else "other"
            self._now[top] = self._now.get(top, 0.0) + now - self._mark
        self._mark = now

    def _wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            self._charge()
            self._stack.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self._charge()
                self._stack.pop()
        return timed

    def start(self) -> None:
        self._now = {}
        self._mark = time.thread_time()

    def stop(self, keep: bool) -> None:
        self._charge()
        if keep:
            self.runs[-1].append(self._now)
        self._now = None

    def report(self, per: int = 1) -> None:
        """Median per step of each phase over the kept steps (each run's ramp and tail
        dropped, as ``decode_steps`` drops them); ``per`` > 1: steps were decode bursts of
        that many tokens, and the times are per token."""
        steps = [s for run in self.runs for s in run[2:-2]]
        labels = [label for label, _, _ in self.PHASES] + ["other"]
        med = {k: 1e3 / per * float(np.median([s.get(k, 0.0) for s in steps]))
               for k in labels}
        total = 1e3 / per * float(np.median([sum(s.values()) for s in steps]))
        what = "step" if per == 1 else f"token in bursts of {per}"
        print(f"  engine thread CPU per all-decode {what} (median of {len(steps)} steps): "
              f"{total:.3f} ms")
        for k in labels:
            print(f"    {k:24s} {med[k]:6.3f} ms")
