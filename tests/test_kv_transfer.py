"""KV pages moved from one engine to another (``jserve.engine.device.kv_transfer``, the engine
half of prefill/decode disaggregation): a prompt prefilled on engine A, its pages exported and
imported into engine B, gives on B exactly A's greedy tokens and logprobs while B computes only
the last page; in f32 and int8 pages, for prompts longer than a prefill chunk, with part of the
prompt already cached on B, and with no room on B (the rest is computed). Pages are conserved
on both engines after every step. Pages of another format are refused with nothing changed."""
from __future__ import annotations

import numpy as np
import pytest

from jserve import SamplingParams, kv_wire
from jserve.engine.device import kv_transfer
from llm_helpers import check_blocks, small_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
rng = np.random.default_rng(5)
# 200 tokens: 12 full pages of 16 and 8; seven prefill chunks of 32 (SMALL's token budget).
PROMPT = rng.integers(0, 256, 200).tolist()
OTHER = rng.integers(0, 256, 90).tolist()


def _run(eng, prompt):
    """(token ids, [(token, logprob, top ids)], cached prompt tokens) of one request, blocks
    checked after every step."""
    rid = eng.add_request(prompt, PARAMS)
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.finished:
                out = o
        check_blocks(eng)
    assert eng.allocator.num_allocated == 0
    lps = [(lp.token_id, round(lp.logprob, 4), [t for t, _ in lp.top]) for lp in out.logprobs]
    return out.token_ids, lps, out.metrics.cached_tokens


def _same(got, want):
    assert got[0] == want[0]
    for (t1, l1, top1), (t2, l2, top2) in zip(got[1], want[1], strict=True):
        assert t1 == t2 and top1 == top2
        np.testing.assert_allclose(l1, l2, atol=2e-4)


def _pool(eng) -> tuple[int, int, int]:
    a = eng.allocator
    return a.num_free, a.num_idle, a.num_allocated


@pytest.fixture(scope="module", params=["auto", "int8"])
def pair(request):
    kw = dict(kv_cache_dtype=request.param)
    return small_llm(**kw).engine, small_llm(**kw).engine


def test_imported_pages_give_the_prefill_engines_tokens(pair):
    a, b = pair
    want = _run(a, PROMPT)
    wire = kv_transfer.export_pages(a, PROMPT)
    new, held = kv_transfer.import_pages(b, PROMPT, wire)
    assert (new, held) == (12, 12)  # every full page but the last token's (199 // 16)
    b.allocator.check()
    assert b.allocator.num_allocated == 0 and b.allocator.num_idle >= 12
    got = _run(b, PROMPT)
    assert got[2] == 12 * 16  # B computed the last 8 tokens only
    _same(got, want)
    # a second import of the same prompt finds every page cached: nothing new
    assert kv_transfer.import_pages(b, PROMPT, wire) == (0, 12)
    b.allocator.check()


def test_pages_partly_cached_on_the_decode_engine_are_kept(pair):
    a, b = pair
    head = OTHER[:40]  # two full pages of OTHER cached on B by a request of its own
    _run(b, head + [1, 2, 3])
    want = _run(a, OTHER)
    new, held = kv_transfer.import_pages(b, OTHER, kv_transfer.export_pages(a, OTHER))
    assert (new, held) == (3, 5)  # 89 // 16 = 5 pages, two already B's
    got = _run(b, OTHER)
    assert got[2] == 5 * 16
    _same(got, want)


def test_pages_evicted_before_the_export_leave_the_leading_ones_sent():
    a = small_llm(num_kv_pages=14).engine  # 13 usable pages: one 200-token request's worth
    b = small_llm().engine
    want = _run(a, PROMPT)
    _run(a, OTHER)  # 7 pages: evicts PROMPT's last seven (a sequence's tail goes first)
    wire = kv_transfer.export_pages(a, PROMPT)
    a.allocator.check()
    assert kv_transfer.import_pages(b, PROMPT, wire) == (6, 6)
    got = _run(b, PROMPT)
    assert got[2] == 6 * 16  # the rest computed on B
    _same(got, want)


def test_a_decode_engine_without_room_imports_what_fits_and_computes_the_rest():
    a = small_llm().engine
    b = small_llm(num_kv_pages=16).engine  # 15 usable pages
    want = _run(a, PROMPT)
    wire = kv_transfer.export_pages(a, PROMPT)
    # a request holding 4 of B's pages while the import runs
    rid = b.add_request(OTHER[:60], SamplingParams(temperature=0.0, max_tokens=40,
                                                   ignore_eos=True))
    while b.allocator.num_allocated < 4:
        b.step()
    free_before = b.allocator.num_free
    new, held = kv_transfer.import_pages(b, PROMPT, wire)
    assert new == held == free_before < 12
    check_blocks(b)
    b.abort(rid)
    b.step()
    got = _run(b, PROMPT)
    assert got[0] == want[0]


def test_pages_of_another_format_are_refused_with_nothing_changed():
    f32, int8 = small_llm().engine, small_llm(kv_cache_dtype="int8").engine
    small_pages = small_llm(page_size=8).engine
    _run(f32, PROMPT)
    wire = kv_transfer.export_pages(f32, PROMPT)
    for eng, bad, why in [
            (int8, wire, "2 KV leaves sent, this engine has 4"),  # values and scales
            (small_pages, wire, "pages of 16 tokens sent to an engine with pages of 8"),
            (f32, wire[:-5], "end early"),
            (f32, wire + b"xx", "bytes after the pages"),
            (f32, b"\x00\x00\x00\x05hello", "not KV pages"),
            (f32, b"", "not KV pages")]:
        before = _pool(eng)
        with pytest.raises(kv_wire.PageFormatError, match=why):
            kv_transfer.import_pages(eng, PROMPT, bad)
        assert _pool(eng) == before
        eng.allocator.check()


def test_engines_that_cannot_move_pages_say_why():
    assert kv_transfer.unsupported(small_llm().engine) is None
    assert kv_transfer.unsupported(small_llm(enable_prefix_caching=False).engine) == \
        "prefix caching is off"
    eng = small_llm().engine
    assert kv_transfer.bytes_per_token(eng) == 4 * 2 * 2 * 64 * 4  # layers x K,V x heads x d
