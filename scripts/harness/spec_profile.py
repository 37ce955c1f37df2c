"""Where a batch-1 speculating step's milliseconds go, against a plain decode step
(``scripts/profile_speculative.py``): each phase of ``LLMEngine.step`` timed by wrapping the
engine's own calls (proposer, policy and packing, build, dispatch, readback, update and
output), per kind of step, and the device-only time of the captured decode steps."""
from __future__ import annotations

import collections
import functools
import statistics
import time

import jax
import numpy as np
from tqdm import tqdm

from harness.spec_decode import SETTINGS, workloads
from jserve import LLM

PHASES = ("propose", "schedule", "build", "dispatch", "readback", "update+output", "step")


class PhaseTimer:
    """Wraps an engine's calls and records per engine step how long each phase took."""

    def __init__(self, llm: LLM):
        eng = self.eng = llm.engine
        self.steps: list[dict[str, float]] = []
        self.now: dict[str, float] = collections.defaultdict(float)
        self.rows: list[int] = []
        sched = eng.scheduler
        if sched.proposer is not None:
            sched.proposer = self._timed("propose", sched.proposer)
        schedule = self._timed("schedule", sched.schedule)

        def scheduled(*args, **kwargs):  # the engine passes the burst's arguments
            plan = schedule(*args, **kwargs)
            self.now["drafts"] = plan.num_draft_tokens
            return plan
        sched.schedule = scheduled
        eng.builder.build = self._timed("build", eng.builder.build)
        eng._execute = self._timed("dispatch", eng._execute)
        sched.update = self._timed("update+output", sched.update)
        self._outputs = eng.outputs.add_token
        eng.outputs.add_token = self._timed("update+output", eng.outputs.add_token)
        self._read = eng._read
        eng._read = self._wait_then_read
        self._step = eng.step
        eng.step = self._timed_step
        self.captured: dict[tuple[int, int], tuple] = {}
        execute = eng.runner.execute_packed

        def capture(shape, ibuf, fbuf, *args, **kwargs):
            self.captured[shape] = (ibuf, fbuf)
            return execute(shape, ibuf, fbuf, *args, **kwargs)
        eng.runner.execute_packed = capture

    def _timed(self, name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[name] += time.perf_counter() - t
        return run

    def _wait_then_read(self, done):
        t = time.perf_counter()
        jax.block_until_ready(done.out.tokens)
        self.now["readback"] += time.perf_counter() - t
        return self._read(done)

    def _timed_step(self):
        self.now = collections.defaultdict(float)
        t = time.perf_counter()
        out = self._step()
        self.now["step"] = time.perf_counter() - t
        # schedule() includes the proposer: report the policy and packing alone.
        self.now["schedule"] -= self.now["propose"]
        self.steps.append(dict(self.now))
        return out


def phase_medians(timer: PhaseTimer, llm: LLM, prompts, params
                  ) -> dict[str, tuple[dict[str, float], float]]:
    """Per kind of step ("all", "drafts": with drafts, "plain": without): (per-phase median
    ms over the run's decode steps, the share of such steps)."""
    timer.steps = []
    outs = llm.generate(prompts, params)
    steps = timer.steps[2:]  # past the prefill and the first decode
    tokens = sum(len(o.token_ids) for o in outs)
    kinds = {"all": steps, "drafts": [s for s in steps if s.get("drafts")],
             "plain": [s for s in steps if not s.get("drafts")]}
    res = {k: ({p: statistics.median(s.get(p, 0.0) for s in ss) * 1e3 for p in PHASES},
               len(ss) / len(steps)) for k, ss in kinds.items() if ss}
    res["all"][0]["tokens/step"] = tokens / len(timer.steps)
    res["all"][0]["mean"] = sum(s["step"] for s in timer.steps) / tokens * 1e3
    return res


def device_only(llm: LLM, shape: tuple[int, int], bufs: tuple, calls: int = 30) -> float:
    """Median ms of the compiled step plus sampling, run back to back on a captured step's
    buffers (run after every timed run: it rewrites that step's KV slots)."""
    runner = llm.engine.runner
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        np.asarray(runner.execute_packed(shape, *bufs).tokens)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def profile(a) -> None:
    """The three engines (base, base-sync, ngram) on one greedy request of ``a.workload``,
    ``a.reps`` times; the phase table and the device-only steps.
    ``a``: ``scripts/profile_speculative.py``'s flags."""
    model, prompts, params = workloads(1)[a.workload]
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1}
    engines = {"base": LLM(model, **SETTINGS),
               "ngram": LLM(model, speculative_config=spec, **SETTINGS)}
    modes = {"base": ("base", True), "base-sync": ("base", False), "ngram": ("ngram", True)}
    timers = {name: PhaseTimer(llm) for name, llm in engines.items()}
    res: dict[str, list] = collections.defaultdict(list)
    for _ in tqdm(range(a.reps), desc="repetitions"):
        for mode, (name, async_on) in modes.items():
            llm = engines[name]
            llm.engine.async_scheduling = async_on
            res[mode].append(phase_medians(timers[name], llm, prompts, params))
    print_phases(a, res)
    print_device_only(a, engines, timers)


def print_phases(a, res: dict[str, list]) -> None:
    print(f"\nworkload {a.workload}, batch 1, k={a.k}: per engine step, ms (median)\n")
    print("| mode | steps | share | " + " | ".join(PHASES) + " |")
    print("|---|---|---:|" + "---:|" * len(PHASES))
    for mode, runs in res.items():
        for kind in ("all", "drafts", "plain"):
            got = [r[kind] for r in runs if kind in r]
            if not got:
                continue
            med = {p: statistics.median(g[0][p] for g in got) for p in PHASES}
            share = statistics.median(g[1] for g in got)
            print(f"| {mode} | {kind} | {share:.2f} | "
                  + " | ".join(f"{med[p]:.3f}" for p in PHASES) + " |")
        per_step = statistics.median(r["all"][0]["tokens/step"] for r in runs)
        per_token = statistics.median(r["all"][0]["mean"] for r in runs)
        print(f"| {mode} | tokens/step {per_step:.2f}, ms/token {per_token:.3f} |"
              + " |" * (len(PHASES) + 1))


def print_device_only(a, engines: dict[str, LLM], timers: dict[str, PhaseTimer]) -> None:
    print("\ndevice-only step + sampling, captured decode-only steps (rows bucket: ms):")
    for name, llm in engines.items():
        for shape, bufs in sorted(timers[name].captured.items()):
            if shape[1] == 0:
                ms = statistics.median(device_only(llm, shape, bufs) for _ in range(a.reps))
                print(f"  {name}: {shape[0]} rows: {ms:.3f} ms")
