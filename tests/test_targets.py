"""jserve's programs compiled for accelerators this host does not have (``jserve.targets``):
the HLO reading on a module written by hand (exact counts), on programs XLA:GPU and libtpu
compile here (control flow counted exactly), and ``jserve compile --target`` on the built-in
model for an H100 and a v5e, the engine's whole program set."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from jserve import backend
from jserve.targets import hlo
from jserve.targets.specs import TARGETS, devices

# A layer loop of 4 known trips: each slices layer i of a stacked [4, 8, 16] weight into a
# copy (a weight copy of 256 bytes a trip), multiplies by it (a GEMM fusion), and writes KV
# rows in place through a custom call that takes the [2, 4, 16] pool (aliased); after the
# loop a conditional picks one of two branches (2 kernels or 1).
MODULE = """HloModule jit_f, entry_computation_layout={(bf16[4,8,16]{2,1,0})->bf16[2,8]{1,0}}

%fused_slice (param_0: bf16[4,8,16], param_1: s32[]) -> bf16[8,16] {
  %param_0 = bf16[4,8,16]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%param_0, %param_1, %c0, %c0), dynamic_slice_sizes={1,8,16}
  ROOT %b = bf16[8,16]{1,0} bitcast(%ds)
}

%gemm_computation (param_0: bf16[2,8], param_1: bf16[8,16]) -> bf16[2,16] {
  %param_0 = bf16[2,8]{1,0} parameter(0)
  %param_1 = bf16[8,16]{1,0} parameter(1)
  ROOT %dot = bf16[2,16]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_take (param_0: bf16[4,8,16], param_1: s32[]) -> bf16[1,8,16] {
  %param_0 = bf16[4,8,16]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%param_0, %param_1, %c0, %c0), dynamic_slice_sizes={1,8,16}
}

%body (p: (s32[], bf16[4,8,16], bf16[2,8], bf16[2,4,16])) -> (s32[], bf16[4,8,16], bf16[2,8], bf16[2,4,16]) {
  %p = (s32[], bf16[4,8,16]{2,1,0}, bf16[2,8]{1,0}, bf16[2,4,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[4,8,16]{2,1,0} get-tuple-element(%p), index=1
  %x = bf16[2,8]{1,0} get-tuple-element(%p), index=2
  %kv = bf16[2,4,16]{2,1,0} get-tuple-element(%p), index=3
  %wi = bf16[8,16]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %y = bf16[2,16]{1,0} fusion(%x, %wi), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %kv2 = bf16[2,4,16]{2,1,0} custom-call(%kv, %y), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{}: (0, {})}
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[4,8,16]{2,1,0}, bf16[2,8]{1,0}, bf16[2,4,16]{2,1,0}) tuple(%i2, %w, %x, %kv2)
}

%cond (p: (s32[], bf16[4,8,16], bf16[2,8], bf16[2,4,16])) -> pred[] {
  %p = (s32[], bf16[4,8,16]{2,1,0}, bf16[2,8]{1,0}, bf16[2,4,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%two (a: bf16[2,8]) -> bf16[2,8] {
  %a = bf16[2,8]{1,0} parameter(0)
  %n1 = bf16[2,8]{1,0} negate(%a)
  ROOT %n2 = bf16[2,8]{1,0} negate(%n1)
}

%one (a: bf16[2,8]) -> bf16[2,8] {
  %a = bf16[2,8]{1,0} parameter(0)
  ROOT %n1 = bf16[2,8]{1,0} negate(%a)
}

ENTRY %main (w: bf16[4,8,16], x: bf16[2,8], kv: bf16[2,4,16], flag: pred[]) -> bf16[2,8] {
  %w = bf16[4,8,16]{2,1,0} parameter(0)
  %x = bf16[2,8]{1,0} parameter(1)
  %kv = bf16[2,4,16]{2,1,0} parameter(2)
  %flag = pred[] parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,8,16]{2,1,0}, bf16[2,8]{1,0}, bf16[2,4,16]{2,1,0}) tuple(%zero, %w, %x, %kv)
  %loop = (s32[], bf16[4,8,16]{2,1,0}, bf16[2,8]{1,0}, bf16[2,4,16]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %taken = bf16[1,8,16]{2,1,0} fusion(%w, %zero), kind=kLoop, calls=%fused_take
  ROOT %out = bf16[2,8]{1,0} conditional(%flag, %x, %x), true_computation=%two, false_computation=%one
}
"""

GEOMETRY = hlo.Geometry(weights=frozenset({(8, 16), (4, 8, 16)}),
                        kv=frozenset({(2, 4, 16)}))


def test_a_module_written_by_hand_is_counted_exactly():
    a = hlo.analyse(MODULE, GEOMETRY)
    # Per trip: the slice fusion, the GEMM, the custom call and the counter's add (4 trips);
    # the condition's compare (4 trips); then the entry's slice fusion and the larger branch.
    assert dict(a.kernels) == {"fusion": 4 + 1, "gemm": 4, "pallas": 4, "other": 4 + 4 + 2}
    assert (a.whiles, a.unknown_trip_whiles, a.conditionals, a.host_syncs) == (1, 0, 1, 1)
    # The weight slices: 4 trips x 256 bytes inside the loop, one more outside it.
    assert [(c.name, c.kind, c.bytes) for c in a.copies] == \
        [("wi", "weight", 4 * 256)] + [("taken", "weight", 256)]
    # Bytes: the slice fusion reads its slice (256) and index (4) and writes the slice
    # (256); the GEMM reads x (32) and the slice (256) and writes 64; the custom call reads y
    # (64) and neither reads nor writes the KV pool (paged, aliased); the add moves 3 x 4
    # bytes and the compare 4 + 4 + 1.
    per_trip = (256 + 4 + 256) + (32 + 256 + 64) + 64 + 12 + 9
    branch = 2 * (32 + 32)
    assert a.bytes == 4 * per_trip + (256 + 4 + 256) + branch
    assert a.flops == 4 * 2 * 8 * (2 * 16)


def test_a_while_without_a_known_trip_count_counts_once_and_syncs():
    a = hlo.analyse(MODULE.replace(', backend_config={"known_trip_count":{"n":"4"}}', ""),
                    GEOMETRY)
    assert (a.whiles, a.unknown_trip_whiles, a.host_syncs) == (1, 1, 2)
    assert a.kernels["gemm"] == 1 and a.copy_bytes("weight") == 2 * 256


def _on(target: str, f, *specs):
    """``f`` compiled for ``target``'s first compile-only device."""
    one = jax.sharding.SingleDeviceSharding(devices(target)[0])
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one) for s in specs]
    with backend.compiling_for(TARGETS[target].platform):
        return jax.jit(f).lower(*args).compile()


@pytest.mark.parametrize("target", ["h100", "v5e"])
def test_control_flow_of_a_compiled_program_is_counted(target):
    """A counted layer loop around a matmul, a data-dependent ``while`` and a ``cond``
    between two matmuls, compiled by the target's compiler: the loop's kernels count once a
    trip (3, 6 and 9 trips add the same kernels each time), the ``while`` whose trips are
    data once, the conditional once."""
    def program(trips):
        def f(n, w, x):
            y = jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w[i]), x)
            y = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2.0),
                                   (0, y))[1]
            return jax.lax.cond(n > 3, lambda y: jnp.tanh(y @ w[0]), lambda y: y @ w[1], y)
        return f
    specs = (jax.ShapeDtypeStruct((), jnp.int32),
             jax.ShapeDtypeStruct((9, 256, 256), jnp.bfloat16),
             jax.ShapeDtypeStruct((8, 256), jnp.bfloat16))
    geometry = hlo.Geometry(frozenset({(256, 256), (9, 256, 256)}), frozenset(), 9)
    runs = [hlo.analyse(_on(target, program(trips), *specs).as_text(), geometry)
            for trips in (3, 6, 9)]
    for a in runs:
        assert (a.whiles, a.unknown_trip_whiles, a.conditionals) == (2, 1, 1), a
    launches = [a.launches for a in runs]
    assert launches[2] - launches[1] == launches[1] - launches[0] > 0, launches
    flops = [a.flops for a in runs] if target == "h100" else None  # GEMM fusions on GPU
    if flops:
        assert flops[1] - flops[0] == 3 * 2 * 8 * 256 * 256, flops


def test_every_target_gives_its_compile_only_device():
    for name, t in TARGETS.items():
        (d,) = devices(name)
        assert (d.platform, d.device_kind) == (t.platform, t.device_kind), name


def _compile_default(tmp_path, target: str) -> dict:
    from jserve.cli import main

    out = tmp_path / f"{target}.json"
    flags = ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "256"]
    assert main(["compile", "--target", target, *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("target, attention, layers", [("h100", "pallas_gpu", "sliced"),
                                                       ("v5e", "reference", "unrolled")])
def test_jserve_compile_builds_the_engines_whole_program_set(tmp_path, target, attention,
                                                             layers):
    """``jserve compile`` on the built-in model: every program the engine would compile
    there (each bucket's step and the sampler), compiled by the target's compiler, each
    read; the layer mode and kernels ``auto`` resolves to on that platform."""
    from jserve.engine.config import EngineConfig
    from jserve.engine.factory import engine_geometry
    from jserve.model.weights import load_config

    report = _compile_default(tmp_path, target)
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=256)
    buckets = engine_geometry(load_config("default"), config).buckets
    steps = sorted(f"step {d}x{p}" for d, p in buckets.all_shapes())
    names = [p["program"] for p in report["programs"]]
    assert sorted(n for n in names if n.startswith("step")) == steps
    assert [n for n in names if n.startswith("sampler")] != []
    assert (report["attention"], report["layer_mode"], report["plan_fits"]) == \
        (attention, layers, True)
    for p in report["programs"]:
        assert p["launches"] > 0 and p["memory_bytes"] > 0, p
