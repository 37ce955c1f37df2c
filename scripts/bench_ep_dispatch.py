"""Expert-parallel dispatch for one MoE block on a simulated 8-device CPU mesh: tokens
replicated over ep with one psum (jserve's ``moe.moe_mlp``), all-to-all, and all-gather +
reduce-scatter, each checked against the one-device block.

    nice -n 19 python scripts/bench_ep_dispatch.py > /tmp/ep_dispatch.json
    python scripts/bench_ep_dispatch.py --tokens 8 --meshes 2 --rounds 1 --calls 2   # smoke

For each mesh (ep=2, 4, 8) x token count x way: the median over ``--rounds`` rounds (the ways
alternating, each timed over ``--calls`` back-to-back calls) of the wall ms a call, and the
same program with its collectives replaced by local stand-ins (``ms_no_collectives``). Then the
bytes each way moves a shard per layer per step, for this block and for a Qwen3-30B-A3B-shaped
layer (hidden 2048, 128 experts, top 8) at 32 and 4096 tokens. JSON lines on stdout; exits 1
when a way's output differs from the one-device block. The simulated devices share this
host's cores: collectives are memcpys and the shards' compute runs one after another, so the
times rank the ways' compute and overheads, not a real interconnect (harness/ep_dispatch.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

from harness.ep_dispatch import bytes_moved, run  # noqa: E402

QWEN3_30B_A3B = {"hidden": 2048, "experts": 128, "k": 8}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2, help="experts a token (top k)")
    p.add_argument("--inter", type=int, default=768, help="an expert's MLP width")
    p.add_argument("--tokens", type=_ints, default=[8, 64, 512])
    p.add_argument("--meshes", type=_ints, default=[2, 4, 8], help="ep sizes")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10, help="calls of each way timed a round")
    p.add_argument("--atol", type=float, default=2e-5, help="and rtol, against one device")
    p.add_argument("--no-compute-only", action="store_true",
                   help="skip the runs with the collectives replaced")
    args = p.parse_args()
    emit = lambda row: print(json.dumps(row), flush=True)
    run(args.hidden, args.experts, args.k, args.inter, args.tokens, args.meshes, args.rounds,
        args.calls, not args.no_compute_only, args.atol, emit)
    shapes = {"bench": dict(hidden=args.hidden, experts=args.experts, k=args.k),
              "qwen3_30b_a3b": QWEN3_30B_A3B}
    for name, s in shapes.items():
        for t in ((32, 4096) if name != "bench" else args.tokens):
            for ep in args.meshes:
                moved = bytes_moved(t, s["hidden"], s["experts"], s["k"], ep)
                emit({"kind": "bytes", "shape": name, **s, "tokens": t, "mesh": f"ep={ep}",
                      "elem_bytes": 4, **{w: int(b) for w, b in moved.items()}})


if __name__ == "__main__":
    main()
