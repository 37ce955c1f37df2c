"""Sliding-window attention (``ModelConfig.layer_windows``, the kernels' ``window``) and the
Mistral family, against HF transformers.

Kernels: every implementation (the jnp reference, the native CPU decode kernel, the Pallas GPU
and TPU kernels interpreted) with a traced window against dense attention under the window
mask, on a ragged batch whose page-table entries before every query's window point at a page
of NaN: a kernel that loaded one would put NaN in its output. Window 0 is full attention.

Model: a tiny random-weight ``MistralForCausalLM`` written by transformers with an ``[INST]``
chat template (GQA 6:2, head_dim 20, window 24 with pages of 16, prompts of 10 and 100
tokens): logits at every position equal transformers' (whose mask is p - window < k <= p),
greedy tokens equal ``generate``'s on the native CPU kernel and on one tp=2 x kvp=2 x spp=2
mesh; a chat request's prompt tokens equal ``apply_chat_template``'s. Qwen2's
``use_sliding_window`` windows the layers from ``max_window_layers`` on, as transformers does;
configs and their windows survive an orbax round trip.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from devices import run_on_devices
from hf_models import (
    SWA_WINDOW,
    WINDOWED_CONFIGS,
    mistral_chat_dir,
    tiny_llama_dir,
    tiny_llama_model,
)
from jserve import LLM, SamplingParams
from jserve.kernels import attention, cpu, pallas_gpu, pallas_tpu
from jserve.kernels.reference import dense_reference, ragged_paged_attention as reference
from jserve.model.families import SUPPORTED_ARCHITECTURES, read_config, read_config_file
from jserve.model.weights import load_model, save_orbax
from jserve.train.trainer import dense_forward
from ragged import lowering_case, ragged_case
from test_hf_parity import _all_position_logits
from test_model_families import _SCRIPT

PAGE = 4
IMPLS = ("reference", "cpu", "pallas_gpu", "pallas_tpu")  # Pallas interpreted here


_dense = jax.jit(dense_reference, static_argnums=(4, 5))


def _windowed_case(window: int):
    """A ragged batch (decodes at contexts inside and past the window, a padding row,
    prefill chunks from scratch and after a cached context) whose table entries before each
    sequence's first query's window name an extra page of NaN; the dense expectation."""
    rng = np.random.default_rng(window)
    q, kp, vp, meta, dense = ragged_case(rng, [5, 23, 61, 0], [(0, 37), (40, 9), (3, 1)],
                                         hq=6, hkv=2, d=20, page_size=PAGE, width=16)
    nan_page = kp.shape[1]
    kp, vp = (np.concatenate([x, np.full_like(x[:, :1], np.nan)], axis=1) for x in (kp, vp))
    table = np.asarray(meta.page_table).copy()
    poisoned = 0
    for row, (_, _, _, pos) in enumerate(dense):
        first_page = max(0, int(pos[0]) - window + 1) // PAGE
        table[row, :first_page] = nan_page
        poisoned += first_page
    assert poisoned >= 10  # several whole pages before the windows, in several rows
    meta = type(meta)(**{**meta.__dict__, "page_table": jnp.asarray(table)})
    want_out, want_lse = [], []
    for qi, k, v, pos in dense:
        if len(k):
            o, l = _dense(jnp.asarray(qi), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos),
                          len(k), window)
        else:  # the padding decode row sees no key
            o, l = np.zeros_like(qi), np.full(qi.shape[:2], -np.inf, np.float32)
        want_out.append(np.asarray(o))
        want_lse.append(np.asarray(l))
    return q, kp, vp, meta, np.concatenate(want_out), np.concatenate(want_lse)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_each_kernel_skips_pages_before_the_window_and_matches_dense(impl):
    """Through the dispatcher the model calls (``jserve.kernels.attention``); the GPU
    kernel splits the decode launch's KV range in four (split-K) from the window's block."""
    assert impl != "cpu" or cpu.available()
    window = 10  # not a multiple of the page size: the first read page is partly masked
    q, kp, vp, meta, want_out, want_lse = _windowed_case(window)
    attend = jax.jit(lambda q, k, v, meta, w: attention(q, k, v, meta, impl=impl, window=w))
    out, lse = attend(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), meta,
                      jnp.int32(window))
    n = len(want_out)
    np.testing.assert_allclose(np.asarray(out)[:n], want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[:n], want_lse, atol=2e-5, rtol=2e-5)
    assert np.all(np.isfinite(np.asarray(out)))
    if impl == "cpu":  # the decode rows ran on the native kernel
        text = attend.lower(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), meta,
                            jnp.int32(window)).as_text()
        assert text.count("jserve_cpu_decode_attention") == 1
    # Window 0 (the same executable) is full causal attention: the reference's without one.
    q, kp, vp, meta, _ = ragged_case(np.random.default_rng(0), [5, 61, 0], [(0, 37), (40, 9)],
                                     hq=6, hkv=2, d=20, page_size=PAGE, width=16)
    args = tuple(jnp.asarray(x) for x in (q, kp, vp))
    full, full_lse = attend(*args, meta, jnp.int32(0))
    ref, ref_lse = jax.jit(reference)(*args, meta)
    np.testing.assert_allclose(np.asarray(full), np.asarray(ref), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(full_lse), np.asarray(ref_lse), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("platform, attend, target", [
    ("cuda", pallas_gpu.ragged_paged_attention, "__gpu$xla.gpu.triton"),
    ("tpu", pallas_tpu.ragged_paged_attention, "tpu_custom_call")])
def test_windowed_kernels_lower_for_their_accelerator(platform, attend, target):
    """The window's code (scalar reads of the table and positions, the clamped page ids, the
    mask) goes through the Pallas-to-Triton / Pallas-to-Mosaic rules without the device, as
    the serving step calls it: a stacked cache, a traced layer and a traced window."""
    q, kp, vp, meta, export = lowering_case(platform, target)
    q, kp, vp = (jnp.asarray(x, jnp.bfloat16) for x in (q, kp, vp))
    stack = lambda x: jnp.stack([x] * 3)  # noqa: E731
    windowed = lambda q, k, v, meta, i, w: attend(q, k, v, meta, layer=i, window=w)  # noqa: E731
    assert target in export(jax.jit(windowed))(q, stack(kp), stack(vp), meta, jnp.int32(1),
                                               jnp.int32(24)).mlir_module()


# A prompt inside the window and one of four windows' length (several pages wholly out of it).
PROMPTS = [[1, 5, 9, 200, 33, 7, 81, 64, 12, 400], [3 + (7 * j) % 500 for j in range(100)]]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=128,
              warmup=False)


@functools.cache
def mistral_model():
    return transformers.MistralForCausalLM.from_pretrained(mistral_chat_dir()).eval()


@functools.cache
def hf_tokens() -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop)."""
    with torch.no_grad():
        return [mistral_model().generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                                         do_sample=False, eos_token_id=None,
                                         pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]


@functools.cache
def mistral_llm(impl: str) -> LLM:
    return LLM(str(mistral_chat_dir()), attention_impl=impl, **ENGINE)


@pytest.mark.slow
def test_configs_read_their_windows_and_round_trip(tmp_path):
    cfg = read_config_file(mistral_chat_dir() / "config.json")
    hf = WINDOWED_CONFIGS["mistral"]
    assert (cfg.architecture, cfg.model_type) == ("MistralForCausalLM", "mistral")
    assert "MistralForCausalLM" in SUPPORTED_ARCHITECTURES
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 2, 20)
    assert cfg.layer_windows == (SWA_WINDOW,) * hf["num_hidden_layers"]
    assert cfg.kv_window == SWA_WINDOW
    # Qwen2 as transformers reads it: windows from max_window_layers (1) on; a config
    # whose use_sliding_window is off has none, whatever its sliding_window says.
    qwen = read_config_file(tiny_llama_dir("qwen2-swa") / "config.json")
    assert qwen.layer_windows == (0, SWA_WINDOW) and qwen.kv_window is None
    raw = json.loads((tiny_llama_dir("qwen2-swa") / "config.json").read_text())
    assert read_config(dict(raw, use_sliding_window=False, layer_types=None)).layer_windows == ()
    mistral = json.loads((mistral_chat_dir() / "config.json").read_text())
    assert read_config(dict(mistral, sliding_window=None)).layer_windows == ()
    assert read_config({k: v for k, v in mistral.items()
                        if k != "sliding_window"}).layer_windows == (4096, 4096)
    with pytest.raises(ValueError, match="chunked_attention"):
        read_config(dict(raw, layer_types=["full_attention", "chunked_attention"]))
    with pytest.raises(ValueError, match="sliding_window"):
        read_config(dict(mistral, sliding_window=0))
    # An orbax checkpoint keeps the windows (and a Mistral's null window) and loads back.
    for model_dir, nulled in ((mistral_chat_dir(), False), (tiny_llama_dir("qwen2-swa"), False),
                              (mistral_chat_dir(), True)):
        cfg, params, _ = load_model(str(model_dir))
        if nulled:
            cfg = dataclasses.replace(cfg, layer_windows=())
        save_orbax(tmp_path / "ckpt", cfg, params)
        assert load_model(str(tmp_path / "ckpt"))[0] == cfg
        shutil.rmtree(tmp_path / "ckpt")


@pytest.mark.slow
def test_logits_match_transformers_past_the_window():
    """transformers masks k <= p - window: position 24 is the first whose logits change
    with the window (jserve without it differs there). The windowed Qwen2 (layer 0 full,
    layer 1 windowed) matches too, and so does the trainer's dense attention."""
    ids = PROMPTS[1] + PROMPTS[0]
    cfg, params, _ = load_model(str(mistral_chat_dir()))
    with torch.no_grad():
        theirs = mistral_model()(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_all_position_logits(cfg, params, ids), theirs, atol=1e-4,
                               rtol=1e-4)
    unwindowed = _all_position_logits(dataclasses.replace(cfg, layer_windows=()), params, ids)
    off = np.abs(unwindowed - theirs).max(axis=-1)
    assert off[:SWA_WINDOW].max() < 1e-4 and off[SWA_WINDOW] > 1e-2
    row = jnp.asarray([ids])
    dense = dense_forward(params, row, jnp.arange(len(ids))[None], jnp.zeros_like(row), cfg)
    np.testing.assert_allclose(np.asarray(dense)[0], theirs, atol=1e-4, rtol=1e-4)
    cfg, params, _ = load_model(str(tiny_llama_dir("qwen2-swa")))
    with torch.no_grad():
        theirs = tiny_llama_model("qwen2-swa")(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(_all_position_logits(cfg, params, ids), theirs, atol=1e-4,
                               rtol=1e-4)


# "auto" is the native CPU decode kernel with the reference's prefill; the Pallas kernels
# run interpreted (9 s an engine with the suite's XLA settings, tests/devices.py).
ENGINE_IMPLS = ["auto", "pallas_gpu", "pallas_tpu"]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ENGINE_IMPLS)
def test_greedy_tokens_match_generate(impl):
    want = hf_tokens()
    assert len({t for out in want for t in out}) > 8  # no constant stream: layers matter
    llm = mistral_llm(impl)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    again = llm.generate(PROMPTS, GREEDY)  # whatever the prefix cache hands back
    assert [o.token_ids for o in again] == want
    llm.engine.allocator.check()
    assert llm.engine.allocator.num_allocated == 0


@pytest.mark.slow
def test_a_chat_request_is_prompted_as_transformers_templates_it():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "why?"}]
    ref = transformers.AutoTokenizer.from_pretrained(mistral_chat_dir())
    want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    inst, end = ref.convert_tokens_to_ids(["[INST]", "[/INST]"])
    assert want[0] == ref.bos_token_id and want.count(inst) == want.count(end) == 2
    out = mistral_llm("auto").chat(msgs, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.prompt_token_ids == want


@pytest.mark.slow
def test_a_tp_kvp_spp_mesh_matches_generate():
    """One engine on every axis at once (8 simulated devices): tp=2 (3 query heads and 1 KV
    head a shard), kvp=2 (64 tokens a group: the long prompt's window crosses from one group
    into the other; a group wholly before it reads nothing) and spp=2 (a stage per layer,
    each indexing the windows by its model layer). Each axis alone passed too (tp=2, kvp=2,
    spp=2: three engines), left out for the suite's time."""
    runs = {"mesh": (str(mistral_chat_dir()), "spp=2,kvp=2,tp=2", {})}
    got = run_on_devices(_SCRIPT, json.dumps(runs), json.dumps(PROMPTS), json.dumps(ENGINE),
                         str(MAX_TOKENS), timeout=900).result["mesh"]
    assert (got["devices"], got["leaked"]) == (8, 0)
    assert got["tokens"] == hf_tokens()
