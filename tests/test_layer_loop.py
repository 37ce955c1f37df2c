"""The "indexed" layer loop (``EngineConfig.layer_loop``): one loop over the stacked weights,
whose matmuls read each layer's tiles in place (``jserve.kernels.layer_matmul``).

- Tokens: the indexed loop gives the unrolled layers' greedy tokens on one device and on a
  mesh of every axis at once (tp, kvp and spp), through the mesh matrix's script and checks.
- Weight copies. What is checked is the program the GPU and TPU compilers get: the step
  exported for cuda and for tpu (``jax.export``, no device needed) hands every layer matmul
  the whole stacked weight [L, in, out] and the traced layer (a Triton / Mosaic call), and
  holds no dynamic slice of a layer matrix, where the plain loop's exported step holds one
  per matrix (the slice XLA:GPU copies; docs/device.md). The optimized HLO of the indexed
  step on CPU cannot show it: there the kernel runs in Pallas interpret mode, which copies
  its operands (it is exact, not fast), and XLA:CPU has no kernel that reads a slice in
  place. What the CPU's optimized HLO does show is the copies this mode removes: the plain
  loop's step materialises every layer matrix (the counter ``harness.layer_copies``
  finds all four), unrolled layers none.
- The kernel itself: both flavours, interpreted, equal ``x @ w[i]`` for plain and quantized
  weights at every layer.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.layer_copies import layer_matrix_copies, layer_matrix_shapes
from jserve.engine.config import EngineConfig, layer_flags
from jserve.engine.engine import LLMEngine
from jserve.kernels.layer_matmul import gpu_splits, layer_matmul
from jserve.model import quant
from jserve.model.weights import DEFAULT_CONFIG, init_params
from test_mesh_matrix import check_against_one_device, run_meshes

TARGETS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
SHAPE = (4, 0)  # the step the HLO tests build: 4 decode rows


@pytest.mark.slow
def test_indexed_loop_matches_unrolled_layers_on_every_mesh_axis():
    # One device, and every axis at once (the interpreted kernel is slow on CPU: the axes
    # one at a time are the plain modes' matrix, test_mesh_matrix.py).
    meshes = ["tp=1|indexed", "spp=2,kvp=2,tp=2|indexed"]
    result = run_meshes([["tp=1|sync", meshes[0]], meshes[1:]])
    check_against_one_device(result, meshes)  # the base runs the default model unrolled


@pytest.mark.parametrize("flavour, quantization, rows, k, n", [
    ("gpu", "none", 5, 256, 384),   # split-K: 4 parts of 64
    ("gpu", "none", 33, 688, 256),  # rows padded to 64; K tiles 16 wide, 43 of them
    ("gpu", "int8", 5, 256, 384),
    ("tpu", "none", 5, 1024, 640),  # a 2 x 5 grid of 512 x 128 tiles
    ("tpu", "fp8", 33, 688, 256)])  # (the engine tests run the TPU flavour on plain weights)
def test_layer_matmul_reads_each_layer(flavour, quantization, rows, k, n):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, k, n)) / 16, jnp.float32)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    if quantization != "none":
        w = quant.quantize_weight(w, quantization)
    run = jax.jit(functools.partial(layer_matmul, flavour=flavour))
    for i in range(3):
        want = quant.matmul(x, jax.tree.map(lambda a, i=i: a[i], w))
        np.testing.assert_allclose(np.asarray(run(x, w, jnp.int32(i))), np.asarray(want),
                                   rtol=2e-5, atol=2e-5)


def test_gpu_split_k_fills_the_gpu_and_divides_the_k_tiles():
    assert gpu_splits(programs=3, k_tiles=4) == 4          # decode, narrow matrix: split
    assert gpu_splits(programs=16, k_tiles=64) == 16       # capped (GPU_MAX_SPLITS)
    assert gpu_splits(programs=16, k_tiles=43) == 1        # 43 tiles: no power-of-two split
    assert gpu_splits(programs=512, k_tiles=64) == 1       # enough programs already


@pytest.fixture(scope="module")
def engines():
    """One engine per layer mode on the default model (4 layers), nothing compiled."""
    params = init_params(DEFAULT_CONFIG)
    make = lambda mode: LLMEngine(DEFAULT_CONFIG, params, None, EngineConfig(  # noqa: E731
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, warmup=False,
        attention_impl="reference", layer_loop=mode, enable_prefix_caching=False))
    return {mode: make(mode) for mode in ("loop", "indexed")}


def exported_step(engine: LLMEngine, platform: str) -> str:
    """The MLIR text of ``engine``'s decode step exported for ``platform``."""
    low = engine.runner.programs.lowering
    layout, ibuf, fbuf, masks = low._buffer_specs(SHAPE)
    export = jax.export.export(
        low.jitted.step, platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TARGETS[platform])])
    spec = low.step_spec(SHAPE, burst_steps=1)  # one decode step, no burst loop around it
    assert spec.layout is layout and not spec.slice_layers
    return export(*low.args, ibuf, fbuf, masks, low.spare_spec(spec.rows),
                  spec=spec).mlir_module()


def _tensor(shape) -> str:
    return "tensor<" + "x".join(map(str, shape)) + "xf32>"


def layer_slices(mlir: str) -> int:
    """Dynamic slices whose result is a layer matrix (of the default model)."""
    shapes = "|".join(re.escape(_tensor(s)) for s in layer_matrix_shapes(DEFAULT_CONFIG))
    return len(re.findall(rf"stablehlo\.dynamic_slice[^\n]*-> (?:{shapes})", mlir))


def stacked_operand_calls(mlir: str, target: str) -> int:
    """Calls of the kernel ``target`` taking a whole stacked layer matrix as an operand."""
    layers = DEFAULT_CONFIG.num_hidden_layers
    stacks = [_tensor((layers, *s)) for s in layer_matrix_shapes(DEFAULT_CONFIG) if len(s) == 2]
    calls = [line for line in mlir.splitlines() if f"custom_call @{target}" in line]
    return sum(any(s in line.split("->")[0] for s in stacks) for line in calls)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_exported_indexed_step_reads_stacked_weights_in_place(engines, platform):
    indexed = exported_step(engines["indexed"], platform)
    # Four matmuls in the loop body (wqkv, wo, w_gate_up, w_down), each one kernel call on
    # its stacked weight, and no layer matrix sliced out.
    assert stacked_operand_calls(indexed, TARGETS[platform]) == 4
    assert layer_slices(indexed) == 0
    # The plain loop slices every matrix: one slice function per distinct shape (the
    # built-in model's four are all distinct).
    assert layer_slices(exported_step(engines["loop"], platform)) == 4


def test_cpu_loop_step_copies_every_layer_matrix(engines):
    """The copies the indexed mode exists to remove, in the optimized CPU HLO of the step:
    each of the loop body's four matrices materialised (unrolled layers copy none:
    ``scripts/bench_layer_loop.py`` counts every mode)."""
    hlo = engines["loop"].runner.programs.lowering.lower(SHAPE)[0].compile().as_text()
    assert layer_matrix_copies(hlo, DEFAULT_CONFIG) == 4


@pytest.mark.parametrize("layers", [12, 32])
def test_cpu_auto_step_copies_no_layer_matrix_at_any_depth(layers):
    """``auto`` on CPU unrolls deep models too: the optimized decode step of a 12- and a
    32-layer model materialises no layer matrix (the loop's would, every layer)."""
    cfg = dataclasses.replace(DEFAULT_CONFIG, num_hidden_layers=layers)
    eng = LLMEngine(cfg, init_params(cfg), None, EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, warmup=False,
        enable_prefix_caching=False))
    assert eng.config.layer_mode(layers, 1) == "unrolled"
    hlo = eng.runner.programs.lowering.lower(SHAPE)[0].compile().as_text()
    assert layer_matrix_copies(hlo, cfg) == 0


def test_layer_loop_option_is_wired():
    from jserve.flags.args import add_engine_args, engine_kwargs
    assert EngineConfig(layer_loop="indexed").layer_mode(32, 2, "gpu") == "indexed"
    # auto on GPU: decode-only steps indexed, the rest sliced; sliced for a model whose KV
    # layer groups need every step's layers unrolled (tests/test_targets.py: what each does)
    assert EngineConfig().layer_mode(32, 1, "gpu") == "sliced-indexed"
    assert EngineConfig().layer_mode(32, 1, "gpu", windowed=True) == "sliced"
    assert EngineConfig().layer_mode(32, 1, "tpu") == "indexed"
    assert layer_flags("sliced-indexed") == dict(slice_layers=True, in_place_layers="decode")
    with pytest.raises(ValueError, match="spp == 1"):
        EngineConfig(layer_loop="sliced-indexed").layer_mode(32, 2, "gpu")
    with pytest.raises(ValueError, match="layer_loop"):
        EngineConfig(layer_loop="scan")
    import argparse
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--layer-loop", "indexed"]))["layer_loop"] == "indexed"
