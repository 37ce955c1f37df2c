"""A tokenizer from another directory than the model's (vLLM's ``--tokenizer DIR`` and
``LLM(tokenizer=DIR)``; ``load_model(tokenizer=...)``): a weights-only checkpoint served with
the tiny tokenizer's directory tokenizes, templates and decodes exactly as transformers does
with that tokenizer; a tokenizer larger than the embedding is refused naming both sizes."""
from __future__ import annotations

import httpx2 as httpx
import pytest

from hf_models import tiny_llama_dir, tiny_tokenizer_dir, write_llama3_tokenizer
from jserve.cli import main
from jserve.model.weights import load_model

TEXT = "Hello, world! Grüße aus Köln."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _reference():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


def _chat_ids(ref) -> list[int]:
    out = ref.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_load_model_reads_the_other_directory_and_its_eos_beside_the_weights():
    model = str(tiny_llama_dir("llama3"))  # weights only: 512 embedding rows, EOS 2 and 3
    assert load_model(model, lazy=True)[2] is None
    cfg, _, tok = load_model(model, lazy=True, tokenizer=str(tiny_tokenizer_dir()))
    ref = _reference()
    assert tok.encode(TEXT) == ref(TEXT)["input_ids"] and tok.vocab_size == len(ref) == 400
    assert tok.apply_chat_template(CHAT) == ref.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    # </s> (the tokenizer's EOS), then the model directory's generation_config.json's.
    assert tok.eos_token_ids == (2, 3) and cfg.vocab_size == 512


def test_a_tokenizer_larger_than_the_embedding_is_refused_naming_both_sizes(tmp_path, capsys):
    model = str(tiny_llama_dir("llama3"))
    big = write_llama3_tokenizer(tmp_path / "big")
    from jserve.tokenizer import HFTokenizer
    n = HFTokenizer(big).vocab_size
    assert n > 512
    message = f"tokenizer {big}: its vocabulary has {n} tokens, more than the model's 512 " \
              f"embedding rows"
    with pytest.raises(ValueError) as e:
        load_model(model, lazy=True, tokenizer=str(big))
    assert str(e.value) == message
    assert main(["serve", model, "--tokenizer", str(big), "--port", "0"]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_model(model, lazy=True, tokenizer=str(tmp_path))


@pytest.mark.slow
def test_a_served_checkpoint_without_a_tokenizer_uses_the_given_one():
    """/tokenize (a text, a chat), /detokenize and a chat completion's prompt are the given
    tokenizer's ids exactly: the chat answer is the completion of those very ids."""
    from conftest import Served

    ref = _reference()
    chat_ids = _chat_ids(ref)
    s = Served(str(tiny_llama_dir("llama3")), "--tokenizer", str(tiny_tokenizer_dir()),
               "--served-model-name", "m")
    try:
        def post(path, body):
            r = httpx.post(s.url + path, json={"model": "m", **body}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()
        assert post("/tokenize", {"prompt": TEXT})["tokens"] == ref(TEXT)["input_ids"]
        assert post("/tokenize", {"messages": CHAT})["tokens"] == chat_ids
        assert post("/detokenize", {"tokens": chat_ids})["prompt"] == ref.decode(chat_ids)
        greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        chat = post("/v1/chat/completions", {"messages": CHAT, **greedy})
        plain = post("/v1/completions", {"prompt": chat_ids, **greedy})
        assert chat["usage"]["prompt_tokens"] == len(chat_ids)
        assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
        assert plain["usage"]["completion_tokens"] == 8
    finally:
        s.close()
