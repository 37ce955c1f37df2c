"""``x @ w[layer]`` for a stacked weight ``w`` [L, in, out] and a traced ``layer``, reading
that layer's tiles where they lie: the layer loop's matmuls without the per-layer copy of
the weight (``EngineConfig.layer_loop`` "indexed"; docs/device.md).

Why a kernel: in a loop over stacked weights each layer's matrix is ``w[i]``, a
``dynamic-slice``. XLA:CPU materialises it before the dot, and XLA:GPU copies it too (on an
H100 4 copies a layer, more than half an 8B decode step; XLA's dynamic-slice fusion flag
did not remove them). A Pallas kernel takes the whole stack as its operand and addresses
the layer itself, as the attention kernels do for the stacked KV cache:

- GPU (Triton): the weight's block is the whole stack's column strip [L, in, bn]; the
  kernel loads ``w[layer, k-tile, :]`` tiles with the layer read from an int32 operand.
- TPU (Mosaic): the layer is scalar-prefetched and the weight's ``BlockSpec`` index map
  reads it, ``(layer, k, j)``, so the pipeline DMAs layer ``layer``'s [bk, bn] tiles.
- Elsewhere (CPU tests) the TPU flavour runs in Pallas interpret mode: exact, but the
  interpreter copies its operands, so on CPU this is a correctness path, not a fast one.

Quantized weights (``jserve.model.quant``: int8 / fp8 values and per-output-channel
scales) are read as stored and converted per tile in the kernel; the scales [L, 1, out]
are applied to the [rows, out] result (a slice of one layer's scales is ``out`` floats).
The reference is ``x @ w[layer]``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu, triton as plgpu

from jserve import backend as jserve_backend

FLAVOURS = ("gpu", "tpu")
# Tile caps: Triton's tiles must be powers of two (>= 16 for its dot); Mosaic's last two
# block dims multiples of (8, 128) or the whole dimension.
GPU_TILES = (64, 64, 128)     # rows, in, out
TPU_TILES = (128, 512, 512)
# Split-K aims for this many programs a launch (an H100 has 132 SMs, an H200 too).
GPU_TARGET_PROGRAMS = 264
GPU_MAX_SPLITS = 16


def _pow2_tile(dim: int, cap: int) -> int:
    """The largest power of two <= cap dividing ``dim``."""
    t = 1
    while t * 2 <= cap and dim % (t * 2) == 0:
        t *= 2
    return t


def _tpu_tile(dim: int, cap: int, align: int = 128) -> int:
    """A multiple of ``align`` <= cap dividing ``dim``, else the whole dimension."""
    for t in range(cap - cap % align, 0, -align):
        if dim % t == 0:
            return t
    return dim


def gpu_supports(k: int, n: int) -> bool:
    """Whether the Triton flavour tiles a [k, n] layer matrix (power-of-two tiles >= 16)."""
    return _pow2_tile(k, GPU_TILES[1]) >= 16 and _pow2_tile(n, GPU_TILES[2]) >= 16


def _gpu_kernel(layer_ref, x_ref, w_ref, o_ref, *, bk: int, steps: int):
    # x_ref [bm, in] of this row block; w_ref [L, in, bn]: the column strip of every layer;
    # program (i, j, s) sums K tiles [s * steps, (s + 1) * steps) (split-K part s).
    layer = layer_ref[0]
    bm, bn = o_ref.shape
    first = pl.program_id(2) * steps

    def step(k, acc):
        x = x_ref[:, pl.ds(k * bk, bk)]
        w = w_ref[layer, pl.ds(k * bk, bk), :].astype(x.dtype)
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(first, first + steps, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def gpu_splits(programs: int, k_tiles: int) -> int:
    """Split-K parts of a launch of ``programs`` (row x column blocks): a power of two
    dividing the K tiles, enough for about ``GPU_TARGET_PROGRAMS`` programs. A decode step's
    few rows give one row block, so without it a narrow matrix runs on a few SMs."""
    splits = 1
    while (programs * splits < GPU_TARGET_PROGRAMS and k_tiles % (splits * 2) == 0
           and splits < GPU_MAX_SPLITS):
        splits *= 2
    return splits


def _gpu_matmul(x, w, layer, out_dtype, interpret: bool):
    m, k = x.shape
    num_layers, _, n = w.shape
    bm = max(16, min(GPU_TILES[0], pl.next_power_of_2(m)))
    bk, bn = _pow2_tile(k, GPU_TILES[1]), _pow2_tile(n, GPU_TILES[2])
    x = _pad_rows(x, bm)
    grid_m, grid_n = x.shape[0] // bm, n // bn
    splits = gpu_splits(grid_m * grid_n, k // bk)
    acc_dtype = out_dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, bk=bk, steps=k // bk // splits),
        grid=(grid_m, grid_n, splits),
        in_specs=[pl.BlockSpec((1,), lambda i, j, s: (0,)),
                  pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
                  pl.BlockSpec((num_layers, k, bn), lambda i, j, s: (0, 0, j))],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, x.shape[0], n), acc_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="layer_matmul_gpu",
    )(layer, x, w)
    return (out[0] if splits == 1 else out.sum(0).astype(out_dtype))[:m]


def _tpu_kernel(layer_ref, x_ref, w_ref, o_ref, acc_ref):
    # layer_ref (SMEM) already placed the weight's block at that layer: w_ref [bk, bn].
    del layer_ref
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    acc_ref[...] += jnp.dot(x, w_ref[...].astype(x.dtype), preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _tpu_matmul(x, w, layer, out_dtype, interpret: bool, tiles=TPU_TILES):
    m, k = x.shape
    n = w.shape[2]
    bm = min(tiles[0], -(-m // 16) * 16)
    bk, bn = _tpu_tile(k, tiles[1]), _tpu_tile(n, tiles[2])
    x = _pad_rows(x, bm)
    return pl.pallas_call(
        _tpu_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(x.shape[0] // bm, n // bn, k // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk, layer: (i, kk)),
                      pl.BlockSpec((None, bk, bn), lambda i, j, kk, layer: (layer[0], kk, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk, layer: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="layer_matmul_tpu",
    )(layer, x, w)[:m]


def _pad_rows(x, multiple: int):
    pad = -x.shape[0] % multiple
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _product(x2, values, layer, out_dtype, flavour: str, interpret: bool,
             whole: bool = False):
    """[rows, out] of ``x2`` @ ``values[layer]`` by one flavour (or XLA's slice and dot where
    the Triton flavour cannot tile the matrix). ``whole``: the TPU flavour with one tile per
    layer matrix (the interpreter copies its operands every grid step: fewest steps)."""
    if flavour == "gpu" and not gpu_supports(*values.shape[1:]):
        return jnp.dot(x2, jax.lax.dynamic_index_in_dim(values, layer[0], keepdims=False)
                       .astype(x2.dtype), preferred_element_type=out_dtype)
    if flavour == "gpu":
        return _gpu_matmul(x2, values, layer, out_dtype, interpret)
    tiles = (TPU_TILES[0], *values.shape[1:]) if whole else TPU_TILES
    return _tpu_matmul(x2, values, layer, out_dtype, interpret, tiles)


def layer_matmul(x: jax.Array, w, layer, *, flavour: str | None = None,
                 interpret: bool | None = None) -> jax.Array:
    """``x`` [..., in] @ layer ``layer`` (int or traced int32) of ``w`` [L, in, out] (plain,
    or a quantized ``QArray`` whose values are [L, in, out] and scales [L, 1, out]) -> [...,
    out] in x's dtype, accumulated in float32.

    ``flavour`` None: chosen when the program is lowered, per platform
    (``jax.lax.platform_dependent``): Triton on cuda, Mosaic on tpu, elsewhere the TPU
    flavour interpreted; so a program exported for a GPU on this CPU holds the Triton call.
    ``flavour`` gpu | tpu: that one, interpreted unless ``interpret`` is False or the
    backend is the flavour's. A matrix the Triton flavour cannot tile (``gpu_supports``) is
    sliced out and multiplied by XLA."""
    if flavour not in (None, *FLAVOURS):
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    quantized = hasattr(w, "qvalue")
    values = w.qvalue if quantized else w
    lead, k = x.shape[:-1], x.shape[-1]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    out_dtype = jnp.float32 if quantized else x.dtype
    x2 = x.reshape(-1, k)
    run = functools.partial(_product, x2, values, layer, out_dtype)
    if flavour is not None:
        y = run(flavour, jserve_backend.current() != flavour if interpret is None else interpret)
    else:
        y = jax.lax.platform_dependent(cuda=lambda: run("gpu", False),
                                       tpu=lambda: run("tpu", False),
                                       default=lambda: run("tpu", True, whole=True))
    if quantized:
        scale = jax.lax.dynamic_index_in_dim(w.scale, layer[0], keepdims=False)
        y = (y * scale.reshape(-1)).astype(x.dtype)
    return y.reshape(*lead, y.shape[-1])
