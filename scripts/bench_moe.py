"""The MoE block's ways of running its experts (``jserve.model.moe``) on this backend, against
the dense gated MLP of the same active parameters, one layer alone, float32:

    python scripts/bench_moe.py                       # 8 experts, top 2, hidden 256, MLP 768
    python scripts/bench_moe.py --experts 128 --top-k 8 --tokens 1,16,256

``gathered`` and ``grouped`` are the block's two ways (``moe.gathers`` picks by token count);
``all-experts`` is a candidate not in the package: every expert on every token as two plain
2D matmuls, the gate/up stack laid out [hidden, experts * 2 * MLP] (a load-time layout) and
the unchosen experts' activations zeroed before the down projection. Medians of ``--reps``
timed calls after one untimed, in ms."""
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


def _median_ms(f, *args, reps: int) -> float:
    f(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--mlp", type=int, default=768, help="one expert's intermediate size")
    p.add_argument("--tokens", default="1,8,64,256")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    e, k, d, f = a.experts, a.top_k, a.hidden, a.mlp
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(0, 0.05, s), jnp.float32)
    layer = {"router": w(d, e), "we_gate_up": w(e, d, 2 * f), "we_down": w(e, f, d)}
    dense = {"w_gate_up": w(d, 2 * k * f), "w_down": w(k * f, d)}  # the active parameters
    gate_up_2d = jnp.transpose(layer["we_gate_up"], (1, 0, 2)).reshape(d, -1)

    def all_experts(layer, x, weights, experts, act):
        g, u = jnp.split((x @ gate_up_2d).reshape(x.shape[0], e, 2 * f), 2, axis=-1)
        picked = jnp.zeros((x.shape[0], e), jnp.float32).at[
            jnp.arange(x.shape[0])[:, None], experts].set(weights)
        h = act(g) * u * picked[..., None].astype(x.dtype)
        return h.reshape(x.shape[0], -1) @ layer["we_down"].reshape(-1, d)

    ways = {"gathered": moe.gathered_experts, "grouped": moe.grouped_experts,
            "all-experts": all_experts}
    rows = []
    for t in map(int, a.tokens.split(",")):
        x = w(t, d) * 20
        row = {"tokens": t, "picked_by_moe_mlp": "gathered" if moe.gathers(t, k, e)
               else "grouped",
               "dense_active_ms": _median_ms(jax.jit(gated_mlp), dense, x, reps=a.reps)}
        for name, way in ways.items():
            run = jax.jit(lambda l, x, way=way: way(l, x, *moe.route(x @ l["router"], k),
                                                    jax.nn.silu))
            row[f"{name}_ms"] = _median_ms(run, layer, x, reps=a.reps)
        rows.append(row)
        print(json.dumps({key: round(v, 3) if isinstance(v, float) else v
                          for key, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
