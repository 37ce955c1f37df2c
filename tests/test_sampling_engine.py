"""Per-request sampling through the engine: seeds across batch mixes, stops, min_tokens,
EOS handling, logprobs, and penalties against a host-side reference."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jserve import SamplingParams
from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.model.weights import load_model
from llm_helpers import small_llm
from test_hf_parity import _all_position_logits

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_ref(llm):
    return llm.generate(PROMPT, GREEDY)[0]


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12,
                            ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20)]
    mixed = llm.generate(["zzz", PROMPT, "a much longer prompt " * 4],
                         [others[0], seeded, others[1]])[1].token_ids
    assert alone == mixed
    other_seed = llm.generate(PROMPT, dataclasses.replace(seeded, seed=99))[0].token_ids
    assert other_seed != alone


def test_filtered_rows_are_sampled_by_the_executable_with_the_whole_chain(llm, greedy_ref):
    # The fused step samples greedy and temperature rows only; a step with a filtered row
    # (or a bias, penalty, ban, mask, logprobs) is sampled again by the sampling
    # executable. Filters that keep only the top token must give the greedy tokens, beside
    # an unfiltered sampled row and a greedy one.
    sampled = dict(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    keep_top = [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)]
    params = [SamplingParams(**sampled, **f) for f in keep_top]
    outs = llm.generate([PROMPT] * 5, params + [SamplingParams(**sampled), GREEDY])
    assert [o.token_ids for o in outs[:3]] == [greedy_ref.token_ids] * 3
    assert outs[3].token_ids != greedy_ref.token_ids
    assert outs[4].token_ids == greedy_ref.token_ids
    # Alone, the temperature row is sampled by the step itself: the same tokens.
    assert llm.generate(PROMPT, SamplingParams(**sampled))[0].token_ids == outs[3].token_ids
    programs = llm.engine.runner.programs
    step = programs.compiled(llm.engine.buckets.shape_for(2, 0))[0].as_text()
    whole = programs.sampler().as_text()
    # the filters' per-row fallback: the programs' only sort
    assert " sort(" not in step and " sort(" in whole


def test_whole_chain_decision_on_each_kind_of_row():
    # Which steps the fused step samples alone and which the sampling executable samples
    # again (``StepArrays.whole_chain``): one row of each kind beside a plain one.
    from jserve.engine.batch.builder import StepFlags, _masked, _whole_chain
    from jserve.sampling.sampler import SamplerRow, make_sampling_batch
    hot = dict(temperature=0.7, max_tokens=4)
    row = lambda **kw: SamplerRow(SamplingParams(**{**hot, **kw}), seed=1, step=0)
    plain = [row(), row(temperature=0.0)]
    def decide(extra, logprobs=False):
        rows = plain + extra
        flags = StepFlags(any_random=True, any_penalty=False, want_logprobs=logprobs,
                          any_bias=any(r.params.logit_bias for r in rows),
                          beyond_temperature=any(r.params.beyond_temperature for r in rows))
        return _whole_chain(flags, make_sampling_batch(rows, pad_to=8, words=2),
                            _masked(rows))
    assert not decide([])
    # Filters on a greedy row change nothing: it takes the argmax either way.
    assert not decide([row(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)])
    for kind in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)):
        assert decide([row(**kind)]), kind
    for kind in (dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                 dict(frequency_penalty=-0.5), dict(logit_bias={3: 2.0})):
        assert decide([row(**kind)]) and decide([row(temperature=0.0, **kind)]), kind
    assert decide([row()._replace(banned_ids=(7,))])
    assert decide([row()._replace(allowed=np.array([5, -1], np.int32))])
    assert decide([row()._replace(draft=9)])
    assert not decide([row(temperature=0.0)._replace(draft=9)])  # greedy verify: the argmax
    assert decide([], logprobs=True)


def test_stop_string_ends_text_exactly_before_it(llm, greedy_ref):
    text = greedy_ref.text
    stop = text[5:8]
    assert stop and text.find(stop) >= 0
    out = llm.generate(PROMPT, dataclasses.replace(GREEDY, stop=["\x00\x01", stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.find(stop)]
    assert out.token_ids == greedy_ref.token_ids[:len(out.token_ids)]


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm, greedy_ref):
    out = llm.generate(PROMPT, dataclasses.replace(GREEDY, detokenize=False, logprobs=2))[0]
    assert out.token_ids == greedy_ref.token_ids and out.text == "" and greedy_ref.text
    assert all(lp.decoded_token is None for step in out.outputs[0].logprobs
               for lp in step.values())


def test_stop_token_id_and_min_tokens(llm, greedy_ref):
    ids = greedy_ref.token_ids
    stop_id = ids[3]
    first = ids.index(stop_id)
    out = llm.generate(PROMPT, dataclasses.replace(GREEDY, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[:first + 1]
    # While min_tokens is not reached the stop id is banned, so it cannot appear early.
    held = llm.generate(PROMPT, dataclasses.replace(GREEDY, stop_token_ids=[stop_id],
                                                    min_tokens=first + 3))[0]
    assert stop_id not in held.token_ids[:first + 3]
    assert len(held.token_ids) >= first + 3


def test_eos_stops_unless_ignore_eos(greedy_ref):
    cfg, params, tok = load_model("default")
    eos = greedy_ref.token_ids[4]
    cfg = dataclasses.replace(cfg, eos_token_ids=(eos,))
    eng_cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2,
                           max_model_len=512, warmup=False)
    eng = LLMEngine(cfg, params, tok, eng_cfg)
    stopped = _run(eng, dataclasses.replace(GREEDY, ignore_eos=False))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy_ref.token_ids[:greedy_ref.token_ids.index(eos) + 1]
    ignored = _run(eng, GREEDY)
    assert ignored.finish_reason == "length" and ignored.token_ids == greedy_ref.token_ids


def _run(eng, params, prompt=PROMPT):
    rid = eng.add_request(prompt, params)
    while True:
        for o in eng.step():
            if o.request_id == rid and o.finished:
                return o


def test_logprobs_are_the_raw_model_distribution(llm, greedy_ref):
    out = llm.generate(PROMPT, dataclasses.replace(GREEDY, max_tokens=6, logprobs=3))[0]
    cfg, params, tok = load_model("default")
    ids = tok.encode(PROMPT) + out.token_ids
    logits = _all_position_logits(cfg, params, ids)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    n_prompt = len(out.prompt_token_ids)
    assert len(out.logprobs) == 6
    for i, lp in enumerate(out.logprobs):
        row = logp[n_prompt - 1 + i]
        assert lp.token_id == out.token_ids[i] == int(row.argmax())
        np.testing.assert_allclose(lp.logprob, row[lp.token_id], atol=1e-4)
        assert [t for t, _ in lp.top] == np.argsort(-row, kind="stable")[:3].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(row)[::-1][:3], atol=1e-4)


def test_penalties_match_a_host_side_reference(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            repetition_penalty=1.8, presence_penalty=0.4, frequency_penalty=0.3)
    out = llm.generate(PROMPT, params)[0]
    cfg, weights, tok = load_model("default")
    prompt = tok.encode(PROMPT)
    generated: list[int] = []
    for _ in range(10):
        logits = _all_position_logits(cfg, weights, prompt + generated)[-1].astype(np.float64)
        counts = np.bincount(generated, minlength=cfg.vocab_size)
        seen = (counts > 0) | np.isin(np.arange(cfg.vocab_size), prompt)
        logits = np.where(seen, np.where(logits > 0, logits / 1.8, logits * 1.8), logits)
        logits -= 0.4 * (counts > 0) + 0.3 * counts
        generated.append(int(logits.argmax()))
    assert out.token_ids == generated
    plain = llm.generate(PROMPT, dataclasses.replace(params, repetition_penalty=1.0,
                                                     presence_penalty=0.0,
                                                     frequency_penalty=0.0))[0]
    assert plain.token_ids != generated  # the penalties changed something


def test_penalty_state_survives_preemption():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            repetition_penalty=1.5, frequency_penalty=0.5)
    prompts = ["first prompt here", "second one", "third prompt, a bit longer"]
    roomy = small_llm(max_model_len=160)
    tight = small_llm(kv_cache_bytes=9 * 2 * 4 * 2 * 16 * 64 * 4, max_model_len=160)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.engine.scheduler.num_preemptions > 0
