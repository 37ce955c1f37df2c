"""The engine's side of speculative decoding: which requests speculate, their draft tokens
before each ``schedule()``, and which plans the host must read before planning the next.

Async scheduling plans step N+1 while step N runs, with step N's tokens still on the device.
A proposer needs those tokens (the n-gram's key ends with them; a draft model continues
them), so a plan holding a request that speculates is read back before the next plan is
made: such requests run one step at a time, the others keep overlapping. A request that
does not speculate (opted out, or paused after a failing acceptance window) overlaps
again."""
from __future__ import annotations

import dataclasses

from jserve.scheduler import PLACEHOLDER, Request
from jserve.scheduler.base import SchedulerBase
from jserve.speculative.config import SpeculativeConfig
from jserve.speculative.draft_model import DraftModelProposer, NewEngine
from jserve.speculative.ngram import INDEX_BUDGET, NgramIndex


@dataclasses.dataclass
class _Acceptance:
    """A request's current acceptance window (its tallies when the window began) and the
    output length before which its speculation is paused."""

    drafted: int = 0
    accepted: int = 0
    resume_at: int = 0
    pause: int = 0
    misses: int = 0  # proposals in a row that found no draft
    # While paused (n-gram only): a proposal made on the host alone, (real tokens it
    # continued, its draft), checked against the tokens that come (``Speculator._shadow``).
    shadow: tuple[int, list[int]] | None = None


class Speculator:
    """Drafts for the decodes of the next plan (``propose``), from prompt lookup or from
    a ``draft`` proposer (``jserve.speculative.draft_model``) when given."""

    def __init__(self, config: SpeculativeConfig | None, max_model_len: int,
                 scheduler: SchedulerBase, draft=None):
        """``config`` None: speculation is off (nothing proposed, every plan may overlap)."""
        self.config = config
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.draft = draft
        # request id -> (the request, its tokens' n-gram index)
        self._indexes: dict[str, tuple[Request, NgramIndex]] = {}
        self._acceptance: dict[str, _Acceptance] = {}

    # -- who speculates ----------------------------------------------------------------
    def speculates(self, req: Request) -> bool:
        """Off for a request that opted out, uses penalties (their counts would have to
        follow each draft) or a grammar (its state would too). Acceptance is judged per
        window of ``acceptance_window`` verified drafts: a window accepted less than
        ``min_acceptance_rate`` of the time pauses the request's speculation for as many
        output tokens as the window, twice as many after the next failing one, and so on
        (text that starts free and later quotes gets drafts again; free text wastes little)."""
        if not self._may_speculate(req):
            return False
        c = self.config
        a = self._acceptance.setdefault(req.request_id, _Acceptance())
        if req.num_output_tokens < a.resume_at:
            return False
        drafted = req.num_drafted - a.drafted
        if drafted >= c.acceptance_window:
            if req.num_accepted - a.accepted < c.min_acceptance_rate * drafted:
                a.pause = max(2 * a.pause, c.acceptance_window)
                a.resume_at = req.num_output_tokens + a.pause
            a.drafted, a.accepted = req.num_drafted, req.num_accepted
        return req.num_output_tokens >= a.resume_at

    def _may_speculate(self, req: Request) -> bool:
        p = req.payload.params
        return (self.config is not None and p.speculative and not p.uses_penalties
                and p.structured_output is None)

    def active(self, scheduler: SchedulerBase) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or len(scheduler.running) <= limit

    def reads_now(self, launched, scheduler: SchedulerBase) -> bool:
        """Whether the host reads ``launched`` (an ``InFlight`` entry, or None) before
        planning again: its plan verifies drafts, or a request in it samples a token a
        proposal will need next step. Not a plan whose structured outputs sample late
        (their masks wait for the previous plan's tokens): it is read the async way, and
        its speculating requests wait for it (a verifying one is never released early)."""
        if self.config is None or launched is None or getattr(launched, "late", None):
            return False
        plan = launched.plan
        if plan.num_draft_tokens:
            return True
        if not self.active(scheduler):
            return False
        return any(c.samples and self.speculates(r)
                   for r, c in zip(launched.requests, plan.decodes + plan.prefills))

    def stats(self) -> dict[str, float]:
        """Totals since start: draft tokens verified and accepted, speculating decodes
        verified, the acceptance rate and the mean accepted length (tokens a speculating
        decode appends: accepted drafts + 1)."""
        s = self.scheduler
        drafted, accepted, steps = (s.num_draft_tokens, s.num_accepted_tokens,
                                    s.num_draft_steps)
        return dict(draft_tokens=drafted, accepted_tokens=accepted, drafts=steps,
                    acceptance_rate=accepted / drafted if drafted else 0.0,
                    mean_accepted_length=(accepted + steps) / steps if steps else 0.0)

    # -- proposing ---------------------------------------------------------------------
    def propose(self, scheduler: SchedulerBase) -> None:
        """Sets ``draft_ids`` of every running request that decodes next and speculates:
        at most ``num_speculative_tokens``, and never past ``max_tokens`` or the context
        (a step appends at most drafts + 1 tokens)."""
        if self.config is None:
            return
        for req in scheduler.running:
            req.draft_ids = []
        if len(self._indexes) > 2 * len(scheduler.running) + 64:  # drop finished ones
            live = {r.request_id for r in scheduler.running}
            self._indexes = {k: v for k, v in self._indexes.items() if k in live}
            self._acceptance = {k: v for k, v in self._acceptance.items() if k in live}
        if not self.active(scheduler):
            return
        reqs, ks = [], []
        for req in scheduler.running:
            # (Drafts start past min_tokens, so all rows of a step ban the same ids.)
            if (req in scheduler.in_flight or not req.is_decode
                    or req.all_token_ids[-1] == PLACEHOLDER or not self.speculates(req)
                    or req.num_output_tokens < req.payload.params.min_tokens):
                if self.draft is None and req.is_decode:
                    self._shadow(req)
                continue
            # (the step appends the k drafts and one token more)
            k = min(self.config.num_speculative_tokens, req.room(self.max_model_len) - 1)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if not reqs:
            return
        if self.draft is not None:
            drafts = self.draft.propose(reqs, ks)
        else:
            drafts = [self._index(r, len(r.all_token_ids)).propose(k) for r, k in zip(reqs, ks)]
        for req, d in zip(reqs, drafts):
            req.draft_ids = [int(t) for t in d]
            self._missed(req, not req.draft_ids)

    def _shadow(self, req: Request) -> None:
        """A paused request's speculation resumes as soon as prompt lookup, run on the host
        alone meanwhile (microseconds a step, nothing sent to the device), proposes k tokens
        that all come true: text that starts free and then quotes (an answer that opens in
        its own words, then copies the document; a list whose items start repeating) gets
        drafts again at once, not after its pause. Its window starts afresh; the pause it
        had still doubles after the next failing window."""
        a = self._acceptance.get(req.request_id)
        if (a is None or req.num_output_tokens >= a.resume_at
                or not self._may_speculate(req)):
            return
        ids = req.all_token_ids
        n = len(ids)
        while n and ids[n - 1] == PLACEHOLDER:  # async: the token not read back yet
            n -= 1
        if a.shadow is not None:
            base, draft = a.shadow
            came = ids[base:min(n, base + len(draft))]
            if came != draft[:len(came)]:
                a.shadow = None  # a miss: propose anew from here
            elif len(came) == len(draft):
                a.shadow = None
                a.resume_at, a.misses = req.num_output_tokens, 0
                a.drafted, a.accepted = req.num_drafted, req.num_accepted
                return
            else:
                return  # still coming true
        draft = self._index(req, n).propose(self.config.num_speculative_tokens)
        if len(draft):
            a.shadow = (n, draft.tolist())

    def _missed(self, req: Request, missed: bool) -> None:

        """A request whose proposal found nothing waits 1, 2, 4, ... output tokens (at most
        ``acceptance_window``) before the next: meanwhile it is not read back early, so it
        overlaps instead of paying a synchronous step for no draft."""
        a = self._acceptance[req.request_id]
        a.misses = a.misses + 1 if missed else 0
        if missed:
            wait = min(1 << (a.misses - 1), self.config.acceptance_window)
            a.resume_at = max(a.resume_at, req.num_output_tokens + wait)

    def _index(self, req: Request, n: int) -> NgramIndex:
        """``req``'s n-gram index over its first ``n`` tokens (real ones: no placeholder,
        no draft), given the tokens appended since the last step."""
        owner, index = self._indexes.get(req.request_id, (None, None))
        ids = req.all_token_ids
        if owner is not req or n < len(index.tokens):  # new (or its id reused)
            c = self.config
            index = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max, INDEX_BUDGET)
            self._indexes[req.request_id] = (req, index)
        index.extend(ids[len(index.tokens):n])
        return index


def build_speculator(engine_config, cfg, max_model_len: int, scheduler: SchedulerBase,
                     new_engine: NewEngine | None = None) -> Speculator:
    """The engine's speculator for ``engine_config.speculative_config`` (None: off), proposing
    at the start of each ``scheduler.schedule()``; a draft model is loaded here, into an
    engine from ``new_engine``."""
    config = engine_config.speculative_config
    draft = None
    if config is not None and config.method == "draft_model":
        if new_engine is None:
            raise ValueError("speculative_config: a draft model needs an engine to run in")
        draft = DraftModelProposer.load(config.model, cfg, engine_config, max_model_len,
                                        new_engine)
    speculator = Speculator(config, max_model_len, scheduler, draft)
    if config is not None:
        scheduler.proposer = speculator.propose
    return speculator
