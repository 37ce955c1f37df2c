"""Prefill/decode disaggregation chosen per request: whether a request's prompt is prefilled
on the engine that will decode it (colocated) or on a prefill-only engine whose KV pages then
move to the decode engine (disaggregated), and on which engines. A pure function of the
request, the engines' reports (``jserve.routing.load``) and the cost of moving KV, like
``jserve.routing.choose``; the live front end and the simulator (``jserve.sim.disagg``) make
the same decision.

Modes: ``never`` colocates every request (the deadline router over the decode engines);
``always`` disaggregates every request while a prefill engine is healthy; ``auto`` decides per
request (``place``'s docstring states the rule).

What disaggregation buys: a prompt prefilled elsewhere takes no share of the decode engine's
iterations (the running decodes' TPOT, and the first tokens of the other requests queued
there), nor its KV pages and sequence slot while it prefills, which for a 1M-token document
is minutes. What it costs: the transfer (the prompt's KV over the engines' links) and the
prefill pool's queue; a short chat's prefill is as cheap on the decode engine as anywhere,
so moving it buys nothing unless the decode engines are backed up.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jserve.routing.load import default_deadline, predicted_ttft
from jserve.routing.policies import ReplicaView, RouteRequest, choose

MODES = ("auto", "always", "never")

# A link of unknown speed: one InfiniBand NDR / HDR-200 NIC per GPU moves 25 GB/s, what a
# DGX A100 / H100 node gives each GPU toward another node (8 x 200 Gb/s HDR). Treating an
# unknown link as free would disaggregate everything, as infinitely slow nothing; a typical
# NIC's rate keeps the decision about the queues.
DEFAULT_BYTES_PER_S = 25e9
# auto: a short prompt that both placements would serve on time is colocated only while the
# decode engine has fewer than this share of its sequence slots taken.
SLOT_PRESSURE = 0.5


@dataclasses.dataclass(frozen=True)
class TransferCost:
    """Seconds to move a prompt's KV pages from a prefill engine to a decode engine:
    ``latency_s`` + tokens x ``bytes_per_token`` / ``bytes_per_s``. With matching meshes each
    GPU sends its own shard over its own link, so give one GPU's share of a token's KV and
    one GPU's link rate. ``bytes_per_s`` <= 0 (unknown): ``DEFAULT_BYTES_PER_S``.
    ``page_size``: the engines' KV page; the decode engine recomputes at most the prompt's
    last page (its tokens past the last full page, or the whole last page when the prompt
    ends on one, since the last token's logits are needed)."""

    bytes_per_token: float
    bytes_per_s: float
    latency_s: float = 0.0
    page_size: int = 16

    def __post_init__(self) -> None:
        if self.bytes_per_token < 0 or self.latency_s < 0 or self.page_size < 1:
            raise ValueError("bytes_per_token and latency_s must be >= 0, page_size >= 1")

    @property
    def rate(self) -> float:
        """Bytes per second used: ``bytes_per_s``, or the default for an unknown link."""
        return self.bytes_per_s if self.bytes_per_s > 0 else DEFAULT_BYTES_PER_S

    def seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_s + tokens * self.bytes_per_token / self.rate

    def tail_tokens(self, prompt_tokens: int) -> int:
        """Prompt tokens the decode engine computes after the import: past the last full
        page that leaves the last token to compute (what its prefix lookup takes)."""
        return prompt_tokens - (prompt_tokens - 1) // self.page_size * self.page_size


@dataclasses.dataclass(frozen=True)
class Placement:
    decode: int                 # index into the decode views: the engine producing tokens
    prefill: int | None         # index into the prefill views; None: colocated on decode
    predicted_ttft_s: float
    reason: str                 # why, in a word or phrase (logs, the decisions endpoint)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


@dataclasses.dataclass(frozen=True)
class _Option:
    decode: int
    prefill: int | None
    ttft: float


def _due(request: RouteRequest, views: Sequence[ReplicaView]) -> float:
    if request.ttft_slo is not None:
        return request.ttft_slo
    return default_deadline(views[0].load.table.remaining(request.prompt_tokens, 0))


def _ttft(v: ReplicaView, request: RouteRequest) -> float:
    return predicted_ttft(v.load, request.prompt_tokens, v.cached_tokens, request.ttft_slo)


def _colocated(request: RouteRequest, decode: Sequence[ReplicaView]) -> _Option:
    k = choose("deadline", request, decode)
    ttft = _ttft(decode[k], request)
    return _Option(k, None, math.inf if decode[k].load.slots_full else ttft)


def _disaggregated(request: RouteRequest, decode: Sequence[ReplicaView],
                   prefill: Sequence[ReplicaView], healthy_prefill: list[int],
                   transfer: TransferCost, due: float) -> _Option:
    """The soonest prefill engine, then the decode engine for the import: among the healthy
    ones with a free sequence slot (all healthy ones when none has), those whose predicted
    tail (the last page and the first token, behind their queue) still meets the deadline
    left, then the fewest outstanding requests, then the least KV in use."""
    p = min(healthy_prefill, key=lambda i: (_ttft(prefill[i], request),
                                            prefill[i].load.outstanding, i))
    ready = _ttft(prefill[p], request) + transfer.seconds(request.prompt_tokens)
    n = request.prompt_tokens
    left = due - ready
    healthy = [i for i, v in enumerate(decode) if v.load.healthy]
    open_ = [i for i in healthy if not decode[i].load.slots_full] or healthy

    def tail(i: int) -> float:
        return predicted_ttft(decode[i].load, n, n - transfer.tail_tokens(n), left)
    d = min(open_, key=lambda i: (tail(i) > left, decode[i].load.outstanding,
                                  decode[i].load.kv_usage, i))
    return _Option(d, p, ready + tail(d) if not decode[d].load.slots_full else math.inf)


def place(mode: str, request: RouteRequest, decode: Sequence[ReplicaView],
          prefill: Sequence[ReplicaView], transfer: TransferCost) -> Placement:
    """Where ``request`` is prefilled and decoded. ``decode``: the engines that decode (role
    decode or both); ``prefill``: the prefill-only engines. Unhealthy views are skipped;
    without a healthy prefill engine the request is colocated; without a healthy decode
    engine, ValueError.

    Colocated: the deadline router's choice among the decode engines, with its predicted
    TTFT. Disaggregated: the prefill engine predicted to finish the prompt soonest (its
    prefix cache and queue counted), plus the transfer, plus the decode engine's remaining
    work for the request (its last page and first token, behind that engine's queue) on the
    decode engine ``_disaggregated`` picks. A decode engine with every sequence slot taken
    starts nothing new until a request finishes: its TTFT counts as late.

    The ``auto`` rule, with both predicted against the request's TTFT deadline:
      - a long prompt (the decode engines' ``long_threshold``, 32K tokens) is disaggregated,
        on time or not: colocated, its prefill would share every iteration of the decode
        engine for its whole length (minutes for a 1M-token document), stretching each to the
        iteration budget, so every decode there runs at that pace and holds its sequence
        slot that much longer. Only when the prefill pool would make it late, colocating
        would not, and the colocated engine runs nothing at all is it colocated;
      - a short prompt: where only one placement is on time, that one ("colocated late" /
        "prefill pool late"); where both are, colocated (its prefill is a few iterations'
        share anywhere; moving it costs the transfer and the prefill pool's queue) unless
        the decode engine has ``SLOT_PRESSURE`` (half) of its sequence slots taken or
        promised, when it goes to the prefill pool ("decode slots scarce": a colocated
        prefill holds a decode slot while it runs and slows the decodes whose turnover frees
        slots); where neither is, wherever the first token is predicted sooner (the prefill
        pool on a tie: its prefill then overlaps the wait for a decode slot).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    healthy_decode = [v for v in decode if v.load.healthy]
    if not healthy_decode:
        raise ValueError("no healthy decode engine to place a request on")
    col = _colocated(request, decode)
    healthy_prefill = [i for i, v in enumerate(prefill) if v.load.healthy]
    if mode == "never" or not healthy_prefill:
        why = "never disaggregate" if mode == "never" else "no prefill engine"
        return Placement(col.decode, None, col.ttft, why)
    due = _due(request, healthy_decode)
    dis = _disaggregated(request, decode, prefill, healthy_prefill, transfer, due)
    if mode == "always":
        return Placement(dis.decode, dis.prefill, dis.ttft, "always disaggregate")
    choice, why = _auto(request, healthy_decode[0], decode[col.decode], col, dis, due)
    return Placement(choice.decode, choice.prefill, choice.ttft, why)


def _slots_used(load) -> float:
    """Share of the engine's sequence slots taken or promised (0: slots unknown)."""
    return load.outstanding / load.max_num_seqs if load.max_num_seqs > 0 else 0.0


def _auto(request: RouteRequest, first: ReplicaView, here: ReplicaView, col: _Option,
          dis: _Option, due: float) -> tuple[_Option, str]:
    long = request.prompt_tokens >= first.load.long_threshold
    col_meets, dis_meets = col.ttft <= due, dis.ttft <= due
    if long:
        if col_meets and not dis_meets and here.load.running == 0:
            return col, "prefill pool late, decode engine idle"
        return dis, "long prompt off the decode engines"
    if dis_meets and not col_meets:
        return dis, "colocated late"
    if col_meets and not dis_meets:
        return col, "prefill pool late"
    if col_meets:
        if _slots_used(here.load) >= SLOT_PRESSURE:
            return dis, "decode slots scarce"
        return col, "short prompt"
    return (dis, "short, late: prefill pool sooner") if dis.ttft <= col.ttft else (
        col, "short, late: colocated sooner")
