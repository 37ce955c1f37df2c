"""The scheduler with LoRA adapter slots (jserve/lora/slots.py), on constructed cases and no
model: a request is admitted only with its adapter's slot, a slot goes to another adapter
only when no running request holds it (least recently used first), and the deadline
policies price a waiting request's adapter copy."""
from __future__ import annotations

import types

import pytest

from jserve.cache.allocator import PageAllocator
from jserve.fields import FieldError
from jserve.lora.config import LoRAConfig, LoRARequest
from jserve.lora.slots import AdapterSlots
from jserve.scheduler import Limits, SchedulerSpec, build_scheduler
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request, RequestStatus


def _slots(max_loras: int, written: list) -> AdapterSlots:
    read = lambda req: types.SimpleNamespace(name=req.lora_name)
    slots = AdapterSlots(LoRAConfig(max_loras=max_loras), read,
                         lambda slot, adapter: written.append((slot, adapter.name)))
    for i, name in enumerate("abc"):
        slots.add(LoRARequest(name, i + 1, f"/{name}"))
    return slots


def _sched(policy: str, slots: AdapterSlots):
    sched = build_scheduler(SchedulerSpec(policy, Limits(8, 256, 4), max_context=4096),
                            PageAllocator(257, 16),
                            predictor=LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0)))
    sched.adapters = slots
    return sched


def _req(rid: str, adapter: str | None, n: int = 10) -> Request:
    return Request(rid, list(range(3, 3 + n)), 4, 0.0, adapter=adapter)


@pytest.mark.parametrize("policy", ["sarathi", "lars", "edf"])
def test_a_request_waits_for_a_slot_its_adapter_can_take(policy):
    written = []
    slots = _slots(1, written)
    sched = _sched(policy, slots)
    a, b, base = _req("a", "a"), _req("b", "b"), _req("base", None)
    for r in (a, b, base):
        sched.add(r)
    plan = sched.schedule()
    admitted = {c.request_id for c in plan.prefills}
    assert admitted == {"a", "base"}  # b's adapter has no slot while a runs
    assert slots.running() == ["a"] and b.status is RequestStatus.WAITING
    slots.flush()
    assert written == [(0, "a")]
    sched.update(plan, [7] * len(plan.prefills))
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    assert slots.running() == []
    plan = sched.schedule()
    assert "b" in {c.request_id for c in plan.prefills}
    slots.flush()
    assert written == [(0, "a"), (0, "b")] and slots.evictions == 1
    assert slots.slot("b") == 0 and not slots.resident("a")


def test_least_recently_used_idle_slot_is_given_first():
    written = []
    slots = _slots(2, written)
    assert slots.acquire("a") and slots.acquire("b")
    slots.flush()
    slots.release("a")
    slots.release("b")
    assert slots.acquire("a")  # a used again: b is now the least recently used
    slots.release("a")
    assert slots.acquire("c")
    slots.flush()
    assert written == [(1, "b"), (0, "a"), (1, "c")]  # (a slot given twice before a
    # step is copied once: the last adapter it was given)
    assert slots.resident("a") and not slots.resident("b")
    assert slots.acquire("b") and not slots.acquire("a")  # both held now: a must wait
    assert slots.running() == ["b", "c"]


def test_preemption_gives_the_slot_back():
    slots = _slots(1, [])
    sched = _sched("sarathi", slots)
    a = _req("a", "a")
    sched.add(a)
    sched.schedule()
    assert a.holds_adapter
    sched._preempt(a)
    assert not a.holds_adapter and slots.running() == []


def test_deadline_policies_price_the_adapter_copy():
    slots = _slots(1, [])
    slots.load_seconds = 0.25  # the engine's measured mean copy
    sched = _sched("lars", slots)
    cold, base = _req("cold", "b"), _req("base", None)
    assert sched.remaining_work(cold) == pytest.approx(sched.remaining_work(base) + 0.25)
    assert slots.acquire("b")
    assert sched.remaining_work(_req("warm", "b")) == pytest.approx(sched.remaining_work(base))


def test_registry_refusals():
    slots = _slots(1, [])
    with pytest.raises(FieldError, match="lora_int_id 1 is adapter 'a'"):
        slots.add(LoRARequest("z", 1, "/z"))
    slots.accept("a")
    with pytest.raises(FieldError, match="in use by 1"):
        slots.remove("a")
    slots.done("a")
    slots.remove("a")
    with pytest.raises(FieldError, match="no adapter 'a'"):
        slots.check("a")
