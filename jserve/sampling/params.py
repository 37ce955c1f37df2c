"""Per-request sampling parameters (vLLM-like) and their validation.

Everything a client can send is checked here, on the host, so that the device-side sampler
never has to deal with out-of-range values and every rejection names the offending field.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from jserve.fields import MAX_INT, MAX_TOKEN_LOGPROBS, FieldError, number
from jserve.sampling.structured import StructuredOutput

# Size limits keep the device-side arrays fixed-shape (no recompiles per request).
MAX_LOGPROBS = MAX_TOKEN_LOGPROBS
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 16
# stop ids + eos ids that are masked while ``min_tokens`` has not been reached.
MAX_BANNED_IDS = 32
# logit_bias entries per request: OpenAI's own cap, and the width of the sampler's sparse
# per-row bias arrays (ids and values, [rows, MAX_LOGIT_BIAS], sent only as part of a step).
MAX_LOGIT_BIAS = 300

# The numeric fields, checked against jserve.fields.NUMBERS (type, finiteness, range).
_NUMERIC = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs",
            "prompt_logprobs")
_UNSET_OK = ("seed", "logprobs", "prompt_logprobs")  # numeric fields that may be None


def _as_tuple(name: str, value: object) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise FieldError(name, f"{name} must be a list, got {value!r}")
    return tuple(value)


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request's completion.

    ``stop`` and ``stop_token_ids`` are normalised to tuples (empty when not given) so that
    consumers never have to handle ``None`` / a bare string.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: chosen token only; n: chosen + top-n
    # Each prompt token's logprob given the tokens before it (vLLM's ``prompt_logprobs``;
    # None: none; 0: the token's own; n: + the top n). With it ``max_tokens`` may be 0: the
    # request is scored, nothing generated (lm-eval's loglikelihood, ``echo``).
    prompt_logprobs: int | None = None
    # A JSON schema, regex, choice or grammar the output must follow (None: free text).
    structured_output: StructuredOutput | None = None
    # Speculative decoding, when the engine has a speculative_config: False opts this
    # request out (it decodes one token a step).
    speculative: bool = True
    # Sequences per prompt (``LLM.generate``; the engine runs one per request): ``best_of``
    # are sampled (None: ``n``) and the ``n`` of highest cumulative logprob returned.
    n: int = 1
    best_of: int | None = None
    # Token id -> a bias in [-100, 100] added to its logit before penalties and sampling
    # (OpenAI's ``logit_bias``; logprobs stay the model's own). Keys may be decimal strings.
    logit_bias: Mapping[int, float] | None = None
    # vLLM's ``detokenize``: False leaves the output's text empty (ids only). A front end
    # that makes the text itself (``jserve serve --engine-process``) sends its requests so.
    detokenize: bool = True
    # vLLM's: False keeps special tokens in the text (what gpt-oss's harmony parser reads).
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.stop = _as_tuple("stop", (self.stop,) if isinstance(self.stop, str) else self.stop)
        self.stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _bias_map(self.logit_bias)
        self.validate()

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def beyond_temperature(self) -> bool:
        """Whether choosing a token takes more than greedy or temperature sampling: a filter
        (top-k, top-p, min-p) when sampling, a penalty or a logit bias: the sampling
        executable's whole chain, not the fused step's (a step holding such a sampled row
        is sampled by it, ``batch.builder.StepFlags``; on a CPU such a request takes no
        decode burst, ``burst.may_burst``)."""
        filtered = not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0
                                           or self.min_p > 0.0)
        return filtered or self.uses_penalties or bool(self.logit_bias)

    @property
    def sequences(self) -> int:
        """How many sequences of a prompt run: ``best_of``, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``FieldError`` (a ``ValueError``) naming the field for any invalid value.

        Called without ``vocab_size`` at construction; the engine calls it again with the
        model's vocabulary size to also check token-id ranges.
        """
        for name in _NUMERIC:
            value = getattr(self, name)
            if name == "max_tokens" and value == 0 and type(value) is int:
                if self.prompt_logprobs is None:
                    raise FieldError("max_tokens", "max_tokens must be >= 1 (0 only with "
                                     "prompt_logprobs, or echo over HTTP: a prompt scored, "
                                     "nothing generated), got 0")
                continue
            if value is not None or name not in _UNSET_OK:
                number(name, value)
        if self.min_tokens > self.max_tokens:
            raise FieldError("min_tokens", f"min_tokens must be in [0, max_tokens="
                                           f"{self.max_tokens}], got {self.min_tokens}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise FieldError("top_k",
                             f"top_k must be <= vocab_size={vocab_size}, got {self.top_k}")

        self._validate_stop()
        self._validate_stop_token_ids(vocab_size)
        self._validate_sequences()
        self._validate_logit_bias(vocab_size)

        if not isinstance(self.speculative, bool):
            raise FieldError("speculative",
                             f"speculative must be a bool, got {self.speculative!r}")
        if not isinstance(self.detokenize, bool):
            raise FieldError("detokenize",
                             f"detokenize must be a bool, got {self.detokenize!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise FieldError("skip_special_tokens", f"skip_special_tokens must be a bool, got "
                                                    f"{self.skip_special_tokens!r}")
        if self.stop and not self.detokenize:
            raise FieldError("stop", "stop strings need detokenize=True: they are found in "
                                     "the text")
        if not isinstance(self.ignore_eos, bool):
            raise FieldError("ignore_eos",
                             f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.structured_output is not None and not isinstance(self.structured_output,
                                                                 StructuredOutput):
            raise FieldError("structured_output", f"structured_output must be a "
                             f"StructuredOutput, got {self.structured_output!r}")

    def _validate_stop(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop must have at most {MAX_STOP_STRINGS} strings, "
                                     f"got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise FieldError("stop", f"stop strings must be non-empty str, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise FieldError("stop", f"stop strings must be at most "
                                         f"{MAX_STOP_STRING_CHARS} chars, got {len(s)}")

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise FieldError("stop_token_ids", f"stop_token_ids must have at most "
                             f"{MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            number("stop_token_ids", t)  # an int in the table's range
            if vocab_size is not None and t >= vocab_size:
                raise FieldError("stop_token_ids", f"stop_token_ids must be ints in "
                                                   f"[0, {vocab_size}), got {t!r}")

    def _validate_sequences(self) -> None:
        number("n", self.n)
        if self.best_of is not None:
            number("best_of", self.best_of)
            if self.best_of < self.n:
                raise FieldError("best_of", f"best_of must be >= n ({self.n}), got {self.best_of}")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if self.logit_bias is None:
            return
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"logit_bias must have at most {MAX_LOGIT_BIAS} "
                                           f"entries, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias.items():
            if vocab_size is not None and tok >= vocab_size:
                raise FieldError("logit_bias", f"logit_bias keys must be token ids in "
                                               f"[0, {vocab_size}), got {tok}")
            try:
                number("logit_bias", bias, name=f"logit_bias (token {tok})")
            except FieldError as e:
                raise FieldError("logit_bias", e.message) from None


def _bias_map(value: object) -> dict[int, float] | None:
    """``logit_bias`` as {token id: bias}: keys ints or decimal strings (JSON's object keys),
    values as given (``validate`` checks them); None when empty."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise FieldError("logit_bias", f"logit_bias must be a map of token id to bias, "
                                       f"got {value!r}"[:200])
    if len(value) > MAX_LOGIT_BIAS:  # before converting every key of a huge map
        raise FieldError("logit_bias", f"logit_bias must have at most {MAX_LOGIT_BIAS} "
                                       f"entries, got {len(value)}")
    out = {}
    for key, bias in value.items():
        tok = key if isinstance(key, int) and not isinstance(key, bool) else (
            int(key) if isinstance(key, str) and key.isdecimal() and key.isascii() else None)
        if tok is None or not 0 <= tok <= MAX_INT:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), "
                                           f"got {key!r}"[:200])
        out[tok] = bias
    return out or None
