"""Engine-side bookkeeping of the length probe: per request, the prompt embedding summed over
its prefill chunks and the remaining-length filter; writes the predictions into the
scheduler's ``Request`` fields. Host-side numpy only."""
from __future__ import annotations

import numpy as np

from jserve.probe.length_probe import LengthProbe
from jserve.probe.smoothing import RemainingFilter, posterior, transition_matrix


class LengthTracker:
    """``observe`` runs after every captured step, before the step's tokens are appended.

    A request's first sampled row (no output yet) gets the probe on its mean prompt embedding
    (``first_prediction``); every later sampled row (a decode, or the last chunk of a
    recompute) updates the filter with that row's embedding (``predicted_remaining``).
    With ``record`` every embedding is kept in ``log`` as (request id, tokens generated
    before the step, "prompt" | "token", vector): what the probe trains on, the target being
    the final output length minus that count.
    """

    def __init__(self, probe: LengthProbe | None, layer: int, record: bool = False):
        self.probe = probe
        self.layer = layer  # the decoder layer the engine captures
        self.transition = transition_matrix(probe.bins) if probe is not None else None
        self.log: list[tuple[str, int, str, np.ndarray]] | None = [] if record else None
        self._sum: dict[str, np.ndarray] = {}
        self._count: dict[str, int] = {}
        self._filters: dict[str, RemainingFilter] = {}

    def observe(self, plan, built, requests, capture) -> None:
        rows = np.asarray(capture.rows)
        # Prompt sums only matter for prefill chunks: decode-only steps skip the transfer.
        sums = np.asarray(capture.prompt_sum) if plan.prefills else None
        bd = built.shape[0]
        for j, c in enumerate(plan.prefills):
            rid = c.request_id
            if rid in self._filters:
                continue
            req = requests[rid]
            if c.start == 0:  # a first chunk, or a recompute from scratch
                self._sum.pop(rid, None)
                self._count.pop(rid, None)
            n_prompt = min(c.start + c.num_tokens, req.num_prompt_tokens) - c.start
            if n_prompt > 0:
                self._sum[rid] = self._sum.get(rid, 0.0) + sums[bd + j]
                self._count[rid] = self._count.get(rid, 0) + n_prompt
        firsts, updates = [], []
        for row, c in built.sample_rows:
            rid = c.request_id
            k = requests[rid].num_output_tokens
            if k == 0 and rid not in self._filters and self._count.get(rid):
                emb = self._sum.pop(rid) / self._count.pop(rid)
                firsts.append((rid, emb))
                kind = "prompt"
            else:
                emb = rows[row]
                updates.append((rid, emb))
                kind = "token"
            if self.log is not None:
                self.log.append((rid, k, kind, np.array(emb, np.float32)))
        if self.probe is None:
            return
        if firsts:
            probs = self.probe.probs(np.stack([e for _, e in firsts]))
            for (rid, _), p in zip(firsts, probs):
                f = self._filters[rid] = RemainingFilter(self.probe.bins, self.transition)
                req = requests[rid]
                req.first_prediction = req.predicted_remaining = f.start(p)
        updates = [(rid, e) for rid, e in updates if rid in self._filters]
        if updates:  # one probe call and one batched filter step for the whole step
            probs = self.probe.probs(np.stack([e for _, e in updates]))
            filters = [self._filters[rid] for rid, _ in updates]
            post = posterior(np.stack([f.probs for f in filters]), probs, self.transition)
            expected = self.probe.bins.expected(post)
            for (rid, _), f, p, e in zip(updates, filters, post, expected):
                f.probs = p
                requests[rid].predicted_remaining = float(e)

    def forget(self, request_id: str) -> None:
        for d in (self._sum, self._count, self._filters):
            d.pop(request_id, None)
