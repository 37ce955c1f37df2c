"""Scheduling: request state, batch plans and policies. No JAX import, so the simulator and the
live engine run the same code."""
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.registry import (
    ENGINE_POLICIES,
    POLICIES,
    Limits,
    SchedulerSpec,
    build_scheduler,
    policy,
)
from jserve.scheduler.request import PLACEHOLDER, Request, RequestStatus
from jserve.scheduler.sarathi import SarathiScheduler

__all__ = ["PLACEHOLDER", "BatchPlan", "ScheduledChunk", "Request", "RequestStatus",
           "SarathiScheduler", "ENGINE_POLICIES", "POLICIES", "Limits", "SchedulerSpec",
           "build_scheduler", "policy"]
