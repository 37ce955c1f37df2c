"""The device check (``scripts/device_check.py``): the backend's Pallas kernels against the
XLA reference, the engine's greedy tokens with the kernel against the reference, and engine
timings on random weights; every check gets a status, and a JSON and markdown report is
written. ``run`` is the whole check; the script parses its flags."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from harness import device_flags, device_hf
from harness.device_budget import Budget, Item
from harness.device_profiles import FULL, SMOKE, Profile, llama_cfg, peak_figures, ratio
from harness.device_report import error_text, fmt, render_markdown, say
from harness.device_timings import ModelTimings
from harness.kernel_check import kernel_check, kv_write_check, quantized_kernel_check
from harness.random_engine import free_memory, make_engine, serve
from jserve.engine.config import EngineConfig
from jserve.kernels import resolve_impl
from jserve.model.weights import init_params
from jserve.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run checks: the profile (flags applied), the kernels checked, the engine's
    and the timings' attention, and the timing models."""

    profile: Profile
    smoke: bool
    kernel_impls: list[str]
    engine_impl: str
    timing_impl: str
    models: list[str]


def plan(args: argparse.Namespace) -> Plan:
    """The run ``args`` asks for (``scripts/device_check.py``'s flags); ValueError says why
    there is none."""
    backend = jax.default_backend()
    smoke = args.smoke or (not args.full and backend not in ("gpu", "tpu"))
    p = SMOKE if smoke else FULL
    if args.contexts:
        p = dataclasses.replace(p, contexts=tuple(int(c) for c in args.contexts.split(",")))
    if args.reps:
        p = dataclasses.replace(p, reps=args.reps)
    if smoke and args.impl == "auto":
        kernel_impls, engine_impl = ["pallas_gpu", "pallas_tpu"], "pallas_gpu"
        timing_impl = resolve_impl("auto")
    else:
        impl = resolve_impl(args.impl)
        if impl == "reference":
            raise ValueError(f"no Pallas kernel for backend {backend!r}: pass --impl pallas_gpu "
                             f"or pallas_tpu (interpreted, very slow at full shapes) or use "
                             f"--smoke")
        kernel_impls, engine_impl, timing_impl = [impl], impl, impl
    models = args.models.split(",") if args.models else list(p.timing_models)
    unknown = sorted(set(models) - set(p.timing_models))
    if unknown:
        raise ValueError(f"unknown models {unknown}; this mode has {list(p.timing_models)}")
    return Plan(p, smoke, kernel_impls, engine_impl, timing_impl, models)


def run(args: argparse.Namespace, command: str, docs_dir: Path) -> int:
    """The whole check: exit status 0 when every check passed, 1 when one failed, 2 when the
    flags ask for no run, ``CUT_SHORT_EXIT`` when ``--budget`` ran out (the report says what
    ran and what did not). The report goes to ``--json`` / ``--md``, else ``docs_dir`` (full
    mode or ``--write-docs``) or a temporary directory (smoke); the JSON is rewritten after
    every item, so a run killed from outside leaves what it measured."""
    t_start = time.perf_counter()
    try:
        pl = plan(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    p = pl.profile
    device_kind = jax.devices()[0].device_kind
    to_docs = not pl.smoke or args.write_docs  # smoke runs (CI) keep off docs/ unless asked
    json_path = args.json or (docs_dir / "check.json" if to_docs else
                              Path(tempfile.mkdtemp(prefix="device-check-")) / "device.json")
    md_path = args.md or (docs_dir / "check.md" if to_docs else json_path.with_suffix(".md"))
    peaks = peak_figures(device_kind, args.peak_tflops, args.peak_tbps)
    _persistent_cache()
    say(f"device check ({p.name}): backend={jax.default_backend()} device={device_kind} "
        f"jax={jax.__version__} kernels={pl.kernel_impls} engine={pl.engine_impl} "
        f"timings={pl.timing_impl} peaks={fmt(ratio(peaks[0], 1e12))} TFLOP/s, "
        f"{fmt(ratio(peaks[1], 1e12))} TB/s"
        + (f"; budget {args.budget:.0f} s" if args.budget else ""))
    res = _results(p, device_kind, command, peaks)

    def write_md() -> None:
        res["wall_s"] = time.perf_counter() - t_start
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(render_markdown(res))

    budget = Budget(args.budget or None, json_path, res, on_cut=write_md)
    budget.run_all(_items(res, pl, args, peaks, budget))
    checks = res["checks"]
    res["passed"] = all(c["status"] == "pass" for c in checks)
    write_md()
    budget.write()
    n_fail = sum(c["status"] == "fail" for c in checks)
    skipped = [i["name"] for i in res["items"] if i["status"] == "skipped"]
    say(f"{len(checks) - n_fail}/{len(checks)} checks passed in {res['wall_s']:.1f} s"
        + (f"; skipped (budget): {', '.join(skipped)}" if skipped else "")
        + f"; wrote {json_path} and {md_path}")
    return 0 if res["passed"] else 1


def _items(res: dict, pl: Plan, args: argparse.Namespace, peaks, budget: Budget
           ) -> list[Item]:
    """The run's measurements, most valuable first: kernel correctness, the engine's
    tokens, decode at each batch with and without bursts per model, the one-chunk prefill,
    HF transformers' ``generate`` on the decode shapes, the chunked long prefill."""
    p, seed, items = pl.profile, args.seed, []
    if not args.skip_kernels:
        items += [Item(f"kernels context {ctx}", functools.partial(
            _kernel_checks, res, p, pl.kernel_impls, seed, peaks, [ctx], quantized=False))
            for ctx in p.contexts]
        items.append(Item("kernels over quantized KV pages", functools.partial(
            _kernel_checks, res, p, pl.kernel_impls, seed, peaks, [], quantized=True)))
    if not args.skip_engine:
        items.append(Item("engine greedy tokens",
                          functools.partial(_engine_check, res, p, pl.engine_impl, seed)))
    models = {}
    if not args.skip_timings:
        t = res["timings"] = dict(impl=pl.timing_impl, decode=[], prefill=[], chunked=[],
                                  errors=[])
        for name in pl.models:
            m = models[name] = ModelTimings(p, name, pl.timing_impl, peaks, seed, t)
            items += [Item(f"decode {name} b={b}" + (f" bursts of {k}" if k > 1 else ""),
                           functools.partial(m.decode, b, k), floor_s=30)
                      for b in p.decode_batches for k in (1, p.decode_burst)]
            items += [Item(f"prefill {name} {p.prefill_len} in one chunk", m.prefill),
                      Item(f"release {name}", m.close, quiet=True)]
    if not args.skip_hf:
        res["hf"] = []
        items += [Item(f"HF generate {name}", functools.partial(
            _hf_baseline, res, p, name, seed, budget), floor_s=30) for name in pl.models]
    if models:  # the first model's batch-1 decode again: the layers as one indexed loop, ...
        first = next(iter(models))
        indexed = ModelTimings(dataclasses.replace(p, decode_batches=(1,)), first,
                               pl.timing_impl, peaks, seed, res["timings"],
                               layer_loop="indexed")
        items += [Item(f"decode {first} b=1 layer_loop=indexed" +
                       (f" bursts of {k}" if k > 1 else ""),
                       functools.partial(indexed.decode, 1, k), floor_s=30)
                  for k in (1, p.decode_burst)]
        items.append(Item(f"release {first} (indexed)", indexed.close, quiet=True))
        # ... and with control flow in CUDA graphs
        items.append(Item(f"decode {first} b=1, loops and conditionals in command buffers",
                          functools.partial(_flags_ab, res, p, first, pl.timing_impl, peaks,
                                            seed, budget), floor_s=60))
    for name, m in models.items():
        items += [Item(f"prefill {name} {p.chunk_context} in chunks of "
                       f"{'/'.join(map(str, p.chunk_sizes))}", m.chunked, floor_s=30),
                  Item(f"release {name} (chunked)", m.close, quiet=True)]
    if models:
        items.append(Item("timings check", functools.partial(_timings_check, res, pl),
                          quiet=True))
    return items


def _timings_check(res: dict, pl: Plan) -> None:
    """The timings' check, once any of them ran (none: the budget skipped them all)."""
    t = res["timings"]
    if not (t["decode"] or t["prefill"] or t["errors"]):
        return
    record(res, f"engine timings ran ({', '.join(pl.models)}; {pl.timing_impl})",
           not t["errors"], "; ".join(t["errors"][:3]) if t["errors"] else
           "figures are not judged" + ("; in smoke mode they say nothing about speed"
                                       if pl.smoke else ""))


def _hf_baseline(res: dict, p: Profile, name: str, seed: int, budget: Budget) -> None:
    """HF transformers' ``generate`` on ``name``'s decode shapes, in a child process given
    the budget left (``device_hf``)."""
    rows = device_hf.measure_in_child(p.timing_models[name], list(p.decode_batches),
                                      p.decode_prompt, p.decode_tokens, seed,
                                      timeout=min(budget.left() - 5, 3600))
    for row in rows:
        row["model"] = name
        res["hf"].append(row)
        say(f"  HF generate {name} b={row['batch']}: TPOT {row['tpot_ms']:.2f} ms, "
            f"{row['tok_s']:.1f} tok/s ({row['device']}, {row['dtype']})")


def _flags_ab(res: dict, p: Profile, name: str, impl: str, peaks, seed: int,
              budget: Budget) -> None:
    """``name``'s batch-1 decode (plain steps and bursts) in a child process whose XLA
    flags put ``while`` loops and conditionals in command buffers (``device_flags``): the
    A/B against the same rows of this process."""
    flags = device_flags.CONTROL_FLOW_GRAPHS
    rows = device_flags.measure_in_child(p, name, impl, peaks, seed, flags,
                                         timeout=min(budget.left() - 5, 3600))
    res["timings"]["decode"] += rows
    for row in rows:
        say(f"  decode {name} b=1 burst {row['burst']} under {flags}: "
            f"{row['step_ms']:.2f} ms/step")


def _persistent_cache() -> None:
    """The engine's persistent compilation cache, on from the start so the kernel checks'
    compiles are kept too (a rerun skips them)."""
    cache_dir = EngineConfig().compilation_cache_dir
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _results(p: Profile, device_kind: str, command: str, peaks) -> dict:
    """The results dict before any check ran."""
    return dict(
        mode=p.name, backend=jax.default_backend(), device_kind=device_kind,
        jax_version=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command, peaks=dict(tflops=ratio(peaks[0], 1e12), tbps=ratio(peaks[1], 1e12)),
        shapes=dict(hq=p.hq, hkv=p.hkv, d=p.d, dtype=p.dtype, page=p.page), reps=p.reps,
        checks=[], kernels=[], kv_write=[], kernels_quantized=[])


def record(res: dict, name: str, ok: bool, detail: str | None = None, **extra) -> None:
    """One check's status into ``res["checks"]``, and its line printed."""
    res["checks"].append(dict(name=name, status="pass" if ok else "fail", detail=detail,
                              **extra))
    say(f"[{'pass' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))


def _kernel_checks(res: dict, p: Profile, kernel_impls: list[str], seed: int, peaks,
                   contexts: list[int] | None = None, quantized: bool = True) -> None:
    """Every kernel on every batch kind and context (default: the profile's), its cache
    write, and with ``quantized`` the mixed batch over quantized KV pages
    (docs/quantization.md) at the profile's longest context."""
    contexts = p.contexts if contexts is None else contexts
    cases = [(impl, kind, ctx) for impl in kernel_impls for ctx in contexts
             for kind in ("decode", "prefill", "mixed")]
    cases += [(impl, "write_kv", ctx) for impl in kernel_impls for ctx in contexts]
    if quantized:
        cases += [(impl, f"mixed {kv}", max(p.contexts)) for impl in kernel_impls
                  for kv in ("int8", "fp8_e4m3")]
    for n, (impl, kind, ctx) in enumerate(tqdm(cases, desc="kernels", disable=None)):
        name = f"kernel {impl} {kind} context {ctx}"
        table = (res["kv_write"] if kind == "write_kv" else res["kernels_quantized"]
                 if kind.startswith("mixed ") else res["kernels"])
        try:
            row, detail = _kernel_case(p, impl, kind, ctx, seed * 1000 + ctx + n, peaks)
            table.append(row)
            row["status"] = "pass" if row["ok"] else "fail"
            record(res, name, row["ok"], detail)
        except Exception as e:  # noqa: BLE001 - one failure must not hide the others
            traceback.print_exc()
            table.append(dict(impl=impl, kind=kind, context=ctx, status="fail",
                              error=error_text(e)))
            record(res, name, False, error_text(e))
        gc.collect()  # the case's cache pool (compiled kernels stay: shapes repeat)
    free_memory()


def _kernel_case(p: Profile, impl: str, kind: str, ctx: int, seed: int, peaks
                 ) -> tuple[dict, str]:
    """One kernel case's row and its check's detail line."""
    if kind.startswith("mixed "):
        row = quantized_kernel_check(p, impl, kind.split()[1], ctx, seed)
        return row, (f"max abs err out {row['max_abs_err_out']:.2e} (tol {p.tol:g}); "
                     f"{row['kernel_ms']:.3g} ms vs {row['full_precision_ms']:.3g} ms "
                     f"over full-precision pages")
    if kind == "write_kv":
        row = kv_write_check(p, impl, ctx, seed)
        return row, (f"{row['mismatched_rows']} rows differ" if not row["ok"] else
                     f"{row['kernel_ms']:.3g} ms vs {row['reference_ms']:.3g} ms")
    row = kernel_check(p, impl, kind, ctx, seed, peaks)
    detail = (f"max abs err out {row['max_abs_err_out']:.2e}, lse "
              f"{row['max_abs_err_lse']:.2e} (tol {p.tol:g}); "
              f"{row['kernel_ms']:.3g} ms vs reference "
              f"{row['reference_ms']:.3g} ms")
    if not row["ok"]:
        detail = f"{row['problem']} out of tolerance; " + detail
    return row, detail


def _engine_check(res: dict, p: Profile, engine_impl: str, seed: int) -> None:
    name = f"engine greedy tokens {engine_impl} vs reference"
    try:
        e = engine_check(p, engine_impl, seed)
        res["engine"] = e
        detail = (f"{e['tokens_compared']} tokens identical" if e["ok"] else
                  f"first mismatch {e['first_mismatch']}" if e["first_mismatch"] else
                  "outputs shorter than max_tokens")
        record(res, name, e["ok"], detail, tokens_compared=e["tokens_compared"])
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["engine"] = dict(impl=engine_impl, error=error_text(e), tokens_compared=0)
        record(res, name, False, error_text(e), tokens_compared=0)
    free_memory()


def engine_check(p: Profile, impl: str, seed: int) -> dict:
    cfg = llama_cfg(**p.engine_model)
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in p.engine_prompts]
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in p.engine_tokens]
    # On an accelerator, float32 matmuls default to reduced precision (TF32 / one bf16 pass):
    # at "highest" both runs compute the same model and differ only in attention.
    precise = (jax.default_matmul_precision("highest") if jax.default_backend() != "cpu"
               else contextlib.nullcontext())
    tokens, secs = {}, {}
    with precise:
        for name in ("reference", impl):
            t0 = time.perf_counter()
            engine = make_engine(cfg, params, name, **p.engine_kwargs)
            outs, _, _ = serve(engine, prompts, greedy, f"engine {name}")
            secs[name] = time.perf_counter() - t0
            tokens[name] = [list(o.token_ids) for o in outs]
            del engine
            free_memory()
    ref, got = tokens["reference"], tokens[impl]
    compared = sum(min(len(a), len(b)) for a, b in zip(ref, got))
    mismatch = None
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatch = dict(request=i, prompt_len=len(prompts[i]), token=k,
                            reference=a[k:k + 5], kernel=b[k:k + 5])
            break
    full_length = all(len(a) == len(b) == n for a, b, n in zip(ref, got, p.engine_tokens))
    return dict(impl=impl, model=p.engine_model, prompts=list(p.engine_prompts),
                engine=p.engine_kwargs, max_tokens=list(p.engine_tokens), tokens_compared=compared,
                identical=mismatch is None and full_length, first_mismatch=mismatch,
                reference_s=secs["reference"], kernel_s=secs[impl],
                ok=mismatch is None and full_length)
