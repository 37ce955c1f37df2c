"""``jserve compile --target NAME [--model M] [engine flags]``: the engine's programs compiled
for an accelerator this host does not have, and a table of what each does there (how each
column is counted: ``jserve.targets.hlo``). Exit 0 when every program compiled and the
configuration fits the target's memory, 1 when it does not fit, 2 on a refusal."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from jserve.flags.args import add_engine_args, engine_kwargs


def add_compile_parser(sub) -> None:
    from jserve.targets.specs import TARGETS

    s = sub.add_parser("compile", help="compile the engine's programs for a GPU or TPU this "
                                       "host does not have, and say what each does there")
    s.add_argument("--target", required=True, choices=sorted(TARGETS),
                   help="the accelerator (one device; --mesh for more of the same host)")
    add_engine_args(s, warmup="all")
    s.add_argument("--model-config", default=None,
                   help="a config.json to compile for instead of --model (nothing read "
                        "beside it: the shapes are all a compile needs)")
    s.add_argument("--attention-impl", default="auto",
                   help="the step's attention kernels: auto (what the engine picks on the "
                        "target), reference, pallas_gpu, pallas_tpu")
    s.add_argument("--write-cache", nargs="?", const="", default=None, metavar="DIR",
                   help="write the executables into this persistent compilation cache (no "
                        "DIR: the engine's, ~/.cache/jserve/xla), for the target's engine "
                        "to read at start (not yet shown to load on a real device)")
    s.add_argument("--json", default=None, help="also write the table as JSON to this file")
    s.add_argument("--dump-hlo", default=None,
                   help="write each program's optimized HLO into this directory")
    s.add_argument("--steps", default=None, type=_steps,
                   help="only the step programs of these buckets, as DECODESxPREFILL_TOKENS "
                        "separated by commas (1x0: batch-1 decode; 32x256: a mixed step); "
                        "default: every program the engine compiles")
    s.add_argument("--threads", type=int, default=None, help="compile threads (default: "
                                                             "one per two cores, at least 2)")
    s.set_defaults(func=run)


def _steps(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 0 or sum(s) == 0 for s in out):
        raise argparse.ArgumentTypeError(f"steps: DECODESxPREFILL_TOKENS[,...], got {text!r}")
    return out


def _model_config(a: argparse.Namespace, platform: str):
    """The model's config in the dtype the engine would compute in on ``platform``."""
    from jserve.model.families import read_config_file
    from jserve.model.weights import load_config, resolve_dtype

    q = a.quantization
    if a.model_config:
        return read_config_file(a.model_config, dtype=None if a.dtype == "auto" else a.dtype,
                                quantization=q)
    dtype, _ = resolve_dtype(a.model, a.dtype, platform)
    return load_config(a.model, dtype=dtype, quantization=q)


def run(a: argparse.Namespace) -> int:
    import os

    import jax

    from jserve.engine.config import EngineConfig
    from jserve.targets.programs import compile_for
    from jserve.targets.specs import target

    if "JAX_PLATFORMS" not in os.environ:
        # The compile-only devices need no backend of this host's, and a plugin that finds
        # no device of its own (jax[cuda] on a host without a GPU) would fail the start.
        jax.config.update("jax_platforms", "cpu")
    t = target(a.target)
    cfg = _model_config(a, t.platform)
    config = EngineConfig(**engine_kwargs(a), attention_impl=a.attention_impl)
    cache = None
    if a.write_cache is not None:
        from jserve.engine.build.factory import enable_compilation_cache
        from jserve.engine.config import default_compilation_cache_dir

        cache = Path(a.write_cache or default_compilation_cache_dir())
        cache.mkdir(parents=True, exist_ok=True)
        before = set(cache.iterdir())
        enable_compilation_cache(str(cache))
    report = compile_for(t.name, cfg, config, threads=a.threads, steps=a.steps)
    print(table(report))
    if cache is not None:
        print(f"wrote {len(set(cache.iterdir()) - before)} executables into {cache}")
    if a.json:
        Path(a.json).write_text(json.dumps(as_dict(report), indent=1))
    if a.dump_hlo:
        out = Path(a.dump_hlo)
        out.mkdir(parents=True, exist_ok=True)
        for p in report.programs:
            (out / f"{p.name.replace(' ', '_')}.hlo.txt").write_text(p.text)
    return 0 if report.fits else 1


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def rows(report) -> list[dict]:
    """One dict per program: the table's columns, as numbers."""
    out = []
    for p in report.programs:
        a, m = p.analysis, p.memory
        out.append(dict(
            program=p.name, compile_s=round(p.seconds, 2), launches=a.launches,
            launches_least=a.least_launches,
            kernels=dict(a.kernels), whiles=a.whiles, unknown_trip_whiles=a.unknown_trip_whiles,
            conditionals=a.conditionals, host_syncs=a.host_syncs,
            host_syncs_least=a.least_host_syncs,
            weight_copy_bytes=a.copy_bytes("weight"), kv_copy_bytes=a.copy_bytes("kv"),
            bytes_hlo=a.bytes, bytes_hlo_least=a.least_bytes, bytes_xla=p.cost_bytes,
            flops=p.cost_flops or a.flops,
            memory_bytes=None if m is None else m.needed_bytes,
            temp_bytes=None if m is None else m.temp_bytes,
            roofline_us=round(p.roofline_seconds(report.target) * 1e6, 1)))
    return out


def as_dict(report) -> dict:
    t = report.target
    return dict(target=t.name, device_kind=t.device_kind, layer_mode=report.layer_mode,
                attention=report.attention, weight_bytes=report.weight_bytes,
                kv_pool_bytes=report.kv_pool_bytes, fits=report.fits,
                largest_memory_bytes=report.largest_memory,
                plan_problems=report.plan.problems, seconds=round(report.seconds, 1),
                programs=rows(report))


def table(report) -> str:
    """The report as a markdown table, with a header line saying what was compiled."""
    t = report.target
    lines = [f"jserve compile: {len(report.programs)} programs for {t.name} "
             f"({t.device_kind}, {t.bandwidth / 1e12:.2f} TB/s, "
             f"{t.peak_flops / 1e12:.0f} TFLOP/s bf16) in {report.seconds:.0f} s; layers "
             f"{report.layer_mode}, attention {report.attention}; weights "
             f"{_gb(report.weight_bytes)}, KV pool {_gb(report.kv_pool_bytes)} a device"
             + ("" if report.fits else f"; DOES NOT FIT in {_gb(t.memory_bytes)}: "
                + "; ".join(report.plan.problems
                            or [f"a program needs {_gb(report.largest_memory)}"])),
             "",
             "| program | compile s | launches (fusions/GEMMs/Pallas/copies/other; cheapest "
             "branches) | while (no trip count) | cond | host syncs (largest / cheapest "
             "branches) | weight copies | KV copies | bytes (XLA / HLO / HLO cheapest "
             "branches) | memory | roofline |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows(report):
        k = r["kernels"]
        kinds = "/".join(str(int(k.get(x, 0))) for x in ("fusion", "gemm", "pallas"))
        kinds += f"/{int(k.get('copy', 0) + k.get('copy-start', 0))}"
        kinds += f"/{int(k.get('custom-call', 0) + k.get('other', 0))}"
        xla = "-" if r["bytes_xla"] is None else _gb(r["bytes_xla"])
        mem = "-" if r["memory_bytes"] is None else _gb(r["memory_bytes"])
        lines.append(
            f"| {r['program']} | {r['compile_s']:.1f} | {r['launches']} ({kinds}; "
            f"{r['launches_least']}) | "
            f"{r['whiles']} ({r['unknown_trip_whiles']}) | {r['conditionals']} | "
            f"{r['host_syncs']} / {r['host_syncs_least']} | "
            f"{_gb(r['weight_copy_bytes'])} | {_gb(r['kv_copy_bytes'])} | "
            f"{xla} / {_gb(r['bytes_hlo'])} / {_gb(r['bytes_hlo_least'])} | {mem} | "
            f"{r['roofline_us']} us |")
    plan = report.plan
    lines += ["", f"plan: {_gb(plan.weight_bytes)} weights + {plan.num_kv_pages} KV pages "
                  f"of {plan.kv_bytes_per_page} B a device; the largest step's XLA memory "
                  "is its row's memory column"]
    return "\n".join(lines)
