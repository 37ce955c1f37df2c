"""Decode bursts: several decode steps of the same requests in one executable call.

On a machine where the host's per-step work (schedule, build, output processing for every
request) shares the cores the step runs on, or where it is longer than the step itself (a
small model on a GPU), that work is paid once a burst instead of once a token. The scheduler
makes a plan a burst of ``k`` steps only when nothing else is waiting and every request in
it may take ``k`` more tokens without a host decision in between (no structured output, no
logprobs, no pending ``min_tokens`` ban, room under ``max_tokens`` and the context) and,
on a CPU, is sampled greedily or at a temperature with nothing else (what the fused step
samples itself, ``SamplingParams.beyond_temperature``; a GPU or TPU's all-decode steps
sample with the whole chain, ``StepLowering.modes.whole_chain_decodes``): then the tokens of
step ``j`` are exactly the inputs of step ``j + 1``, and what changes between the steps
(position, KV slot, context length, sampler step) is computed on the device from the
first step's buffers (``advance``). A stop token or string inside a burst ends the request
there on the host; the tokens after it are dropped, as an async step's extra token is.
(vLLM's "multi-step scheduling" is the same idea.)

There is no program of its own: each all-decode shape's step program loops over a runtime
count of steps, 1 to ``EngineConfig.burst_steps`` (``step_program._step``), so bursts add
nothing to compile and a single step and a burst of that shape run the same executable.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def advance(layout, ibuf: jax.Array, j: jax.Array, tokens: jax.Array, num_decodes: int,
            page_size: int) -> jax.Array:
    """The packed int buffer of an all-decode step moved ``j`` tokens on: every live decode
    row (``kv_len > 0``) gets ``tokens`` (the previous step's samples, row i = token i) as its
    input unless ``j == 0``, its position, context length and sampler step ``+ j``, and the
    KV slot of that position from its page table (whose pages the scheduler grew for the
    whole burst). Padding rows are left as built (they write to the reserved page 0)."""
    nd = num_decodes
    leaf = lambda name: layout.int_leaf(ibuf, name)[:nd]
    kv_lens = leaf(".batch.attn.kv_lens")
    live = kv_lens > 0
    moved = jnp.where(live, j, 0)
    positions = leaf(".batch.attn.positions") + moved
    page = layout.int_leaf(ibuf, ".batch.attn.page_table")[jnp.arange(nd),
                                                           positions // page_size]
    slots = jnp.where(live, page * page_size + positions % page_size, leaf(".batch.slots"))
    if layout.has_int_leaf(".batch.local_slots"):  # two KV layer groups: the local slots too
        local = layout.int_leaf(ibuf, ".batch.local_page_table")[jnp.arange(nd),
                                                                 positions // page_size]
        ibuf = layout.with_int_leaf(ibuf, ".batch.local_slots", jnp.where(
            live, local * page_size + positions % page_size, leaf(".batch.local_slots")))
    fed = live & (j > 0)
    for name, value in ((".batch.attn.positions", positions), (".batch.slots", slots),
                        (".batch.attn.kv_lens", kv_lens + moved),
                        (".sampling.step", leaf(".sampling.step") + moved),
                        (".batch.tokens", jnp.where(fed, tokens[:nd], leaf(".batch.tokens"))),
                        (".token_fed", jnp.where(fed, 0, leaf(".token_fed")))):
        ibuf = layout.with_int_leaf(ibuf, name, value)
    return ibuf


def may_burst(req, steps: int, max_model_len: int, whole_chain: bool = False) -> bool:
    """Whether ``req`` may decode ``steps`` tokens with no host decision between them: no
    structured output or logprobs, no ``min_tokens`` ban left, nothing beyond greedy or
    temperature sampling unless the all-decode steps sample with the whole chain
    (``whole_chain``; else they sample as the fused step does), and the ``steps`` tokens
    fit under ``max_tokens`` and the context (the last one may end it by length)."""
    st = req.payload
    p = st.params
    return (st.constraint is None and p.logprobs is None
            and (whole_chain or not p.beyond_temperature)
            and req.num_output_tokens >= p.min_tokens and req.room(max_model_len, steps) >= 0)


class DecodeBursts:
    """Whether the engine's next plan may be a burst, and of at most how many steps: ``steps``
    (``EngineConfig.decode_burst``; settable between steps from 1, off, to the steps the
    programs were built for, ``StepLowering.modes.burst_steps``) where bursts are ``supported``
    (one device and process, no KV-cache parallelism, no length probe or speculative
    decoding), while nothing waits, once the step program of the running requests'
    all-decode shape is compiled (``StepPrograms.burst_ready``: until then the step runs
    padded up to a compiled shape, one at a time)."""

    def __init__(self, steps: int, supported: bool, scheduler, runner, buckets,
                 max_model_len: int):
        self.supported = supported
        self.scheduler, self.runner, self.buckets = scheduler, runner, buckets
        self.steps = steps
        self.may_burst = functools.partial(
            may_burst, max_model_len=max_model_len,
            whole_chain=runner.programs.lowering.modes.whole_chain_decodes)

    @property
    def steps(self) -> int:
        return self._steps

    @steps.setter
    def steps(self, k: int) -> None:
        most = self.runner.programs.lowering.modes.burst_steps
        if self.supported and not 1 <= k <= most:
            raise ValueError(f"decode bursts of {k} steps: the step programs run 1 to {most} "
                             "(decode_burst)")
        self._steps = k

    def next(self) -> tuple[int, object]:
        """``scheduler.schedule``'s arguments for the next plan: (burst, may_burst)."""
        sched, k = self.scheduler, self.steps
        if k == 1 or not self.supported or sched.waiting or not sched.running:
            return 1, None
        ready = self.runner.programs.burst_ready(self.buckets.shape_for(len(sched.running), 0))
        return (k, self.may_burst) if ready else (1, None)
