"""aiperf (NVIDIA's serving benchmark, the ``test`` extra) runs unchanged against a real
``jserve serve`` of the trained-BPE Llama-3 checkpoint: its CLI in a subprocess, offline
(``harness.aiperf`` says what that takes), a streaming profile on the chat and the
completions endpoints; 0 errors, and the requests and tokens of its exports are exactly what
the server's /metrics counted. Also: the HF byte tokenizer written for the built-in model
encodes as jserve's own."""
from __future__ import annotations

import json

import pytest

from conftest import Served, gauges
from harness import aiperf
from hf_models import llama3_chat_dir
from jserve.tokenizer import ByteTokenizer, HFTokenizer

REQUESTS, CONCURRENCY, ISL, OSL = 20, 4, 64, 16


@pytest.fixture(scope="module")
def served():
    s = Served("--model", str(llama3_chat_dir()), "--max-num-seqs", "4",
               "--max-num-batched-tokens", "128", "--max-model-len", "256")
    yield s
    s.close()


def _counts(g: dict) -> tuple[float, float, float]:
    label = lambda **k: json.dumps({"model_name": "llama3-chat", **k}, sort_keys=True)
    return (g["vllm:prompt_tokens_total" + label()], g["vllm:generation_tokens_total" + label()],
            g["vllm:request_success_total" + label(finished_reason="length")])


@pytest.mark.slow  # aiperf starts a dozen processes: about 20 s a profile here
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_aiperf_profile_counts_what_the_server_counted(served, endpoint, tmp_path):
    before = _counts(gauges(served.url))
    cmd = aiperf.command(served.url, "llama3-chat", llama3_chat_dir(), tmp_path / "out",
                         endpoint_type=endpoint, requests=REQUESTS, concurrency=CONCURRENCY,
                         isl=ISL, osl=OSL)
    export = aiperf.run(cmd, timeout=600)
    after = _counts(gauges(served.url))
    assert aiperf.errors(export) == 0 and export["error_summary"] == []
    assert export["request_error_rate"]["avg"] == 0.0 and export["is_complete"]
    assert export["request_count"]["avg"] == export["completed_request_count"]["avg"] == REQUESTS
    prompt = export["usage_prompt_tokens"]["sum"]
    assert export["usage_completion_tokens"]["sum"] == REQUESTS * OSL
    # The server made exactly these requests, read exactly these prompt tokens and generated
    # exactly these tokens, each request to its length.
    assert tuple(a - b for a, b in zip(after, before)) == (prompt, REQUESTS * OSL, REQUESTS)
    recs = aiperf.records(tmp_path / "out")
    assert len(recs) == REQUESTS and sum(r["usage_prompt_tokens"] for r in recs) == prompt
    assert all(r["output_tokens"] == OSL for r in recs)
    assert all(0 <= r["arrival_s"] < r["first_token_s"] <= r["finish_s"] for r in recs)
    figures = aiperf.summary(export)
    assert (figures["ok"], figures["errored"]) == (REQUESTS, 0)
    # Its throughputs divide by its phase's wall time, which starts before the first request
    # is sent: a little longer than its benchmark duration (first send to last response).
    assert figures["tok_s"] == pytest.approx(figures["req_s"] * OSL, rel=1e-9)
    assert REQUESTS / figures["req_s"] >= figures["duration"]
    # Synthetic prompts of ISL tokens by the client's tokenizer, BOS included: the server
    # reads exactly that many from a completion, and its chat template's tokens besides.
    assert export["input_sequence_length"]["sum"] == prompt  # the server's count
    if endpoint == "completions":
        assert prompt == REQUESTS * ISL
    else:
        assert prompt > REQUESTS * ISL


def test_byte_tokenizer_directory_encodes_as_jserves_byte_tokenizer(tmp_path):
    tok, ref = HFTokenizer(aiperf.write_byte_tokenizer(tmp_path)), ByteTokenizer()
    for text in ("hello world", "Grüße, 世界!\n\t  x", "", "tabs\tand  spaces "):
        assert tok.encode(text) == ref.encode(text)
        assert tok.encode(text, add_special_tokens=False) == list(text.encode())
        assert tok.decode(ref.encode(text)) == text
    assert tok.vocab_size == 259
