"""jserve's programs compiled for accelerators this host does not have (``jserve.targets``):
the HLO reading on a module written by hand (exact counts), on programs XLA:GPU and libtpu
compile here (control flow counted exactly), and ``jserve compile --target`` on the built-in
model for an H100 and a v5e, the engine's whole program set."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jserve import backend
from jserve.targets import hlo
from jserve.targets.specs import TARGETS, devices

# tests/data/layer_loop.hlo.txt, written by hand: a layer loop of 4 known trips, each
# slicing layer i of a stacked [4, 8, 16] weight into a copy (a weight copy of 256 bytes a
# trip), multiplying by it (a GEMM fusion) and writing KV rows in place through a custom
# call that takes the [2, 4, 16] pool (aliased); after the loop a conditional picks one of
# two branches (2 kernels or 1).
MODULE = (Path(__file__).parent / "data" / "layer_loop.hlo.txt").read_text()

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
    unannotated = MODULE.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    # libtpu writes no trip count: a counted loop's (i < 4 from 0) is read from its condition
    assert hlo.analyse(unannotated, GEOMETRY) == hlo.analyse(MODULE, GEOMETRY)
    a = hlo.analyse(unannotated.replace("direction=LT", "direction=NE"), GEOMETRY)
    assert (a.whiles, a.unknown_trip_whiles, a.host_syncs) == (1, 1, 2)
    assert a.kernels["gemm"] == 1 and a.copy_bytes("weight") == 2 * 256


ASYNC = """HloModule a

ENTRY %main (p: s8[1024]) -> s8[128] {
  %p = s8[1024]{0} parameter(0)
  %slice-start = ((s8[1024]{0}), s8[128]{0}, s32[]) slice-start(%p), slice={[0:128]}
  %slice-done = s8[128]{0} slice-done(%slice-start)
  %copy-start = (s8[128]{0:S(1)}, s8[128]{0}, u32[]) copy-start(%slice-done)
  ROOT %copy-done = s8[128]{0:S(1)} copy-done(%copy-start)
}
"""


def test_libtpus_asynchronous_slices_and_copies_move_their_result_once():
    """A ``slice-start``'s shape echoes its whole operand (1,024 bytes here) beside the slice
    (128): each start reads and writes its result once, the done moves nothing (counted
    whole, a v6e decode step's bytes were 7x XLA's)."""
    a = hlo.analyse(ASYNC, GEOMETRY)
    assert a.bytes == 2 * 128 + 2 * 128
    assert dict(a.kernels) == {"other": 2 + 1, "copy-start": 1}


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
    """``jserve compile`` run as a user runs it: its own process (JAX reads the persistent
    cache's directory once a process), no ``JAX_PLATFORMS`` (the GPU plugin finds no GPU
    here; the start failed on that before)."""
    out = tmp_path / f"{target}.json"
    flags = ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "256",
             "--write-cache", str(tmp_path / "cache")]
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user's shell
    proc = subprocess.run([sys.executable, "-m", "jserve.cli", "compile", "--target", target,
                           *flags, "--json", str(out)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"executables into {tmp_path / 'cache'}" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("target, attention, layers",
                         [("h100", "pallas_gpu", "sliced-indexed"),
                          ("v5e", "pallas_tpu", "unrolled")])
def test_jserve_compile_builds_the_engines_whole_program_set(tmp_path, target, attention,
                                                             layers):
    """``jserve compile`` on the built-in model: every program the engine would compile
    there (each bucket's step and the sampler), compiled by the target's compiler, each
    read; the layer mode and kernels ``auto`` resolves to on that platform."""
    from jserve.engine.build.factory import engine_geometry
    from jserve.engine.config import EngineConfig
    from jserve.model.weights import load_config

    report = _compile_default(tmp_path, target)
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=256)
    buckets = engine_geometry(load_config("default"), config).buckets
    steps = sorted(f"step {d}x{p}" for d, p in buckets.all_shapes())
    names = [p["program"] for p in report["programs"]]
    assert sorted(n for n in names if n.startswith("step")) == steps
    assert [n for n in names if n.startswith("sampler")] != []
    assert (report["attention"], report["layer_mode"], report["fits"]) == \
        (attention, layers, True)
    for p in report["programs"]:
        assert p["launches"] > 0 and p["memory_bytes"] > 0, p
    # Every program's executable lands in the cache (and the plan's largest step, compiled
    # at a 2-page pool to size the real one).
    assert len(list((tmp_path / "cache").iterdir())) == len(names) + 1


@pytest.mark.slow
def test_jserve_compile_reads_a_transformers_checkpoint(tmp_path):
    """A checkpoint transformers wrote (Llama-3-style, trained BPE tokenizer), compiled for
    an H100 by name as ``jserve serve`` would load it: the program holds exactly the
    checkpoint's weights (every tensor of model.safetensors, float32 as stored: auto keeps
    the dtype on a GPU), and its batch-1 decode step reads each layer in place (auto's GPU
    layer mode), copying no weight."""
    from safetensors import safe_open

    from hf_models import llama3_chat_dir
    from jserve.cli import main

    model = llama3_chat_dir()
    out = tmp_path / "h100.json"
    assert main(["compile", "--target", "h100", "--model", str(model), "--steps", "1x0",
                 "--max-model-len", "512", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    with safe_open(model / "model.safetensors", "np") as f:
        stored = sum(f.get_slice(k).get_shape() and
                     int(jnp.prod(jnp.array(f.get_slice(k).get_shape()))) * 4
                     for k in f.keys())
    assert report["weight_bytes"] == stored
    ((step,),) = [report["programs"]]
    assert (report["layer_mode"], step["program"], step["weight_copy_bytes"]) == \
        ("sliced-indexed", "step 1x0", 0)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert step["kernels"]["pallas"] == layers * 6  # a layer: 4 matmuls, attention, a write
