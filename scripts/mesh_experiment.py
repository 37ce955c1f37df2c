"""Mesh shapes x context lengths x chunk sizes: TTFT and TBT of one request alone (issue 6).

    python scripts/mesh_experiment.py --smoke --out-dir /tmp/mesh            # CI scale
    python scripts/mesh_experiment.py --meshes "1;tp=2;tp=4" --contexts 256,1024 --chunks 64,256
    python scripts/mesh_experiment.py --model /path/to/hf_dir --cpu-devices 0  # real devices only

For each mesh x chunk size one engine (max_num_batched_tokens = chunk, one sequence, a fixed
KV budget); every context runs once untimed (compiles), then ``--repeats`` times; the median
TTFT and the median gap between tokens (TBT) are kept. Writes ``mesh_experiment.csv``,
``mesh_experiment.png`` and ``summary.json`` to ``--out-dir`` and prints whether every mesh
produced the same greedy tokens as the one-device mesh ("1"); exits 1 when one did not.

Devices: ``--cpu-devices N`` (default 8) gives the host platform N simulated devices; it is
set in XLA_FLAGS before JAX is imported and only affects the CPU backend, so on a GPU or TPU
host the real accelerators are used. A mesh the engine rejects becomes an error row.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SMOKE = dict(contexts="24,72", chunks="16,64", decode_tokens=4, repeats=1)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--meshes", default="1;tp=2;kvp=2;spp=2;tp=2,kvp=2,spp=2",
                   help='";"-separated mesh strings ("1" is one device)')
    p.add_argument("--contexts", default="256,1024,4096", help="prompt lengths, comma-separated")
    p.add_argument("--chunks", default="64,256", help="chunk sizes (max_num_batched_tokens)")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-impl", default="reference")
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="simulated host devices (CPU backend only; 0 leaves XLA_FLAGS alone)")
    p.add_argument("--out-dir", default="mesh_experiment")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny settings for CI ({SMOKE}); explicit flags still win")
    args = p.parse_args(argv)
    if args.smoke:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for key, value in SMOKE.items():
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
    return args


def _force_host_devices(n: int) -> None:
    """Must run before JAX is imported; keeps a count the caller already put in XLA_FLAGS."""
    if n < 0:
        raise SystemExit(f"--cpu-devices must be >= 0, got {n}")
    if "jax" in sys.modules:
        raise RuntimeError("jax was imported before the host device count was set")
    flags = os.environ.get("XLA_FLAGS", "")
    if n and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv=None) -> int:
    args = _args(argv)
    _force_host_devices(args.cpu_devices)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from harness.mesh_sweep import SweepSettings, parse_list, run

    try:
        settings = SweepSettings(
            model=args.model, meshes=parse_list(args.meshes, ";"),
            contexts=parse_list(args.contexts, ",", int), chunks=parse_list(args.chunks, ",", int),
            decode_tokens=args.decode_tokens, repeats=args.repeats, seed=args.seed,
            attention_impl=args.attention_impl)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    summary = run(settings, out, log=lambda msg: print(msg, flush=True))
    print(f"wrote {out / 'mesh_experiment.csv'}, {out / 'mesh_experiment.png'}, "
          f"{out / 'summary.json'}")
    # Rejected meshes are expected (error rows); a mesh that ran and changed the tokens is not.
    return 1 if False in summary["same_as_reference"].values() else 0


if __name__ == "__main__":
    sys.exit(main())
