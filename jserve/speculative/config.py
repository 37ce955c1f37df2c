"""``speculative_config``: the dict vLLM users write (``LLM(speculative_config={...})``, the
same dict as JSON after ``--speculative-config``), validated once into a frozen config."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "model", "disable_by_batch_size", "min_acceptance_rate", "acceptance_window"}
_UNSUPPORTED = {"eagle", "eagle3", "medusa", "mlp_speculator", "deepseek_mtp", "mtp",
                "suffix"}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: "ngram" (prompt lookup: the continuation of the latest earlier occurrence
    of the last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) or
    "draft_model" (greedy drafts from ``model``, a small jserve-loadable model with the
    target's vocabulary). ``disable_by_batch_size``: no drafts while more requests than
    this are running (vLLM's key). jserve's own keys: a request whose last
    ``acceptance_window`` draft tokens were accepted less than ``min_acceptance_rate`` of
    the time pauses speculating for that many output tokens, doubling with each failing
    window (``Speculator.speculates``)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 16

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict (or its JSON text); ValueError naming the key for anything wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {value!r}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; "
                             f"supported: {sorted(_KEYS)}")
        d: dict[str, Any] = dict(value)
        method = d.get("method")
        if method is None:  # vLLM's older spellings: model="ngram" / "[ngram]", or a model
            model = d.get("model")
            method = "ngram" if model in (None, "ngram", "[ngram]") else "draft_model"
            if model in ("ngram", "[ngram]"):
                d.pop("model")
        if method in _UNSUPPORTED:
            raise ValueError(f"speculative_config: method {method!r} is not supported "
                             f"(supported: {list(METHODS)})")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(METHODS)}, "
                             f"got {method!r}")
        d["method"] = method
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is not None:
            d["prompt_lookup_min"] = min(1, hi) if isinstance(hi, int) else hi
        if hi is None and lo is not None:
            d["prompt_lookup_max"] = lo
        return cls(**d)

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "acceptance_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {v!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative_config: num_speculative_tokens must be <= 16, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min "
                             f"({self.prompt_lookup_min}) > prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' "
                             "(a path or a built-in model name)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an int "
                             f">= 1, got {b!r}")
        r = self.min_acceptance_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ValueError(f"speculative_config: min_acceptance_rate must be in [0, 1], "
                             f"got {r!r}")
