"""LoRA adapters in the engine (jserve/lora, jserve/model/lora.py): greedy tokens equal to
transformers + peft (unmerged) for three adapters and the base model in one batch, on one
device and on tp=2; the slot pool under contention (loads, evictions, no slot or KV page
leaked, never more adapters in a step than slots); the prefix cache keyed by adapter; bad
adapters refused without disturbing running requests."""
from __future__ import annotations

import json
import shutil
import textwrap

import numpy as np
import pytest

import lora_models as lm
from devices import run_on_devices
from hf_models import tiny_llama_dir
from jserve import LLM, SamplingParams
from jserve.fields import FieldError
from jserve.lora import LoRAConfig, LoRARequest
from jserve.lora.config import lora_config, parse_lora_modules
from jserve.lora.peft import read_adapter
from jserve.model import lora as lora_pool
from llm_helpers import check_blocks

N = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
# Of different lengths: the 40-token one is prefilled in chunks (32 tokens a step).
PROMPTS = lm.PROMPTS + [[1] + [(7 * i) % 500 + 3 for i in range(39)]]
KEYS = (None, "a", "b", "c")


@pytest.fixture(scope="module")
def base():
    return tiny_llama_dir(lm.BASE)


@pytest.fixture(scope="module")
def reference():
    """transformers + peft's greedy tokens, by adapter key (None: the base model)."""
    return lm.reference_tokens(PROMPTS, N, KEYS)


def _request(key, i=0):
    return None if key is None else LoRARequest(key, i + 1, str(lm.peft_adapter_dir(lm.BASE, key)))


def _llm(base, **kw) -> LLM:
    opts = dict(enable_lora=True, max_loras=3, max_lora_rank=16, max_num_seqs=16,
                max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=256,
                warmup=False)
    return LLM(str(base), **{**opts, **kw})


def _mixed(llm: LLM, reference, keys=KEYS):
    """Every prompt under every adapter of ``keys``, all in one generate call (one batch):
    each output equals its adapter's reference tokens."""
    prompts, loras, want = [], [], []
    for k in keys:
        for j, p in enumerate(PROMPTS):
            prompts.append(p)
            loras.append(_request(k, KEYS.index(k)))
            want.append(reference[k][j])
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_adapters_and_base_in_one_batch_equal_peft(base, reference):
    llm = _llm(base)
    _mixed(llm, reference)
    eng = llm.engine
    assert eng.adapters.loads == 3 and eng.adapters.evictions == 0
    assert not eng.adapters.running()
    check_blocks(eng)


@pytest.mark.slow
def test_tensor_parallel_equals_peft(reference):
    """tp=2 (A/B split as their matrices: q/k/v/gate/up's B by columns, o/down's A by rows),
    the layers looped and unrolled: the same tokens."""
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, "tests")
        import test_lora as t
        from hf_models import tiny_llama_dir
        out = {}
        for loop in ("loop", "unrolled"):
            llm = t._llm(tiny_llama_dir(t.lm.BASE), mesh="tp=2", layer_loop=loop)
            prompts, loras = [], []
            for k in t.KEYS:
                prompts += t.PROMPTS
                loras += [t._request(k, t.KEYS.index(k))] * len(t.PROMPTS)
            outs = llm.generate(prompts, t.GREEDY, lora_request=loras)
            out[loop] = [o.outputs[0].token_ids for o in outs]
        print(json.dumps(out))
    """)
    res = run_on_devices(script, devices=2).result
    want = [ids for k in KEYS for ids in reference[k]]
    assert res == {"loop": want, "unrolled": want}


def test_adapter_changes_tokens_and_base_rows_are_untouched(reference):
    # The fixture's adapters differ from the base model on every prompt (else the parity
    # test above would show nothing).
    for k in ("a", "b", "c"):
        assert all(r != b for r, b in zip(reference[k], reference[None]))


def test_slot_pool_under_contention(base, reference):
    """Four adapters (a fourth: a's weights under another name) on two slots, requested at
    once: each request runs with its own adapter's tokens; a step never holds more than two
    adapters; the waiting ones load as slots free (least recently used first); nothing leaks."""
    llm = _llm(base, max_loras=2, scheduler="lars")
    eng = llm.engine
    reqs = {k: _request(k, i) for i, k in enumerate(("a", "b", "c"))}
    reqs["a2"] = LoRARequest("a2", 4, reqs["a"].lora_path)
    ids = {}
    for k, r in reqs.items():
        for j, p in enumerate(PROMPTS):
            ids[eng.add_request(p, GREEDY, lora_request=r)] = (k, j)
    eng.step_log = []
    done, most = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        check_blocks(eng)
        most = max(most, len(eng.adapters.running()))
        assert len(eng.adapters.running()) <= 2
    for rid, (k, j) in ids.items():
        assert done[rid] == reference["a" if k == "a2" else k][j], (k, j)
    for plan, _ in eng.step_log:  # the adapters of each step's requests
        names = {ids[c.request_id][0] for c in plan.decodes + plan.prefills}
        assert len(names) <= 2
    assert most == 2
    assert eng.adapters.loads >= 4 and eng.adapters.evictions == eng.adapters.loads - 2
    assert not eng.adapters.running()


def test_prefix_cache_is_keyed_by_adapter(base, reference):
    """The same long prompt under two adapters, one after the other: each gets its own
    adapter's tokens (no page is shared across adapters); under the same adapter again the
    cache is hit."""
    llm = _llm(base, enable_prefix_caching=True)
    long = PROMPTS[-1]
    eng = llm.engine
    for k, cached in (("a", 0), ("b", 0), (None, 0), ("a", 32)):  # 2 full pages of 16
        before = eng.scheduler.prefix_hit_tokens
        out = llm.generate([long], GREEDY, lora_request=_request(k, KEYS.index(k)))
        assert out[0].outputs[0].token_ids == reference[k][-1]
        assert eng.scheduler.prefix_hit_tokens - before == cached, k
    check_blocks(eng)


def test_pages_moved_between_engines_stay_under_their_adapter(base, reference):
    """Prefill/decode disaggregation with an adapter: the pages a prompt left under adapter
    "a" on one engine, exported and imported into another, are found there by the same
    prompt under "a" (PEFT's tokens, only the last page computed) and by no other."""
    from jserve.engine.device import kv_transfer
    from jserve.kv_wire import pages_in

    prefill, decode = (_llm(base, enable_prefix_caching=True) for _ in range(2))
    long = PROMPTS[-1]  # 40 tokens: two full pages before the last token's
    out = prefill.generate([long], GREEDY, lora_request=_request("a", KEYS.index("a")))
    assert out[0].outputs[0].token_ids == reference["a"][-1]
    assert pages_in(kv_transfer.export_pages(prefill.engine, long, None)) == 0  # not base's
    wire = kv_transfer.export_pages(prefill.engine, long, "a")
    assert kv_transfer.import_pages(decode.engine, long, wire, "a") == (2, 2)
    eng = decode.engine
    for k, cached in ((None, 0), ("a", 32)):
        before = eng.scheduler.prefix_hit_tokens
        out = decode.generate([long], GREEDY, lora_request=_request(k, KEYS.index(k)))
        assert out[0].outputs[0].token_ids == reference[k][-1]
        assert eng.scheduler.prefix_hit_tokens - before == cached, k
    check_blocks(eng)


def test_bad_adapters_refused_while_others_run(base, reference):
    llm = _llm(base)
    eng = llm.engine
    good = eng.add_request(PROMPTS[-1], GREEDY, lora_request=_request("a"))
    eng.step()
    bad = lm.bad_adapters_dir(lm.BASE)
    why = {"unknown_module": "foo_proj", "rank_too_large": "rank 64 is over --max-lora-rank 16",
           "shape_mismatch": "the base model needs", "missing_file": "adapter_model.safetensors"}
    for i, (name, path) in enumerate(bad.items()):
        with pytest.raises(FieldError, match=why[name]) as e:
            eng.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest(name, 10 + i, str(path)))
        assert e.value.field == "lora_path"
        assert name not in eng.adapters.known
    with pytest.raises(FieldError, match="no adapter 'nope' is loaded"):
        eng.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("nope"))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert done == {good: reference["a"][-1]}
    check_blocks(eng)


def test_runtime_load_and_unload(base, reference):
    llm = _llm(base, max_loras=1)
    eng = llm.engine
    slots = eng.adapters
    assert slots.add(_request("b")) and not slots.add(_request("b"))  # again: nothing to do
    with pytest.raises(FieldError, match="already loaded"):
        slots.add(LoRARequest("b", 2, str(lm.peft_adapter_dir(lm.BASE, "c"))))
    rid = eng.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("b"))
    with pytest.raises(FieldError, match="in use by 1 request"):
        slots.remove("b")
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                assert out.request_id == rid and out.token_ids == reference["b"][0]
    slots.remove("b")
    assert "b" not in slots.known
    with pytest.raises(FieldError, match="no adapter 'b' is loaded"):
        eng.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("b"))
    # Loaded again into the freed slot, it gives its tokens again.
    out = llm.generate([PROMPTS[1]], GREEDY, lora_request=_request("b"))
    assert out[0].outputs[0].token_ids == reference["b"][1]


def test_int8_base_with_float_adapters(base, reference):
    """Weight-only int8 under float adapters: base rows equal the int8 engine without
    adapters, each adapter row equals the int8 base plus that adapter's delta, which the
    unquantized parity above pins (here: they differ from the base and across adapters)."""
    plain = LLM(str(base), quantization="int8", max_num_seqs=16, max_num_batched_tokens=32,
                max_prefill_seqs=2, max_model_len=256, warmup=False)
    want_base = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = _llm(base, quantization="int8")
    prompts = PROMPTS * 2
    loras = [None] * len(PROMPTS) + [_request("b", 2)] * len(PROMPTS)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras)]
    assert got[:len(PROMPTS)] == want_base
    assert got[len(PROMPTS):] == reference["b"]  # rank 4 on every projection: robust


def test_delta_is_each_tokens_own_adapter():
    """The masked all-slots delta against a per-token numpy reference."""
    rng = np.random.default_rng(0)
    t, d_in, d_out, slots, r = 7, 12, 10, 3, 4
    a = rng.normal(size=(d_in, slots, r)).astype(np.float32)
    b = rng.normal(size=(slots, r, d_out)).astype(np.float32)
    h = rng.normal(size=(t, d_in)).astype(np.float32)
    s = np.array([0, 2, -1, 1, 2, -1, 0], np.int32)
    layer = {"wo": np.zeros((d_in, d_out), np.float32),
             lora_pool.a_name("wo"): a.reshape(d_in, slots * r),
             lora_pool.b_name("wo"): b, lora_pool.SLOTS: s}
    got = np.asarray(lora_pool.added(layer, "wo", h, np.zeros((t, d_out), np.float32)))
    want = np.stack([np.zeros(d_out) if k < 0 else h[i] @ a[:, k] @ b[k]
                     for i, k in enumerate(s)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_peft_reader_scaling_and_layout(base):
    """rsLoRA scales by alpha / sqrt(r), plain LoRA by alpha / r; A and B come transposed
    from torch's layout into [layers, in, r] and [layers, r, out]."""
    from safetensors.numpy import load_file

    from jserve.model.weights import load_model

    cfg = load_model(str(base), lazy=True)[0]
    for key in ("a", "b"):
        path = lm.peft_adapter_dir(lm.BASE, key)
        conf = json.loads((path / "adapter_config.json").read_text())
        r = conf["r"]
        scaling = conf["lora_alpha"] / (r ** 0.5 if conf.get("use_rslora") else r)
        got = read_adapter(key, str(path), cfg, 16)
        raw = load_file(str(path / "adapter_model.safetensors"))
        pre = "base_model.model.model.layers.1.self_attn.q_proj"
        np.testing.assert_allclose(got.weights["wq"][0][1], raw[f"{pre}.lora_A.weight"].T)
        np.testing.assert_allclose(got.weights["wq"][1][1],
                                   raw[f"{pre}.lora_B.weight"].T * scaling, rtol=1e-6)
        assert got.rank == r


def test_adapter_bin_only_is_refused(base, tmp_path):
    from jserve.model.weights import load_model

    cfg = load_model(str(base), lazy=True)[0]
    src = lm.peft_adapter_dir(lm.BASE, "a")
    shutil.copy(src / "adapter_config.json", tmp_path)
    (tmp_path / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(FieldError, match="safe_serialization"):
        read_adapter("x", str(tmp_path), cfg, 16)


def test_lora_settings():
    assert lora_config() is None
    assert lora_config(True) == LoRAConfig()
    with pytest.raises(ValueError, match="need enable_lora"):
        lora_config(max_loras=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) \
        == (("a", "/x"), ("b", "/y"))
    with pytest.raises(ValueError, match="not name=path"):
        parse_lora_modules(["a"])
    with pytest.raises(ValueError, match="not supported with a stream pipeline"):
        from jserve.engine.config import EngineConfig

        EngineConfig(lora=LoRAConfig(), mesh="spp=2")


def test_chat_with_an_adapter_on_a_trained_tokenizer(tmp_path):
    """A transformers checkpoint with a trained BPE tokenizer and chat template, an adapter
    PEFT wrote for it: ``LLM.chat(..., lora_request=...)`` renders the prompt as
    transformers' ``apply_chat_template`` does and continues it with peft's tokens."""
    import transformers

    from hf_models import llama3_chat_dir

    base_dir = llama3_chat_dir()
    adapter = lm.write_peft_adapter(base_dir, tmp_path / "chat-adapter", rank=8, alpha=16,
                                    targets=lm.ATTENTION + lm.MLP, seed=5, scale=0.5)
    messages = [{"role": "user", "content": "Count the apples in the basket."}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(base_dir)
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = lm.peft_greedy(base_dir, adapter, [ids], N)[0]
    assert want != lm.peft_greedy(base_dir, None, [ids], N)[0]
    llm = LLM(str(base_dir), enable_lora=True, max_lora_rank=8, max_model_len=256,
              warmup=False)
    (out,) = llm.chat(messages, GREEDY, lora_request=LoRARequest("chat", 1, str(adapter)))
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text == hf_tok.decode(want)


def test_lora_modules_json_base_model_name_is_checked():
    from jserve.lora.config import lora_module_bases
    from jserve.serving.commands import check_lora_names

    values = ['{"name": "sql", "path": "/a", "base_model_name": "llama"}', "b=/b"]
    lora = LoRAConfig(modules=parse_lora_modules(values))
    check_lora_names(lora, ("llama",), bases=lora_module_bases(values))
    with pytest.raises(ValueError, match="base_model_name {'sql': 'llama'} is not the model"):
        check_lora_names(lora, ("qwen",), bases=lora_module_bases(values))


@pytest.mark.slow
@pytest.mark.parametrize("family, targets", [
    ("qwen2", lm.ATTENTION + lm.MLP),    # q/k/v biases beside the adapter
    ("gemma3", lm.ATTENTION + lm.MLP),   # its own layer; local and global KV pools
    ("mixtral", lm.ATTENTION)])          # an MoE model: its attention adapted
def test_families_equal_peft(tmp_path, family, targets):
    base_dir = tiny_llama_dir(family)
    adapter = lm.write_peft_adapter(base_dir, tmp_path / "adapter", rank=8, alpha=16,
                                    targets=targets, seed=3, scale=0.5)
    want = lm.peft_greedy(base_dir, adapter, lm.PROMPTS, N)
    want_base = lm.peft_greedy(base_dir, None, lm.PROMPTS, N)
    assert want != want_base
    llm = LLM(str(base_dir), enable_lora=True, max_lora_rank=8, max_model_len=256,
              warmup=False)
    loras = [LoRARequest("x", 1, str(adapter))] * len(lm.PROMPTS) + [None] * len(lm.PROMPTS)
    got = [o.outputs[0].token_ids
           for o in llm.generate(lm.PROMPTS * 2, GREEDY, lora_request=loras)]
    assert got == want + want_base


def test_an_adapter_of_moe_experts_is_refused(tmp_path):
    """Mixtral's experts are not adapted: an adapter of them is refused, naming the module."""
    from jserve.model.weights import load_model

    base_dir = tiny_llama_dir("mixtral")
    adapter = lm.write_peft_adapter(base_dir, tmp_path / "experts", rank=4, alpha=8,
                                    targets=["q_proj", "w1", "w3"], seed=3)
    cfg = load_model(str(base_dir), lazy=True)[0]
    with pytest.raises(FieldError, match="no module 'model.layers.0.*experts"):
        read_adapter("e", str(adapter), cfg, 16)
