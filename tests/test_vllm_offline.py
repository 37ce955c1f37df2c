"""vLLM's offline API on jserve: a vLLM quick-start script runs as written (``from jserve
import LLM, SamplingParams``, ``outputs[i].outputs[k].text``) on the built-in model and on a
Hugging Face Llama-3 chat checkpoint; ``n`` sequences per prompt, seeded ones reproducible
(sequence i samples with seed + i); ``best_of`` returns exactly the top ``n`` of its
candidates by cumulative logprob; ``logit_bias`` forces and bans exact tokens offline and
over HTTP (the official ``openai`` client), its logprobs the model's own, and a bad one is a
400 naming it; ``LLM.chat`` generates on exactly the templated prompt ids; vLLM's constructor
names reach the engine config or are refused naming themselves."""
from __future__ import annotations

import dataclasses

import openai
import pytest

import conftest
from conftest import Served
from hf_models import llama3_chat_dir
from jserve import LLM, CompletionOutput, RequestOutput, SamplingParams
from jserve.flags.vllm_names import llm_engine_kwargs
from jserve.tokenizer import chat_prompt_ids

TOKEN = "s3cret"
PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]
# vLLM's names for a small engine (warmup: jserve's, so nothing compiles up front).
SMALL_VLLM = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32,
                  gpu_memory_utilization=0.5, warmup=False)


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def chat_llm():
    return LLM(model=str(llama3_chat_dir()), **SMALL_VLLM)


def _quick_start(llm: LLM) -> list[RequestOutput]:
    """vLLM's quick-start, as its docs write it (the model built by the caller)."""
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, n=2)
    outputs = llm.generate(PROMPTS, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        assert isinstance(prompt, str) and isinstance(generated_text, str)
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("model", ["default", "llama3-chat"])
def test_the_vllm_quick_start_runs_as_written(model, llm, chat_llm):
    engine = llm if model == "default" else chat_llm
    outputs = _quick_start(engine)
    tok, eos = engine.get_tokenizer(), engine.engine.eos_ids
    assert [o.prompt for o in outputs] == PROMPTS
    for o in outputs:
        assert isinstance(o, RequestOutput) and o.finished
        assert [c.index for c in o.outputs] == [0, 1]
        first, second = o.outputs
        assert isinstance(first, CompletionOutput) and first.finished()
        assert (first.text, first.token_ids, first.finish_reason) == (
            o.text, o.token_ids, o.finish_reason)  # the flat fields: the first sequence's
        assert first.token_ids != second.token_ids  # each sequence draws its own
        for c in o.outputs:
            assert c.logprobs is None and c.cumulative_logprob is None  # none asked for
            ended_by_eos = c.finish_reason == "stop" and c.token_ids[-1] in eos
            assert len(c.token_ids) == 16 or ended_by_eos  # vLLM's default max_tokens
            assert c.text == tok.decode(c.token_ids[:-1] if ended_by_eos else c.token_ids)
            assert c.stop_reason is None
        assert o.prompt_token_ids == tok.encode(o.prompt)


def test_n_seeded_samples_are_distinct_reproducible_and_seed_plus_i(llm):
    p = SamplingParams(temperature=0.8, top_p=0.95, n=3, seed=7, max_tokens=12,
                       ignore_eos=True)
    a, b = (llm.generate(PROMPTS[:2], p) for _ in range(2))
    ids = [[c.token_ids for c in o.outputs] for o in a]
    assert ids == [[c.token_ids for c in o.outputs] for o in b]
    for seqs in ids:
        assert len({tuple(s) for s in seqs}) == 3
    # Sequence i is the one-sequence request seeded seed + i.
    alone = [llm.generate(PROMPTS[:2], dataclasses.replace(p, n=1, seed=7 + i))
             for i in range(3)]
    assert ids == [[alone[i][j].token_ids for i in range(3)] for j in range(2)]
    # Greedy sequences are identical (as in vLLM).
    g = llm.generate(PROMPTS[0], greedy(6, n=3))[0]
    one = llm.generate(PROMPTS[0], greedy(6))[0].token_ids
    assert [c.token_ids for c in g.outputs] == [one] * 3


def test_best_of_returns_the_top_n_candidates_by_cumulative_logprob(llm):
    p = SamplingParams(temperature=1.0, n=2, best_of=5, seed=11, max_tokens=10,
                       ignore_eos=True)
    best = llm.generate(PROMPTS[2], p)[0]
    # The candidates: the same five seeded sequences, with their chosen tokens' logprobs.
    cands = llm.generate(PROMPTS[2], dataclasses.replace(p, n=5, best_of=None,
                                                         logprobs=0))[0].outputs
    assert len({tuple(c.token_ids) for c in cands}) == 5
    ranked = sorted(cands, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].cumulative_logprob is None and best.logprobs is None  # not asked
    # Asked for: each returned sequence's logprobs and sum are its candidate's own.
    shown = llm.generate(PROMPTS[2], dataclasses.replace(p, logprobs=1))[0].outputs
    assert [c.cumulative_logprob for c in shown] == [c.cumulative_logprob for c in ranked[:2]]
    tok = llm.get_tokenizer()
    for c in shown:
        assert len(c.logprobs) == len(c.token_ids)
        for t, entry in zip(c.token_ids, c.logprobs):
            assert next(iter(entry)) == t  # the chosen token first, then the top one
            assert entry[t].decoded_token == tok.decode([t])
            assert len(entry) in (1, 2) and max(lp.rank or 1 for lp in entry.values()) <= 1
        assert sum(next(iter(e.values())).logprob for e in c.logprobs) == c.cumulative_logprob


def test_logit_bias_forces_and_bans_exact_tokens_with_raw_logprobs(llm):
    ref = llm.generate(PROMPTS[1], greedy(logprobs=20))[0]
    first = ref.logprobs[0]
    forced, forced_lp = first.top[5]  # the 6th most likely first token
    runner_up = first.top[1][0]
    out = llm.generate(PROMPTS[1], greedy(logit_bias={forced: 100}, logprobs=0))[0]
    assert out.token_ids == [forced] * 8
    assert out.logprobs[0].logprob == pytest.approx(forced_lp, abs=1e-5)  # the model's own
    banned = llm.generate(PROMPTS[1], greedy(logit_bias={str(ref.token_ids[0]): -100}))[0]
    assert banned.token_ids[0] == runner_up != ref.token_ids[0]
    # Rows without a bias beside biased ones are untouched.
    both = llm.generate([PROMPTS[1], PROMPTS[1]], [greedy(logit_bias={forced: 100}), greedy()])
    assert both[0].token_ids == [forced] * 8 and both[1].token_ids == ref.token_ids


def test_stop_reason_is_the_stop_string_or_token_that_ended_it(llm):
    ref = llm.generate(PROMPTS[0], greedy(12))[0]
    stop = ref.text[4:6]
    by_text, by_id = llm.generate([PROMPTS[0]] * 2, [
        greedy(12, stop=["\x00\x01", stop]), greedy(12, stop_token_ids=[ref.token_ids[3]])])
    assert (by_text.finish_reason, by_text.outputs[0].stop_reason) == ("stop", stop)
    assert by_text.outputs[0].text == ref.text[:ref.text.find(stop)]
    assert (by_id.finish_reason, by_id.outputs[0].stop_reason) == ("stop", ref.token_ids[3])
    assert ref.outputs[0].stop_reason is None and ref.finish_reason == "length"


def test_chat_generates_on_exactly_the_templated_prompt_ids(chat_llm):
    tok = chat_llm.get_tokenizer()
    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
             [{"role": "user", "content": "Count to three."},
              {"role": "assistant", "content": "One, two"}]]
    p = greedy(6)
    got = chat_llm.chat(convs[0], p)
    assert len(got) == 1
    assert got[0].prompt_token_ids == chat_prompt_ids(tok, convs[0])
    assert got[0].token_ids == chat_llm.generate(chat_prompt_ids(tok, convs[0]), p)[0].token_ids
    cont = chat_llm.chat(convs, p, add_generation_prompt=False, continue_final_message=True)
    for conv, o in zip(convs, cont):
        ids = chat_prompt_ids(tok, conv, add_generation_prompt=False,
                              continue_final_message=True)
        assert o.prompt_token_ids == ids
        assert o.token_ids == chat_llm.generate(ids, p)[0].token_ids
    kwargs = {"date_string": "26 Jul 2024"}
    with_kwargs = chat_llm.chat(convs[0], p, chat_template_kwargs=kwargs)[0]
    assert with_kwargs.prompt_token_ids == chat_prompt_ids(tok, convs[0],
                                                           template_kwargs=kwargs)
    with pytest.raises(ValueError, match="continue_final_message"):
        chat_llm.chat(convs[1], p, continue_final_message=True)


def test_constructor_aliases_reach_the_engine_config():
    llm = LLM("default", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32,
              enable_prefix_caching=False, gpu_memory_utilization=0.3, kv_cache_dtype="fp8",
              seed=5, tensor_parallel_size=1, tokenizer="default", trust_remote_code=True,
              dtype="auto", warmup=False)
    c = llm.engine.config
    assert (c.max_model_len, c.max_num_seqs, c.max_num_batched_tokens) == (256, 2, 32)
    assert (c.enable_prefix_caching, c.memory_fraction, c.kv_cache_dtype, c.seed, c.mesh) == (
        False, 0.3, "fp8_e4m3", 5, "tp=1")
    assert llm.get_tokenizer() is llm.engine.tokenizer


def test_block_size_pages_the_cache_and_keeps_the_tokens(chat_llm):
    """``block_size`` (vLLM's KV block) is the page size: 32-token pages hold the same
    greedy tokens as the default 16 on the chat checkpoint, over several pages."""
    llm = LLM(model=str(llama3_chat_dir()), block_size=32, swap_space=1, **SMALL_VLLM)
    assert (llm.engine.config.page_size, llm.engine.config.swap_space_bytes) == (32, 1 << 30)
    prompt = "Paged attention keeps the key value cache in fixed size blocks. " * 4
    want = chat_llm.generate(prompt, greedy(40))[0]
    assert len(want.prompt_token_ids) + 40 > 2 * 32  # over more than two pages of 32
    assert llm.generate(prompt, greedy(40))[0].token_ids == want.token_ids


def test_vllm_names_map_or_are_refused_naming_themselves():
    assert llm_engine_kwargs("m", {"tensor_parallel_size": 2, "mesh": "kvp=2,spp=2"}) == {
        "mesh": "spp=2,kvp=2,tp=2"}
    assert llm_engine_kwargs("m", {"num_gpu_blocks_override": 64, "seed": None}) == {
        "num_kv_pages": 64}
    assert llm_engine_kwargs("m", {"block_size": 32, "swap_space": 0.5}) == {
        "page_size": 32, "swap_space_bytes": 1 << 29}
    with pytest.raises(TypeError, match="swap_space or swap_space_bytes"):
        llm_engine_kwargs("m", {"swap_space": 1, "swap_space_bytes": 1})
    with pytest.raises(ValueError, match="swap_space must be"):
        llm_engine_kwargs("m", {"swap_space": -1})
    with pytest.raises(ValueError, match="tensor_parallel_size 2 and mesh"):
        llm_engine_kwargs("m", {"tensor_parallel_size": 2, "mesh": "tp=4"})
    for kw, name in [({"enforce_eager": True}, "enforce_eager"),
                     ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
                     ({"cpu_offload_gb": 4}, "cpu_offload_gb"),
                     ({"frobnicate": 1}, "frobnicate"),
                     ({"gpu_memory_utilization": 0.5, "memory_fraction": 0.5},
                      "gpu_memory_utilization")]:
        with pytest.raises(TypeError, match=name):
            LLM("default", **kw)
    for kw, name in [({"tokenizer": "/elsewhere"}, "tokenizer"),
                     ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                     ({"tensor_parallel_size": 0}, "tensor_parallel_size")]:
        with pytest.raises(ValueError, match=name):
            LLM("default", **kw)


def test_the_engine_itself_runs_one_sequence_per_request(llm):
    queued = set(llm.engine.requests)  # has_unfinished() may see an async step still in flight
    with pytest.raises(ValueError, match="one sequence per request"):
        llm.engine.add_request("x", SamplingParams(n=2))
    with pytest.raises(ValueError, match="prompt 1: .*logit_bias"):
        llm.generate(["a", "b"], [greedy(), greedy(logit_bias={10**6: 1})])
    assert set(llm.engine.requests) == queued  # neither call queued anything


# -- over HTTP (a real `jserve serve`, the official openai client) ----------------------------
@pytest.fixture(scope="module")
def served():
    s = Served("--auth-token", TOKEN)
    yield s
    s.close()


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key=TOKEN, max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.mark.slow
def test_logit_bias_over_http_equals_offline(served, oai, llm):
    top = llm.generate(PROMPTS[3], greedy())[0].token_ids[0]
    forced = ord("Z") if top != ord("Z") else ord("Q")  # a byte: one character
    cases = [{str(forced): 100}, {str(top): -100}, {str(forced): 100, str(top): -100.0}]
    for bias in cases:
        want = llm.generate(PROMPTS[3], greedy(logit_bias=bias))[0]
        got = oai.completions.create(model="default", prompt=PROMPTS[3], max_tokens=8,
                                     temperature=0, logit_bias=bias,
                                     extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text
    assert want.token_ids[0] == forced
    # The chat endpoint: as LLM.chat with the same bias.
    msgs = [{"role": "user", "content": "Say something."}]
    want = llm.chat(msgs, greedy(6, logit_bias={forced: 100}))[0]
    got = oai.chat.completions.create(model="default", messages=msgs, max_tokens=6,
                                      temperature=0, logit_bias={str(forced): 100},
                                      extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text == llm.get_tokenizer().decode(
        [forced] * 6)


@pytest.mark.slow
def test_bad_logit_bias_and_best_of_get_a_400_naming_them(served, oai):
    bad = [{"5": 500}, {"x": 1}, {"99999": 1}, {str(i): 1 for i in range(301)}, {"5": True},
           [5]]
    for endpoint in ("completions", "chat"):
        for bias in bad:
            with pytest.raises(openai.BadRequestError) as e:
                if endpoint == "chat":
                    oai.chat.completions.create(model="default", max_tokens=2,
                                                messages=[{"role": "user", "content": "x"}],
                                                logit_bias=bias)
                else:
                    oai.completions.create(model="default", prompt="x", max_tokens=2,
                                           logit_bias=bias)
            err = e.value.body
            assert err["param"] == "logit_bias" and "logit_bias" in err["message"], err
    for kw in ({"n": 2, "best_of": 1}, {"best_of": 2, "stream": True}, {"best_of": 17}):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="default", prompt="x", max_tokens=2, **kw)
        assert e.value.body["param"] == "best_of", e.value.body
    conftest.wait_blocks_free(served.url, TOKEN)


@pytest.mark.slow
def test_best_of_over_http_equals_offline(served, oai, llm):
    p = SamplingParams(temperature=1.0, n=2, best_of=4, seed=3, max_tokens=10,
                       ignore_eos=True)
    want = llm.generate(PROMPTS[0], p)[0].outputs
    got = oai.completions.create(model="default", prompt=PROMPTS[0], n=2, best_of=4, seed=3,
                                 temperature=1.0, max_tokens=10,
                                 extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [c.text for c in want]
    assert [c.index for c in got.choices] == [0, 1]
    assert all(c.logprobs is None for c in got.choices)  # ranked by them, not shown
    assert got.usage.completion_tokens == 40  # every candidate was generated
    shown = oai.completions.create(model="default", prompt=PROMPTS[0], n=2, best_of=4,
                                   seed=3, temperature=1.0, max_tokens=10, logprobs=0,
                                   extra_body={"ignore_eos": True})
    sums = [sum(c.logprobs.token_logprobs) for c in shown.choices]
    assert [c.text for c in shown.choices] == [c.text for c in want] and sums[0] >= sums[1]
    conftest.wait_blocks_free(served.url, TOKEN)
