"""The Pallas kernels (GPU and TPU flavours, interpret mode on CPU): attention against the
reference on random ragged batches, the cache write against the scatter, their lowering to
Triton and Mosaic, the dispatch, and the engine's greedy tokens with each flavour."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve import SamplingParams
from jserve.kernels import kv_write, pallas_gpu, pallas_tpu, resolve_impl
from jserve.kernels.blocks import merge_partials
from jserve.kernels.reference import ragged_paged_attention as reference
from jserve.model.weights import DEFAULT_CONFIG, init_params, save_orbax
from jserve.tokenizer import ByteTokenizer
from llm_helpers import small_llm
from ragged import interpreted_flavours, lowering_case, ragged_case

FLAVOURS = interpreted_flavours()
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def random_batch(rng, max_ctx, page_size):
    """Decode contexts (one padding row of length 0) and prefill (cached, chunk) pairs with
    chunks of one token, chunks crossing pages, and a fresh prompt."""
    decode_ctx = [int(c) for c in rng.integers(1, max_ctx, 3)] + [0]
    prefill = [(0, int(rng.integers(2, 3 * page_size))),
               (int(rng.integers(1, max_ctx // 2)), 1),
               (int(rng.integers(1, max_ctx // 2)), int(rng.integers(page_size, 3 * page_size)))]
    return decode_ctx, prefill


def check_against_reference(kernel, rng, *, hq, hkv, d, dtype, max_ctx=60, page_size=4,
                            width=16):
    decode_ctx, prefill = random_batch(rng, max_ctx, page_size)
    q, kp, vp, meta, _ = ragged_case(rng, decode_ctx, prefill, hq=hq, hkv=hkv, d=d,
                                     page_size=page_size, width=width)
    q, kp, vp = (jnp.asarray(x, dtype) for x in (q, kp, vp))
    out, lse = jax.jit(kernel)(q, kp, vp, meta)
    ref_out, ref_lse = reference(q, kp, vp, meta)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=tol, rtol=tol)
    # Rows without keys (the padding decode row, padding tokens) are exactly 0 and -inf.
    empty = np.isneginf(np.asarray(ref_lse))
    assert empty.any() and np.all(np.isneginf(np.asarray(lse))[empty])
    assert np.all(np.asarray(out, np.float32)[empty] == 0)


# Every GQA ratio, head dim and dtype appears for each flavour without the full cross product
# (each case compiles an interpreted kernel, about two seconds here).
CASES = [(4, 4, 64, jnp.float32), (8, 2, 128, jnp.bfloat16), (8, 1, 64, jnp.bfloat16)]


@pytest.mark.slow
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("hq, hkv, d, dtype", CASES)
def test_kernel_matches_reference_on_random_ragged_batches(flavour, hq, hkv, d, dtype):
    rng = np.random.default_rng(hq * 1000 + hkv * 100 + d + (flavour == "tpu"))
    check_against_reference(FLAVOURS[flavour], rng, hq=hq, hkv=hkv, d=d, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_kernel_matches_reference_at_a_few_thousand_tokens_of_context(flavour):
    rng = np.random.default_rng(3)
    check_against_reference(FLAVOURS[flavour], rng, hq=8, hkv=2, d=64, dtype=jnp.float32,
                            max_ctx=3500, page_size=16, width=256)


@pytest.mark.slow
def test_gpu_without_split_k_matches_reference():
    """The random-batch cases split every launch (small grids); this one splits none."""
    rng = np.random.default_rng(4)
    kernel = functools.partial(FLAVOURS["gpu"], splits=1)
    check_against_reference(kernel, rng, hq=4, hkv=2, d=64, dtype=jnp.float32)


def test_lse_merge_of_disjoint_parts_equals_attention_over_all():
    rng = np.random.default_rng(0)
    s, v = rng.normal(size=(4, 12)), rng.normal(size=(12, 8))

    def part(p):  # softmax-normalised output and log-sum-exp over the keys in p
        if p.start == p.stop:
            return np.zeros((4, 8)), np.full(4, -np.inf)
        lse = np.log(np.exp(s[:, p]).sum(1))
        return np.exp(s[:, p] - lse[:, None]) @ v[p], lse

    outs, lses = zip(*map(part, [slice(0, 5), slice(5, 5), slice(5, 12)]))
    out, lse = merge_partials(jnp.asarray(np.stack(outs)), jnp.asarray(np.stack(lses)))
    whole_out, whole_lse = part(slice(0, 12))
    np.testing.assert_allclose(out, whole_out, atol=1e-6)
    np.testing.assert_allclose(lse, whole_lse, atol=1e-6)


def kv_write_case(rng, dtype=jnp.float32):
    """21 new rows of 2 KV heads: 18 to scattered slots, 3 padding rows to the sink page 0."""
    hkv, p, s, d = 2, 8, 4, 64
    pages = jnp.asarray(rng.normal(size=(hkv, p, s, d)), dtype)
    live = rng.permutation(np.arange(s, p * s))[:18]
    slots = jnp.asarray(np.concatenate([live, [0, 0, 0]]), jnp.int32)
    return pages, slots, jnp.asarray(rng.normal(size=(21, hkv, d)), jnp.float32)


@pytest.mark.parametrize("writer", [kv_write.write_kv_gpu, kv_write.write_kv_tpu])
def test_kv_write_kernel_matches_the_scatter_outside_the_sink_page(writer):
    pages, slots, new = kv_write_case(np.random.default_rng(5), jnp.bfloat16)
    out = jax.jit(functools.partial(writer, interpret=True))(pages, slots, new)
    ref = kv_write.write_kv(pages, slots, new)
    assert out.dtype == pages.dtype
    np.testing.assert_array_equal(np.asarray(out[:, 1:], np.float32),
                                  np.asarray(ref[:, 1:], np.float32))


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8])
def test_a_layers_k_and_v_written_in_one_gpu_launch_equal_two_scatters(kv_dtype):
    """``write_kv_pair`` on the GPU kernel (one launch for K, V and int8 pages' scales, at
    slots padded once a step: ``write_slots``) stores what the reference's two writes
    store, outside the sink page, in one layer of a stacked cache; the other layers are
    untouched."""
    from jserve import kernels
    from jserve.kernels import kv_quant

    rng = np.random.default_rng(11)
    pages, slots, k = kv_write_case(rng)
    v = jnp.asarray(rng.normal(size=k.shape), jnp.float32)
    stack = lambda x: jnp.stack([x, x + 1, x - 1])
    k_pages, v_pages = stack(pages), stack(-pages)
    if kv_dtype == jnp.int8:
        k_pages, v_pages = (kv_quant.QuantizedPages(*kv_quant.quantize(x, jnp.int8))
                            for x in (k_pages, v_pages))
    else:
        k_pages, v_pages = k_pages.astype(kv_dtype), v_pages.astype(kv_dtype)

    def write(impl):
        return jax.jit(lambda kp, vp, k, v, i: kernels.write_kv_pair(
            kp, vp, kernels.write_slots(slots, impl), k, v, impl=impl, layer=i))(
                k_pages, v_pages, k, v, jnp.int32(1))

    got, want = write("pallas_gpu"), write("reference")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g[:, :, 1:], np.float32),
                                      np.asarray(w[:, :, 1:], np.float32))
    for g, before in zip(jax.tree.leaves(got), jax.tree.leaves((k_pages, v_pages))):
        np.testing.assert_array_equal(np.asarray(g[::2], np.float32),
                                      np.asarray(before[::2], np.float32))


@pytest.mark.parametrize("attend, writer", [
    (FLAVOURS["gpu"], kv_write.write_kv_gpu), (FLAVOURS["tpu"], kv_write.write_kv_tpu)])
def test_kernels_read_and_write_one_layer_of_a_stacked_cache_in_place(attend, writer):
    """The serving step hands the kernels the whole stacked cache and a traced layer index:
    writing at layer 1 changes that layer alone (as the scatter does), and attention at
    layer 1 equals attention over that layer's pages alone."""
    rng = np.random.default_rng(7)
    q, kp, vp, meta, _ = ragged_case(rng, [9, 0], [(0, 20), (30, 5)], hq=4, hkv=2, d=64,
                                     page_size=4, width=16)
    noise = lambda: rng.normal(size=(3, *kp.shape))
    k_stack = jnp.asarray(noise(), jnp.float32).at[1].set(kp)
    v_stack = jnp.asarray(noise(), jnp.float32).at[1].set(vp)
    out, lse = jax.jit(lambda q, k, v, meta, i: attend(q, k, v, meta, layer=i))(
        jnp.asarray(q), k_stack, v_stack, meta, jnp.int32(1))
    ref_out, ref_lse = reference(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), meta)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=2e-5)

    pages, slots, new = kv_write_case(rng)
    stack = jnp.asarray(rng.normal(size=(3, *pages.shape)), jnp.float32)
    write = jax.jit(lambda p, s, n, i: writer(p, s, n, interpret=True, layer=i))
    out = write(stack, slots, new, jnp.int32(1))
    ref = kv_write.write_kv(stack, slots, new, layer=1)
    assert out.shape == stack.shape
    np.testing.assert_array_equal(np.asarray(out[:, :, 1:]), np.asarray(ref[:, :, 1:]))
    np.testing.assert_array_equal(np.asarray(out[::2]), np.asarray(stack[::2]))


@pytest.mark.parametrize("platform, attend, writer, target", [
    ("cuda", pallas_gpu.ragged_paged_attention, kv_write.write_kv_gpu, "__gpu$xla.gpu.triton"),
    ("tpu", pallas_tpu.ragged_paged_attention, kv_write.write_kv_tpu, "tpu_custom_call")])
def test_kernels_lower_for_their_accelerator(platform, attend, writer, target):
    """Lowering runs the Pallas-to-Triton / Pallas-to-Mosaic rules without the device: an op
    the backend cannot express fails here (the backend compiler's own passes do not run)."""
    q, kp, vp, meta, export = lowering_case(platform, target)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, kp, vp)]
    assert target in export(jax.jit(attend))(*args, meta).mlir_module()
    write_args = kv_write_case(np.random.default_rng(1), jnp.bfloat16)
    assert target in export(jax.jit(writer))(*write_args).mlir_module()
    # The serving step's call: a stacked cache of 3 layers and a traced layer index.
    stack = lambda x: jnp.stack([x] * 3)  # noqa: E731
    at_layer = lambda q, k, v, meta, i: attend(q, k, v, meta, layer=i)  # noqa: E731
    assert target in export(jax.jit(at_layer))(args[0], stack(args[1]), stack(args[2]), meta,
                                               jnp.int32(1)).mlir_module()
    write_at = lambda p, s, n, i: writer(p, s, n, layer=i)  # noqa: E731
    assert target in export(jax.jit(write_at))(stack(write_args[0]), *write_args[1:],
                                               jnp.int32(1)).mlir_module()


def test_auto_picks_the_backends_kernel():
    assert resolve_impl("auto", "gpu") == "pallas_gpu"
    assert resolve_impl("auto", "tpu") == "pallas_tpu"  # compiled for v5e/v6e (test_targets)
    assert resolve_impl("auto", "cpu") == "cpu"  # the native decode kernel (test_cpu_kernel)
    assert resolve_impl("pallas_tpu", "cpu") == "pallas_tpu"  # interpreted, see the engine test
    with pytest.raises(ValueError, match="attention_impl"):
        resolve_impl("flash")


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory) -> str:
    """The default model cut to one layer: interpreted kernels compile per layer."""
    cfg = dataclasses.replace(DEFAULT_CONFIG, num_hidden_layers=1)
    path = tmp_path_factory.mktemp("one_layer")
    save_orbax(path, cfg, init_params(cfg, seed=0), tokenizer=ByteTokenizer())
    return str(path)


GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
# Budget 32: the first step prefills 5 + 27 tokens, the next mixes a decode with the 13-token
# rest of the long prompt, then two decodes: three compiled shapes cover a mixed batch.
PROMPTS = [np.random.default_rng(7).integers(0, 256, n).tolist() for n in (5, 40)]


@pytest.fixture(scope="module")
def greedy_reference(one_layer_model):
    llm = small_llm(one_layer_model, max_num_seqs=2, attention_impl="reference")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "cpu"])
def test_engine_greedy_tokens_match_the_reference(impl, greedy_reference, one_layer_model):
    llm = small_llm(one_layer_model, max_num_seqs=2, attention_impl=impl)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy_reference
