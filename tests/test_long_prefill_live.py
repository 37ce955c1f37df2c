"""A real-length long prefill on the live engine under lars (default model, CPU): a short
request that arrives during a 16K-token prefill gets its first token before that prefill
ends, the long prompt's greedy output is the one it gives alone, and while the long prefill
is alone in the engine it runs whole chunks (``full_chunk_alone``), not budget-cut ones.

Its time goes to running 16K-token prefills, not to compiling, so it runs in a process with
XLA's default code generation (the suite's settings made it 3x slower: tests/devices.py)."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from devices import run_on_devices
from jserve import SamplingParams
from llm_helpers import check_blocks, small_llm

LONG = 16_384
CHUNK = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _drain(eng, first: dict[str, int], outputs: dict[str, list[int]], step: list[int]) -> None:
    """One engine step; notes at which step each request got its first token."""
    for out in eng.step():
        first.setdefault(out.request_id, step[0])
        if out.finished:
            outputs[out.request_id] = out.token_ids
    check_blocks(eng)
    step[0] += 1


@pytest.mark.slow
def test_a_short_request_gets_its_first_token_inside_a_16k_prefill_under_lars():
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        import test_long_prefill_live as t
        t.short_request_inside_a_long_prefill()
        print("{}")
    """)
    run_on_devices(script, devices=1, suite_flags=False)


def short_request_inside_a_long_prefill() -> None:
    """The test's body (asserts)."""
    rng = np.random.default_rng(3)
    long_prompt = rng.integers(0, 256, LONG).tolist()
    short_prompt = rng.integers(0, 256, 24).tolist()
    # Prefix caching off: the second, lone run of the long prompt must compute it again.
    llm = small_llm(scheduler="lars", max_model_len=LONG + 64, max_num_batched_tokens=CHUNK,
                    enable_prefix_caching=False)
    eng = llm.engine
    eng.step_log = []
    first: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    step = [0]
    eng.add_request(long_prompt, GREEDY, request_id="long")
    for _ in range(3):
        _drain(eng, first, outputs, step)
    # Alone, the long prefill ran whole chunks, not ones cut to the 50 ms budget.
    # (The step log trails by the step in flight under async scheduling.)
    alone = [[c.num_tokens for c in p.prefills] for p, _ in eng.step_log]
    assert len(alone) >= 2 and alone == [[CHUNK]] * len(alone)
    eng.add_request(short_prompt, GREEDY, request_id="short")
    while eng.has_unfinished():
        _drain(eng, first, outputs, step)
    assert first["short"] < first["long"]  # served inside the long prefill
    long_steps = [p for p, _ in eng.step_log
                  if any(c.request_id == "long" for c in p.prefills)]
    assert sum(c.num_tokens for p in long_steps for c in p.prefills
               if c.request_id == "long") == LONG
    # The long prompt alone gives the same greedy tokens.
    eng.add_request(long_prompt, GREEDY, request_id="alone")
    while eng.has_unfinished():
        _drain(eng, first, outputs, step)
    assert outputs["long"] == outputs["alone"]
    assert len(outputs["short"]) == GREEDY.max_tokens
    assert eng.allocator.num_allocated == 0
