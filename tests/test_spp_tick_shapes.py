"""Pipeline ticks sized to the batches in flight (``jserve.engine.batch.tick_slots``): a
decode-only spp engine runs decode-sized ticks, not the largest step shape, and mixed
traffic, where a decode batch shares a tick with a prefill batch and is re-padded to it,
gives the one-device engine's tokens. A batch alone in an empty pipeline passes every stage
in one step (``sharding.pipeline.lone_pass``), and traffic that switches between passes and
ticks gives the one-device tokens too, with async scheduling on and off.

The spp=2 engine runs in a subprocess with 2 forced host devices (tests/devices.py)."""
from __future__ import annotations

import json
import textwrap

import pytest

from devices import run_on_devices

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent("""
    import json, sys
    from jserve import LLM, SamplingParams
    settings = json.loads(sys.argv[1])
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=5, ignore_eos=True)
    penalised = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.5, frequency_penalty=0.7)
    late = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    SHORT = [[5, 6, 7, 8], [9, 10, 11, 12]]
    LONG = [list(range(20, 90)), list(range(100, 145))]  # 70 and 45 tokens: several chunks

    def drain(eng, done):
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids

    def decode_only(eng):
        # Two prompts of one length prefill in one batch, then decode in lockstep.
        done = {}
        ids = [eng.add_request(p, greedy) for p in SHORT]
        drain(eng, done)
        return [done[i] for i in ids]

    def mixed(eng):
        # Two requests are decoding when two long prompts arrive; their chunks share the
        # pipeline with decode batches.
        done = {}
        ids = [eng.add_request(SHORT[0], seeded), eng.add_request(SHORT[1], penalised)]
        for _ in range(4):
            eng.step()
        ids += [eng.add_request(LONG[0], greedy), eng.add_request(LONG[1], greedy)]
        drain(eng, done)
        return [done[i] for i in ids]

    def lone(eng):
        # One request alone: every batch (its prefill, then each decode) is a pass.
        steps, done = 0, {}
        rid = eng.add_request(SHORT[0], greedy)
        while eng.has_unfinished():
            steps += 1
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        return {"tokens": done[rid], "steps": steps}

    def switching(eng):
        # A request decodes alone (passes), a long prompt arrives (ticks: its chunks and the
        # decodes fill the pipeline), more requests arrive, and the last ones decode alone
        # again (passes).
        done = {}
        eng.pipeline_log = []
        ids = [eng.add_request(SHORT[0], seeded)]
        for _ in range(3):
            eng.step()
        ids.append(eng.add_request(LONG[0], greedy))
        for _ in range(3):
            eng.step()
        ids += [eng.add_request(SHORT[1], penalised), eng.add_request(LONG[1], greedy),
                eng.add_request([7, 8, 9], late)]
        drain(eng, done)
        kinds = ["pass" if t.get("lone") else "tick" for t in eng.pipeline_log]
        eng.pipeline_log = None
        return {"tokens": [done[i] for i in ids], "kinds": kinds}

    def counts(eng, before=None):
        now = {"ticks": sum(eng.runner.executed.values()),
               "passes": sum(getattr(eng.runner, "passed", {}).values())}
        return now if before is None else {k: now[k] - before[k] for k in now}

    def run(mesh, warmup):
        eng = LLM("default", mesh=mesh, warmup=warmup, **settings).engine
        warm = eng.compile_count
        result = {"warm": warm, "shapes": [list(s) for s in eng.buckets.all_shapes()]}
        result["decode_only"] = decode_only(eng)
        result["decode_only_passed"] = [[list(s), n] for s, n in
                                        getattr(eng.runner, "passed", {}).items()]
        result["decode_only_ticked"] = [[list(s), n] for s, n in eng.runner.executed.items()]
        pipelined = mesh != "tp=1"
        if pipelined:  # the same traffic as ticks only
            eng._in_flight.lone_passes = False
            before = dict(eng.runner.executed)
            result["decode_only_ticks"] = decode_only(eng)
            result["decode_only_executed"] = [[list(s), n - before.get(s, 0)]
                                              for s, n in eng.runner.executed.items()
                                              if n > before.get(s, 0)]
            eng._in_flight.lone_passes = True
        for mode in (True, False):
            eng.async_scheduling = mode
            before = counts(eng)
            result[f"lone_{mode}"] = {**lone(eng), **counts(eng, before)}
            result[f"switching_{mode}"] = switching(eng)
        eng.async_scheduling = True
        ticks = []
        if pipelined:
            buffers = eng._slots.buffers

            def record(new, in_flight, lone=False):
                live = [new] + [b.built for b in in_flight if b is not None]
                own = [list((s.original or s).shape) for s in live if s is not None]
                exits = len(in_flight) == 1 and in_flight[0] is not None
                out = buffers(new, in_flight, lone)
                ticks.append({"tick": list(out[0]), "own": own, "exits": exits, "lone": lone,
                              "buffers": [list(b.shape) for b in out[1][:2]],
                              "masks": out[1][2], "launch": out[2].name,
                              "samples": out[2].name != "NO_EXIT"})
                return out

            eng._slots.buffers = record
        result["mixed"] = mixed(eng)
        result["ticks"] = ticks
        result["compiles"] = eng.compile_count
        if pipelined:
            result["pass_shapes"] = [list(s) for s in eng.runner.programs.passes]
        return result

    def looped():
        # Deeper stages keep the loop over stacked weights: same tokens.
        eng = LLM("default", mesh="spp=2", warmup=False, layer_loop="loop", **settings).engine
        return {"stacked": isinstance(eng.runner.params["layers"], dict), "mixed": mixed(eng)}

    print(json.dumps({"one": run("tp=1", False), "spp": run("spp=2", True),
                      "spp_loop": looped()}))
""")


@pytest.fixture(scope="module")
def result():
    # The traffic repeats its prompts: the tick shapes asserted here are those of whole
    # prefills, so the prefix cache is off (spp with the cache: test_prefix_cache_engine).
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_prefill_seqs": 2,
                "max_model_len": 512, "enable_prefix_caching": False}
    return run_on_devices(_SCRIPT, json.dumps(settings), devices=2, timeout=900).result


def test_spp_compiles_every_bucket_shape_once(result):
    """At start-up one tick executable and one pass executable per bucket shape (a batch
    alone in the pipeline passes every stage in one step) and the sampler; nothing compiles
    after (the carry has one shape whatever the tick's)."""
    spp = result["spp"]
    decode_only = [s for s in spp["shapes"] if s[1] == 0]
    assert decode_only and len(decode_only) < len(spp["shapes"])
    assert spp["warm"] == 2 * len(spp["shapes"]) + 1
    passes = spp["pass_shapes"]
    assert sorted(map(tuple, passes)) == sorted(map(tuple, spp["shapes"]))
    assert spp["compiles"] == spp["warm"]


def test_lone_decode_takes_one_step_per_token(result):
    """A request alone under spp=2: its prefill and every decode are passes (no tick), one
    engine step per token (plus the step that reads the last one under async scheduling),
    and its tokens are the one-device engine's."""
    one, spp = result["one"], result["spp"]
    for mode in ("True", "False"):
        run = spp[f"lone_{mode}"]
        assert run["tokens"] == one[f"lone_{mode}"]["tokens"]
        assert len(run["tokens"]) == 8
        assert (run["ticks"], run["passes"]) == (0, 8), run
        assert run["steps"] == one[f"lone_{mode}"]["steps"] == 8 + (mode == "True"), run


def test_decode_only_batch_alone_passes(result):
    """Two requests prefilling and decoding together form one batch at a time: passes
    only, at decode-sized shapes after the prefill."""
    one, spp = result["one"], result["spp"]
    assert spp["decode_only"] == one["decode_only"]
    assert {tuple(s): n for s, n in spp["decode_only_passed"]} == {(0, 16): 1, (2, 0): 7}
    assert not spp["decode_only_ticked"]


def test_switching_between_passes_and_ticks_matches_one_device(result):
    """A request decoding alone (passes), a long prompt arriving (ticks while chunks and
    decodes fill the pipeline), more requests, and the last one alone again (passes):
    seeded, penalised and greedy tokens identical to one device, async scheduling on and
    off."""
    one, spp = result["one"], result["spp"]
    for mode in ("True", "False"):
        run = spp[f"switching_{mode}"]
        assert run["tokens"] == one[f"switching_{mode}"]["tokens"]
        assert [len(t) for t in run["tokens"]] == [8, 8, 8, 8, 24]
        kinds = "".join(k[0] for k in run["kinds"])
        assert kinds.startswith("ppp"), kinds
        assert "pt" in kinds and "tp" in kinds and kinds.endswith("p"), kinds
    assert spp["switching_True"]["tokens"] == spp["switching_False"]["tokens"]


def test_decode_only_pipeline_runs_decode_sized_ticks(result):
    """With passes off (``InFlight.lone_passes``) the same traffic ticks, at decode
    size."""
    one, spp = result["one"], result["spp"]
    assert spp["decode_only_ticks"] == one["decode_only"]
    assert all(len(t) == 8 for t in spp["decode_only"])
    executed = {tuple(s): n for s, n in spp["decode_only_executed"]}
    largest = max(map(tuple, spp["shapes"]), key=sum)
    # The prefill batch's tick twice (entering, then leaving the last stage), then 7 decode
    # batches of 2 rows, each over 2 ticks; never the largest shape.
    assert executed == {(0, 16): 2, (2, 0): 14}, executed
    assert largest not in executed


def test_mixed_traffic_matches_one_device(result):
    one, spp = result["one"], result["spp"]
    assert spp["mixed"] == one["mixed"]
    assert all(len(t) == 8 for t in spp["mixed"])
    ticks = spp["ticks"]
    # Every tick covers every batch it runs, sends one buffer row per stage, and samples
    # exactly when a batch leaves the last stage ...
    # (and a pass: one batch's buffers at its own shape, which samples) ...
    passes = [t for t in ticks if t["lone"]]
    assert passes and all(t["samples"] and len(t["own"]) == 1 and t["tick"] == t["own"][0]
                          and len(t["buffers"][0]) == 1 and t["launch"] == "PASS"
                          for t in passes), passes
    ticks = [t for t in ticks if not t["lone"]]
    for t in ticks:
        assert all(t["tick"][0] >= d and t["tick"][1] >= p for d, p in t["own"]), t
        assert [b[0] for b in t["buffers"]] == [2, 2], t
        assert t["samples"] == t["exits"] and t["launch"] in ("STEP", "NO_EXIT"), t
    assert any(t["samples"] for t in ticks) and not all(t["samples"] for t in ticks)
    # No request has structured output: no tick or pass sends a bitmask.
    assert all(t["masks"] is None for t in spp["ticks"])
    # ... and decode batches were re-padded to a prefill batch's tick.
    assert any(p == 0 and t["tick"][1] > 0 for t in ticks for _, p in t["own"]), ticks
    # Small ticks as well as the largest ones.
    assert len({tuple(t["tick"]) for t in ticks}) >= 3


def test_stages_unroll_their_layers_or_loop_alike(result):
    """The default engine here unrolls each stage's 2 layers (``unstack_stages``);
    ``layer_loop="loop"`` keeps them stacked and must give the same tokens."""
    assert result["spp_loop"]["stacked"]
    assert result["spp_loop"]["mixed"] == result["one"]["mixed"]
