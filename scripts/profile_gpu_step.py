"""Where the engine's decode step spends its time on a GPU: a profiler trace of steady decode
steps, the device's kernels summed by name, against the step's wall time.

    python scripts/profile_gpu_step.py --model llama-3.2-1b-shaped --batch 32
    python scripts/profile_gpu_step.py --model llama-3-8b-shaped --batch 1 --out /tmp/trace

Same random weights and engine settings as ``scripts/device_check.py``'s decode timings. The
trace (``jax.profiler``, Perfetto JSON) stays in ``--out``; the table printed last gives,
per kernel name, the calls and milliseconds per step and the share of the device-busy time.
On CPU it runs too, as a try of the script: the trace has no device process, so the table
lists the host's events, which nest (their sum is no busy time).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jserve
import jax  # noqa: E402

from harness.device_profiles import FULL, SMOKE, llama_cfg  # noqa: E402
from harness.random_engine import make_engine, random_params, serve  # noqa: E402
from jserve.engine.config import LAYER_LOOPS  # noqa: E402
from jserve.sampling.params import SamplingParams  # noqa: E402


def kernel_table(trace_dir: Path, steps: int, top: int) -> tuple[list[tuple], float, str]:
    """[(name, calls per step, ms per step, share)], busy ms per step, the process read:
    events of the device process (the GPU's streams; on CPU the host's XLA ops)."""
    path = next(trace_dir.rglob("*.trace.json.gz"), None) or next(trace_dir.rglob("*.json.gz"))
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = [pid for pid, n in names.items() if "/device:" in n and "GPU" in n.upper()]
    pids = device or [pid for pid, n in names.items() if "host" in n.lower()]
    totals, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in pids:
            totals[e["name"]] += e.get("dur", 0) / 1e3
            calls[e["name"]] += 1
    busy = sum(totals.values())
    rows = [(n, calls[n] / steps, ms / steps, ms / busy if busy else 0.0)
            for n, ms in totals.most_common(top)]
    return rows, busy / steps, ", ".join(names[p] for p in pids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    models = {**FULL.timing_models, **SMOKE.timing_models}
    ap.add_argument("--model", default="llama-3.2-1b-shaped", choices=sorted(models),
                    help="random-weight model (tiny: the smoke check's, for a CPU try)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=8, help="decode steps traced")
    ap.add_argument("--impl", default="auto", help="attention_impl")
    ap.add_argument("--layer-loop", default="auto", choices=LAYER_LOOPS,
                    help="EngineConfig.layer_loop")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also run N more steps under cProfile and list the host's top "
                         "functions (where the host loop spends its time)")
    ap.add_argument("--top", type=int, default=25, help="kernel names listed")
    ap.add_argument("--out", default=None, help="trace directory (default: a temporary one)")
    args = ap.parse_args(argv)

    cfg = llama_cfg(**models[args.model])
    params = random_params(cfg, 0)
    page = FULL.page
    new_tokens = args.steps + 48
    pages = args.batch * -(-(args.prompt + new_tokens) // page)
    engine = make_engine(cfg, params, args.impl, max_num_seqs=args.batch,
                            max_num_batched_tokens=2048, max_prefill_seqs=4,
                            max_model_len=args.prompt + new_tokens + page, page_size=page,
                            num_kv_pages=pages + 2, layer_loop=args.layer_loop)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    serve(engine, prompts, greedy, "warm-up")  # compiles every shape the run meets

    engine.add_requests(prompts, [greedy] * len(prompts))
    engine.step_log = []
    while not (engine.step_log and not engine.step_log[-1][0].prefills
               and len(engine.step_log[-1][0].decodes) == args.batch):
        engine.step()
    for _ in range(4):  # settle into steady decode
        engine.step()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-step-trace-"))
    engine.step_log = []
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        jax.effects_barrier()
        while len(engine.step_log) < args.steps:  # the last launched step's tokens
            engine.step()
        wall = (time.perf_counter() - t0) / len(engine.step_log)
    logged = float(np.median([s for _, s in engine.step_log]))
    traced_steps, engine.step_log = len(engine.step_log), None
    if args.cprofile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(lambda: [engine.step() for _ in range(args.cprofile)])
        print(f"host, {args.cprofile} steps under cProfile: "
              f"{(time.perf_counter() - t0) / args.cprofile * 1e3:.2f} ms per step")
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=sys.stdout).sort_stats(key).print_stats(args.top)
    while engine.has_unfinished():
        engine.step()

    rows, busy, where = kernel_table(out, traced_steps, args.top)
    print(f"{args.model} batch {args.batch}, prompt {args.prompt}, attention "
          f"{engine.config.attention_impl}, layer_loop {args.layer_loop}, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"trace {out}; events of: {where}"
          + ("" if "/device:" in where else " (no device: nested host events, busy means nothing)"))
    print(f"step: wall {wall * 1e3:.2f} ms (traced), logged median {logged * 1e3:.2f} ms, "
          f"device busy {busy:.2f} ms ({busy / (wall * 1e3):.0%} of wall)")
    print(f"{'kernel':60s} {'calls':>6s} {'ms/step':>8s} {'share':>6s}")
    for name, n, ms, share in rows:
        print(f"{name[:60]:60s} {n:6.1f} {ms:8.3f} {share:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
