"""Engine behaviour: chunking invariance, block conservation, preemption, aborts, bad input,
no compilation after warm-up, orbax round trip."""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from jserve import SamplingParams
from jserve.engine.config import EngineConfig
from jserve.model.weights import DEFAULT_CONFIG, init_params, save_orbax
from jserve.tokenizer import ByteTokenizer
from llm_helpers import small_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
rng = np.random.default_rng(7)
PROMPTS = [rng.integers(0, 256, n).tolist() for n in (3, 40, 100)]


@pytest.fixture(scope="module")
def reference(llm):
    """Each prompt alone with a generous budget."""
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("budget", [1, 7, 32, 256, None])
def test_greedy_output_is_independent_of_chunk_size_and_batch_mix(budget, reference):
    llm = small_llm(max_num_batched_tokens=budget or 512)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    mixed = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert alone == reference
    assert mixed == reference
    llm.engine.allocator.check()
    assert llm.engine.allocator.num_allocated == 0


def test_blocks_are_conserved_after_every_step(llm):
    eng = llm.engine
    for i, p in enumerate(PROMPTS * 2):
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True))
    finished = 0
    while eng.has_unfinished():
        finished += sum(o.finished for o in eng.step())
        eng.allocator.check()  # each held block counted once per holder (shared prefixes)
        eng.allocator.check_holders(eng.scheduler.page_holders())
    assert finished == 6
    assert eng.allocator.num_free == eng.allocator.total


def test_preemption_by_recompute_keeps_greedy_outputs(reference):
    # 10 blocks of 16 tokens cannot hold three growing sequences at once.
    llm = small_llm(kv_cache_bytes=11 * 2 * 4 * 2 * 16 * 64 * 4, max_model_len=160)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.allocator.num_allocated == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_blocks_and_others_finish(async_scheduling, reference):
    eng = small_llm(async_scheduling=async_scheduling).engine
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    extra = eng.add_request(PROMPTS[1], GREEDY)
    outs = {}
    for _ in range(3):
        for o in eng.step():
            outs[o.request_id] = o
    running = next(r for r in eng.scheduler.running if r.request_id == ids[0])
    held = len(running.page_ids)
    assert held > 0
    before = eng.allocator.num_free
    aborted = eng.abort(ids[0])
    assert aborted.finish_reason == "abort" and aborted.finished
    assert running.page_ids == []
    if async_scheduling:  # its next decode is on the device: freed once that step is read
        assert eng.allocator.num_free == before
        assert [len(b) for b in eng.scheduler.page_holders()[len(eng.scheduler.running):]] \
            == [held]
        eng.allocator.check_holders(eng.scheduler.page_holders())
        for o in eng.step():
            outs[o.request_id] = o
        assert eng.scheduler.page_holders() == [r.page_ids for r in eng.scheduler.running]
    else:
        assert eng.allocator.num_free == before + held
    assert eng.abort(ids[0]) is None  # already gone
    eng.abort(extra)
    eng.allocator.check()
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert [outs[i].token_ids for i in ids[1:]] == reference[1:]
    assert eng.allocator.num_allocated == 0


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "prompt is empty"),
    ([], SamplingParams(), "prompt is empty"),
    ([1, 2, 999], SamplingParams(), "outside the vocabulary"),
    ([1] * 512, SamplingParams(), "context holds 512"),
    ([1] * 500, SamplingParams(max_tokens=20), "exceeds the context"),
    ([1, 2], SamplingParams(top_k=1000), "top_k"),
    ([1, 2], SamplingParams(stop_token_ids=[400]), "stop_token_ids"),
])
def test_bad_input_is_refused_and_in_flight_requests_are_untouched(llm, reference, prompt, params,
                                                                   message):
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    eng.step()
    with pytest.raises(ValueError, match=message):
        eng.add_request(prompt, params)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0], prompt], [GREEDY, params])
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert [outs[i].token_ids for i in ids] == reference


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("min_p", 1.5),
                                          ("max_tokens", 0), ("top_k", -2)])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_nothing_compiles_after_warmup_on_a_mixed_workload():
    llm = small_llm(warmup=True)
    eng = llm.engine
    warm = eng.compile_count
    # every step shape, the one sampler and the two swap programs (page_io)
    assert warm == len(eng.buckets.all_shapes()) + 1 + 2
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=3, max_tokens=17,
                             ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.2,
                             presence_penalty=0.3, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, frequency_penalty=0.5, max_tokens=30,
                             stop=["zz"], ignore_eos=True)]
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 5, 17, 31, 33, 64, 150, 7)]
    llm.generate(prompts, [params[i % 4] for i in range(len(prompts))])
    llm.generate(prompts[:1], params[1])
    assert eng.compile_count == warm


def test_orbax_round_trip_gives_identical_outputs(tmp_path, llm, reference):
    save_orbax(tmp_path / "ckpt", DEFAULT_CONFIG, init_params(DEFAULT_CONFIG, seed=0),
               tokenizer=ByteTokenizer())
    restored = small_llm(str(tmp_path / "ckpt"))
    assert isinstance(restored.tokenizer, ByteTokenizer)
    assert [o.token_ids for o in restored.generate(PROMPTS, GREEDY)] == reference
    text = "Hello, jserve"
    assert (restored.generate(text, GREEDY)[0].token_ids == llm.generate(text, GREEDY)[0].token_ids)


def test_a_failing_step_ends_its_requests_with_an_error_and_frees_blocks(monkeypatch):
    llm = small_llm()
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS[:2]]

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.runner, "execute_packed", broken)
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert all(o.finished and o.finish_reason == "abort" and "device lost" in o.error
               for o in outs)
    assert not eng.has_unfinished() and eng.allocator.num_allocated == 0


@pytest.mark.parametrize("layer_loop, max_num_seqs",
                         [("loop", 4), ("loop", 1), ("unrolled", 1), ("sliced", 4)])
def test_looped_and_unrolled_layers_give_the_same_tokens(reference, layer_loop, max_num_seqs):
    """The default engine here unrolls its 4 layers over per-layer weights; the loop over
    stacked weights must agree, also with one sequence at a time (one-token steps, whose KV
    write takes the padded-scatter path), and so must the layers unrolled in the program
    over slices of the stacked weights (the GPU default)."""
    llm = small_llm(layer_loop=layer_loop, max_num_seqs=max_num_seqs)
    layers = llm.engine.runner.params["layers"]
    assert isinstance(layers, list if layer_loop == "unrolled" else dict)
    assert llm.engine.runner.slice_layers == (layer_loop == "sliced")
    assert [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == reference


def test_the_layer_mode_follows_backend_depth_and_pipeline():
    """GPU: sliced-indexed (docs/device.md, "Compiled for"); TPU: unrolled up to 8 layers a
    stage, else indexed (the loop copies every layer's weights there); CPU: unrolled up to
    8 layers a stage, else the loop; an explicit choice stands, but sliced cannot split into
    stages."""
    auto = EngineConfig()
    assert auto.layer_mode(32, 1, "gpu") == "sliced-indexed"
    assert auto.layer_mode(32, 2, "gpu") == "indexed"
    assert auto.layer_mode(8, 1, "cpu") == "unrolled" and auto.layer_mode(64, 2, "cpu") == \
        "unrolled"
    assert auto.layer_mode(16, 2, "tpu") == "unrolled" and auto.layer_mode(16, 1, "tpu") == \
        "indexed"
    assert EngineConfig(layer_loop="loop").layer_mode(4, 1, "gpu") == "loop"
    with pytest.raises(ValueError, match="spp == 1"):
        EngineConfig(layer_loop="sliced").layer_mode(4, 2, "gpu")


def test_a_plain_step_is_one_executable_call_with_the_same_tokens(llm, reference, monkeypatch):
    """Each step samples greedy and temperature rows inside its own executable (the logits
    never leave it): a run of greedy and seeded random rows dispatches one call a step and
    never the sampling executable, and its greedy tokens are the reference's. Rows with
    logprobs or penalties (``StepArrays.whole_chain``) take the sampling executable too,
    on their steps only."""
    runner = llm.engine.runner
    calls = {"sampler": 0, "steps": 0}
    sample, execute = runner.sample, runner.execute_packed
    monkeypatch.setattr(runner, "sample", lambda *a, **k: (
        calls.__setitem__("sampler", calls["sampler"] + 1), sample(*a, **k))[1])
    monkeypatch.setattr(runner, "execute_packed", lambda *a, **k: (
        calls.__setitem__("steps", calls["steps"] + 1), execute(*a, **k))[1])
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=6)
    outs = llm.generate(PROMPTS + PROMPTS[:1], [GREEDY] * len(PROMPTS) + [seeded])
    assert [o.token_ids for o in outs[:len(PROMPTS)]] == reference
    assert calls["steps"] > 0 and calls["sampler"] == 0
    mixed = [dataclasses.replace(seeded, logprobs=2),
             SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=6)]
    steps = calls["steps"]
    outs = llm.generate(PROMPTS[:2], mixed)
    assert len(outs[0].logprobs) == 6 and all(len(o.token_ids) == 6 for o in outs)
    assert calls["sampler"] == calls["steps"] - steps > 0
    # The sampling executable's tokens of a temperature row are the step's own.
    assert outs[0].token_ids == llm.generate(PROMPTS[:1], seeded)[0].token_ids


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_decode_steps_built_from_the_last_step_equal_fresh_builds(llm, reference, monkeypatch,
                                                                   async_scheduling):
    """``StepBuilder._advance`` (an all-decode step of the same requests as the last one,
    from that one's arrays) gives exactly the arrays a build from request state gives, on
    a workload that makes it stop and start again: requests ending at different lengths,
    rows banned until ``min_tokens``, seeded random rows, new blocks taken mid-run."""
    from jserve.engine.requests.state import NEUTRAL_ROW, sampler_row

    eng, b = llm.engine, llm.engine.builder
    monkeypatch.setattr(eng, "async_scheduling", async_scheduling)
    advance, tried, checked, bursts = b._advance, [], [], []

    def compared(plan, requests, state_row, flags):
        built = advance(plan, requests, state_row, flags)
        tried.append(plan)
        if built is not None:
            fresh = b._build(plan, requests, lambda r: sampler_row(r, eng.eos_ids),
                             NEUTRAL_ROW, state_row, flags)
            assert built.shape == fresh.shape and built.sample_rows == fresh.sample_rows
            # Built packed: the buffers are what packing the fresh build gives, bit for bit,
            # and the arrays unpacked from them are the fresh ones, dtypes included.
            want_i, want_f, want_masks = built.layout.pack(fresh.arrays)
            np.testing.assert_array_equal(built.packed[0], want_i)
            np.testing.assert_array_equal(built.packed[1], want_f)
            assert built.packed[2] is None and want_masks is None and not fresh.masked
            for got, want in zip(jax.tree.leaves(built.arrays), jax.tree.leaves(fresh.arrays),
                                 strict=True):
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got, want)
            checked.append(len(plan.decodes))
            bursts.append(plan.burst)
        return built

    monkeypatch.setattr(b, "_advance", compared)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 23)]
    params += [SamplingParams(temperature=0.0, max_tokens=30, min_tokens=6, ignore_eos=True),
               SamplingParams(temperature=0.9, seed=11, max_tokens=35, ignore_eos=True)]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], [7] * 14, [3, 4]], params)
    assert [len(o.token_ids) for o in outs] == [40, 23, 30, 35]
    assert outs[0].token_ids[:12] == reference[0]
    # The cheap way was taken, with 4 rows and with fewer, by decode bursts of 4, by
    # shorter ones (a request near its max_tokens shortens the burst) and, synchronously,
    # by a single step; the other all-decode steps followed a change of the batch or of
    # its flags, or had a row banned until ``min_tokens``. (rows, burst) of each cheap
    # step, and all-decode steps tried:
    cheap = [(4, 4), (4, 4), (4, 4), (3, 4)] + ([(3, 3), (2, 4), (1, 3)] if async_scheduling
                                                else [(2, 1)])
    assert (list(zip(checked, bursts)), len(tried)) == (cheap, 16 if async_scheduling else 14)


def _instructions(hlo: str):
    """(result shape, op, line) of every instruction of an optimized HLO module."""
    for line in hlo.splitlines():
        m = re.match(r"^\s+(?:ROOT )?%[\w.\-]+ = (\([^()]*\)|\S+) ([\w\-]+)\(", line)
        if m:
            yield m.group(1), m.group(2), line


def test_decode_step_writes_the_kv_cache_in_place_and_samples_without_a_variadic_argmax(llm):
    # docs/bench.md, "Batch-32 decode against the ceiling": the compiled decode step aliases
    # both donated KV buffers to its outputs and never copies a whole cache (the write is a
    # scatter into the buffer); the greedy argmax on CPU is two plain reductions, not the
    # (value, index) reduce that took most of the sampler's time.
    runner = llm.engine.runner
    exe, _ = runner.programs.compiled(llm.engine.buckets.shape_for(2, 0))
    hlo = exe.as_text()
    kv = jax.tree.leaves(runner.kv_cache)
    first_kv = len(jax.tree.leaves(runner.params))
    aliased = {int(n) for n in re.findall(r"\((\d+), \{\}, (?:may|must)-alias\)",
                                          hlo.splitlines()[0])}
    assert {first_kv + i for i in range(len(kv))} <= aliased
    cache_shape = "f32[" + ",".join(map(str, kv[0].shape)) + "]"
    whole_cache = [(op, line.strip()[:120]) for shape, op, line in _instructions(hlo)
                   if shape.startswith(cache_shape)
                   and op not in ("parameter", "bitcast", "get-tuple-element")
                   and not (op == "fusion" and "scatter" in line)]
    assert not whole_cache, whole_cache
    # The step samples in its own executable, so its argmax is held to the same rule.
    for program in (hlo, runner.programs.sampler().as_text()):
        variadic = [line.strip()[:120] for shape, op, line in _instructions(program)
                    if op == "reduce"
                    and re.fullmatch(r"\(f32\[\d+\]\{0\}, s32\[\d+\]\{0\}\)", shape)]
        assert not variadic, variadic
