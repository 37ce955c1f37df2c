"""Host side of a step: turn a BatchPlan into padded numpy arrays for one bucket."""
from __future__ import annotations

import dataclasses

import numpy as np

from jserve.engine.buckets import Buckets
from jserve.engine.runner import StepArrays
from jserve.kernels import AttentionMetadata
from jserve.model.llama import StepInput
from jserve.sampling.sampler import SamplerRow, make_sampling_batch
from jserve.scheduler import BatchPlan, Request, ScheduledChunk


@dataclasses.dataclass(frozen=True)
class StepFlags:
    """Run-time switches of the fused step (no recompile): see ``runner._step``."""

    any_random: bool     # some sampled row has temperature > 0
    any_penalty: bool    # some request in the step uses penalties
    want_logprobs: bool  # some sampled row asked for logprobs


@dataclasses.dataclass(frozen=True)
class BuiltStep:
    shape: tuple[int, int]
    arrays: StepArrays
    sample_rows: list[tuple[int, ScheduledChunk]]  # (row in the step, chunk) for sampled rows


class StepBuilder:
    """With ``buckets.kvp`` > 1 block ids are global (``group * pool_pages + local``, see
    ``jserve.cache.allocator``): each row's page table gets, in column block g, the local ids
    of its logical chunk ``(g - start) % kvp``; each token its local slot and owning group;
    each row its start group. On one group those are the plain ids, slots and zeros."""

    def __init__(self, buckets: Buckets, page_size: int, state_sink: int,
                 pool_pages: int | None = None):
        if buckets.kvp > 1 and pool_pages is None:
            raise ValueError("kvp > 1 needs pool_pages (KV pages per group)")
        self.buckets = buckets
        self.page_size = page_size
        self.state_sink = state_sink
        self.kvp = buckets.kvp
        self.pool_pages = pool_pages

    def _kvp_row(self, page_table: np.ndarray, row: int, block_ids) -> int:
        """Fills ``row`` of the page table from global ``block_ids``; returns the start group."""
        blocks = np.asarray(block_ids, np.int32)
        if not len(blocks):
            return 0
        ppg, pool = self.buckets.pages_per_group, self.pool_pages
        start = int(blocks[0]) // pool
        j = np.arange(len(blocks))
        page_table[row, ((start + j // ppg) % self.kvp) * ppg + j % ppg] = blocks % pool
        return start

    def build(self, plan: BatchPlan, requests: dict[str, Request],
              sampler_row: "callable[[Request], SamplerRow]", neutral_row: SamplerRow,
              state_row: "callable[[Request], int]", flags: StepFlags) -> BuiltStep:
        nd = len(plan.decodes)
        n_pre_tokens = sum(c.num_tokens for c in plan.prefills)
        bd, padded_prefill_tokens = self.buckets.shape_for(nd, n_pre_tokens)
        t = bd + padded_prefill_tokens
        s = bd + (self.buckets.prefill_rows if padded_prefill_tokens else 0)
        ps = self.page_size

        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.zeros(t, np.int32)
        token_seq = np.full(t, s, np.int32)
        token_state = np.full(t, self.state_sink, np.int32)
        token_is_prompt = np.zeros(t, bool)
        slot_groups = np.zeros(t, np.int32)
        start_groups = np.zeros(s, np.int32)
        kv_lens = np.zeros(s, np.int32)
        page_table = np.zeros((s, self.buckets.page_table_width), np.int32)
        logits_rows = np.zeros(s, np.int32)
        state_rows = np.full(s, self.state_sink, np.int32)
        reset_rows = np.full(s, self.state_sink, np.int32)
        rows: list[SamplerRow] = [neutral_row] * s
        sample_rows: list[tuple[int, ScheduledChunk]] = []

        token_seq[:bd] = np.arange(bd)
        # Decodes (the bulk of rows): scalars gathered in Python, one numpy store per field.
        nd = len(plan.decodes)
        if nd:
            dec = [requests[c.request_id] for c in plan.decodes]
            pos_d = [c.start for c in plan.decodes]
            srows = [state_row(r) for r in dec]
            tokens[:nd] = [r.token_ids[p] for r, p in zip(dec, pos_d)]
            positions[:nd] = pos_d
            token_state[:nd] = srows
            kv_lens[:nd] = [p + 1 for p in pos_d]
            logits_rows[:nd] = np.arange(nd)
            state_rows[:nd] = srows
            if self.kvp == 1:
                slots[:nd] = [r.block_ids[p // ps] * ps + p % ps for r, p in zip(dec, pos_d)]
                for i, r in enumerate(dec):
                    page_table[i, :len(r.block_ids)] = r.block_ids
            else:
                pool = self.pool_pages
                pages = np.asarray([r.block_ids[p // ps] for r, p in zip(dec, pos_d)], np.int32)
                slots[:nd] = pages % pool * ps + np.asarray(pos_d, np.int32) % ps
                slot_groups[:nd] = pages // pool
                for i, r in enumerate(dec):
                    start_groups[i] = self._kvp_row(page_table, i, r.block_ids)
            for i, (r, c) in enumerate(zip(dec, plan.decodes)):
                rows[i] = sampler_row(r)
                sample_rows.append((i, c))

        start = bd
        for j, c in enumerate(plan.prefills):
            row = bd + j
            req = requests[c.request_id]
            n = c.num_tokens
            end = start + n
            pos = np.arange(c.start, c.start + n, dtype=np.int32)
            blocks = np.asarray(req.block_ids, np.int32)
            tokens[start:end] = req.token_ids[c.start:c.start + n]
            positions[start:end] = pos
            if self.kvp == 1:
                slots[start:end] = blocks[pos // ps] * ps + pos % ps
                page_table[row, :len(blocks)] = blocks
            else:
                pages = blocks[pos // ps]
                slots[start:end] = pages % self.pool_pages * ps + pos % ps
                slot_groups[start:end] = pages // self.pool_pages
                start_groups[row] = self._kvp_row(page_table, row, blocks)
            token_seq[start:end] = row
            srow = state_row(req)
            token_state[start:end] = srow
            token_is_prompt[start:end] = pos < req.num_prompt_tokens
            kv_lens[row] = c.start + n
            logits_rows[row] = end - 1
            state_rows[row] = srow
            if c.start == 0:
                reset_rows[row] = srow
            if c.samples:
                rows[row] = sampler_row(req)
                sample_rows.append((row, c))
            start = end

        attn = AttentionMetadata(positions=positions, token_seq=token_seq, kv_lens=kv_lens,
                                 page_table=page_table,
                                 num_prefills=np.asarray(len(plan.prefills), np.int32),
                                 num_decodes=bd)
        arrays = StepArrays(
            batch=StepInput(tokens=tokens, slots=slots, logits_rows=logits_rows, attn=attn,
                            slot_groups=slot_groups, start_groups=start_groups),
            token_state_rows=token_state, token_is_prompt=token_is_prompt,
            state_rows=state_rows, reset_rows=reset_rows,
            sampling=make_sampling_batch(rows, pad_to=s),
            any_random=np.asarray(flags.any_random), any_penalty=np.asarray(flags.any_penalty),
            want_logprobs=np.asarray(flags.want_logprobs))
        return BuiltStep((bd, padded_prefill_tokens), arrays, sample_rows)
