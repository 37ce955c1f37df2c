"""Pipeline ticks sized to the batches in flight (``jserve.engine.tick_slots``): a
decode-only spp engine runs decode-sized ticks, not the largest step shape, and mixed
traffic, where a decode batch shares a tick with a prefill batch and is re-padded to it,
gives the one-device engine's tokens.

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

    def run(mesh, warmup):
        eng = LLM("default", mesh=mesh, warmup=warmup, **settings).engine
        warm = eng.compile_count
        result = {"warm": warm, "shapes": [list(s) for s in eng.buckets.all_shapes()]}
        result["decode_only"] = decode_only(eng)
        result["decode_only_executed"] = [[list(s), n] for s, n in eng.runner.executed.items()]
        ticks = []
        if mesh != "tp=1":
            buffers = eng._slots.buffers

            def record(new, in_flight):
                live = [new] + [b.built for b in in_flight if b is not None]
                own = [list((s.original or s).shape) for s in live if s is not None]
                exits = len(in_flight) == 1 and in_flight[0] is not None
                out = buffers(new, in_flight)
                ticks.append({"tick": list(out[0]), "own": own, "exits": exits,
                              "buffers": [list(b.shape) for b in out[1][:2]],
                              "samples": out[1][2]})
                return out

            eng._slots.buffers = record
        result["mixed"] = mixed(eng)
        result["ticks"] = ticks
        result["compiles"] = eng.compile_count
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
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_prefill_seqs": 2,
                "max_model_len": 512}
    return run_on_devices(_SCRIPT, json.dumps(settings), devices=2, timeout=900).result


def test_spp_compiles_every_bucket_shape_once(result):
    """One tick executable per bucket shape plus the sampler at start-up, none after (the
    carry has one shape whatever the tick's)."""
    spp = result["spp"]
    assert spp["warm"] == len(spp["shapes"]) + 1
    assert spp["compiles"] == spp["warm"]


def test_decode_only_pipeline_runs_decode_sized_ticks(result):
    one, spp = result["one"], result["spp"]
    assert spp["decode_only"] == one["decode_only"]
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
    for t in ticks:
        assert all(t["tick"][0] >= d and t["tick"][1] >= p for d, p in t["own"]), t
        assert [b[0] for b in t["buffers"]] == [2, 2], t
        assert t["samples"] == t["exits"], t
    assert any(t["samples"] for t in ticks) and not all(t["samples"] for t in ticks)
    # ... and decode batches were re-padded to a prefill batch's tick.
    assert any(p == 0 and t["tick"][1] > 0 for t in ticks for _, p in t["own"]), ticks
    # Small ticks as well as the largest ones.
    assert len({tuple(t["tick"]) for t in ticks}) >= 3


def test_stages_unroll_their_layers_or_loop_alike(result):
    """The default engine here unrolls each stage's 2 layers (``unstack_stages``);
    ``layer_loop="loop"`` keeps them stacked and must give the same tokens."""
    assert result["spp_loop"]["stacked"]
    assert result["spp_loop"]["mixed"] == result["one"]["mixed"]
