"""Gemma 3 beyond ``test_model_families``' parity runs (where its tiny checkpoint runs like the
other families'): a chat request on a Gemma-style checkpoint (``hf_models.gemma3_chat_dir``)
has the prompt tokens of transformers' ``apply_chat_template``, prompt logprobs equal to
transformers' (its 81 tokens are past the local window; the logits capped), greedy tokens
equal to ``generate``'s, and stops on ``<end_of_turn>``, an EOS listed only in
generation_config.json. Older config.json keys (``sliding_window_pattern``, flat RoPE keys)
read as transformers reads them; what jserve cannot serve is refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from hf_models import FAMILY_CONFIGS, gemma3_chat_dir, tiny_llama_dir, tiny_llama_model
from jserve import LLM, SamplingParams
from jserve.model.families import read_config

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, warmup=False)
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world! How are you today?"},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "The weather in Paris?"}]
END_OF_TURN = 5


def test_a_chat_follows_the_template_matches_transformers_and_stops_at_end_of_turn():
    model_dir = gemma3_chat_dir()
    ref = transformers.AutoTokenizer.from_pretrained(model_dir)
    want_prompt = list(ref.apply_chat_template(CHAT, tokenize=True,
                                               add_generation_prompt=True)["input_ids"])
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    # <end_of_turn> made certain: the request must end on it (an EOS from generation_config).
    ends = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={END_OF_TURN: 100.0})
    llm = LLM(str(model_dir), **ENGINE)
    assert END_OF_TURN in llm.engine.eos_ids
    assert END_OF_TURN not in llm.engine.model_config.eos_token_ids
    scored, stopped = llm.chat([CHAT, CHAT], [greedy, ends])
    assert scored.prompt_token_ids == want_prompt == stopped.prompt_token_ids
    assert len(want_prompt) > 4 * FAMILY_CONFIGS["gemma3"]["sliding_window"]
    model = tiny_llama_model("gemma3")
    with torch.no_grad():
        logits = model(torch.tensor([want_prompt])).logits[0].double()
        want = model.generate(torch.tensor([want_prompt]), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(want_prompt):]
    assert scored.outputs[0].token_ids == want.tolist()
    lp = torch.log_softmax(logits, -1)[torch.arange(len(want_prompt) - 1), want_prompt[1:]]
    got = [e.logprob for e in scored.prompt_logprobs[1:]]
    np.testing.assert_allclose(got, lp.numpy(), atol=2e-4)
    assert stopped.outputs[0].token_ids == [END_OF_TURN]
    assert stopped.outputs[0].finish_reason == "stop"
    llm.engine.allocator.check()
    assert llm.engine.allocator.num_allocated == 0


def _saved_config() -> dict:
    return json.loads((tiny_llama_dir("gemma3") / "config.json").read_text())


def test_older_config_keys_read_as_transformers_reads_them():
    """Gemma 3's hub configs predate ``layer_types`` and per-type ``rope_parameters``."""
    new = _saved_config()
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old |= dict(sliding_window_pattern=3, rope_theta=50000.0, rope_local_base_freq=1000.0,
                rope_scaling={"rope_type": "linear", "factor": 4.0})
    theirs = transformers.Gemma3TextConfig(**old)
    assert (theirs.layer_types, theirs.rope_parameters) == (new["layer_types"],
                                                            new["rope_parameters"])
    cfg = read_config(new)
    assert read_config(old) == cfg
    assert cfg.layer_windows == (20, 20, 0, 20) and cfg.rope_local_theta == 1000.0
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 4.0)
    # With neither, the defaults are transformers' (every sixth layer global).
    bare = {k: v for k, v in old.items() if k not in ("sliding_window_pattern",)}
    assert read_config(bare).layer_windows == (20,) * 4


@pytest.mark.parametrize("change, named", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                              "rope_theta": 1e6}}), "yarn"),
])
def test_what_jserve_cannot_serve_is_refused_at_load_by_name(change, named, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_saved_config() | change))
    with pytest.raises(ValueError, match=named):
        LLM(str(tmp_path), **ENGINE)
