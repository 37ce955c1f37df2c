"""Expert-parallel dispatch, three ways, for one MoE block (router + top-k + experts, float32)
under ``jax.shard_map`` on an ``ep`` mesh; ``scripts/bench_ep_dispatch.py`` is the CLI.

- ``replicated_psum`` (jserve's today): every token on every ep shard, each shard runs the
  pairs routed to its E / ep experts (others weigh 0: ``moe.to_local``), one psum over ep.
  It is ``moe.moe_mlp`` itself, the serving code path.
- ``all_to_all``: tokens split over ep (T / ep a shard, as under data-parallel attention);
  each shard routes its tokens, packs each pair's row into a fixed-capacity buffer per
  destination shard (capacity T / ep * k rows, the worst case: nothing is dropped),
  ``all_to_all`` to the experts' owners, which run them (one local expert a row), and
  ``all_to_all`` back; the source weighs and sums its pairs.
- ``allgather_rs``: tokens split over ep; ``all_gather`` them, run the local experts' pairs
  as ``replicated_psum`` does, ``psum_scatter`` the output back to the token shards.

Each way can also run with its collectives replaced by local stand-ins of the same shapes
(identity, tiling, slicing): wrong numbers, the same compute, so the gap is what the
collectives (and the rendezvous between simulated devices) cost.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jserve.model import moe
from jserve.model.tp_layout import layer_axes
from sharding.mesh import MeshConfig, make_mesh

WAYS = ("replicated_psum", "all_to_all", "allgather_rs")
AX = moe.EP_AXIS


def make_layer(hidden: int, experts: int, inter: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The runtime layout of one layer (fused ``we_gate_up`` [hidden, E * 2 * inter]),
    weights scaled by 1 / sqrt(fan-in) so the block's output is O(1)."""
    rng = np.random.default_rng(seed)
    w = lambda fan, *s: (rng.standard_normal(s) / np.sqrt(fan)).astype(np.float32)
    gate_up = w(hidden, experts, hidden, 2 * inter)
    return {"router": w(hidden, hidden, experts), "we_down": w(inter, experts, inter, hidden),
            "we_gate_up": np.asarray(moe.side_by_side(jnp.asarray(gate_up)))}


def _local_pairs(layer, x, weights, experts) -> jax.Array:
    """This shard's experts on ``x``'s pairs (local ids; weight-0 pairs add nothing), as
    ``moe.moe_mlp`` picks the way on a CPU, without its psum over ep."""
    if moe.native(layer, moe.silu_glu):
        return moe.native_experts(layer, x, weights, experts, moe.silu_glu)
    few = moe.gathers(x.shape[0], experts.shape[1], moe.local_experts(layer))
    way = moe.gathered_experts if few else moe.all_experts
    return way(layer, x, weights, experts, moe.silu_glu)


def _routed(layer, x, k):
    """(weights, global expert ids) [T, k] of ``x``'s tokens, as ``moe.moe_mlp`` routes."""
    return moe.route(x @ layer["router"], k)


def replicated_psum(layer, x, k, ep, comm=True):
    if comm:
        return moe.moe_mlp(layer, x, k)
    return _local_pairs(layer, x, *moe.to_local(layer, *_routed(layer, x, k)))


def all_to_all(layer, x, k, ep, comm=True):
    t, d = x.shape
    n_local = moe.local_experts(layer)
    weights, experts = _routed(layer, x, k)  # [t, k] global ids
    dest = (experts // n_local).reshape(-1)  # [t * k] token-major
    cap = t * k  # worst case: every pair of this shard to one owner
    onehot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, dest[:, None], axis=1)[:, 0]
    token = jnp.arange(t * k) // k
    send = jnp.zeros((ep, cap, d), x.dtype).at[dest, slot].set(x[token])
    ids = jnp.zeros((ep, cap), jnp.int32).at[dest, slot].set(
        (experts % n_local).reshape(-1))
    live = jnp.zeros((ep, cap), jnp.float32).at[dest, slot].set(1.0)
    a2a = ((lambda a: jax.lax.all_to_all(a, AX, 0, 0)) if comm else (lambda a: a))
    rows, ids, live = a2a(send), a2a(ids), a2a(live)  # [ep (source), cap, ...]
    y = _local_pairs(layer, rows.reshape(ep * cap, d), live.reshape(-1, 1), ids.reshape(-1, 1))
    back = a2a(y.reshape(ep, cap, d))  # [ep (owner), cap, d]
    pairs = back[dest, slot].reshape(t, k, d)
    return jnp.einsum("tk,tkd->td", weights.astype(x.dtype), pairs)


def allgather_rs(layer, x, k, ep, comm=True):
    t = x.shape[0]
    every = jax.lax.all_gather(x, AX, tiled=True) if comm else jnp.tile(x, (ep, 1))
    out = _local_pairs(layer, every, *moe.to_local(layer, *_routed(layer, every, k)))
    if comm:
        return jax.lax.psum_scatter(out, AX, scatter_dimension=0, tiled=True)
    return out[:t]


def programs(layer: dict, ep: int, k: int, comm: bool) -> tuple[dict[str, Callable], dict]:
    """(way -> jitted shard_map program of (layer, x), the layer placed on the ep mesh) and the
    x shardings: replicated for ``replicated_psum``, split by token for the others."""
    mesh = make_mesh(MeshConfig(ep=ep))
    specs = {n: P(*layer_axes(n)[1:]) for n in layer}  # less the stacked layer axis
    placed = {n: jax.device_put(a, NamedSharding(mesh, specs[n])) for n, a in layer.items()}
    fns, x_sharding = {}, {}
    for name in WAYS:
        xs = P() if name == "replicated_psum" else P(AX)
        body = globals()[name]
        f = jax.shard_map(lambda l, h, body=body: body(l, h, k, ep, comm), mesh=mesh,
                          in_specs=(specs, xs), out_specs=xs, check_vma=False)
        fns[name] = jax.jit(f)
        x_sharding[name] = NamedSharding(mesh, xs)
    return fns, {"layer": placed, "x": x_sharding}


def _time(fn, layer, x, calls: int) -> float:
    """Wall ms a call, over ``calls`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(layer, x)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / calls


def run(hidden: int, experts: int, k: int, inter: int, tokens: list[int], meshes: list[int],
        rounds: int, calls: int, compute_only: bool, atol: float, emit: Callable) -> None:
    """Times every (mesh, tokens, way) and checks each against the one-device block."""
    emit({"kind": "setup", "devices": jax.device_count(), "cpu_cores": os.cpu_count(),
          "hidden": hidden, "experts": experts, "k": k, "inter": inter, "dtype": "float32",
          "rounds": rounds, "calls": calls, "loadavg_1m": os.getloadavg()[0],
          "native_kernel": moe.native(
              {n: jnp.asarray(a) for n, a in make_layer(8, 2, 4).items()}, moe.silu_glu),
          "note": "simulated host devices share the CPU cores: collectives are memcpys "
                  "and the shards' compute is serialized"})
    layer = make_layer(hidden, experts, inter)
    rng = np.random.default_rng(1)
    one = jax.jit(lambda l, h: moe.moe_mlp(l, h, k))
    dev_layer = {n: jnp.asarray(a) for n, a in layer.items()}
    for ep in meshes:
        if experts % ep:
            raise SystemExit(f"ep={ep} does not divide {experts} experts")
        sets = {True: programs(layer, ep, k, True)}
        if compute_only:
            sets[False] = programs(layer, ep, k, False)
        for t in tokens:
            if t % ep:
                raise SystemExit(f"{t} tokens do not split over ep={ep}")
            x = rng.standard_normal((t, hidden)).astype(np.float32)
            want = np.asarray(one(dev_layer, jnp.asarray(x)))
            ms: dict[tuple[str, bool], list[float]] = {}
            err, xs = {}, {}
            for comm, (fns, placed) in sets.items():
                xs[comm] = {w: jax.device_put(x, placed["x"][w]) for w in WAYS}
                for w in WAYS:  # compile, and check the real ways
                    got = np.asarray(fns[w](placed["layer"], xs[comm][w]))
                    if comm:
                        err[w] = float(np.max(np.abs(got - want)))
                        if not np.allclose(got, want, atol=atol, rtol=atol):
                            raise SystemExit(f"ep={ep} T={t} {w}: differs from the one-device "
                                             f"block by up to {err[w]:.3g} (atol {atol})")
            # The ways (and their stand-ins) alternate, the order rotating a round.
            runs = [(w, comm) for w in WAYS for comm in sets]
            for r in range(rounds):
                for w, comm in runs[r % len(runs):] + runs[:r % len(runs)]:
                    fns, placed = sets[comm]
                    ms.setdefault((w, comm), []).append(
                        _time(fns[w], placed["layer"], xs[comm][w], calls))
            for w in WAYS:
                row = {"kind": "time", "mesh": f"ep={ep}", "tokens": t, "way": w,
                       "ms": round(statistics.median(ms[w, True]), 3),
                       "max_abs_err": err[w]}
                if compute_only:
                    row["ms_no_collectives"] = round(statistics.median(ms[w, False]), 3)
                emit(row)
    emit({"kind": "done", "loadavg_1m": os.getloadavg()[0]})


def bytes_moved(tokens: int, hidden: int, experts: int, k: int, ep: int, elem: int = 4
                ) -> dict[str, float]:
    """Bytes one shard sends per MoE layer per step (ring collectives; each way's dispatch
    and combine together), by way:

    - replicated_psum: all-reduce of the output, 2 (ep-1)/ep * T * H * b (tokens already on
      every shard: attention replicated over ep);
    - replicated_psum_dp_attention: the same after gathering data-parallel attention's token
      shards first, + (ep-1)/ep * T * H * b;
    - allgather_rs: all-gather in plus reduce-scatter out, 2 (ep-1)/ep * T * H * b;
    - all_to_all (balanced routing, the payload only): T/ep tokens * k pairs a shard,
      (ep-1)/ep of them remote, each way: 2 * T * k * (ep-1)/ep^2 * H * b;
    - all_to_all_dedup (balanced, a token sent once to each remote shard holding any of its k
      experts, uniform routing): 2 * T/ep * (ep-1) * (1 - C(E - E/ep, k) / C(E, k)) * H * b;
    - all_to_all_worst_capacity (this bench's dense buffers, capacity T/ep * k rows for each
      of the ep-1 remote owners): 2 * T * k * (ep-1)/ep * H * b."""
    row = tokens * hidden * elem
    f = (ep - 1) / ep
    hit = 1 - math.comb(experts - experts // ep, k) / math.comb(experts, k)
    return {"replicated_psum": 2 * f * row, "replicated_psum_dp_attention": 3 * f * row,
            "allgather_rs": 2 * f * row, "all_to_all": 2 * k * f / ep * row,
            "all_to_all_dedup": 2 * f * hit * row,
            "all_to_all_worst_capacity": 2 * k * f * row}
