"""DeadlineScheduler.schedule() ("FormNextBatch") time with 1,000 waiting and 128 running requests.

    python scripts/bench_scheduler.py                      # table: every policy x predictor
    python scripts/bench_scheduler.py --reps 100 --json out.json
    python scripts/bench_scheduler.py --warm               # state read once before timing
    python scripts/bench_scheduler.py --profile lars --predictor gpu   # cProfile one case

The state (seeded, rebuilt identically for every policy and predictor):
- running: 120 decodes (ShareGPT4 prompt + part of its output, so KV lengths vary) and 8
  partial prefills, two of them long (64k and 128k prompts past the 32k long threshold);
- waiting: 1,000 requests with ShareGPT4 prompt lengths (``sharegpt4_8k_lengths.csv`` in the
  shared data) plus 5 long ones (32k-128k tokens), arrived over the last 3 s, with the
  default TTFT deadlines, so some slacks are already negative;
- limits: max_num_seqs 256 (room for 128 admissions), 8192 tokens, 8 prefills per batch,
  a 50 ms iteration budget, space sharing on; KV memory is not the constraint.

Predictors: ``gpu`` is the simulator's ``GpuTimeModel("llama3-8b", "a100", tp=8, spp=2)``;
``linear`` a ``LinearPredictor`` fitted to it on random plans. Each repetition restores the
state (a deep copy; predictor and prefill-time cache shared) and times ``schedule()`` alone.
A fresh copy is cold in the CPU caches; ``--warm`` reads every request once before timing,
as the previous step would have left them.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import csv
import json
import pstats
import random
import statistics
import time

from jserve.cache.allocator import BlockAllocator
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request, RequestStatus
from jserve.sim import GpuTimeModel, VirtualClock
from jserve.sim.hardware import default_data_dir

POLICIES = ("lars", "edf", "lrs", "fcfs")
NOW = 100.0
MAX_CONTEXT = 131_072
LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_prefill_seqs=8)
CONFIG = DeadlineConfig(t_target=0.05, space_sharing=True)


def sharegpt_lengths() -> list[tuple[int, int]]:
    path = default_data_dir() / "traces" / "sharegpt4_8k_lengths.csv"
    with open(path, newline="") as f:
        return [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
                for r in csv.DictReader(f)]


def fit_linear(gpu: GpuTimeModel, rng: random.Random) -> LinearPredictor:
    """A LinearPredictor fitted to the GPU model, as ``jserve profile`` fits one to the engine."""
    samples = []
    for _ in range(400):
        decodes = tuple(ScheduledChunk(f"d{i}", rng.randrange(1, 8000), 1, True)
                        for i in range(rng.randrange(0, 160)))
        prefills = tuple(ScheduledChunk(f"p{i}", rng.randrange(0, MAX_CONTEXT),
                                        rng.randrange(1, 4096), False)
                         for i in range(rng.randrange(0 if decodes else 1, 4)))
        plan = BatchPlan(decodes, prefills)
        samples.append((plan, gpu.predict(plan)))
    return LinearPredictor.fit(samples, meta={"fitted_to": gpu.describe()})


def build(policy: str, predictor, cache: PrefillTimeCache, seed: int = 0) -> DeadlineScheduler:
    rng = random.Random(seed)
    lengths = sharegpt_lengths()
    clock = VirtualClock(NOW)
    sched = DeadlineScheduler(BlockAllocator(65_536, 16), policy=policy, predictor=predictor,
                              prefill_cache=cache, config=CONFIG, clock=clock, **LIMITS)
    alloc = sched.allocator

    def run(req: Request, computed: int) -> None:
        """Put ``req`` in the running queue as if it had already computed ``computed`` tokens."""
        sched.add(req)
        sched.waiting.remove(req)
        req.num_computed = computed
        req.block_ids = alloc.allocate(alloc.blocks_for(computed))
        req.status = RequestStatus.RUNNING
        sched.running.append(req)

    for i in range(120):  # decodes: prompt + some output already generated
        prompt, out = rng.choice(lengths)
        req = Request(f"dec{i}", [0] * prompt, out + 1, NOW - rng.uniform(1, 60))
        req.token_ids += [0] * rng.randint(1, out)
        run(req, len(req.token_ids) - 1)
    for i, prompt in enumerate([65_536, 131_072] + [rng.choice(lengths)[0] + 64
                                                    for _ in range(6)]):
        done = 40_000 if prompt > 60_000 else rng.randrange(0, prompt - 32, 32)
        run(Request(f"pre{i}", [0] * prompt, 128, NOW - rng.uniform(0.5, 20)), done)
    prompts = [rng.choice(lengths)[0] for _ in range(1000)]
    prompts += [rng.choice([32_768, 65_536, 131_072]) for _ in range(5)]
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"w{i}", [0] * prompt, 128, NOW - rng.uniform(0, 3)))
    return sched


def restore(sched: DeadlineScheduler) -> DeadlineScheduler:
    """A deep copy of ``sched`` sharing what ``schedule()`` never mutates: the predictor, the
    prefill-time cache and the token lists (copying 2M token ids would dominate the bench)."""
    shared = {id(sched.predictor): sched.predictor, id(sched.cache): sched.cache}
    for r in (*sched.waiting, *sched.running):
        shared[id(r.token_ids)] = r.token_ids
        shared[id(r.prompt_token_ids)] = r.prompt_token_ids
    return copy.deepcopy(sched, shared)


def touch(sched: DeadlineScheduler) -> None:
    for r in (*sched.waiting, *sched.running):
        tuple(vars(r).values())


def measure(sched: DeadlineScheduler, reps: int, warm: bool) -> tuple[list[float], BatchPlan]:
    """Times of ``schedule()`` on ``reps`` fresh copies of ``sched`` (seconds), and one plan."""
    times, plan = [], None
    for _ in range(reps + 1):  # the first is a warm-up
        fresh = restore(sched)
        if warm:
            touch(fresh)
        t0 = time.perf_counter()
        plan = fresh.schedule()
        times.append(time.perf_counter() - t0)
    return times[1:], plan


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--policy", choices=POLICIES, nargs="*", default=list(POLICIES))
    ap.add_argument("--predictor", choices=("gpu", "linear"), nargs="*",
                    default=["gpu", "linear"])
    ap.add_argument("--warm", action="store_true", help="read the state once before timing")
    ap.add_argument("--profile", choices=POLICIES, help="cProfile this policy instead")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    gpu = GpuTimeModel("llama3-8b", "a100", tp=8, spp=2)
    predictors = {"gpu": gpu, "linear": fit_linear(gpu, random.Random(1))}
    caches = {name: PrefillTimeCache(p, MAX_CONTEXT, CONFIG.t_target,
                                     chunk_granularity=CONFIG.chunk_granularity,
                                     max_chunk=LIMITS["max_num_batched_tokens"])
              for name, p in predictors.items() if name in args.predictor}

    if args.profile:
        name = args.predictor[0]
        sched = build(args.profile, predictors[name], caches[name])
        copies = [restore(sched) for _ in range(args.reps)]
        prof = cProfile.Profile()
        prof.enable()
        for s in copies:
            s.schedule()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return

    print(f"schedule() with 1,000+5 waiting and 128 running; {args.reps} reps each; "
          f"t_target {CONFIG.t_target * 1e3:.0f} ms; {'warm' if args.warm else 'cold'} state")
    print(f"{'policy':<6} {'predictor':<9} {'median ms':>10} {'p90 ms':>8}  "
          f"{'decodes':>7} {'prefills':>8} {'tokens':>6} {'predicted ms':>12}")
    rows = []
    for name in args.predictor:
        for policy in args.policy:
            sched = build(policy, predictors[name], caches[name])
            times, plan = measure(sched, args.reps, args.warm)
            row = dict(policy=policy, predictor=name,
                       median_ms=statistics.median(times) * 1e3,
                       p90_ms=percentile(times, 0.9) * 1e3, decodes=len(plan.decodes),
                       prefills=len(plan.prefills), tokens=plan.num_tokens,
                       predicted_ms=predictors[name].predict(plan) * 1e3)
            rows.append(row)
            print(f"{policy:<6} {name:<9} {row['median_ms']:>10.3f} {row['p90_ms']:>8.3f}  "
                  f"{row['decodes']:>7} {row['prefills']:>8} {row['tokens']:>6} "
                  f"{row['predicted_ms']:>12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
