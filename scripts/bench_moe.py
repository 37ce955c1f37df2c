"""The MoE block's ways of running its experts (``jserve.model.moe``) on this backend, against
the dense gated MLP of the same active parameters, one layer alone, float32:

    python scripts/bench_moe.py                       # 8 experts, top 2, hidden 256, MLP 768
    python scripts/bench_moe.py --experts 128 --top-k 8 --tokens 1,16,256

``gathered``, ``all-experts``, ``grouped`` and (on a CPU) ``native`` are the block's ways
(``moe.moe_mlp`` picks one by the token count and the platform; ``picked`` says which it
takes here), on the runtime layout (``we_gate_up`` [hidden, experts * 2 * MLP]), the router
included. Each of ``--reps`` rounds times 10 calls of every way in turn, after one untimed
(so a change of machine load hits all ways alike); medians of the rounds, in ms, and the
median over rounds of ``picked`` / dense."""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jserve.model import moe
from jserve.model.layers import gated_mlp


def _round_ms(f, *args) -> float:
    t0 = time.perf_counter()
    for _ in range(10):
        out = f(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) * 100


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--mlp", type=int, default=768, help="one expert's intermediate size")
    p.add_argument("--tokens", default="1,8,64,256")
    p.add_argument("--reps", type=int, default=15, help="rounds")
    a = p.parse_args()
    e, k, d, f = a.experts, a.top_k, a.hidden, a.mlp
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(0, 0.05, s), jnp.float32)
    backend = jax.default_backend()
    gate_up = moe.side_by_side(w(e, d, 2 * f))
    layer = {"router": w(d, e), "we_gate_up": gate_up, "we_down": w(e, f, d)}
    dense = {"w_gate_up": w(d, 2 * k * f), "w_down": w(k * f, d)}  # the active parameters
    ways = {"gathered": moe.gathered_experts, "all-experts": moe.all_experts,
            "grouped": moe.grouped_experts}
    if backend == "cpu" and moe.native(layer, moe.silu_glu):
        ways["native"] = moe.native_experts
    for t in map(int, a.tokens.split(",")):
        x = w(t, d) * 20
        few = moe.gathers(t, k, e)
        picked = ("native" if "native" in ways else "gathered" if few
                  else "grouped" if backend == "tpu" else "all-experts")  # as moe_mlp picks
        runs = {"dense_active": (jax.jit(gated_mlp), dense)}
        for name, way in ways.items():
            runs[name] = (jax.jit(lambda l, x, way=way: way(l, x, *moe.route(x @ l["router"], k),
                                                            moe.silu_glu)), layer)
        for f, params in runs.values():
            f(params, x).block_until_ready()
        rounds = [{name: _round_ms(f, params, x) for name, (f, params) in runs.items()}
                  for _ in range(a.reps)]
        row = {"tokens": t, "picked": picked,
               **{f"{name}_ms": float(np.median([r[name] for r in rounds])) for name in runs},
               "picked_over_dense": float(np.median([r[picked] / r["dense_active"]
                                                     for r in rounds]))}
        print(json.dumps({key: round(v, 3) if isinstance(v, float) else v
                          for key, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
