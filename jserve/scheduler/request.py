"""A request's scheduling state. Pure Python: shared by the live engine and the simulator."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jserve.lengths import length_room

# A token sampled by a step that is still on the device (async scheduling): it stands in
# ``all_token_ids`` until ``SchedulerBase.update`` writes the real id; the step builder marks it
# to be fed from the device.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"          # prefilling or decoding; holds KV pages
    PREEMPTED = "preempted"      # pages released; KV swapped to host or to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclasses.dataclass(eq=False)
class Request:
    """``all_token_ids`` is prompt + generated so far (vLLM's name; an output's
    ``token_ids`` is its generated tokens alone). Tokens ``[num_computed, len(all_token_ids))``
    still have to go through the model: more than one is a prefill (or a recompute after
    preemption), exactly one is a decode."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    payload: Any = None  # engine-side data (sampling params, detokenizer); opaque here
    all_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    page_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    ttft_deadline: float | None = None  # absolute time; deadline-aware policies fill it in
    swapped: bool = False  # preempted with its KV (num_computed tokens) kept in host memory
    tpot_slo: float | None = None  # seconds per output token; None: the engine's default
    priority: int = 0              # lower runs first among deadline-aware policies' ties
    # Output-length probe (TRAIL): tokens still to generate as predicted from the mean prompt
    # embedding once the prompt is prefilled, and the smoothed prediction after each step.
    first_prediction: float | None = None
    predicted_remaining: float | None = None
    # Prefix caching: whether this request may take cached pages (False when something
    # must see every prompt token go through the model: penalties, a length probe); the
    # content keys of its full pages so far; how many of its pages are registered; the
    # cached prompt tokens a lookup found when it was queued (what the policies rank a
    # waiting request by); and the tokens it took from the cache at its last admission.
    cacheable: bool = True
    # False: it takes no cached pages, though its own full pages are offered (prompt
    # logprobs: every prompt token must go through the model for its logprob).
    takes_cached: bool = True
    page_keys: list = dataclasses.field(default_factory=list, repr=False)
    num_registered_pages: int = 0
    # Sliding window: how many leading entries of ``page_ids`` are pages the window has
    # passed, given back (``FREED_PAGE`` in the list; ``PageAllocator.drop_dead``).
    num_dropped_pages: int = 0
    cached_hint: int = 0
    num_cached_tokens: int = 0
    # The host tier: of ``cached_hint``, the pages only the host holds (what a restore
    # costs); (host slot, device page) of a claim's pages to restore; and the tokens
    # restored from the host at its last admission (part of ``num_cached_tokens``).
    restore_hint: int = 0
    restoring: list = dataclasses.field(default_factory=list, repr=False)
    num_restored_tokens: int = 0
    # Speculative decoding: the draft tokens a proposer offers for the next decode (the
    # scheduler takes as many as the budget allows), and the request's running tally of
    # drafts verified and accepted (``jserve.speculative`` turns speculation off for a
    # request whose drafts keep failing).
    draft_ids: list[int] = dataclasses.field(default_factory=list, repr=False)
    num_drafted: int = 0
    num_accepted: int = 0
    # LoRA: the adapter the request runs with (None: the base model), which also salts its
    # prefix-cache keys (no page is shared across adapters); whether it holds the
    # adapter's device slot (from admission until it finishes or is preempted).
    adapter: str | None = None
    holds_adapter: bool = False

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def room(self, max_model_len: int, ahead: int = 0) -> int:
        """``length_room`` once ``ahead`` more tokens are out, counting every token it holds
        (placeholders of tokens still on the device too)."""
        return length_room(self.max_tokens, self.num_prompt_tokens,
                           self.num_output_tokens + ahead, max_model_len)

    @property
    def held_page_ids(self) -> list[int]:
        """The pages it holds: its page list past the ones a sliding window dropped."""
        return self.page_ids[self.num_dropped_pages:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.all_token_ids) - self.num_computed

    @property
    def num_done(self) -> int:
        """Tokens whose KV exists or is expected to be found cached (waiting requests)."""
        return self.num_computed or self.cached_hint

    @property
    def is_decode(self) -> bool:
        return self.num_uncomputed == 1 and self.num_output_tokens > 0
