"""Scoring through the completions API (lm-eval's ``local-completions``): a real ``jserve
serve`` on the trained-BPE Llama-3-style checkpoint answers ``echo`` with the prompt's tokens
and logprobs (OpenAI's legacy shape), ``max_tokens: 0`` and vLLM's ``prompt_logprobs``, the
values those of the offline engine; lm-eval's own CLI then runs a local multiple-choice task
against it and against transformers (``--model hf``, float32 on CPU), and every choice's
loglikelihood agrees; a generate_until task gives the offline API's greedy text. Nothing is
downloaded (the tasks and data are tests/data/lm_eval/, the hub and datasets offline)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest

from conftest import Served, wait_blocks_free
from hf_models import llama3_chat_dir
from jserve import SamplingParams
from llm_helpers import small_llm

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data" / "lm_eval"
LOGLIKELIHOOD_TOL = 1e-3   # a choice's summed logprob: jserve (XLA, f32) vs torch f32
WIRE_TOL = 1e-4            # one token's logprob: the server's batch vs the offline engine's
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def served():
    s = Served("--model", str(llama3_chat_dir()), "--max-model-len", "1024")
    s.model = httpx.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm():
    return small_llm(str(llama3_chat_dir()), max_model_len=1024)


def _post(served, path: str, **body) -> dict:
    r = httpx.post(served.url + path, json={"model": served.model, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _token(llm, tid: int) -> str:
    return llm.tokenizer.decode([tid])


def test_echo_gives_the_prompts_tokens_and_logprobs(served, llm):
    """lm-eval's body (echo, logprobs 1, max_tokens 1) over a batch of token-id prompts and a
    text prompt: each choice starts with its prompt, the first token's logprob and
    alternatives null, then the one generated token; usage counts each once."""
    tok = llm.tokenizer
    prompts = [tok.encode("The quick brown fox jumps over"), tok.encode("Paris, Oslo")]
    body = dict(prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    res = _post(served, "/v1/completions", **body)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1,
                                                logprobs=1))
    assert res["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 2,
                            "total_tokens": sum(map(len, prompts)) + 2}
    for choice, ids, w in zip(res["choices"], prompts, want):
        lp = choice["logprobs"]
        assert choice["text"] == tok.decode(ids) + w.text
        assert lp["tokens"] == [_token(llm, t) for t in ids + w.token_ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:],
                                   [e.logprob for e in w.prompt_logprobs[1:]]
                                   + [w.logprobs[0].logprob], atol=WIRE_TOL)
        for top, e in zip(lp["top_logprobs"][1:len(ids)], w.prompt_logprobs[1:]):
            # the token itself and the top alternative (OpenAI: up to logprobs + 1)
            want_top = {_token(llm, e.token_id): e.logprob, _token(llm, e.top[0][0]): e.top[0][1]}
            assert top.keys() == want_top.keys()
            np.testing.assert_allclose([top[k] for k in want_top], list(want_top.values()),
                                       atol=WIRE_TOL)
        offsets = np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]])
        assert lp["text_offset"] == offsets.tolist()
    text = _post(served, "/v1/completions", **{**body, "prompt": "Paris, Oslo"})
    assert text["choices"][0]["logprobs"]["tokens"] == res["choices"][1]["logprobs"]["tokens"]
    assert text["choices"][0]["text"].startswith("Paris, Oslo")


def test_max_tokens_0_scores_the_prompt_alone(served, llm):
    prompt = llm.tokenizer.encode("Hello, world! How are you today?")
    res = _post(served, "/v1/completions", prompt=prompt, echo=True, max_tokens=0, logprobs=0)
    (choice,) = res["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == llm.tokenizer.decode(prompt)
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    assert res["usage"]["completion_tokens"] == 0
    assert res["usage"]["prompt_tokens"] == len(prompt)
    bare = _post(served, "/v1/completions", prompt=prompt, echo=True, max_tokens=0)
    assert bare["choices"][0]["text"] == choice["text"]
    assert bare["choices"][0]["logprobs"] is None
    assert wait_blocks_free(served.url)["jserve_kv_blocks_used"] == 0


def test_vllm_prompt_logprobs_field(served, llm):
    """vLLM's shape: completions per choice, chat at the top; per position the prompt token
    (its rank) and the top k (ranks 1..k) by token id, the first null."""
    ids = llm.tokenizer.encode("def forward(x): return x @ w + b")
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2,
                                              prompt_logprobs=3))[0].prompt_logprobs
    res = _post(served, "/v1/completions", prompt=ids, max_tokens=2, prompt_logprobs=3)
    got = res["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for pos, e in zip(got[1:], want[1:]):
        assert list(pos)[0] == str(e.token_id) and pos[str(e.token_id)]["rank"] == e.rank
        tops = [(str(t), r) for r, (t, _) in enumerate(e.top, 1)]
        assert all(pos[t]["rank"] == r for t, r in tops)
        assert set(pos) == {str(e.token_id)} | {t for t, _ in tops}
        assert pos[str(e.token_id)]["decoded_token"] == _token(llm, e.token_id)
        np.testing.assert_allclose(pos[str(e.token_id)]["logprob"], e.logprob, atol=WIRE_TOL)
    chat = _post(served, "/v1/chat/completions", max_tokens=1, prompt_logprobs=0,
                 messages=[{"role": "user", "content": "Hi"}])
    chat_ids = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat_ids)
    assert [list(p) for p in chat["prompt_logprobs"][1:]] == [[str(t)] for t in chat_ids[1:]]


def test_streaming_echo_sends_the_prompt_first(served, llm):
    body = {"model": served.model, "prompt": "The weather in Paris", "echo": True,
            "logprobs": 0, "max_tokens": 3, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    full = _post(served, "/v1/completions", **{k: v for k, v in body.items()
                                               if k not in ("model", "stream",
                                                            "stream_options")})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["text"].startswith("The weather in Paris")
    assert "".join(c["text"] for c in choices) == full["choices"][0]["text"]
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert tokens == full["choices"][0]["logprobs"]["tokens"]
    assert choices[0]["logprobs"]["token_logprobs"][0] is None
    assert chunks[-1]["usage"] == full["usage"]


def _lm_eval(out: Path, model: str, model_args: str, tasks: str) -> dict[str, list[dict]]:
    """lm-eval's CLI (offline) on the local tasks; the logged samples of each task."""
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
         "--tasks", tasks, "--include_path", str(DATA), "--batch_size", "4", "--device", "cpu",
         "--log_samples", "--output_path", str(out)],
        cwd=DATA, env={**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(out / "datasets")},
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples = {}
    for task in tasks.split(","):
        (path,) = out.glob(f"*/samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()),
                               key=lambda s: s["doc_id"])
    return samples


def test_lm_eval_scores_as_transformers_and_generates_as_the_offline_api(served, llm,
                                                                           tmp_path):
    ckpt = llama3_chat_dir()
    common = f"tokenizer={ckpt},add_bos_token=True,max_length=1024"
    api = _lm_eval(tmp_path / "api", "local-completions",
                   f"base_url={served.url}/v1/completions,model={served.model},"
                   f"tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1,"
                   + common, "jserve_mc,jserve_gen")
    hf = _lm_eval(tmp_path / "hf", "hf", f"pretrained={ckpt},dtype=float32," + common,
                  "jserve_mc")
    mc, ref = api["jserve_mc"], hf["jserve_mc"]
    assert [s["doc_id"] for s in mc] == [s["doc_id"] for s in ref] == list(range(10))
    for ours, theirs in zip(mc, ref):
        assert ours["arguments"] == theirs["arguments"]  # the same (context, choice) pairs
        got = [r[0] for r in ours["resps"]]  # per choice: [loglikelihood, is_greedy]
        want = [r[0] for r in theirs["resps"]]
        np.testing.assert_allclose([float(g[0]) for g in got], [float(w[0]) for w in want],
                                   atol=LOGLIKELIHOOD_TOL)
        assert [g[1] for g in got] == [w[1] for w in want]
    tok = llm.tokenizer
    for sample in api["jserve_gen"]:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        want = llm.generate([tok.encode(context)], SamplingParams(
            temperature=0, max_tokens=8, stop=["\n\n"]))[0].text
        assert sample["resps"] == [[want]], context
