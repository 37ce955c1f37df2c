"""Host side of a step: turn a BatchPlan into padded numpy arrays for one bucket."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, NamedTuple

import jax
import numpy as np

from jserve.engine.batch.arrays import PackedLayout, StepArrays
from jserve.engine.batch.buckets import Buckets
from jserve.engine.requests.prompt_logprobs import targets as prompt_targets
from jserve.kernels import AttentionMetadata
from jserve.model.decoder import StepInput
from jserve.sampling.sampler import SamplerRow, SamplingBatch, make_sampling_batch, mask_words
from jserve.scheduler import PLACEHOLDER, BatchPlan, Request, ScheduledChunk


@dataclasses.dataclass(frozen=True)
class StepFlags:
    """Run-time switches of the fused step (no recompile): see ``step_program._step``."""

    any_random: bool     # some sampled row has temperature > 0
    any_penalty: bool    # some request in the step uses penalties
    want_logprobs: bool  # some sampled row asked for logprobs
    want_prompt_logprobs: bool = False  # some prefill chunk's request wants prompt logprobs
    prompt_top: int = 0  # the most alternatives such a request wants (its prompt_logprobs)
    any_bias: bool = False  # some sampled row has a logit_bias
    # some sampled row's request samples beyond greedy or temperature (a filter, penalty or
    # bias: ``SamplingParams.beyond_temperature``)
    beyond_temperature: bool = False

    @classmethod
    def of(cls, params: list, plan: BatchPlan) -> "StepFlags":
        """The switches ``plan`` needs (``params``: its chunks' requests'). Every chunk of a
        penalised request counts: its prompt tokens fill the penalty state."""
        sampled = [p for p, c in zip(params, plan.decodes + plan.prefills) if c.samples]
        prompt = [p.prompt_logprobs for p in params[len(plan.decodes):]
                  if p.prompt_logprobs is not None]
        return cls(any_random=any(p.temperature > 0 for p in sampled),
                   any_penalty=any(p.uses_penalties for p in params),
                   want_logprobs=any(p.logprobs is not None for p in sampled),
                   want_prompt_logprobs=bool(prompt), prompt_top=max(prompt, default=0),
                   any_bias=any(p.logit_bias for p in sampled),
                   beyond_temperature=any(p.beyond_temperature for p in sampled))


def _masked(rows: list[SamplerRow]) -> bool:
    """Some row has a structured-output bitmask (``BuiltStep.masked``)."""
    return any(r.allowed is not None for r in rows)


def _whole_chain(flags: StepFlags, sb: SamplingBatch, masked: bool) -> bool:
    """``StepArrays.whole_chain``: some sampled row of the step needs more than greedy or
    temperature sampling (the rows of chunks that do not sample are neutral, whatever their
    request asks). Logprobs, filters, penalties and biases: as ``flags`` has them (from the
    requests); bans, masks (``masked``) and sampled drafts: from the rows, which alone know
    them."""
    return bool(flags.want_logprobs or flags.beyond_temperature or masked
                or (sb.banned_ids >= 0).any()
                or ((sb.draft >= 0) & (sb.temperature > 0)).any())


@dataclasses.dataclass(frozen=True)
class BuiltStep:
    """A step's host inputs: its ``arrays``, and, when the builder packed them, the two
    buffers of ``layout`` and the bitmask (``PackedLayout.pack``). A step built packed
    (``StepBuilder._advance``) has only those: ``arrays`` unpacks them the first time
    something asks. ``masked``: some row has a structured-output bitmask."""

    shape: tuple[int, int]
    _arrays: StepArrays | None
    sample_rows: list[tuple[int, ScheduledChunk]]  # (row in the step, chunk) for sampled rows
    original: "BuiltStep | None" = None  # what ``resized`` padded (None: as built)
    # never written once handed out
    packed: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None
    layout: PackedLayout | None = None
    masked: bool = False

    @property
    def arrays(self) -> StepArrays:
        if self._arrays is None:
            object.__setattr__(self, "_arrays", self.layout.host_arrays(*self.packed))
        return self._arrays

    def resized(self, empty: "BuiltStep") -> "BuiltStep":
        """The step as built, padded to the shape of ``empty`` (the all-padding step of a
        shape at least the built one's in both dimensions): what building the plan at that
        shape gives, from the host arrays alone (the requests may have moved on while it is
        in flight). A resized step resizes from its original, to a smaller shape too.

        Every leaf with a leading token (T) or row (S) dimension keeps its decode part at the
        front and moves its prefill part from offset ``bd`` to the new ``bd``; the rest is
        ``empty``'s padding. The two dimensions need no telling apart: both put decodes
        first and the prefill part after them. Leaves whose shape does not change (scalars,
        rows when only the prefill tokens grow) are kept. Values that number rows or tokens
        of the step are remapped: ``token_seq``, ``logits_rows`` and ``sample_rows``."""
        if self.original is not None:
            return self.original.resized(empty)
        (bd, tp), (new_bd, new_tp) = self.shape, empty.shape
        if (bd, tp) == (new_bd, new_tp):
            return self
        if new_bd < bd or new_tp < tp:
            raise ValueError(f"cannot resize a step of shape {self.shape} to {empty.shape}")
        shift = new_bd - bd

        def move(leaf, pad):
            leaf = np.asarray(leaf)
            if leaf.shape == np.shape(pad):
                return leaf
            out = np.array(pad, copy=True)
            out[:bd] = leaf[:bd]
            out[new_bd:new_bd + len(leaf) - bd] = leaf[bd:]
            return out

        leaves = [move(a, b) for a, b in zip(jax.tree.leaves(self.arrays),
                                             jax.tree.leaves(empty.arrays), strict=True)]
        arrays = jax.tree.unflatten(jax.tree.structure(empty.arrays), leaves)
        attn, old = arrays.batch.attn, self.arrays.batch
        # Prefill tokens name their rows (bd + j); padding tokens the row past the last.
        rows, new_rows = len(old.logits_rows), len(arrays.batch.logits_rows)
        seq = attn.token_seq.copy()
        part = seq[new_bd:new_bd + tp]
        part[:] = np.where(part < rows, part + shift, new_rows)
        # Live prefill rows take their logits from their last token; padding rows keep 0.
        logits_rows = arrays.batch.logits_rows.copy()
        logits_rows[new_bd:new_bd + int(old.attn.num_prefills)] += shift
        arrays = dataclasses.replace(arrays, batch=dataclasses.replace(
            arrays.batch, logits_rows=logits_rows,
            attn=dataclasses.replace(attn, token_seq=seq)))
        return BuiltStep(empty.shape, arrays,
                         [(r if r < bd else r + shift, c) for r, c in self.sample_rows], self,
                         masked=self.masked)


@dataclasses.dataclass(frozen=True)
class BuilderSpec:
    """What every step an engine builds is laid out by, fixed for the engine's life."""

    page_size: int
    state_sink: int  # the penalty-state row that padding rows and tokens name
    # KV pages per group (``buckets.kvp`` > 1: page ids are ``group * pool_pages + local``),
    # or the global pool's pages (``hybrid``)
    pool_pages: int | None = None
    vocab_size: int = 32  # sets the structured-output bitmask's width (``mask_words``)
    # Two KV layer groups (``jserve.cache.hybrid``): a page id packs a global page and a local
    # one (``global + local * pool_pages``), split into the two page tables and slot arrays.
    hybrid: bool = False
    # The all-decode steps' programs sample with the whole chain
    # (``StepLowering.modes.whole_chain_decodes``), so only logprobs send such a step to the
    # sampling executable (``StepArrays.whole_chain``).
    whole_chain_decodes: bool = False


@dataclasses.dataclass(frozen=True)
class RequestHooks:
    """What the builder asks of a request beyond its own state."""

    # Whether its sampler row has neither bans nor a mask (``requests.state.plain_sampler_row``):
    # with a ``layout``, an all-decode step of plain rows is packed as built and the next one
    # of the same requests is built from its buffers (``StepBuilder._advance``).
    plain_row: Callable[[Request], bool] | None = None
    # Whether it wants prompt logprobs: its prefill tokens get targets.
    prompt_logprobs: Callable[[Request], bool] = lambda req: False
    # LoRA adapters served: its slot in the pool (-1: the base model), carried by its tokens
    # (``StepInput.lora_slots``); None: no adapters.
    lora_slot: Callable[[Request], int] | None = None


class StepBuilder:
    """With ``buckets.kvp`` > 1 page ids are global (``group * pool_pages + local``, see
    ``jserve.cache.allocator``): each row's page table gets, in column block g, the local ids
    of its logical chunk ``(g - start) % kvp``; each token its local slot and owning group;
    each row its start group. On one group those are the plain ids, slots and zeros."""

    def __init__(self, buckets: Buckets, spec: BuilderSpec, hooks: RequestHooks | None = None,
                 ready: Callable[[tuple[int, int]], tuple[int, int]] | None = None,
                 layout: Callable[[tuple[int, int]], PackedLayout] | None = None):
        """``ready``: the shape a step of a bucket shape is built at now
        (``StepPrograms.ready_shape``: a compiled one covering it while its own compiles in
        the background); None: the bucket shape itself. ``layout``: a bucket shape's
        ``PackedLayout`` (None: steps are not packed here). ``hooks``: None, none of them."""
        if buckets.kvp > 1 and spec.pool_pages is None:
            raise ValueError("kvp > 1 needs pool_pages (KV pages per group)")
        self.buckets, self.spec, self.kvp = buckets, spec, buckets.kvp
        self.ready = ready or (lambda shape: shape)
        self.layout, hooks = layout, hooks or RequestHooks()
        self.plain_row, self.prompt_logprobs = hooks.plain_row, hooks.prompt_logprobs
        self.lora_slot = hooks.lora_slot
        self._last: _LastDecodes | None = None
        self.page_size, self.state_sink = spec.page_size, spec.state_sink
        self.pool_pages, self.hybrid = spec.pool_pages, spec.hybrid
        self.whole_chain_decodes = spec.whole_chain_decodes
        self.mask_words = mask_words(spec.vocab_size)  # structured-output bitmask width

    def _kvp_row(self, page_table: np.ndarray, row: int, page_ids) -> int:
        """Fills ``row`` of the page table from global ``page_ids``; returns the start group."""
        ids = np.asarray(page_ids, np.int32)
        if not len(ids):
            return 0
        ppg, pool = self.buckets.pages_per_group, self.pool_pages
        start = int(ids[0]) // pool
        j = np.arange(len(ids))
        page_table[row, ((start + j // ppg) % self.kvp) * ppg + j % ppg] = ids % pool
        return start

    def _hybrid_row(self, h: "_HostArrays", row: int, page_ids, pos: np.ndarray,
                    tokens: slice) -> None:
        """Row ``row``'s two page tables and its ``tokens``' slots at positions ``pos``
        from packed ``page_ids`` (``hybrid``)."""
        ps = self.page_size
        glob, loc = _split_ids(page_ids, self.pool_pages)
        h.page_table[row, :len(glob)] = glob
        h.local_page_table[row, :len(loc)] = loc
        h.slots[tokens] = glob[pos // ps] * ps + pos % ps
        h.local_slots[tokens] = loc[pos // ps] * ps + pos % ps

    def build(self, plan: BatchPlan, requests: dict[str, Request],
              sampler_row: "callable[[Request], SamplerRow]", neutral_row: SamplerRow,
              state_row: "callable[[Request], int]", flags: StepFlags,
              shape: tuple[int, int] | None = None) -> BuiltStep:
        """``shape``: build at this bucket shape instead of the smallest one that fits."""
        decodes_only = (shape is None and self.plain_row is not None and self.kvp == 1
                        and self.layout is not None and not self.hybrid and not plan.prefills
                        and not plan.num_draft_tokens)
        if decodes_only:
            built = self._advance(plan, requests, state_row, flags)
            if built is not None:
                return built
        built = self._build(plan, requests, sampler_row, neutral_row, state_row, flags, shape)
        self._last = None
        if decodes_only and plan.decodes:
            dec = [requests[c.request_id] for c in plan.decodes]
            if all(map(self.plain_row, dec)):  # packed now: the next step starts from it
                layout = self.layout(built.shape)
                built = BuiltStep(built.shape, built.arrays, built.sample_rows,
                                  packed=layout.pack(built.arrays, masked=False),
                                  layout=layout)
                self._last = _LastDecodes(plan.decodes, dec, built, flags,
                                          [r.page_ids for r in dec],
                                          [len(r.page_ids) for r in dec], plan.burst)
        return built

    def _advance(self, plan: BatchPlan, requests: dict[str, Request],
                 state_row: "callable[[Request], int]", flags: StepFlags) -> BuiltStep | None:
        """The steady state of decoding, cheaply: when the last step built was all decodes
        of the same requests in the same order, each as many tokens further as that step
        moved them (one, or a burst's), at the same shape and switches, every row plain (no
        bans, no mask) then and now, this step's int buffer is a copy of that one's with the
        per-token entries rewritten (``_advance_packed``) and its float buffer is that one's
        (no sampling parameter changes). None when it does not apply: ``_build`` then builds
        it (a test holds the two equal, buffers and arrays)."""
        last = self._last
        if last is None or flags != last.flags or len(plan.decodes) != len(last.decodes):
            return None
        shape = self.ready(self.buckets.shape_for(len(plan.decodes), 0))
        if shape != last.built.shape:
            return None
        dec = []
        for c, old, req, pages in zip(plan.decodes, last.decodes, last.requests,
                                      last.page_lists):
            r = requests.get(c.request_id)
            if (r is not req or c.start != old.start + last.burst or r.page_ids is not pages
                    or not self.plain_row(r)):
                return None
            dec.append(r)
        pos = [c.start for c in plan.decodes]
        lens = [len(r.page_ids) for r in dec]
        ibuf = _advance_packed(last, dec, pos, [state_row(r) for r in dec], lens,
                               self.page_size, plan.burst)
        built = BuiltStep(shape, None, list(enumerate(plan.decodes)),
                          packed=(ibuf, last.built.packed[1], None), layout=last.built.layout)
        self._last = last._replace(decodes=plan.decodes, built=built, lens=lens,
                                   burst=plan.burst)
        return built

    def _build(self, plan: BatchPlan, requests: dict[str, Request],
               sampler_row: "callable[[Request], SamplerRow]", neutral_row: SamplerRow,
               state_row: "callable[[Request], int]", flags: StepFlags,
               shape: tuple[int, int] | None = None) -> BuiltStep:
        """The step built from the requests' state alone."""
        bd, padded_prefill_tokens = shape or self.ready(self.buckets.shape_for(
            plan.num_decode_rows, sum(c.num_tokens for c in plan.prefills)))
        s = bd + (self.buckets.prefill_rows if padded_prefill_tokens else 0)
        h = _HostArrays.empty(bd + padded_prefill_tokens, s, self.buckets.page_table_width,
                              self.state_sink, neutral_row, self.hybrid,
                              lora=self.lora_slot is not None)
        h.token_seq[:bd] = np.arange(bd)
        if plan.decodes:
            self._fill_decodes(h, plan, requests, sampler_row, state_row)
        self._fill_prefills(h, plan, requests, sampler_row, state_row, first_row=bd)
        h.token_fed = h.tokens == PLACEHOLDER  # sampled by a step still on the device
        h.tokens[h.token_fed] = 0
        attn = AttentionMetadata(positions=h.positions, token_seq=h.token_seq,
                                 kv_lens=h.kv_lens, page_table=h.page_table,
                                 num_prefills=np.asarray(len(plan.prefills), np.int32),
                                 num_decodes=bd)
        sampling = make_sampling_batch(h.rows, pad_to=s, words=self.mask_words)
        masked = _masked(h.rows)
        arrays = StepArrays(
            batch=StepInput(tokens=h.tokens, slots=h.slots, logits_rows=h.logits_rows,
                            attn=attn, slot_groups=h.slot_groups, start_groups=h.start_groups,
                            local_slots=h.local_slots, local_page_table=h.local_page_table,
                            lora_slots=h.lora_slots),
            token_state_rows=h.token_state, token_is_prompt=h.token_is_prompt,
            token_fed=h.token_fed, state_rows=h.state_rows, reset_rows=h.reset_rows,
            prompt_targets=h.prompt_targets,
            want_prompt_logprobs=np.asarray(flags.want_prompt_logprobs),
            prompt_top=np.asarray(flags.prompt_top, np.int32),
            sampled_state_rows=h.sampled_state_rows,
            sampling=sampling,
            any_random=np.asarray(flags.any_random), any_penalty=np.asarray(flags.any_penalty),
            want_logprobs=np.asarray(flags.want_logprobs), any_bias=np.asarray(flags.any_bias),
            whole_chain=np.asarray(flags.want_logprobs
                                   if self.whole_chain_decodes and not padded_prefill_tokens
                                   else _whole_chain(flags, sampling, masked)),
            burst=np.asarray(plan.burst, np.int32))
        return BuiltStep((bd, padded_prefill_tokens), arrays, h.sample_rows, masked=masked)

    def empty(self, shape: tuple[int, int], neutral_row: SamplerRow) -> BuiltStep:
        """The all-padding step of ``shape``: writes go to the sink page 0, no row samples
        (an empty pipeline slot, and ``BuiltStep.resized``'s padding)."""
        return self.build(BatchPlan((), ()), {}, None, neutral_row, None,
                          StepFlags(False, False, False), shape=shape)

    def _fill_decodes(self, h: "_HostArrays", plan: BatchPlan, requests, sampler_row,
                      state_row) -> None:
        """Decodes (the bulk of rows): scalars gathered in Python, one numpy store per
        field. A speculating decode takes one row per token (its own, then its drafts), each
        sampling: row j attends to the KV its earlier rows write in the same step."""
        ps = self.page_size
        chunks = plan.decodes
        if plan.num_draft_tokens:
            chunks = [c._replace(start=c.start + j, num_tokens=1, drafts=c.drafts[j:])
                      for c in plan.decodes for j in range(c.num_tokens)]
        nd = len(chunks)
        dec = [requests[c.request_id] for c in chunks]
        pos_d = [c.start for c in chunks]
        srows = [state_row(r) for r in dec]
        h.tokens[:nd] = [r.all_token_ids[p] for r, p in zip(dec, pos_d)]
        h.positions[:nd] = pos_d
        h.token_state[:nd] = srows
        h.kv_lens[:nd] = [p + 1 for p in pos_d]
        h.logits_rows[:nd] = np.arange(nd)
        h.state_rows[:nd] = srows
        if self.lora_slot is not None:
            h.lora_slots[:nd] = [self.lora_slot(r) for r in dec]
        if self.hybrid:
            for i, (r, p) in enumerate(zip(dec, pos_d)):
                self._hybrid_row(h, i, r.page_ids, np.asarray([p]), slice(i, i + 1))
        elif self.kvp == 1:
            h.slots[:nd] = _decode_slots(dec, pos_d, ps)
            # Every row's pages in one store: a boolean mask over the table takes them in
            # row-major order, so the pages of all rows, concatenated, fill it.
            tables = [r.page_ids for r in dec]
            lens = np.fromiter(map(len, tables), np.int32, nd)
            h.page_table[:nd][np.arange(h.page_table.shape[1]) < lens[:, None]] = \
                list(itertools.chain.from_iterable(tables))
        else:
            pool = self.pool_pages
            pages = np.asarray([r.page_ids[p // ps] for r, p in zip(dec, pos_d)], np.int32)
            h.slots[:nd] = pages % pool * ps + np.asarray(pos_d, np.int32) % ps
            h.slot_groups[:nd] = pages // pool
            for i, r in enumerate(dec):
                h.start_groups[i] = self._kvp_row(h.page_table, i, r.page_ids)
        h.sampled_state_rows[:nd] = srows
        h.rows[:nd] = map(sampler_row, dec)
        h.sample_rows.extend(enumerate(chunks))
        if plan.num_draft_tokens:
            for i, (r, c) in enumerate(zip(dec, chunks)):
                if c.drafts:  # a row of a speculating decode: the token after position start
                    # (no bans differ between its rows: drafts start past min_tokens)
                    h.rows[i] = h.rows[i]._replace(step=c.start + 1 - r.num_prompt_tokens,
                                                   draft=c.drafts[0])

    def _fill_prefills(self, h: "_HostArrays", plan: BatchPlan, requests, sampler_row,
                       state_row, first_row: int) -> None:
        """One row per prefill chunk; its tokens follow the decode rows' tokens."""
        ps = self.page_size
        start = first_row
        for j, c in enumerate(plan.prefills):
            row = first_row + j
            req = requests[c.request_id]
            n = c.num_tokens
            end = start + n
            pos = np.arange(c.start, c.start + n, dtype=np.int32)
            h.tokens[start:end] = req.all_token_ids[c.start:c.start + n]
            h.positions[start:end] = pos
            if self.hybrid:
                self._hybrid_row(h, row, req.page_ids, pos, slice(start, end))
            elif self.kvp == 1:
                ids = np.asarray(req.page_ids, np.int32)
                h.slots[start:end] = ids[pos // ps] * ps + pos % ps
                h.page_table[row, :len(ids)] = ids
            else:
                ids = np.asarray(req.page_ids, np.int32)
                pages = ids[pos // ps]
                h.slots[start:end] = pages % self.pool_pages * ps + pos % ps
                h.slot_groups[start:end] = pages // self.pool_pages
                h.start_groups[row] = self._kvp_row(h.page_table, row, ids)
            h.token_seq[start:end] = row
            if self.lora_slot is not None:
                h.lora_slots[start:end] = self.lora_slot(req)
            srow = state_row(req)
            h.token_state[start:end] = srow
            h.token_is_prompt[start:end] = pos < req.num_prompt_tokens
            if self.prompt_logprobs(req):
                h.prompt_targets[start:end] = prompt_targets(req.prompt_token_ids, c.start, n)
            h.kv_lens[row] = c.start + n
            h.logits_rows[row] = end - 1
            h.state_rows[row] = srow
            if c.start == 0:
                h.reset_rows[row] = srow
            if c.samples:
                h.rows[row] = sampler_row(req)
                h.sample_rows.append((row, c))
                h.sampled_state_rows[row] = srow
            start = end


def _split_ids(page_ids, pool_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed page ids (``jserve.cache.hybrid``) -> (global, local) page ids, int32."""
    ids = np.asarray(page_ids, np.int64)
    return (ids % pool_pages).astype(np.int32), (ids // pool_pages).astype(np.int32)


def _advance_packed(last: "_LastDecodes", dec: list[Request], pos: list[int],
                    srows: list[int], lens: list[int], page_size: int, burst: int
                    ) -> np.ndarray:
    """``last``'s int buffer with what moves from one decode step to the next rewritten for
    ``dec`` at ``pos``: tokens (0 where fed), fed flags, positions, KV lengths, slots, state
    rows, sampling steps, the steps of this call (``burst``) and the page-table rows of
    requests that took a page. A new
    buffer: the last one may still be an input of a step on the device."""
    layout, nd = last.built.layout, len(dec)
    ibuf = last.built.packed[0].copy()

    def put(name: str, values) -> None:
        at = layout.int_offset(name)
        ibuf[at:at + nd] = values

    tokens = [r.all_token_ids[p] for r, p in zip(dec, pos)]
    put(".batch.tokens", [0 if t == PLACEHOLDER else t for t in tokens])
    put(".token_fed", [t == PLACEHOLDER for t in tokens])
    put(".batch.attn.positions", pos)
    put(".batch.attn.kv_lens", [p + 1 for p in pos])
    put(".batch.slots", _decode_slots(dec, pos, page_size))
    for name in (".token_state_rows", ".state_rows", ".sampled_state_rows"):
        put(name, srows)
    put(".sampling.step", [r.num_output_tokens for r in dec])
    ibuf[layout.int_offset(".burst")] = burst
    table = layout.int_offset(".batch.attn.page_table")
    width = layout.int_shape(".batch.attn.page_table")[1]
    for i, (n, was) in enumerate(zip(lens, last.lens)):
        if n != was:
            ibuf[table + i * width:table + i * width + n] = dec[i].page_ids
    return ibuf


def _decode_slots(requests: list[Request], positions: list[int], page_size: int) -> list[int]:
    """The KV slot each decode row writes (kvp == 1): its position's page, then offset."""
    return [r.page_ids[p // page_size] * page_size + p % page_size
            for r, p in zip(requests, positions)]


class _LastDecodes(NamedTuple):
    """The last all-decode step built with every row plain (``StepBuilder._advance``)."""

    decodes: tuple[ScheduledChunk, ...]
    requests: list[Request]
    built: BuiltStep
    flags: StepFlags
    page_lists: list[list[int]]  # each request's page list (the same list while it runs)
    lens: list[int]  # how many pages each held then
    burst: int  # the tokens each decode moved on (``BatchPlan.burst``)


@dataclasses.dataclass
class _HostArrays:
    """One step's host arrays while they are filled: per token (t), per row (s)."""

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    token_seq: np.ndarray
    token_state: np.ndarray
    token_is_prompt: np.ndarray
    token_fed: np.ndarray
    prompt_targets: np.ndarray
    slot_groups: np.ndarray
    start_groups: np.ndarray
    kv_lens: np.ndarray
    page_table: np.ndarray
    logits_rows: np.ndarray
    state_rows: np.ndarray
    reset_rows: np.ndarray
    sampled_state_rows: np.ndarray
    rows: list[SamplerRow]
    sample_rows: list[tuple[int, ScheduledChunk]]
    local_slots: np.ndarray | None = None  # two KV layer groups: the windowed layers'
    local_page_table: np.ndarray | None = None
    lora_slots: np.ndarray | None = None  # LoRA adapters served: each token's slot

    @classmethod
    def empty(cls, t: int, s: int, page_table_width: int, state_sink: int,
              neutral_row: SamplerRow, hybrid: bool = False, lora: bool = False
              ) -> "_HostArrays":
        """Padding everywhere: tokens of row ``s`` (none), state sink rows, neutral sampling."""
        return cls(
            tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
            slots=np.zeros(t, np.int32), token_seq=np.full(t, s, np.int32),
            token_state=np.full(t, state_sink, np.int32),
            token_is_prompt=np.zeros(t, bool), token_fed=np.zeros(t, bool),
            prompt_targets=np.full(t, -1, np.int32),
            slot_groups=np.zeros(t, np.int32),
            start_groups=np.zeros(s, np.int32), kv_lens=np.zeros(s, np.int32),
            page_table=np.zeros((s, page_table_width), np.int32),
            logits_rows=np.zeros(s, np.int32), state_rows=np.full(s, state_sink, np.int32),
            reset_rows=np.full(s, state_sink, np.int32),
            sampled_state_rows=np.full(s, state_sink, np.int32), rows=[neutral_row] * s,
            sample_rows=[],
            **({"local_slots": np.zeros(t, np.int32),
                "local_page_table": np.zeros((s, page_table_width), np.int32)}
               if hybrid else {}),
            lora_slots=np.full(t, -1, np.int32) if lora else None)
