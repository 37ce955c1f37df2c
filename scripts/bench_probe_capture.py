"""What the length probe's capture costs per decode step on "tiny-tasks": mean step time with
the capture off and on (alternating, twice each) and the host-side tracker's share.

    python scripts/bench_probe_capture.py
"""
from __future__ import annotations

import argparse
import time

from jserve import LLM, SamplingParams
from jserve.probe import default_probe_path
from jserve.train.length_task import format_prompt, sample_tasks


def measure(probe: str | None, steps: int = 150) -> tuple[float, float]:
    """(seconds per step, tracker seconds per step) over ``steps`` steps after 5 warm ones,
    8 requests decoding."""
    llm = LLM("tiny-tasks", scheduler="fcfs", max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=1024, warmup=True, length_probe=probe)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for t in sample_tasks(8, 5):
        eng.add_request(format_prompt(t.prompt), params)
    for _ in range(5):
        eng.step()
    tracked = [0.0]
    if eng.length_tracker is not None:
        observe = eng.length_tracker.observe

        def timed(*args):
            t = time.perf_counter()
            observe(*args)
            tracked[0] += time.perf_counter() - t
        eng.length_tracker.observe = timed
    n, t0 = 0, time.perf_counter()
    while eng.has_unfinished() and n < steps:
        eng.step()
        n += 1
    return (time.perf_counter() - t0) / n, tracked[0] / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="timed decode steps a run")
    a = p.parse_args()
    probe = str(default_probe_path("tiny-tasks"))
    for path in (None, probe, None, probe):
        step, tracker = measure(path, a.steps)
        print(f"capture {'on ' if path else 'off'}: step {step * 1e3:.2f} ms, "
              f"tracker {tracker * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
