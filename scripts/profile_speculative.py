"""Where a batch-1 speculating step's milliseconds go, against a plain decode step.

    python scripts/profile_speculative.py [--reps 5] [--k 4] [--workload quote]

One greedy request of ``bench_speculative.py``'s workload runs through three engines (same
settings as the bench): ``base`` (no speculation, async), ``base-sync`` (no speculation,
async off) and ``ngram`` (prompt lookup, k drafts). Each phase of ``LLMEngine.step`` is timed
by wrapping the engine's own calls: the proposer, the rest of ``schedule()`` (the policy and
packing), building the step's arrays, dispatching the step, waiting for its tokens (the
readback: this is where the host sits idle while the device runs), and ``update`` plus output
processing. Per step, each phase's median over the run, then the median over ``--reps``
runs. Also the device-only time of a step with 1 decode row and with 1 + k rows of one
sequence (the captured buffers run back to back, 30 calls, median): what the extra rows cost.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import subprocess
import time

import jax
import numpy as np
from tqdm import tqdm

import bench_speculative as bench
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

        def scheduled():
            plan = schedule()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--workload", default="quote", choices=bench.WORKLOADS)
    a = ap.parse_args()
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout
          .strip(), f"({os.cpu_count()} CPUs)")
    model, prompts, params = bench.workloads(1)[a.workload]
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1}
    engines = {"base": LLM(model, **bench.SETTINGS),
               "ngram": LLM(model, speculative_config=spec, **bench.SETTINGS)}
    modes = {"base": ("base", True), "base-sync": ("base", False), "ngram": ("ngram", True)}
    timers = {name: PhaseTimer(llm) for name, llm in engines.items()}
    res: dict[str, list] = collections.defaultdict(list)
    for _ in tqdm(range(a.reps), desc="repetitions"):
        for mode, (name, async_on) in modes.items():
            llm = engines[name]
            llm.engine.async_scheduling = async_on
            res[mode].append(phase_medians(timers[name], llm, prompts, params))
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
    print("\ndevice-only step + sampling, captured decode-only steps (rows bucket: ms):")
    for name, llm in engines.items():
        for shape, bufs in sorted(timers[name].captured.items()):
            if shape[1] == 0:
                ms = statistics.median(device_only(llm, shape, bufs) for _ in range(a.reps))
                print(f"  {name}: {shape[0]} rows: {ms:.3f} ms")
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout
          .strip())


if __name__ == "__main__":
    main()
