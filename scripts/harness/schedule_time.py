"""The scheduler's schedule() ("FormNextBatch") time with 1,000 waiting and 128 running requests
(``scripts/bench_scheduler.py``; its docstring says the state, the policies and the
predictors). ``compare`` runs this module as a file in another checkout, so keep its imports
to what every checkout's ``jserve`` has."""
from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file by ``compare``: jserve from PYTHONPATH, not siblings
    del sys.path[0]

from jserve.cache.allocator import PageAllocator  # noqa: E402
from jserve.scheduler.base import SchedulerBase  # noqa: E402
from jserve.scheduler.chunking import PrefillTimeCache  # noqa: E402
from jserve.scheduler.deadline import DeadlineConfig  # noqa: E402
from jserve.scheduler.plan import BatchPlan, ScheduledChunk  # noqa: E402
from jserve.scheduler.predictor import LinearPredictor  # noqa: E402
from jserve.scheduler.registry import build_scheduler  # noqa: E402
from jserve.scheduler.request import Request  # noqa: E402
from jserve.sim import GpuTimeModel, VirtualClock  # noqa: E402
from jserve.sim.trace import read_lengths  # noqa: E402

try:  # a checkout from before SchedulerSpec takes the policy's fields as keywords
    from jserve.scheduler.registry import Limits, SchedulerSpec  # noqa: E402
except ImportError:
    Limits = SchedulerSpec = None

DESCRIPTION = ('The scheduler\'s schedule() ("FormNextBatch") time with 1,000 waiting and 128 '
               "running requests.")
DEADLINE_POLICIES = ("lars", "edf", "lrs", "fcfs")
POLICIES = DEADLINE_POLICIES + ("sarathi", "sprpt")  # the last two use no predictor
NOW = 100.0
MAX_CONTEXT = 131_072
LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_prefill_seqs=8)
CONFIG = DeadlineConfig(t_target=0.05, space_sharing=True)


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


def build(policy: str, predictor, cache: PrefillTimeCache, seed: int = 0) -> SchedulerBase:
    rng = random.Random(seed)
    lengths = read_lengths("sharegpt4")
    clock = VirtualClock(NOW)
    alloc = PageAllocator(65_536, 16)
    if SchedulerSpec is None:
        sched = build_scheduler(policy, alloc, predictor=predictor, prefill_cache=cache,
                                deadline=CONFIG, clock=clock, **LIMITS)
    else:
        sched = build_scheduler(SchedulerSpec(policy, Limits(**LIMITS), deadline=CONFIG), alloc,
                                predictor=predictor, prefill_cache=cache, clock=clock)

    def run(req: Request, computed: int) -> None:
        """Put ``req`` in the running queue as if it had already computed ``computed`` tokens."""
        sched.add(req)
        req.num_computed = computed
        req.page_ids = alloc.allocate(alloc.pages_for(computed))
        sched._admit(req)  # out of the waiting queue (and its cached key parts), running

    probe = random.Random(seed + 1)  # sprpt's predicted lengths: the state stays the same
    for i in range(120):  # decodes: prompt + some output already generated
        prompt, out = rng.choice(lengths)
        req = Request(f"dec{i}", [0] * prompt, out + 1, NOW - rng.uniform(1, 60))
        req.all_token_ids += [0] * rng.randint(1, out)
        req.first_prediction = probe.uniform(1, 2 * out)
        req.predicted_remaining = probe.uniform(1, 2 * out)
        run(req, len(req.all_token_ids) - 1)
    for i, prompt in enumerate([65_536, 131_072] + [rng.choice(lengths)[0] + 64
                                                    for _ in range(6)]):
        done = 40_000 if prompt > 60_000 else rng.randrange(0, prompt - 32, 32)
        run(Request(f"pre{i}", [0] * prompt, 128, NOW - rng.uniform(0.5, 20)), done)
    prompts = [rng.choice(lengths)[0] for _ in range(1000)]
    prompts += [rng.choice([32_768, 65_536, 131_072]) for _ in range(5)]
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"w{i}", [0] * prompt, 128, NOW - rng.uniform(0, 3)))
    return sched


def restore(sched: SchedulerBase) -> SchedulerBase:
    """A deep copy of ``sched`` sharing what ``schedule()`` never mutates: the predictor, the
    prefill-time cache and the token lists (copying 2M token ids would dominate the bench)."""
    shared = {id(x): x for x in (getattr(sched, "predictor", None), getattr(sched, "cache", None))
              if x is not None}
    for r in (*sched.waiting, *sched.running):
        shared[id(r.all_token_ids)] = r.all_token_ids
        shared[id(r.prompt_token_ids)] = r.prompt_token_ids
    return copy.deepcopy(sched, shared)


def touch(sched: SchedulerBase) -> None:
    for r in (*sched.waiting, *sched.running):
        tuple(vars(r).values())


def measure(sched: SchedulerBase, reps: int, warm: bool) -> tuple[list[float], BatchPlan]:
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


def cases(policies: list[str], predictors: list[str]) -> list[tuple[str, str]]:
    """(policy, predictor) pairs: deadline-aware policies under each predictor, the others
    once (labelled with the first predictor, whose cache they do not use)."""
    out = [(p, name) for name in predictors for p in policies if p in DEADLINE_POLICIES]
    return out + [(p, predictors[0]) for p in policies if p not in DEADLINE_POLICIES]


def compare(args: argparse.Namespace) -> None:
    """This tree against the checkout ``args.against``: this module run as a file in each
    tree (so the state is this module's, the scheduler each tree's), alternating which goes
    first, ``args.rounds`` times; the medians of the runs' medians and of their ratios."""
    trees = {"before": Path(args.against).resolve(), "after": Path(__file__).resolve().parents[2]}
    flags = ["--reps", str(args.reps), "--policy", *args.policy, "--predictor", *args.predictor]
    flags += ["--warm"] if args.warm else []
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                out = os.path.join(tmp, f"{label}{r}.json")
                env = dict(os.environ, PYTHONPATH=str(trees[label]))
                subprocess.run([sys.executable, __file__, *flags, "--json", out], env=env,
                               cwd=trees[label], check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    runs[label].append({(row["policy"], row["predictor"]): row
                                        for row in json.load(f)})
    print(f"schedule() median ms, {'warm' if args.warm else 'cold'}; median of {args.rounds} "
          f"alternating runs of {args.reps} reps; before: {trees['before']}, after: "
          f"{trees['after']}")
    print(f"{'policy':<8} {'predictor':<9} {'before':>8} {'after':>8} {'after/before':>13}  "
          f"{'same plan':>9}")
    rows = []
    for key in runs["after"][0]:
        before = [run[key]["median_ms"] for run in runs["before"]]
        after = [run[key]["median_ms"] for run in runs["after"]]
        same = all(run[key]["plan"] == runs["after"][0][key]["plan"]
                   for run in runs["before"] + runs["after"])
        row = dict(policy=key[0], predictor=key[1], before_ms=statistics.median(before),
                   after_ms=statistics.median(after), same_plan=same,
                   ratio=statistics.median(a / b for a, b in zip(after, before)))
        rows.append(row)
        print(f"{key[0]:<8} {key[1]:<9} {row['before_ms']:>8.3f} {row['after_ms']:>8.3f} "
              f"{row['ratio']:>13.2f}  {'yes' if same else 'NO':>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def build_parser() -> argparse.ArgumentParser:
    """``scripts/bench_scheduler.py``'s flags (here: ``compare`` runs this module with them)."""
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--policy", choices=POLICIES, nargs="*", default=list(POLICIES))
    ap.add_argument("--predictor", choices=("gpu", "linear"), nargs="*",
                    default=["gpu", "linear"])
    ap.add_argument("--warm", action="store_true", help="read the state once before timing")
    ap.add_argument("--profile", choices=POLICIES, help="cProfile this policy instead")
    ap.add_argument("--against", metavar="DIR",
                    help="also time the checkout at DIR, alternating with this tree")
    ap.add_argument("--rounds", type=int, default=6, help="alternating runs for --against")
    ap.add_argument("--json", help="write the figures here")
    return ap


def run(args: argparse.Namespace) -> None:
    """The table of every (policy, predictor), or a cProfile of one policy (``--profile``), or
    the A/B against another checkout (``--against``)."""
    if args.against:
        compare(args)
        return

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
    print(f"{'policy':<8} {'predictor':<9} {'median ms':>10} {'p90 ms':>8}  "
          f"{'decodes':>7} {'prefills':>8} {'tokens':>6} {'predicted ms':>12}")
    rows = []
    for policy, name in cases(args.policy, args.predictor):
        sched = build(policy, predictors[name], caches[name])
        times, plan = measure(sched, args.reps, args.warm)
        row = dict(policy=policy, predictor=name if policy in DEADLINE_POLICIES else "-",
                   median_ms=statistics.median(times) * 1e3,
                   p90_ms=percentile(times, 0.9) * 1e3, decodes=len(plan.decodes),
                   prefills=len(plan.prefills), tokens=plan.num_tokens,
                   predicted_ms=predictors[name].predict(plan) * 1e3,
                   plan=repr((plan.decodes, plan.prefills, plan.preempted)))
        rows.append(row)
        print(f"{policy:<8} {row['predictor']:<9} {row['median_ms']:>10.3f} "
              f"{row['p90_ms']:>8.3f}  {row['decodes']:>7} {row['prefills']:>8} "
              f"{row['tokens']:>6} {row['predicted_ms']:>12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    run(build_parser().parse_args())
