"""What one client may ask of a shared server (docs/server.md, "Limits").

Per-request SLO fields and priorities are requests, not orders: a ``tpot_slo`` below what
this engine can do (the predictor's time of a lone decode step, or the configured floor), a
``ttft_slo`` below the request's isolated prefill time (or the configured floor), and a
``priority`` outside the configured range are refused, naming the field and the bound. A
priority that puts a request ahead of the default (below 0: lower runs first) needs a
trusted client (the priority token, or ``trust_priority``); any client may yield (0 and up).
What is accepted still cannot hold the queue: the scheduler's progress rule
(``DeadlineConfig.prefill_share``) bounds what a ``tpot_slo`` does to other requests.

Both front ends check through ``Gateway.prepare``; nothing here imports gRPC or HTTP code.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jserve.fields import FieldError, check_slos, number

if TYPE_CHECKING:
    from jserve.serving.engine_api import EngineClient


@dataclasses.dataclass(frozen=True)
class ClientLimits:
    """The server's bounds on what a request may carry (flags of ``jserve serve``)."""

    min_tpot_slo: float = 0.01           # seconds; the engine's lone decode step if higher
    min_ttft_slo: float = 0.05           # seconds; the request's isolated prefill if higher
    priority_range: tuple[int, int] = (-10, 10)
    trust_priority: bool = False         # every client may go ahead of the default
    priority_token: str | None = None    # bearer token of clients that may
    max_choices: int = 256               # prompts x n of one HTTP request

    def __post_init__(self) -> None:
        lo, hi = self.priority_range
        if not lo <= 0 <= hi:
            raise ValueError(f"priority_range must contain the default 0, got {lo}..{hi}")
        for name in ("min_tpot_slo", "min_ttft_slo"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_choices < 1:
            raise ValueError(f"max_choices must be >= 1, got {self.max_choices}")
        if self.priority_token is not None and not self.priority_token:
            raise ValueError("priority_token is empty")


class RequestLimits:
    """``ClientLimits`` against one engine: the floors its predictions set (a lone decode
    step, a prompt's isolated prefill: ``EngineClient.info.lone_decode_s`` and
    ``isolated_prefill_s``)."""

    def __init__(self, limits: ClientLimits, engine: EngineClient):
        self.limits = limits
        self.tpot_floor = max(limits.min_tpot_slo, engine.info.lone_decode_s)
        self._isolated = engine.isolated_prefill_s

    def ttft_floor(self, prompt_tokens: int) -> float:
        return max(self.limits.min_ttft_slo, self._isolated(prompt_tokens))

    def check(self, prompt_tokens: int, ttft_slo: float | None, tpot_slo: float | None,
              priority: int, trusted: bool,
              names: tuple[str, str, str] = ("ttft_slo", "tpot_slo", "priority")) -> None:
        """``FieldError`` naming the field (as ``names`` spells it) and the bound it missed."""
        ttft_name, tpot_name, priority_name = names
        check_slos(ttft_slo, tpot_slo, (ttft_name, tpot_name))
        number("priority", priority, priority_name)
        for name, slo, floor in ((ttft_name, ttft_slo, self.ttft_floor(prompt_tokens)),
                                 (tpot_name, tpot_slo, self.tpot_floor)):
            if slo is None:
                continue
            if slo < floor:
                raise FieldError(name, f"{name}={slo:g} s is below this server's floor of "
                                       f"{floor:.4g} s" + (f" for a {prompt_tokens}-token "
                                                           "prompt" if name == ttft_name else ""))
        lo, hi = self.limits.priority_range
        if not lo <= priority <= hi:
            raise FieldError(priority_name, f"{priority_name}={priority} is outside this "
                                            f"server's range [{lo}, {hi}]")
        if priority < 0 and not (trusted or self.limits.trust_priority):
            raise FieldError(priority_name, f"{priority_name}={priority} would run ahead of "
                                            "the default 0; only a client with the priority "
                                            "token may (0 and up: yield)")

    def describe(self) -> str:
        """The start-up line's part."""
        lo, hi = self.limits.priority_range
        who = ("any client" if self.limits.trust_priority else
               "priority-token clients" if self.limits.priority_token else "no client")
        return (f"tpot_slo >= {self.tpot_floor * 1e3:.3g} ms, ttft_slo >= max("
                f"{self.limits.min_ttft_slo * 1e3:.3g} ms, isolated prefill), priority in "
                f"[{lo}, {hi}] (below 0: {who}), prompts x n <= {self.limits.max_choices}")
