"""The TPU cache write (``kv_write.write_kv_tpu``): interpreted on the CPU against the
reference scatter, bit for bit and leaving every other row alone, for each stored dtype
(bf16, float32, int8 with its float32 scales, fp8_e4m3); and compiled (not only lowered:
Mosaic's own passes check each DMA's tile alignment there) for v5e and v6e compile-only
devices, in place: the cache aliased to the output and no copy of it in the optimized HLO."""
from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.kernels import kv_write

SCALES = "scales"  # int8 pages' float32 scales [..., S, 1] (kv_quant), written alike


def stored(kind):
    """(dtype, head dim or None for the pages' own) of a page kind."""
    return (jnp.float32, 1) if kind == SCALES else (kind, None)


def random_rows(rng, shape, dtype):
    if dtype == jnp.int8:
        return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    return jnp.asarray(rng.normal(size=shape) * 3, dtype)


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


def slots_of(pattern, rng, p, s, t):
    """Flat slots of ``t`` tokens. decode: each to its own page at a random row. prefill: a
    run of consecutive slots from an unaligned one, then padding (slot 0 twice). mixed: two
    tokens of one block apart in token order, a run ending inside a block, decodes, padding."""
    if pattern == "decode":
        return rng.permutation(np.arange(1, p))[:t] * s + rng.integers(0, s, t)
    if pattern == "prefill":
        return np.concatenate([np.arange(2 * s + 3, 2 * s + t), [0, 1, 0]])
    a, run = 5 * s + 1, np.arange(11 * s + 5, 11 * s + t - 2)
    return np.concatenate([[a, 9 * s + 2, a + 1, 7 * s], run, [0, 0, 2]])


def assert_writes_like_the_scatter(kind, pattern, t, *, s, d, hkv, layered, p=24, seed=0):
    dtype, own_d = stored(kind)
    d = own_d or d
    rng = np.random.default_rng(seed)
    pages = random_rows(rng, (3, hkv, p, s, d) if layered else (hkv, p, s, d), dtype)
    slots = slots_of(pattern, rng, p, s, t)
    new = random_rows(rng, (len(slots), hkv, d), dtype)
    slots = jnp.asarray(slots, jnp.int32)
    if layered:
        out = jax.jit(lambda pg, sl, nw, i: kv_write.write_kv_tpu(
            pg, sl, nw, interpret=True, layer=i))(pages, slots, new, jnp.int32(1))
        ref = kv_write.write_kv(pages, slots, new, layer=1)
        # The other layers are untouched.
        np.testing.assert_array_equal(bits(out)[::2], bits(pages)[::2])
        out, ref, pages = out[1], ref[1], pages[1]
    else:
        out = jax.jit(functools.partial(kv_write.write_kv_tpu, interpret=True))(
            pages, slots, new)
        ref = kv_write.write_kv(pages, slots, new)
    assert out.dtype == pages.dtype and out.shape == pages.shape
    # Page 0 is the sink: padding tokens write it in either order.
    np.testing.assert_array_equal(bits(out)[:, 1:], bits(ref)[:, 1:])
    written = np.zeros(p * s, bool)
    written[np.asarray(slots)] = True
    kept = ~written.reshape(p, s)[1:]
    np.testing.assert_array_equal(bits(out)[:, 1:][:, kept], bits(pages)[:, 1:][:, kept])
    assert not np.array_equal(bits(out), bits(pages))


# Every kind meets each pattern, page size (4: the page is the block; 16; 64: blocks of a
# page), head dim, KV head count and both cache ranks, without the cross product (each case
# compiles an interpreted kernel, a second or two here).
WRITES = [
    ("decode", 1, dict(s=16, d=128, hkv=8, layered=True)),
    ("decode", 8, dict(s=16, d=64, hkv=2, layered=False)),
    ("prefill", 40, dict(s=16, d=128, hkv=1, layered=True)),
    ("mixed", 30, dict(s=4, d=64, hkv=2, layered=True)),
    ("mixed", 90, dict(s=64, d=128, hkv=2, layered=False)),
]
KINDS = [jnp.bfloat16, jnp.float32, jnp.int8, jnp.float8_e4m3fn, SCALES]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k if k == SCALES else jnp.dtype(k).name)
@pytest.mark.parametrize("pattern, t, geometry", WRITES,
                         ids=[f"{w[0]}{w[1]}-S{w[2]['s']}" for w in WRITES])
def test_tpu_write_matches_the_scatter_bit_for_bit(kind, pattern, t, geometry):
    assert_writes_like_the_scatter(kind, pattern, t, **geometry)


@pytest.mark.parametrize("kind", [jnp.bfloat16, jnp.int8], ids=["bfloat16", "int8"])
def test_tpu_write_splits_blocks_between_grid_steps(kind, monkeypatch):
    """Tokens in grid steps of 16: runs (and blocks) cross the steps' boundaries, and a
    covering run's window must fit in its step."""
    monkeypatch.setattr(kv_write, "TPU_CHUNK_TOKENS", 16)
    assert_writes_like_the_scatter(kind, "prefill", 50, s=16, d=128, hkv=2, layered=True)
    assert_writes_like_the_scatter(kind, "mixed", 40, s=16, d=64, hkv=1, layered=False,
                                   seed=1)


def test_block_rows_are_the_dtype_tile_or_the_page():
    assert kv_write.tpu_block_rows(16, jnp.bfloat16) == 16
    assert kv_write.tpu_block_rows(64, jnp.bfloat16) == 16
    assert kv_write.tpu_block_rows(64, jnp.int8) == 32
    assert kv_write.tpu_block_rows(16, jnp.int8) == 16  # the page: 16 is no multiple of 32
    assert kv_write.tpu_block_rows(4, jnp.float8_e4m3fn) == 4


# --- compiled for TPUs -------------------------------------------------------------------

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def tpu(request):
    """A compile-only TPU device (libtpu's topology; the first of its four chips)."""
    from jax.experimental import topologies

    # No TPU is opened: let several processes load libtpu, and skip the metadata server.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[request.param],
                                        platform="tpu")
    return topo.devices[0]


_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%[\w.\-]+ = (\([^()]*\)|\S+) ([\w\-]+)\(")


def whole_cache_ops(hlo: str, cache_elems: int) -> list[str]:
    """Instructions of an optimized HLO module that output an array of at least a layer's
    cache, other than the parameter, its bitcasts and the kernel (aliased) itself."""
    found = []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None or m.group(2) in ("parameter", "bitcast", "custom-call",
                                       "get-tuple-element", "tuple"):
            continue
        for dims in re.findall(r"\w+\[([\d,]+)\]", m.group(1)):
            if np.prod([int(x) for x in dims.split(",")]) >= cache_elems:
                found.append(line.strip()[:160])
    return found


# (kind, head dim, KV heads, tokens, stacked, page size): decode-like writes (1, 8, 32 tokens,
# each to its own page) and prefill-like ones (256, 512 tokens, consecutive slots).
COMPILED = [
    (jnp.bfloat16, 128, 8, 32, True, 16),
    (jnp.bfloat16, 64, 1, 512, True, 16),
    (jnp.float32, 128, 2, 8, False, 16),
    (jnp.int8, 128, 8, 1, True, 16),
    (jnp.int8, 64, 8, 256, False, 16),
    (jnp.float8_e4m3fn, 128, 2, 512, True, 64),
    (jnp.bfloat16, 128, 8, 32, True, 4),
    (SCALES, None, 8, 32, True, 16),
    (SCALES, None, 2, 256, False, 16),
]


@pytest.mark.parametrize("kind, d, hkv, t, layered, s", COMPILED, ids=[
    f"{k if k == SCALES else jnp.dtype(k).name}-d{d}-h{h}-T{t}-{'L' if st else '1'}-S{s}"
    for k, d, h, t, st, s in COMPILED])
def test_tpu_write_compiles_in_place(tpu, kind, d, hkv, t, layered, s):
    """The cache is pinned row-major, as Mosaic takes it: XLA's own TPU layout for a minor
    dim under 128 (head dim 64, the scales' 1) puts the page axis minor, and any Pallas
    kernel's operand then comes through a copy of the whole cache."""
    from jax.experimental.layout import Format, Layout

    dtype, own_d = stored(kind)
    d = own_d or d
    one = jax.sharding.SingleDeviceSharding(tpu)
    # Caches the size of a serving pool (a small one would be prefetched into VMEM whole).
    shape = (16, hkv, 512, s, d) if layered else (hkv, 8192, s, d)
    cache = Format(Layout(major_to_minor=tuple(range(len(shape)))), one)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=cache),
            jax.ShapeDtypeStruct((t,), jnp.int32, sharding=one),
            jax.ShapeDtypeStruct((t, hkv, d), dtype, sharding=one)]
    if layered:
        args.append(jax.ShapeDtypeStruct((), jnp.int32, sharding=one))
        write = lambda p, sl, n, i: kv_write.write_kv_tpu(p, sl, n, layer=i)  # noqa: E731
    else:
        write = kv_write.write_kv_tpu
    compiled = jax.jit(write, donate_argnums=0, out_shardings=cache).lower(*args).compile()
    hlo = compiled.as_text()
    assert "input_output_alias={ {}: (0, {}" in hlo.splitlines()[0]
    assert "output_to_operand_aliasing" in hlo
    layer_elems = int(np.prod(shape[1:] if layered else shape))
    assert not whole_cache_ops(hlo, layer_elems)
