"""Decode bursts (``EngineConfig.decode_burst``): several decode steps in one executable call,
the all-decode shape's own step program looping over a runtime count. The tokens are
exactly those of one step at a time (greedy, seeded sampling, stop ids and strings, async
and sync scheduling; a batch with a penalised, filtered or biased request steps one at a
time, with its tokens), KV pages are conserved after every step and all free at the end, an
abort while a burst is on the device frees its blocks, a burst whose shape is not compiled
yet waits for the background compile while the engine steps one at a time, bursts add no
program, and bursts on a tp=2 mesh give the one-device tokens."""
from __future__ import annotations

import dataclasses
import json
import textwrap
import threading

import pytest

from devices import run_on_devices
from jserve import SamplingParams
from jserve.engine.batch import burst
from jserve.engine.config import AUTO_BURST_STEPS, EngineConfig
from jserve.engine.requests.state import NEUTRAL_ROW
from jserve.sampling.structured import StructuredOutput
from llm_helpers import check_blocks, small_llm

PROMPTS = [[1 + i, 5, 7, 9 + i] * (3 + i) for i in range(4)]


def _params(stop_token: int | None = None, stop: str | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True,
                           stop_token_ids=[stop_token] if stop_token is not None else None),
            SamplingParams(temperature=0.9, seed=7, max_tokens=18, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True,
                           stop=[stop] if stop else None),
            SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]


def _run(llm, params, abort_in_burst: str | None = None):
    """Every request's (token ids, finish reason), blocks checked after every step; with
    ``abort_in_burst``, that request is aborted once a burst holding it is on the device."""
    eng = llm.engine
    ids = [eng.add_request(p, s, request_id=f"r{i}")
           for i, (p, s) in enumerate(zip(PROMPTS, params))]
    eng.step_log = []
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.finish_reason)
        if abort_in_burst in eng.requests and any(
                e.plan.burst > 1 for e in eng.scheduler._launched):
            out = eng.abort(abort_in_burst)
            done[abort_in_burst] = (out.token_ids, out.finish_reason)
        check_blocks(eng)
    assert eng.allocator.num_free == eng.allocator.total
    return [done[i] for i in ids], sum(p.burst > 1 for p, _ in eng.step_log)


@pytest.fixture(scope="module")
def reference():
    """One step at a time."""
    return small_llm(decode_burst=1)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bursts_give_the_tokens_of_one_step_at_a_time(reference, async_scheduling):
    want, _ = _run(reference, _params())
    # Stops that fall inside bursts: request 0 on the id it generates 7th, request 2 on the
    # text of its 8th to 10th tokens (the byte tokenizer: one character a token).
    stop_token = want[0][0][6]
    text = reference.engine.tokenizer.decode(want[2][0][7:10])
    want, _ = _run(reference, _params(stop_token, text))
    assert want[0][1] == "stop" and len(want[0][0]) <= 7
    assert want[2][1] == "stop"
    burst = small_llm(decode_burst=4, async_scheduling=async_scheduling)
    got, bursts = _run(burst, _params(stop_token, text))
    assert got == want
    assert bursts >= 3


@pytest.mark.slow
def test_a_batch_beyond_temperature_steps_one_at_a_time_with_its_tokens(reference):
    """On a CPU a burst's steps sample as the fused step does (greedy, temperature): a
    batch holding a request with a logit bias, a penalty or a top-p filter takes no burst,
    and its tokens are one step at a time's (a banned greedy token never comes, a +100 one
    always does)."""
    plain, _ = _run(reference, _params())
    banned = plain[0][0][3]
    params = _beyond_temperature(plain)
    want, _ = _run(reference, params)
    assert banned not in want[0][0] and len(want[0][0]) == len(plain[0][0])
    assert want[3][0] == [65] * 9 and 7 not in want[1][0]
    got, bursts = _run(small_llm(decode_burst=4), params)
    assert got == want
    assert bursts == 0


def _beyond_temperature(plain) -> list[SamplingParams]:
    """``_params`` with logit biases (a ban of ``plain``'s 4th greedy token, a +100 on 65,
    a -50 on 7 beside a top-p filter) and penalties."""
    params = _params()
    params[0] = dataclasses.replace(params[0], logit_bias={plain[0][0][3]: -100})
    params[1] = dataclasses.replace(params[1], top_p=0.8,
                                    logit_bias={plain[1][0][0]: 3.0, 7: -50})
    params[2] = dataclasses.replace(params[2], repetition_penalty=1.3, frequency_penalty=0.4)
    params[3] = dataclasses.replace(params[3], logit_bias={65: 100})
    return params


@pytest.mark.slow
@pytest.mark.parametrize("branches_cheap", [True, False])
def test_whole_chain_decodes_burst_filtered_penalised_and_biased_requests(
        reference, monkeypatch, branches_cheap):
    """Where the all-decode steps sample with the whole chain (a GPU or TPU:
    ``factory.whole_chain_decodes``, forced here), a batch with a bias, a top-p filter and
    penalties bursts, with exactly the tokens of one step at a time; its all-decode steps
    need no sampling executable (only mixed steps call it). Also as a GPU's programs are
    built (``backend.branches_cheap`` false, forced): the penalty state and the handed-on
    logits written unconditionally, the bias, penalties, mask and draws of the chain run
    for every row: the same tokens and logprobs."""
    from jserve import backend
    from jserve.engine.build import factory
    plain, _ = _run(reference, _params())
    params = _beyond_temperature(plain)
    want, _ = _run(reference, params)
    monkeypatch.setattr(factory, "whole_chain_decodes", lambda backend: True)
    monkeypatch.setattr(backend, "branches_cheap", lambda: branches_cheap)
    llm = small_llm(decode_burst=4)
    runner = llm.engine.runner
    assert runner.programs.lowering.modes.whole_chain_decodes
    sampled, sample = [], runner.sample
    monkeypatch.setattr(runner, "sample", lambda *a, **k: sampled.append(1) or sample(*a, **k))
    got, bursts = _run(llm, params)
    assert got == want
    assert bursts >= 3
    mixed = sum(bool(p.prefills) for p, _ in llm.engine.step_log)
    assert 0 < len(sampled) <= mixed
    # Logprobs still go to the sampling executable (the step's program returns tokens
    # only): the same tokens and logprobs as one step at a time.
    logprobs = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    got, want = (x.generate(PROMPTS[:2], logprobs) for x in (llm, reference))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and len(g.logprobs) == 6
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_an_abort_during_a_burst_frees_its_blocks_and_leaves_the_others_alone(reference):
    want, _ = _run(reference, _params())
    got, bursts = _run(small_llm(decode_burst=4), _params(), abort_in_burst="r1")
    assert bursts >= 1
    ids, reason = got[1]
    assert reason == "abort" and ids == want[1][0][:len(ids)] and len(ids) < len(want[1][0])
    assert [g for i, g in enumerate(got) if i != 1] == [w for i, w in enumerate(want) if i != 1]


def test_a_burst_not_compiled_yet_compiles_in_the_background_meanwhile_single_steps(
        reference):
    want, _ = _run(reference, _params())
    llm = small_llm(decode_burst=4, warmup="core")
    programs = llm.engine.runner.programs
    shape = llm.engine.buckets.shape_for(len(PROMPTS), 0)
    assert shape not in programs.steps  # ``core``: the smallest decode and the largest step
    gate, compile_one = threading.Event(), programs._compile_in_background

    def held_back(key):  # the background compile of the 4-decode step waits for the test
        if key == shape:
            assert gate.wait(120)
        compile_one(key)

    programs._compile_in_background = held_back
    got, bursts = _run(llm, _params())
    assert got == want and bursts == 0
    gate.set()
    assert programs.wait_compiles(120)
    got, bursts = _run(llm, _params())  # the same requests: now in bursts
    assert got == want and bursts >= 3


_TP_SCRIPT = textwrap.dedent("""
    import json, sys
    from jserve import LLM, SamplingParams
    from harness.evaluate import release_executables
    settings = json.loads(sys.argv[1])
    prompts = ["count down from 40", "list fruits", "count down from 33"]
    params = SamplingParams(max_tokens=30, temperature=0.0)
    result = {}
    for name, mesh, burst in (("ref", "tp=1", 1), ("tp=2", "tp=2", 4)):
        llm = LLM("tiny-tasks", mesh=mesh, decode_burst=burst, **settings)
        llm.engine.step_log = []
        outs = llm.generate(prompts, params)
        eng = llm.engine
        eng.allocator.check()
        result[name] = {"tokens": [o.token_ids for o in outs],
                        "leaked": eng.allocator.num_allocated,
                        "bursts": sum(p.burst > 1 for p, _ in eng.step_log)}
        del llm, eng, outs
        release_executables()
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_bursts_on_a_tp2_mesh_give_the_one_device_tokens():
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2,
                    max_model_len=160, warmup=False)
    result = run_on_devices(_TP_SCRIPT, json.dumps(settings), devices=2, timeout=1200).result
    assert result["tp=2"]["tokens"] == result["ref"]["tokens"]
    assert result["tp=2"]["leaked"] == 0 and result["tp=2"]["bursts"] >= 3
    assert result["ref"]["bursts"] == 0


@pytest.mark.parametrize("setting,steps", [("auto", AUTO_BURST_STEPS), (2, 2), (1, 1)])
def test_auto_decode_burst_steps(setting, steps):
    """"auto" is on everywhere (a burst compiles nothing of its own); a number is taken as
    it is."""
    for warmup in ("all", "none"):
        assert EngineConfig(decode_burst=setting, warmup=warmup).burst_steps() == steps


def test_bursts_add_no_program_and_change_no_other_shape():
    """The program count is the same with and without bursts (each all-decode shape's step
    runs them), and a mixed shape's program is the same HLO either way."""
    counts, hlo = {}, {}
    for k in (1, 4):
        programs = small_llm(decode_burst=k, warmup="all").engine.runner.programs
        counts[k] = programs.compile_count
        mixed = max(programs.steps)
        assert mixed[1] > 0
        decode = programs.lowering.buckets.shape_for(2, 0)
        hlo[k] = [programs.lowering.lower(s)[0].as_text() for s in (mixed, decode)]
    assert counts[1] == counts[4] > 0
    assert hlo[1][0] == hlo[4][0]
    assert hlo[4][1].count("stablehlo.while") == hlo[1][1].count("stablehlo.while") + 1


def test_bursts_beyond_the_programs_are_refused_before_any_step(reference):
    """``bursts.steps`` takes 1 to the steps the programs were built for; a burst the
    runner is handed at a shape without the loop, or longer, fails that step (its requests
    end with an error) instead of reading one token as several."""
    eng = reference.engine  # built with decode_burst=1
    with pytest.raises(ValueError, match="run 1 to 1"):
        eng.bursts.steps = 2
    assert eng.bursts.steps == 1
    four = small_llm(decode_burst=4).engine
    four.bursts.steps = 2  # fewer than built: fine
    with pytest.raises(ValueError, match="run 1 to 4"):
        four.bursts.steps = 5
    runner = four.runner
    shape = four.buckets.shape_for(1, 0)
    layout = runner.programs.compiled(shape)[1]
    empty = four.builder.empty(shape, NEUTRAL_ROW)
    ibuf, fbuf, masks = layout.pack(empty.arrays)
    assert masks is None  # no row has a bitmask: none is sent
    ibuf[layout.int_offset(".burst")] = 5
    with pytest.raises(ValueError, match="a decode burst of 5 steps"):
        runner.execute_packed(shape, ibuf, fbuf)
    assert runner.executed[shape] == 0


@pytest.mark.parametrize("bad", ["fast", 0, -2])
def test_decode_burst_setting_is_checked(bad):
    with pytest.raises(ValueError, match="decode_burst must be 'auto' or >= 1"):
        EngineConfig(decode_burst=bad)


def test_which_requests_may_burst(reference):
    """Per request (``burst.may_burst``, k = 4): greedy, stop strings and ids and seeded
    temperature sampling may (the host ends a request at a stop inside a burst and drops
    the tokens after it); logprobs, a structured output, a pending ``min_tokens`` ban,
    fewer than k tokens left under ``max_tokens``, or sampling beyond a temperature
    (penalty, filter, bias: the fused step's chain has none) may not. A top-p filter on a
    greedy request filters nothing: it may."""
    eng = reference.engine
    assert eng.bursts.steps == 1 and eng.bursts.supported
    base = dict(max_tokens=20, ignore_eos=True)
    cases = {"greedy": (SamplingParams(temperature=0.0, **base), True),
             "stop string": (SamplingParams(stop=["xyz"], stop_token_ids=[9], **base), True),
             "seed": (SamplingParams(temperature=0.8, seed=3, **base), True),
             "greedy, top_p": (SamplingParams(temperature=0.0, top_p=0.5, **base), True),
             "penalty": (SamplingParams(temperature=0.8, seed=3, presence_penalty=0.5,
                                        **base), False),
             "greedy penalty": (SamplingParams(temperature=0.0, repetition_penalty=1.2,
                                               **base), False),
             "top_p": (SamplingParams(temperature=0.8, top_p=0.9, **base), False),
             "top_k": (SamplingParams(temperature=0.8, top_k=5, **base), False),
             "min_p": (SamplingParams(temperature=0.8, min_p=0.1, **base), False),
             "bias": (SamplingParams(temperature=0.0, logit_bias={3: 1.0}, **base), False),
             "logprobs": (SamplingParams(logprobs=2, **base), False),
             "structured": (SamplingParams(structured_output=StructuredOutput(
                 regex="[ab]{30}"), **base), False),
             "min_tokens": (SamplingParams(min_tokens=8, max_tokens=20), False),
             "3 left": (SamplingParams(max_tokens=3, ignore_eos=True), False)}
    ids = {name: eng.add_request(PROMPTS[0], p) for name, (p, _) in cases.items()}
    got = {name: burst.may_burst(eng.requests[rid], 4, eng.max_model_len)
           for name, rid in ids.items()}
    assert got == {name: want for name, (_, want) in cases.items()}
    for rid in ids.values():
        eng.abort(rid)
    assert eng.allocator.num_free == eng.allocator.total
