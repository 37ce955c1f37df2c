"""What a client may send as a number or as nested JSON, checked where it is parsed.

One table (``NUMBERS``) gives every numeric field's type and bounds; ``SamplingParams``, the
HTTP body parser, the gRPC parser and the router endpoints all check through ``number``, so
both front ends and the offline API refuse the same values with the same message, naming the
field, before any arithmetic touches them. Why before: a JSON number may be an integer of any
size, and ``arrival + 10**400`` or ``math.isfinite(10**400)`` raise ``OverflowError``, which is
no ``ValueError``; here an integer is compared with its bounds exactly (Python compares ints
and floats without converting), and only a value already in range becomes a float.

A refusal of one field is a ``FieldError``: it carries the field, so each front end names it
as its wire does (HTTP's ``error.param``, gRPC's ``BadRequest`` detail) without reading the
message.

``loads`` parses client JSON with its nesting bounded (``MAX_JSON_DEPTH``): Python's parser
raises ``RecursionError`` a thousand levels down, and everything that walks a parsed value
(schemas, templates, our own checks) recurses too.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any

MAX_INT = 2**31 - 1
MAX_SECONDS = 1e6            # an SLO of eleven days is as good as none
MAX_JSON_DEPTH = 64          # objects and arrays inside each other, in any client JSON
MAX_TOKEN_LOGPROBS = 20


class FieldError(ValueError):
    """A client's value of ``field`` (a dotted path in ``SamplingParams`` terms, e.g.
    ``structured_output.regex``) refused. The message always starts with the field (it is
    prefixed when the raiser's does not), so a front end renames the field by position."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message if message.startswith(field) else f"{field}: {message}"
        super().__init__(self.message)

    def __reduce__(self):
        # pickled whole (a field error crosses processes: a worker's, a Ray replica's)
        return FieldError, (self.field, self.message)

    @property
    def top(self) -> str:
        """The top-level field (``structured_output`` of ``structured_output.regex``)."""
        return self.field.partition(".")[0]

    def renamed(self, wire: str) -> FieldError:
        """The same refusal with its top-level field called ``wire`` (the caller's name)."""
        rest = self.field[len(self.top):]
        return FieldError(wire + rest, wire + rest + self.message[len(self.field):])


@dataclasses.dataclass(frozen=True)
class Number:
    """An int or a finite real in [lo, hi] (an end left out with ``lo_open``/``hi_open``)."""

    integer: bool
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    unit: str = ""

    def describe(self) -> str:
        kind = "an int" if self.integer else f"a number{' of ' + self.unit if self.unit else ''}"
        lo = f"{'>' if self.lo_open else '>='} {_bound(self.lo)}"
        hi = f"{'<' if self.hi_open else '<='} {_bound(self.hi)}"
        return f"{lo} and {hi} ({kind})"

    def holds(self, v: int | float) -> bool:
        return ((v > self.lo if self.lo_open else v >= self.lo)
                and (v < self.hi if self.hi_open else v <= self.hi))


NUMBERS: dict[str, Number] = {
    # Sampling (SamplingParams; HTTP body fields and gRPC sampling_params of the same name).
    "max_tokens": Number(True, 1, MAX_INT),
    "min_tokens": Number(True, 0, MAX_INT),
    "temperature": Number(False, 0, 1e4),
    "top_k": Number(True, -1, MAX_INT),
    "top_p": Number(False, 0, 1, lo_open=True),
    "min_p": Number(False, 0, 1),
    "repetition_penalty": Number(False, 0, 1e4, lo_open=True),
    "presence_penalty": Number(False, -2, 2),
    "frequency_penalty": Number(False, -2, 2),
    "seed": Number(True, 0, 2**32, hi_open=True),
    "logprobs": Number(True, 0, MAX_TOKEN_LOGPROBS),
    "prompt_logprobs": Number(True, 0, MAX_TOKEN_LOGPROBS),
    "stop_token_ids": Number(True, 0, MAX_INT),     # each; the vocabulary bounds it further
    "logit_bias": Number(False, -100, 100),         # each value (OpenAI's range)
    # Per request (both front ends; the server's limits narrow them further).
    "ttft_slo": Number(False, 0, MAX_SECONDS, lo_open=True, unit="seconds"),
    "tpot_slo": Number(False, 0, MAX_SECONDS, lo_open=True, unit="seconds"),
    "priority": Number(True, -MAX_INT - 1, MAX_INT),
    # Sequences per prompt (SamplingParams and HTTP): n returned of best_of run.
    "n": Number(True, 1, 16),
    "best_of": Number(True, 1, 16),
    # HTTP only.
    "top_logprobs": Number(True, 0, MAX_TOKEN_LOGPROBS),
    "prompt_tokens": Number(True, 1, MAX_INT),      # /v1/route/wait
    "dimensions": Number(True, 1, MAX_INT),         # /v1/embeddings (the model bounds it)
    "top_n": Number(True, 0, MAX_INT),              # /v1/rerank (0: all)
}


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def shown(value: object) -> str:
    """A value for an error message: a 400-digit integer is not echoed whole."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**18:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def number(field: str, value: object, name: str | None = None, rule: str | None = None
           ) -> int | float:
    """``value`` checked against ``NUMBERS[rule or field]``: an int for an int field, a float
    for a real one; ``FieldError`` naming the field (as ``name``, default ``field``) otherwise."""
    spec = NUMBERS[rule or field]
    name = name or field
    ok_type = (isinstance(value, numbers.Integral) if spec.integer
               else isinstance(value, numbers.Real)) and not isinstance(value, bool)
    if (not ok_type or (isinstance(value, float) and not math.isfinite(value))
            or not spec.holds(value)):
        raise FieldError(name, f"{name} must be {spec.describe()}, got {shown(value)}")
    return int(value) if spec.integer else float(value)


def optional_number(field: str, value: object, name: str | None = None) -> int | float | None:
    return None if value is None else number(field, value, name)


def check_slos(ttft_slo: object, tpot_slo: object,
               names: tuple[str, str] = ("ttft_slo", "tpot_slo")) -> None:
    """Per-request SLOs: seconds in the table's bounds, when given."""
    for field, name, slo in zip(("ttft_slo", "tpot_slo"), names, (ttft_slo, tpot_slo)):
        optional_number(field, slo, name)


def depth(value: Any) -> int:
    """How many objects and arrays ``value`` holds inside each other (iteratively)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        todo.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def check_depth(value: Any, what: str) -> None:
    if depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")


def loads(text: str | bytes, what: str) -> Any:
    """Client JSON parsed, nested at most ``MAX_JSON_DEPTH`` levels; ValueError naming
    ``what`` otherwise."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{what} is not JSON: {e}") from None
    check_depth(value, what)
    return value
