"""Saturation QPS of a configuration in the time model: the arrival rate at which the work a
request brings equals what the GPUs can do per second. Below it queues stay bounded and a
comparison does not depend on how long the run is; above it every queue grows with time.

Work of one request, in seconds of the whole mesh (or of all LoongServe instances together):
- prefill: on the pipelined mesh its isolated prefill time at the policy's chunk size,
  summed in *stage* times (consecutive chunks overlap across SPP stages; the same table the
  deadline policies use); for LoongServe its single-instance prefill time over the number of
  instances (ESP splits it evenly; parallel efficiency is 1 in ``EspCosts``);
- decode: its output tokens times one decode row's share of an iteration of
  ``DECODE_BATCH`` rows at the workload's mean context (the mesh's stage time; on
  LoongServe one instance's iteration over the number of instances).
The estimate ignores queueing and batching beyond that, so it is an upper bound on load.
"""
from __future__ import annotations

from typing import Sequence

from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.sim.trace import TraceRequest

DECODE_BATCH = 32


def _decode_share(predict, context: int) -> float:
    rows = tuple(ScheduledChunk(str(i), context, 1, True) for i in range(DECODE_BATCH))
    return predict(BatchPlan(rows, ())) / DECODE_BATCH


def mesh_work_s(trace: Sequence[TraceRequest], prefill_time, stage_time) -> float:
    """Mean mesh-seconds per request: ``prefill_time(n)`` (isolated, pipelined) plus decode."""
    context = round(sum(t.prompt_tokens for t in trace) / len(trace))
    share = _decode_share(stage_time, context)
    return sum(prefill_time(t.prompt_tokens) + t.output_tokens * share for t in trace) / len(trace)


def esp_work_s(trace: Sequence[TraceRequest], costs, num_instances: int) -> float:
    """Mean seconds of all ``num_instances`` LoongServe instances per request."""
    context = round(sum(t.prompt_tokens for t in trace) / len(trace))
    share = _decode_share(costs.instance.predict, context)
    return sum(costs.prefill((t.prompt_tokens,), 1) + t.output_tokens * share
               for t in trace) / len(trace) / num_instances


def saturation_qps(work_s: float) -> float:
    return 1.0 / work_s
