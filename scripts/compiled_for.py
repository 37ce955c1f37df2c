"""The "compiled for" tables of docs/device.md, regenerated: the engine's decode and mixed
steps of the Llama-3.2-1B- and Llama-3-8B-shaped models (random weights: only the shapes
matter) compiled on this host for each target (``jserve compile``'s code), one row a
program and layer mode.

    python scripts/compiled_for.py                       # h100 and v5e, auto layer mode
    python scripts/compiled_for.py --targets h100 --models 1b --layer-loops auto,sliced

Writes ``--out`` (default docs/device/compiled_for.md) and its JSON beside it. The KV pool
is ``--kv-pages`` pages a device (the issue's 1.14 GB pool at 1B; 0: what ``jserve plan``
sizes for the target's memory)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.device_profiles import LLAMA_1B, LLAMA_8B, llama_cfg  # noqa: E402
from jserve.engine.config import EngineConfig  # noqa: E402
from jserve.targets.command import rows  # noqa: E402
from jserve.targets.programs import compile_for  # noqa: E402

MODELS = {"1b": ("Llama-3.2-1B-shaped", LLAMA_1B), "8b": ("Llama-3-8B-shaped", LLAMA_8B)}


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def table(entries: list[dict]) -> list[str]:
    lines = ["| model | layer mode | program | compile s | launches (a layer; cheapest "
             "branches) | while / cond / host syncs (largest / cheapest branches) | weight "
             "copies GB | KV copies GB | bytes GB (XLA / HLO / HLO cheapest branches) | "
             "weights GB | cheapest / weights | memory GB | roofline ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        for r in e["rows"]:
            lines.append(
                f"| {e['model']} | {e['layer_mode']} | {r['program']} | {r['compile_s']:.0f} "
                f"| {r['launches']} ({r['launches'] / e['layers']:.1f}; {r['launches_least']}) "
                f"| {r['whiles']} / "
                f"{r['conditionals']} / {r['host_syncs']} / {r['host_syncs_least']} | "
                f"{_gb(r['weight_copy_bytes'])} | "
                f"{_gb(r['kv_copy_bytes'])} | {_gb(r['bytes_xla'])} / {_gb(r['bytes_hlo'])} / "
                f"{_gb(r['bytes_hlo_least'])} | {_gb(e['weight_bytes'])} | "
                f"{r['bytes_hlo_least'] / e['weight_bytes']:.2f} | "
                f"{_gb(r['memory_bytes'])} | {r['roofline_us'] / 1e3:.2f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="h100,v5e")
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--layer-loops", default="auto")
    ap.add_argument("--steps", default="1x0,32x0,32x256")
    ap.add_argument("--kv-pages", type=int, default=2176)
    ap.add_argument("--attention", default="auto", help="attention_impl (auto: the target's)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "device" / "compiled_for.md"))
    a = ap.parse_args()
    steps = [tuple(int(x) for x in s.split("x")) for s in a.steps.split(",")]
    entries, refused = [], []
    for target in a.targets.split(","):
        for key in a.models.split(","):
            name, shape = MODELS[key]
            cfg = llama_cfg(**shape)
            for mode in a.layer_loops.split(","):
                r, mesh = None, "tp=1"
                for mesh in ("tp=1", "tp=4"):  # a model one chip cannot hold: the 2x2's four
                    config = EngineConfig(layer_loop=mode, num_kv_pages=a.kv_pages or None,
                                          max_model_len=8192, mesh=mesh,
                                          attention_impl=a.attention)
                    try:
                        r = compile_for(target, cfg, config, steps=steps)
                    except Exception as e:  # noqa: BLE001 - a refusal is a result here
                        refused.append(f"{target} {name} {mode} {mesh}: "
                                       f"{str(e).splitlines()[0][:300]}")
                        print(refused[-1], flush=True)
                        continue
                    if r.fits:
                        break
                    refused.append(f"{target} {name} {mode} {mesh}: does not fit "
                                   f"({r.largest_memory / 1e9:.1f} GB a program)")
                if r is None:
                    continue
                entries.append(dict(target=target, model=f"{name} {mesh}",
                                    layer_mode=r.layer_mode,
                                    attention=r.attention, layers=cfg.num_hidden_layers,
                                    weight_bytes=r.weight_bytes, kv_pool_bytes=r.kv_pool_bytes,
                                    rows=rows(r)))
                print(f"{target} {name} {r.layer_mode}: {len(r.programs)} programs in "
                      f"{r.seconds:.0f} s", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shown = " ".join(x for x in sys.argv[1:] if not x.startswith("/"))
    lines = [f"# Compiled for (generated {datetime.date.today()}, "
             f"`python scripts/compiled_for.py {shown}`)".replace(" `)", "`)"), "",
             "Each program compiled on this CPU host for the target's compile-only device; "
             "how each column is counted: `jserve/targets/hlo.py` (a `while` without a known "
             "trip count counts once: a decode burst's figures are one decode step of it; a TPU "
             "program's launches count every op libtpu leaves unfused, its prefetches into VMEM "
             "among them, so they do not compare with a GPU's kernel launches). "
             f"KV pool: {a.kv_pages or 'planned'} pages a device.", ""]
    for target in a.targets.split(","):
        mine = [e for e in entries if e["target"] == target]
        if mine:
            lines += [f"## {target} (attention {mine[0]['attention']})", "", *table(mine), ""]
    if refused:
        lines += ["## Refused", "", *[f"- {r}" for r in refused], ""]
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(dict(entries=entries, refused=refused),
                                                   indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
