"""Structured output: a request's text held to a JSON schema, a regex, a choice of strings or
a Lark grammar, by masking the tokens that cannot continue it (docs/structured_output.md).

The grammar engine is llguidance (imported on first use): this module only says what the
constraint is (``StructuredOutput``, part of ``SamplingParams``), compiles it once per distinct
grammar for a tokenizer (``GrammarCompiler``, a cache) and follows one request through it
(``Constraint``: the allowed-token bitmask for its next token, then the token it got). The
mask is applied on the device by the sampler (``SamplingBatch.allowed``). No JAX here.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import re
import threading
from typing import Any

import numpy as np

from jserve.fields import FieldError

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
# How a thinking block may come before a constrained output (``StructuredOutput.think``):
# "open" the output starts inside one (the prompt opened it), "first" it starts with one (its
# opening tag optional: DeepSeek-R1), "optional" it may start with one (Qwen3). The block's
# text is free; the constraint holds from the end tag on.
THINK_MODES = ("open", "first", "optional")
THINK_START, THINK_END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True, eq=False)
class StructuredOutput:
    """Exactly one of: ``json`` (a JSON schema as a dict, or True for any JSON object),
    ``regex`` (the whole output matches it), ``choice`` (the output is one of the strings),
    ``grammar`` (a Lark grammar, llguidance's dialect; its ``start`` rule is the output).
    ``think`` (``THINK_MODES``, the server's reasoning parser sets it): the output may reason
    between ``<think>`` and ``</think>`` first, and only what follows is held to the
    constraint (None: all of it)."""

    json: dict | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    think: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise FieldError("structured_output", f"structured_output must set exactly one of "
                             f"{STRUCTURED_KINDS}, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not (isinstance(value, dict) or value is True):
            raise FieldError("structured_output.json", f"structured_output.json must be a JSON "
                             f"schema object or true, got {value!r}")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise FieldError(f"structured_output.{kind}",
                             f"structured_output.{kind} must be a non-empty string")
        if kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
                    or not all(isinstance(c, str) and c for c in value):
                raise FieldError("structured_output.choice", "structured_output.choice must be a "
                                 "non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(value))
        if self.think is not None and self.think not in THINK_MODES:
            raise FieldError("structured_output.think", f"structured_output.think must be one "
                             f"of {THINK_MODES} or None, got {self.think!r}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)

    def grammar_text(self, tokenizer=None) -> str:
        """The llguidance grammar (a JSON document naming its grammars): also the cache key.
        With ``think``, the constraint's grammar follows a free block, whose tags are tokens
        of ``tokenizer`` where it has them as one (``lark_literal``)."""
        if self.think is None:
            return self._constraint_text()
        inner = self._constraint_text()
        try:
            grammars = json.loads(inner)["grammars"]
        except ValueError:  # a bare Lark grammar
            grammars = [{"lark_grammar": inner}]
        start, end = (lark_literal(tokenizer, t) for t in (THINK_START, THINK_END))
        closed, thought = text_until(end)
        block = {"open": closed, "first": f"{start}? {closed}",
                 "optional": f"({start} {closed})?"}[self.think]
        # A newline or two may follow the end tag, as thinking models write it.
        head = (f"start: thinking @answer\nthinking: {block} GAP\n{thought}\n"
                f"GAP: /\\n{{0,2}}/\n")
        return json.dumps({"grammars": [{"lark_grammar": head},
                                        dict(grammars[0], name="answer"), *grammars[1:]]})

    def _constraint_text(self) -> str:
        from llguidance import LLMatcher
        if self.json is not None:
            schema = {"type": "object"} if self.json is True else ascii_schema(self.json)
            # Compact JSON (no free whitespace between tokens, as xgrammar's default): a
            # model cannot pad its output with whitespace until max_tokens.
            return LLMatcher.grammar_from_json_schema(json.dumps(schema, sort_keys=True),
                                                      defaults={"whitespace_flexible": False})
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(ascii_regex(self.regex, "regex"))
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})"
                                                         for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


# ECMAScript (the dialect of JSON Schema's ``pattern``) and vLLM's grammar engines read
# \d, \w and \s as ASCII classes; llguidance's regexes are Rust's, where they are Unicode
# classes (\d matches '੬', \s matches U+00A0). The letters of llguidance's ``regex_to_lark``
# ``use_ascii`` argument: all three.
ASCII_CLASSES = "dws"

# Where a JSON schema holds subschemas: one schema, a list of them, a map of them.
_SUBSCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "not", "if",
              "then", "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas", "dependencies")


def ascii_regex(pattern: str, kind: str = "regex") -> str:
    """``pattern`` with ``\\d \\w \\s`` (and ``\\D \\W \\S``) spelled as the ASCII classes
    ``[0-9]``, ``[0-9a-zA-Z_]``, ``[ \\t\\n\\r\\f\\v]``, as ECMAScript and vLLM read them. The
    rewrite is llguidance's own ``regex_to_lark``: it reads escapes left to right, so an
    escaped backslash stays one (``\\\\d`` is a backslash and a ``d``), and inside a character
    class the class nests (``[\\d_]`` becomes ``[[0-9]_]``, a union in Rust's syntax). It
    would drop a trailing lone backslash (an invalid pattern), so that is refused here."""
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        raise FieldError(f"structured_output.{kind}", f"structured_output.{kind} is not a valid "
                         f"constraint: the pattern {pattern!r} ends with a lone backslash")
    from llguidance import regex_to_lark
    return regex_to_lark(pattern, ASCII_CLASSES)


def ascii_schema(schema: Any) -> Any:
    """A copy of the JSON schema with every ``pattern`` and ``patternProperties`` key put
    through ``ascii_regex``; only schema positions are walked (``const``, ``enum``,
    ``default`` and ``examples`` are data, left alone). llguidance reads \\d and \\w in a
    schema as ASCII itself but \\s as Unicode; this makes all three ASCII."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ascii_regex(out["pattern"], "json")
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), list):  # draft 4's tuple ``items``
            out[key] = [ascii_schema(s) for s in out[key]]
        elif key in out:
            out[key] = ascii_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [ascii_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {(ascii_regex(name, "json") if key == "patternProperties" else name):
                        ascii_schema(sub) for name, sub in out[key].items()}
    return out


class GrammarCompiler:
    """Compiled grammars for one tokenizer, by grammar text (LRU, ``capacity`` entries):
    ``start`` returns a fresh matcher per request, copied from the cached one, so each
    distinct constraint compiles once. Thread-safe (requests are prepared on intake threads).
    ``compiles`` counts real compilations, ``hits`` cache hits."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...],
                 capacity: int = 256):
        self.vocab_size = vocab_size  # the model's: mask rows are this wide
        self.capacity = capacity
        self.compiles = self.hits = 0
        self._tokenizer = tokenizer
        self._eos = eos_ids
        self._ll = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _lltokenizer(self):
        if self._ll is None:
            self._ll = llguidance_tokenizer(self._tokenizer, self._eos)
        return self._ll

    def check(self, so: StructuredOutput) -> None:
        """Compiles ``so`` into the cache (or finds it there: a hit); ValueError (naming
        ``structured_output``) if the grammar is invalid. What ``prepare`` calls."""
        self._template(so, count=True)

    def start(self, so: StructuredOutput) -> Constraint:
        """A new ``Constraint`` at the start of ``so``, copied from the cache (not counted: the
        request was ``check``ed; compiled again only if evicted since)."""
        return self._constraint(self._template(so, count=False))

    def compile(self, so: StructuredOutput) -> Constraint:
        """``check`` and ``start`` in one look-up."""
        return self._constraint(self._template(so, count=True))

    def _constraint(self, template) -> Constraint:
        return Constraint(template.deep_copy(), self.vocab_size, self._ll,
                          _special_ids(self._ll))

    def _template(self, so: StructuredOutput, count: bool):
        from llguidance import LLMatcher
        text = so.grammar_text(self._tokenizer)
        with self._lock:
            template = self._cache.get(text)
            if template is not None:
                self._cache.move_to_end(text)
                self.hits += count
                return template
            ll = self._lltokenizer()
            error = LLMatcher.validate_grammar(text, ll)
            if error:
                raise FieldError(f"structured_output.{so.kind}",
                                 f"structured_output.{so.kind} is not a valid constraint: "
                                 + " ".join(line.strip() for line in error.splitlines()[:3]))
            template = LLMatcher(ll, text)
            if template.is_error():
                raise FieldError(f"structured_output.{so.kind}",
                                 f"structured_output.{so.kind} is not a valid constraint: "
                                 f"{template.get_error()}")
            self.compiles += 1
            self._cache[text] = template
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return template


class Constraint:
    """One request's place in its grammar."""

    def __init__(self, matcher, vocab_size: int, ll, specials: np.ndarray):
        self._matcher, self._ll, self._specials = matcher, ll, specials
        self._words = (vocab_size + 31) // 32  # the model's mask width
        self._buf = np.zeros((1, (ll.vocab_size + 31) // 32), np.int32)  # llguidance's

    def mask(self) -> np.ndarray:
        """int32[words]: bit j of word i allows token 32 i + j next (tokens the tokenizer
        does not have, past its vocabulary, never are)."""
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self._matcher, self._buf, 0)
        row = np.zeros(self._words, np.int32)
        n = min(self._words, self._buf.shape[1])
        row[:n] = self._buf[0, :n]
        return self._without_refused_specials(row)

    def _without_refused_specials(self, row: np.ndarray) -> np.ndarray:
        """``row`` with no special token the matcher would refuse. Where a grammar forces
        bytes that spell a special token's text (a regex ``<\\|end\\|>``), llguidance's mask
        offers that token alone and ``consume_token`` then refuses it (the request would end
        at it); the token of the bytes' first character is offered instead."""
        ids = self._specials[self._specials < 32 * len(row)]
        allowed = ids[(row[ids // 32] >> (ids % 32)) & 1 == 1]
        refused = [int(t) for t in allowed if not self._matcher.validate_tokens([int(t)])]
        if not refused:
            return row
        bits = row.view(np.uint32)
        for t in refused:
            bits[t // 32] &= ~np.uint32(1 << (t % 32))
        if not bits.any():
            # the forced text's first character alone (llguidance's tokenizer reads a
            # special token's text as the token, even asked not to parse specials)
            forced = self._matcher.compute_ff_bytes().decode("utf-8", errors="ignore")
            first = self._ll.tokenize_str(forced[:1])[:1]
            if first and first[0] < 32 * len(row) and self._matcher.validate_tokens(first):
                bits[first[0] // 32] |= np.uint32(1 << (first[0] % 32))
        return row

    def advance(self, token: int) -> bool:
        """Consumes the sampled token; False if the grammar rejects it."""
        return bool(self._matcher.consume_token(token)) and not self._matcher.is_error()

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more (only end-of-sequence)."""
        return self._matcher.is_stopped()


@functools.lru_cache(maxsize=8)
def _special_ids(ll) -> np.ndarray:
    """The special tokens of llguidance's tokenizer but its end-of-sequence ones (which end a
    complete output: the matcher's own rule, whatever ``validate_tokens`` says once it has
    stopped), ascending."""
    eos = set(ll.eos_tokens)
    return np.asarray([t for t in range(ll.vocab_size)
                       if ll.is_special_token(t) and t not in eos], np.int64)


def llguidance_tokenizer(tokenizer, eos_ids: tuple[int, ...]):
    """llguidance's view of a jserve tokenizer: an HF one from its own tokenizer.json (its
    vocabulary, merges, byte-level or byte-fallback decoding and special tokens; what
    ``llguidance.hf.from_tokenizer`` hands over, without transformers), the byte tokenizer
    from its 259 tokens. ``eos_ids`` (the engine's: the checkpoint's config and tokenizer
    together) are the tokens a complete output may end with; all of them, not only the
    first (Llama 3 instruct stops on <|eot_id|> and <|end_of_text|>)."""
    import llguidance
    # An id past the tokenizer's vocabulary (a config's, on a padded embedding) is never
    # allowed anyway, and llguidance refuses it.
    eos = [i for i in eos_ids if 0 <= i < tokenizer.vocab_size] or None
    text = hf_tokenizer_json(tokenizer)
    if text is not None:
        return llguidance.LLTokenizer(text, eos_token=eos)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_ByteTokens(tokenizer, eos[0] if eos else None)),
        eos_token=eos)


def text_until(end: str) -> tuple[str, str]:
    """(the Lark term for free text closed by ``end``, the rule it needs), ``end`` a
    ``lark_literal``: quoted text ends a lazy rule; a special token ends a terminal, since no
    text lexeme can cross a token of the vocabulary."""
    if end.startswith('"'):
        return "thought", f"thought[stop={end}]: /(?s:.*)/"
    return f"THOUGHT {end}", "THOUGHT: /(?s:.*)/"


def lark_literal(tokenizer, text: str) -> str:
    """``text`` as a term of a Lark grammar for ``tokenizer``: ``<tool_call>`` (a special
    token's name) when llguidance reads ``text`` as one special token, else the quoted text.
    llguidance takes every added token written ``<...>`` for a special one (Qwen's
    ``<tool_call>``, though tokenizer.json says it is not), and a quoted literal, matched on
    bytes, never matches a special token. None: the quoted text."""
    if tokenizer is not None and text.startswith("<") and text.endswith(">"):
        ll = _lark_tokenizer(tokenizer)
        ids = ll.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and ll.is_special_token(ids[0]):
            return text
    return json.dumps(text)


@functools.lru_cache(maxsize=8)
def _lark_tokenizer(tokenizer):
    return llguidance_tokenizer(tokenizer, tuple(tokenizer.eos_token_ids))


def hf_tokenizer_json(tokenizer) -> str | None:
    """The tokenizer.json text of an HF tokenizer (None for any other), padding and
    truncation off, as llguidance must tokenize whole strings."""
    from jserve.tokenizer import HFTokenizer
    text = getattr(tokenizer, "tokenizer_json", None)
    if text is None and isinstance(tokenizer, HFTokenizer):
        text = tokenizer._tok.to_str()  # the loaded tokenizers.Tokenizer, added tokens included
    if text is None:
        return None
    doc = json.loads(text)
    doc["padding"] = doc["truncation"] = None
    return json.dumps(doc)


class _ByteTokens:
    """The byte tokenizer as llguidance's ``TokenizerWrapper`` reads one."""

    def __init__(self, tokenizer, eos: int | None):
        self._tok = tokenizer
        self.eos_token_id = eos if eos is not None else tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        n = tokenizer.vocab_size
        specials = [i for i in range(256, n)]
        self.special_token_ids = specials
        self.tokens = [bytes([i]) for i in range(256)] + [
            tokenizer.decode([i], skip_special_tokens=False).encode() for i in specials]

    def __call__(self, s) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_special_tokens=False)
