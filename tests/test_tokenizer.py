"""The byte tokenizer, and HFTokenizer against transformers on a tiny written tokenizer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import transformers

from hf_models import CHAT_TEMPLATE, tiny_llama_dir, tiny_tokenizer_dir
from jserve.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    chat_prompt_ids,
    load_tokenizer,
    simple_chat_prompt,
)

TEXTS = ["Hello, world!", "Grüße aus Köln — naïve café", "日本語 🙂 emoji", "  spaced\n\tout  ", ""]
MESSAGES = [
    {"role": "system", "content": "Be brief, ünïcode \"quoted\" <tags>."},
    {"role": "user", "content": "  What is JAX?  "},
    {"role": "assistant", "content": "A library."},
    {"role": "user", "content": "Thanks 🙂"},
]


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    text = "héllo 世界 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256
    assert ids[1:] == list(text.encode("utf-8")) and len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode([*ids, 257, 258], skip_special_tokens=False) == f"<bos>{text}<eos><pad>"
    assert tok.decode([*ids, 257, 258]) == text
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"  # a cut-off 4-byte sequence
    assert (tok.vocab_size, tok.eos_token_ids) == (259, (257,))


def test_byte_tokenizer_chat_template() -> None:
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|system|>\nS\n<|user|>\nhi\n<|assistant|>\n"
    assert (tok.apply_chat_template(msgs, add_generation_prompt=False)
            == "<|system|>\nS\n<|user|>\nhi\n")


@pytest.fixture(scope="module")
def hf_pair() -> tuple[HFTokenizer, transformers.PreTrainedTokenizerBase]:
    return HFTokenizer(tiny_tokenizer_dir()), transformers.AutoTokenizer.from_pretrained(
        tiny_tokenizer_dir())


def test_hf_tokenizer_matches_transformers(hf_pair) -> None:
    ours, ref = hf_pair
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_tokenizer_dir() / "tokenizer.json"))
    assert isinstance(ours, Tokenizer)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"] == fast(text)["input_ids"]
        assert ids[0] == ours.bos_token_id == ref.bos_token_id == 1
        bare = ours.encode(text, add_special_tokens=False)
        assert bare == ref(text, add_special_tokens=False)["input_ids"] == ids[1:]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip)
        assert ours.decode(ids) == text
    assert ours.decode([1, 2, 3], skip_special_tokens=False) == "<s></s><|eot_id|>"
    assert ours.vocab_size == len(ref) == 400
    assert ours.eos_token_ids == (ref.eos_token_id,) == (2,)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(hf_pair, add_generation_prompt: bool) -> None:
    ours, ref = hf_pair
    rendered = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert rendered == ref.apply_chat_template(MESSAGES, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
    assert rendered.startswith("<s><|system|>\n\"Be brief, ünïcode \\\"quoted\\\" <tags>.\"</s>")
    assert rendered.endswith("<|assistant|>\n") == add_generation_prompt


def test_chat_template_from_jinja_file(tmp_path: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir() / f, tmp_path / f)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert HFTokenizer(tmp_path).apply_chat_template(MESSAGES) == ref.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_chat_template_errors(hf_pair, tmp_path: Path) -> None:
    ours, _ = hf_pair
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    shutil.copy(tiny_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = HFTokenizer(tmp_path)  # no tokenizer_config.json: no template, no BOS/EOS names
    assert (bare.bos_token_id, bare.eos_token_ids) == (None, ())
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(MESSAGES)


def test_load_tokenizer_from_checkpoint_dirs() -> None:
    assert load_tokenizer(tiny_llama_dir("llama2")) is None
    llama2 = load_tokenizer(tiny_llama_dir("llama2", with_tokenizer=True))
    assert isinstance(llama2, HFTokenizer) and llama2.eos_token_ids == (2,)
    # Config EOS plus generation_config.json's extra stop id, as Llama 3 instruct models have.
    llama3 = load_tokenizer(tiny_llama_dir("llama3", with_tokenizer=True))
    assert llama3 is not None and llama3.eos_token_ids == (2, 3)


def test_chat_prompt_ids_equal_transformers_with_one_bos(hf_pair) -> None:
    """The template writes BOS itself: encoding its text with specials gave two."""
    ours, ref = hf_pair
    want = ref.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat_prompt_ids(ours, MESSAGES) == want
    assert want.count(ours.bos_token_id) == 1 == want[:1].count(ours.bos_token_id)
    byte = ByteTokenizer()  # no template of its own: the simple format, after its BOS
    assert chat_prompt_ids(byte, MESSAGES) == byte.encode(simple_chat_prompt(MESSAGES))
