"""``StopText``: the one rule for stop tokens and stop strings, on constructed cases (the
engine's output processing and the fake engine both end requests through it)."""
from __future__ import annotations

from jserve.engine.requests.output import StopText
from jserve.sampling.params import SamplingParams
from jserve.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
EOS = (ByteTokenizer.EOS,)


def feed(text_or_ids, **params) -> tuple[StopText, int | None]:
    """Feeds tokens until one ends the output: the state and how many were taken (None:
    none ended it)."""
    ids = TOK.encode(text_or_ids, False) if isinstance(text_or_ids, str) else text_or_ids
    out = StopText(TOK, SamplingParams(**params), EOS)
    for i, t in enumerate(ids):
        if out.add(t):
            return out, i + 1
    out.finish()
    return out, None


def test_a_stop_string_cuts_the_text_where_it_starts_at_the_token_that_completes_it():
    out, n = feed("hello world. more", stop=["o w", "more"])
    assert n == len("hello w")  # the 'w' completes "o w"
    assert out.text == "hell"
    assert out.stop_reason == "o w"


def test_the_earliest_stop_string_wins_when_one_token_completes_two():
    out, n = feed([*TOK.encode("abc", False)], stop=["bc", "abc"])
    assert n == 3 and out.text == "" and out.stop_reason == "abc"


def test_a_stop_string_split_over_multibyte_tokens_is_found_once_the_character_completes():
    text = "x→y"  # the arrow is three byte tokens: no text until its last one
    out, n = feed(text, stop=["→"])
    assert n == 4 and out.text == "x" and out.stop_reason == "→"


def test_a_stop_token_ends_it_and_its_text_is_not_output():
    ids = [*TOK.encode("ab", False), ord("Z"), ord("c")]
    out, n = feed(ids, stop_token_ids=[ord("Z")])
    assert n == 3 and out.text == "ab" and out.stop_reason == ord("Z")


def test_eos_ends_it_unless_ignored():
    ids = [*TOK.encode("ab", False), ByteTokenizer.EOS, ord("c")]
    out, n = feed(ids)
    assert n == 3 and out.text == "ab" and out.stop_reason is None
    out, n = feed(ids, ignore_eos=True)
    assert n is None and out.text == "abc"


def test_no_stop_before_min_tokens():
    # the stop string completes at token 2 and EOS comes at token 3: min_tokens=4 passes
    # both, and the string found again later (token 6) ends it then
    ids = [ord("s"), ord("t"), ByteTokenizer.EOS, ord("x"), ord("s"), ord("t"), ord("y")]
    out, n = feed(ids, stop=["st"], min_tokens=4)
    assert n == 6
    assert out.stop_reason == "st"
    assert out.text == "stx"  # (the passed EOS is special: no text)
    out, n = feed(ids, stop=["st"], min_tokens=2)
    assert n == 2 and out.text == ""
