"""LLMEngine: iteration-level continuous batching on one device or a tp x kvp x spp mesh.

Every ``step()`` is the same loop: ``plan = scheduler.schedule()``, the plan's step goes to
the device, and ``scheduler.update(plan, sampled)`` takes it back with the sampled tokens,
which output processing turns into per-request outputs (text, stops, finish). Plans in
flight wait in a batch queue of depth ``spp``: depth 1 is the plain step, where a plan comes
back in the step that launched it; under stream pipeline parallelism each step is one
pipeline tick, and the plan leaving the last stage comes back, or a pass through every stage
when the plan is alone (empty pipeline, nothing else ready; docs/engine.md). Requests are
added and aborted between steps; every accepted request ends with a finish reason.
"""
from __future__ import annotations

import functools
import itertools
import logging
import random
import time
from typing import Sequence

import numpy as np

from jserve.config import ModelConfig
from jserve.engine.batch.builder import StepFlags
from jserve.engine.batch.tick_slots import TickSlots
from jserve.engine.build.factory import build_engine_parts, enable_compilation_cache
from jserve.engine.build.memory_plan import startup_summary
from jserve.engine.build.startup import StartupTimes
from jserve.engine.config import EngineConfig
from jserve.engine.device.host_pages import HostKVStore, build_host_tier
from jserve.engine.loop.faults import RequestFaults
from jserve.engine.loop.in_flight import InFlight, Launched
from jserve.engine.loop.late_masks import late_bitmask, late_rows
from jserve.engine.loop.timing import StepClock
from jserve.engine.requests import prompt_logprobs
from jserve.engine.requests.intake import PreparedRequest, RequestIntake
from jserve.engine.requests.output import OutputProcessor, RequestOutput, StepLogprobs
from jserve.engine.requests.state import NEUTRAL_ROW, StateRows, new_request, sampler_row
from jserve.fields import check_slos, number
from jserve.lora.config import LoRARequest
from jserve.model.params import Params
from jserve.sampling.params import SamplingParams
from jserve.scheduler import BatchPlan, Request, RequestStatus
from jserve.scheduler.predictor import CorrectedPredictor
from jserve.tokenizer import Tokenizer
from sharding import distributed

log = logging.getLogger(__name__)

_EMPTY_PLAN = BatchPlan((), ())


def _draft_engine(cfg: ModelConfig, params: Params, config: EngineConfig) -> LLMEngine:
    """The engine a draft model proposes from (``jserve.speculative.draft_model``)."""
    return LLMEngine(cfg, params, None, config)


class LLMEngine:
    def __init__(self, cfg: ModelConfig, params: Params, tokenizer: Tokenizer | None,
                 config: EngineConfig = EngineConfig(), startup: StartupTimes | None = None):
        self.startup = startup or StartupTimes()  # ``LLM`` starts it before reading the model
        enable_compilation_cache(config.compilation_cache_dir)
        parts = build_engine_parts(cfg, params, config, self.startup, _draft_engine)
        self.model_config, self.tokenizer, self.config = cfg, tokenizer, config
        self.max_model_len = parts.max_model_len
        self.buckets, self.allocator = parts.buckets, parts.allocator
        self.scheduler, self.runner, self.builder = parts.scheduler, parts.runner, parts.builder
        self.predictor, self.length_tracker = parts.predictor, parts.length_tracker
        self.pooler = parts.pooler  # runner "pooling": each prompt's embedding
        # What reads each step's captured hidden states (the length probe's or the pooler).
        self._captured = self.length_tracker or self.pooler
        self.speculator = parts.speculator  # proposes in the scheduler's schedule()
        self._multi_process = parts.multi_process
        # The model's own EOS ids plus the tokenizer's (generation_config may add end-of-turn).
        self.eos_ids = tuple(dict.fromkeys(
            cfg.eos_token_ids + (tokenizer.eos_token_ids if tokenizer else ())))
        self.intake = RequestIntake(
            tokenizer, cfg.vocab_size, self.max_model_len, self.allocator, self.eos_ids,
            no_prompt_logprobs=("stream pipeline parallelism (spp > 1)"
                                if parts.mesh_config.spp > 1 else
                                "multi-process serving" if parts.multi_process else None),
            adapters=parts.adapters)
        self.adapters = parts.adapters  # LoRA: the adapters and their device slots
        self.outputs = OutputProcessor(self.max_model_len,
                                       pooling=self.pooler is not None)
        self.host_kv = HostKVStore(self.runner)
        self.kv_tier = build_host_tier(cfg, config, parts)  # None: no host tier
        self.state_rows = StateRows(self.runner.state_sink)
        self.faults = RequestFaults()  # per-request failures inside a step
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.step_log: list[tuple[BatchPlan, float]] | None = None  # (plan, seconds) when on
        self._in_flight = InFlight(parts.mesh_config.spp)  # one plan per pipeline stage
        # Settable between steps. Off with a length probe or pooling, which read each step's
        # captured state before its tokens are appended.
        self.async_scheduling = config.async_scheduling and self._captured is None
        # Async: a structured output's mask goes after the forward (``late_masks``) unless
        # the step is one call (a pipeline tick, multi-process followers).
        self._may_continue = functools.partial(
            self.outputs.may_continue,
            late_masks=parts.mesh_config.spp == 1 and not self._multi_process)
        self.bursts = parts.bursts  # ``bursts.steps`` is settable between steps
        self._slots = TickSlots(self.runner, self.builder, NEUTRAL_ROW, self._in_flight.depth)
        self._clock = StepClock()
        # The deadline policies' predictor, corrected online from step times (one device:
        # a pipeline tick's time is not one plan's).
        self._corrected = (parts.predictor if isinstance(parts.predictor, CorrectedPredictor)
                           and self._in_flight.depth == 1 else None)
        if self._in_flight.depth > 1:
            self.runner.start_pipeline()
        self.startup_summary = startup_summary(self, parts.persistent_cache_hits)  # ready now
        log.info("%s", self.startup_summary)

    # -- requests ------------------------------------------------------------------------
    def prepare(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Tokenizes and checks a request (ValueError if refused); safe from any thread.
        ``lora_request``: the adapter it runs with, registered first if it is new and
        has a path (vLLM's offline form; FieldError if the adapter is refused), or without
        one an adapter registered already, by name."""
        if lora_request is not None and lora_request.lora_path and self.adapters is not None:
            self.adapters.add(lora_request)
        return self.intake.prepare(prompt, params,
                                   lora_request.lora_name if lora_request else None)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    ttft_slo: float | None = None, tpot_slo: float | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> str:
        """``ttft_slo`` (seconds after arrival) overrides the policy's default TTFT deadline;
        ``tpot_slo`` caps the iteration budget while the request runs; a lower ``priority``
        goes first under deadline-aware policies; ``lora_request``: its LoRA adapter."""
        prepared = self.prepare(prompt, params, lora_request)
        check_slos(ttft_slo, tpot_slo)
        return self.enqueue(prepared, request_id, arrival_time, ttft_slo, tpot_slo,
                            number("priority", priority))

    def add_requests(self, prompts: Sequence[str | Sequence[int]],
                     params: Sequence[SamplingParams]) -> list[str]:
        """All or nothing: every prompt is prepared before any is queued, so a bad one raises
        ValueError naming its index and leaves the engine as it was."""
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                prepared.append(self.prepare(prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return [self.enqueue(r) for r in prepared]

    def enqueue(self, prepared: PreparedRequest, request_id: str | None = None,
                arrival_time: float | None = None, ttft_slo: float | None = None,
                tpot_slo: float | None = None, priority: int = 0) -> str:
        """Queues a prepared request (its SLOs already checked); ValueError only for an id
        already in use."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        seed = prepared.params.seed
        req = new_request(prepared, rid, seed if seed is not None else self._rng.getrandbits(32),
                          time.monotonic() if arrival_time is None else arrival_time,
                          self.tokenizer, ttft_slo, tpot_slo, priority, self.intake.grammars,
                          self.eos_ids)
        self.requests[rid] = req
        if self.adapters is not None:
            self.adapters.accept(req.adapter)
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort between steps; pages are freed at once (or once its chunks in flight are
        back). None if the id is unknown or done."""
        req = self.requests.get(request_id)
        return None if req is None else self._finish(req, "abort")

    @property
    def multi_process(self) -> bool:
        """The engine's steps run on several processes (``jax.distributed``)."""
        return self._multi_process

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight.pending

    @property
    def pipeline_log(self) -> list[dict] | None:
        """One record per tick when set to a list: plans in flight and their chunks."""
        return self._in_flight.log

    @pipeline_log.setter
    def pipeline_log(self, log: list[dict] | None) -> None:
        self._in_flight.log = log

    @property
    def compile_count(self) -> int:
        return self.runner.programs.compile_count

    # -- one iteration -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One plan goes to the device. Synchronous: the plan leaving it (this one, or under
        spp the one leaving the pipeline) is read back now. Async: its tokens stay on the
        device, its requests may decode again at once (the next step feeds their tokens
        there), and the host reads it during the next step, while that one runs. A request
        whose own part of the step failed (``faults``) ends here with an error."""
        outputs = self._step()
        for req, error in self.faults.take():
            if self.requests.get(req.request_id) is req:
                outputs.append(self._finish(req, "abort", error))
        return outputs

    def _step(self) -> list[RequestOutput]:
        sched = self.scheduler
        plan = sched.schedule(*self.bursts.next()) if sched.has_schedulable() else _EMPTY_PLAN
        self._move_pages(plan)  # before anything can overwrite the pages it frees
        if self.adapters is not None:
            self.adapters.flush()  # adapters given a slot by this plan, copied in
        for rid in plan.preempted:
            self.state_rows.release(self.requests[rid])
        if plan.is_empty and not self._in_flight.busy:
            return self._read_unread()
        try:
            launched = None if plan.is_empty else self._launch(plan)
            lone = self._in_flight.lone(launched, sched.has_schedulable())
            if launched is not None:
                launched.launched_at = time.perf_counter()
            out = self._execute(launched, lone)
            if launched is not None and self._captured is not None:
                launched.capture = self.runner.last_capture
            if (launched is not None and launched.plan.prefills  # (a packed step: no arrays)
                    and launched.built.arrays.want_prompt_logprobs):
                launched.prompt_logprobs = self.runner.last_prompt_logprobs
        except Exception as e:  # noqa: BLE001 - a failed step must not strand its requests
            return self._step_failed(e, new_plan=plan)
        done = self._in_flight.push(launched, out, lone)
        if not self.async_scheduling or self.speculator.reads_now(done, sched):
            return self._read_unread() + (self._read(done) if done is not None else [])
        if done is not None:
            sched.sampled_on_device(done.plan, self._may_continue)
        outputs = self._read_unread()
        if done is not None and done.late:  # its forward runs: now its sampling
            try:
                done.out = self.runner.sample(done.out, late_bitmask(done, self.requests,
                                                                     self.faults))
            except Exception as e:  # noqa: BLE001 - as a failed step
                return outputs + self._step_failed(e, reading=done)
        self._in_flight.unread = done
        return outputs

    def _move_pages(self, plan: BatchPlan) -> None:
        """The plan's page copies between the device and the host: every read of the device
        (swap-outs, the host tier's offloads) before any write (swap-ins, restores)."""
        if self.kv_tier is not None:
            self.kv_tier.offload(plan)
        self.host_kv.apply(plan)
        if self.kv_tier is not None:
            self.kv_tier.restore(plan)

    def _read_unread(self) -> list[RequestOutput]:
        done = self._in_flight.take_unread()
        return [] if done is None else self._read(done)

    def _read(self, done: Launched) -> list[RequestOutput]:
        """Waits for ``done``'s sampled tokens and completes it."""
        try:
            tokens = np.asarray(done.out.tokens)
        except Exception as e:  # noqa: BLE001 - a device error surfaces here under async
            return self._step_failed(e, reading=done)
        seconds = self._clock.read(done.launched_at)
        if self.step_log is not None:
            self.step_log.append((done.plan, seconds))
        if self._corrected is not None and done.plan.burst == 1:
            self._corrected.observe(done.plan, seconds)
        return self._complete(done, tokens)

    def _launch(self, plan: BatchPlan) -> Launched:
        """Gives the plan's requests state rows and first-scheduled times; builds its step."""
        now = time.monotonic()
        reqs = self.scheduler.requests_of(plan)
        for req in reqs:
            self.state_rows.assign(req)
            if req.payload.metrics.first_scheduled_time is None:
                req.payload.metrics.first_scheduled_time = now
        flags = StepFlags.of([r.payload.params for r in reqs], plan)
        row = lambda r: self.faults.run(r, "its sampler row", sampler_row, r, self.eos_ids,
                                        default=NEUTRAL_ROW)
        built = self.builder.build(plan, self.requests, row, NEUTRAL_ROW,
                                   lambda r: r.payload.state_row, flags)
        return Launched(plan, reqs, built, flags.want_logprobs,
                        late=late_rows(built, self.requests))

    def _execute(self, launched: Launched | None, lone: bool):
        """Multi-process: the leader broadcasts every step (empty ticks too) to the followers.
        A plan with late masks runs its forward only (its sampling waits for them)."""
        built = launched.built if launched else None
        shape, bufs, launch = self._slots.buffers(built, self._in_flight.slots, lone)
        if self._multi_process:
            return distributed.leader_execute(self.runner, shape, *bufs, launch)
        if launched and launched.late:
            launch = distributed.Launch.FORWARD
        return self.runner.execute_packed(shape, *bufs, launch)

    def _complete(self, done: Launched, tokens: np.ndarray) -> list[RequestOutput]:
        """The plan ``done`` is back with its sampled tokens (an all-decode step built for
        bursts: [burst steps, rows], the plan's first ``burst`` rows its steps'): the
        scheduler updates request state, output processing makes the outputs."""
        if self._captured is not None and self._in_flight.depth == 1:
            self._captured.observe(done.plan, done.built, self.requests, done.capture)
        rows = [row for row, _ in done.built.sample_rows]
        sampled = (tokens[rows] if tokens.ndim == 1
                   else tokens[:done.plan.burst, rows].T.ravel()).tolist()
        if done.prompt_logprobs is not None:  # before the first token's output
            prompt_logprobs.record(done.prompt_logprobs, done.built.shape[0],
                                   done.plan.prefills, done.requests[len(done.plan.decodes):],
                                   lambda r: self.requests.get(r.request_id) is r)
        appended = self.scheduler.update(done.plan, sampled)
        logprobs = StepLogprobs(done.out) if done.want_logprobs else None
        now = time.monotonic()
        outputs = {}  # one per request: a speculating decode may append several tokens
        for i, req in appended:
            if self.requests.get(req.request_id) is not req:
                continue  # finished by an earlier token of this step (stop, length)
            reason = self.faults.run(req, "output processing", self._add_token, req, rows, i,
                                     sampled[i], logprobs, now)
            if not self.faults.failed(req):
                outputs[req] = self._finish(req, reason) if reason else None
        return [out or self.outputs.output(req) for req, out in outputs.items()]

    def _add_token(self, req: Request, rows: list[int], i: int, token: int,
                   logprobs: StepLogprobs | None, now: float) -> str | None:
        """The ``i``-th sampled token, at sampling row ``rows[i]`` when it has logprobs (a
        burst's tokens, [rows x steps] flattened, have none)."""
        lp = None if req.payload.logprobs is None else logprobs.token(
            rows[i], token, req.payload.params.logprobs)
        return self.outputs.add_token(req, token, now, lp)

    def _step_failed(self, error: Exception, **where) -> list[RequestOutput]:
        log.exception("engine step failed; failing every request in flight")
        return self._fail_in_flight(f"engine step failed: {error}", **where)

    def cancel_in_flight(self, reason: str) -> list[RequestOutput]:
        """Drops every plan on the device unread (a stopping server, a crashed loop): the
        requests they hold end with ``abort`` and ``reason``; their pages are freed."""
        return self._fail_in_flight(reason)

    def _fail_in_flight(self, error: str, reading: Launched | None = None,
                        new_plan: BatchPlan = _EMPTY_PLAN) -> list[RequestOutput]:
        """Fails every request with a chunk in flight (the plan being read and a new plan
        that did not launch among them), hands every plan back to the scheduler oldest
        first, and empties the pipeline."""
        entries = self._in_flight.drain(reading)
        plans = [b.plan for b in entries]
        reqs = [r for b in entries for r in b.requests]
        if not new_plan.is_empty:
            plans.append(new_plan)
            reqs += self.scheduler.requests_of(new_plan)
        outputs = []
        for req in dict.fromkeys(reqs):
            if self.requests.get(req.request_id) is req:
                outputs.append(self._finish(req, "abort", error))
        for p in plans:
            self.scheduler.update(p, None)
        if self._in_flight.depth > 1:
            self.runner.start_pipeline()
        return outputs

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        self.scheduler.finish(req, RequestStatus(reason))
        if self.adapters is not None:
            self.adapters.done(req.adapter)
        self.state_rows.release(req)
        if self._captured is not None:
            self._captured.forget(req.request_id)
        self.host_kv.drop(req.request_id)
        self.outputs.finished(req, reason, error, time.monotonic())
        del self.requests[req.request_id]
        return self.outputs.output(req)
