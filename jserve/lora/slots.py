"""The adapters one engine knows, and which of them hold its device slots.

An adapter is read and checked when it is registered (at start, by ``--lora-modules``, or
at run time), and kept read on the host, up to ``max_cpu_loras`` (least recently used
first out; one evicted from the host is read again from its directory when next needed).
The device pool has ``max_loras`` slots: a running request holds its adapter's slot from
admission until it finishes or is preempted (the scheduler asks ``acquire`` before
admitting it, so no step ever holds more adapters than slots); a slot no running request
holds is given to another adapter least recently used first, and the copy in happens
before the next step launches (``flush``). What a copy costs (the engine's measured mean)
is what the deadline policies add to a waiting request whose adapter is not resident.
"""
from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Callable

from jserve.fields import FieldError
from jserve.lora.config import LoRAConfig, LoRARequest

if TYPE_CHECKING:  # (no JAX here: the scheduler's tests use the slots alone)
    from jserve.lora.peft import Adapter


class AdapterSlots:
    def __init__(self, config: LoRAConfig, read: Callable[[LoRARequest], Adapter],
                 write: Callable[[int, Adapter], None]):
        """``read``: an adapter from its request (``peft.read_adapter`` for the base
        model; FieldError when refused); ``write(slot, adapter)``: its copy into a device
        slot."""
        self.config, self._read, self._write = config, read, write
        self.known: dict[str, LoRARequest] = {}
        self._ids: dict[int, str] = {}
        self._host: collections.OrderedDict[str, Adapter] = collections.OrderedDict()
        self._names: list[str | None] = [None] * config.max_loras  # by slot
        self._refs: collections.Counter = collections.Counter()  # running holders, by name
        # resident adapter -> its slot, least recently used first
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._pending: dict[int, str] = {}  # slots to write before the next step
        self._users: collections.Counter = collections.Counter()  # accepted requests
        self.loads = self.evictions = 0
        self.load_seconds = 0.0  # the mean copy time so far (0: none measured)

    # -- the registry ----------------------------------------------------------------------
    def add(self, req: LoRARequest) -> bool:
        """Registers ``req`` (read and checked now: FieldError on ``lora_path`` if the
        adapter is refused, nothing changed). False when it is already known by that name
        and path (nothing to do); a name or id taken by another adapter is refused."""
        old = self.known.get(req.lora_name)
        if old is not None:
            if old.lora_path == req.lora_path:
                return False
            raise FieldError("lora_name", f"adapter {req.lora_name!r} is already loaded "
                                          f"from {old.lora_path}")
        if req.lora_int_id and self._ids.get(req.lora_int_id, req.lora_name) != req.lora_name:
            raise FieldError("lora_int_id", f"lora_int_id {req.lora_int_id} is adapter "
                                            f"{self._ids[req.lora_int_id]!r}'s")
        adapter = self._read(req)
        self.known[req.lora_name] = req
        if req.lora_int_id:
            self._ids[req.lora_int_id] = req.lora_name
        self._keep(adapter)
        return True

    def remove(self, name: str) -> None:
        """Unregisters adapter ``name``; refused (FieldError) while a request uses it."""
        if name not in self.known:
            raise FieldError("lora_name", f"no adapter {name!r} is loaded")
        if self._users[name]:
            raise FieldError("lora_name", f"adapter {name!r} is in use by "
                                          f"{self._users[name]} request(s)")
        req = self.known.pop(name)
        self._ids.pop(req.lora_int_id, None)
        self._host.pop(name, None)
        slot = self._lru.pop(name, None)
        if slot is not None:  # its slot empty again (and not copied in, if still pending)
            self._names[slot] = None
            self._pending.pop(slot, None)

    def check(self, name: str) -> None:
        """FieldError on ``model`` unless adapter ``name`` is known."""
        check_loaded(name, self.known)

    # -- requests --------------------------------------------------------------------------
    def accept(self, name: str | None) -> None:
        """A request for ``name`` is queued (it may not be unloaded until ``done``)."""
        if name is not None:
            self._users[name] += 1

    def done(self, name: str | None) -> None:
        _decrement(self._users, name)

    # -- the scheduler's view --------------------------------------------------------------
    def resident(self, name: str | None) -> bool:
        return name is None or name in self._lru

    def acquire(self, name: str | None) -> bool:
        """A slot for a request of ``name`` being admitted (its own adapter's, or one no
        running request holds, least recently used first); False: every slot is held by
        other adapters' running requests, so it waits."""
        if name is None:
            return True
        if name not in self._lru:
            slot = self._free_slot(evict=True)
            if slot is None:
                return False
            self._names[slot] = name
            self._pending[slot] = name
            self._lru[name] = slot
        self._lru.move_to_end(name)
        self._refs[name] += 1
        return True

    def can_acquire(self, name: str | None) -> bool:
        """Whether ``acquire(name)`` would succeed now (nothing changes)."""
        return self.resident(name) or self._free_slot(evict=False) is not None

    def release(self, name: str | None) -> None:
        _decrement(self._refs, name)

    def slot(self, name: str | None) -> int:
        """The slot of a resident adapter (-1: the base model)."""
        return -1 if name is None else self._lru[name]

    def load_cost(self, name: str | None) -> float:
        """Seconds the copy in of ``name`` is expected to take before its request can run
        (0 when resident)."""
        return 0.0 if self.resident(name) else self.load_seconds

    def _free_slot(self, evict: bool) -> int | None:
        """An empty slot, else the least recently used one no running request holds (its
        adapter evicted when ``evict``; else nothing changes); None: every slot is held."""
        if None in self._names:
            return self._names.index(None)
        for name, slot in self._lru.items():
            if not self._refs[name]:
                if evict:
                    del self._lru[name]
                    self.evictions += 1
                return slot
        return None

    # -- the device ------------------------------------------------------------------------
    def flush(self) -> None:
        """Copies every adapter given a slot since the last step into it."""
        while self._pending:
            slot, name = self._pending.popitem()
            t0 = time.perf_counter()
            self._write(slot, self._adapter(name))
            dt = time.perf_counter() - t0
            self.loads += 1
            self.load_seconds += (dt - self.load_seconds) / self.loads

    def _adapter(self, name: str) -> Adapter:
        adapter = self._host.get(name)
        if adapter is None:  # evicted from the host: read again
            adapter = self._read(self.known[name])
        self._keep(adapter)
        return adapter

    def _keep(self, adapter: Adapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.config.host_capacity:
            self._host.popitem(last=False)

    # -- what metrics show -----------------------------------------------------------------
    def running(self) -> list[str]:
        return sorted(self._refs)


def _decrement(counter: collections.Counter, name: str | None) -> None:
    """One fewer for ``name`` (None: nothing), dropped from ``counter`` at zero."""
    if name is not None:
        counter[name] -= 1
        if counter[name] <= 0:
            del counter[name]


def check_loaded(name: str, loaded) -> None:
    """FieldError on ``model`` unless adapter ``name`` is among the ``loaded`` names."""
    if name not in loaded:
        raise FieldError("model", f"no adapter {name!r} is loaded (loaded: {sorted(loaded)})")
