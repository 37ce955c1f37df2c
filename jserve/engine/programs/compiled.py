"""A runner's compiled programs and their cache: every bucket shape's step (spp > 1: tick;
an all-decode shape's runs decode bursts too), the passes, sampling executables and the swap
programs. By default
(``warmup="all"``) the whole set compiles before the engine is ready, on a thread pool with
the persistent cache, so nothing compiles while serving; the other modes compile on first
use, or in a background thread after ``defer`` (steps of a shape not compiled yet run padded
up meanwhile). The compile counters are what tests and the start-up line read."""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from jserve.engine.batch.arrays import PackedLayout
from jserve.engine.device import page_io
from jserve.engine.programs.deferred import DeferredCompiles
from jserve.engine.programs.lowering import StepLowering
from sharding.distributed import Launch

log = logging.getLogger(__name__)

# Persistent compilation cache lookups in this process ("cache_hits" / "cache_misses"), so
# the engine can say at start how much of its compile came from the cache.
CACHE_EVENTS: collections.Counter = collections.Counter()


# The same events of the programs a runner compiles (``_compile``): the listener runs in
# the compiling thread, so a thread-local counter tells them from other threads' programs
# (the weights loading beside them).
_PROGRAM_EVENTS = threading.local()


def _count_cache_event(event: str, **_) -> None:
    if event.startswith("/jax/compilation_cache/cache_"):
        name = event.rsplit("/", 1)[1]
        CACHE_EVENTS[name] += 1
        counter = getattr(_PROGRAM_EVENTS, "counter", None)
        if counter is not None:
            counter[name] += 1


jax.monitoring.register_event_listener(_count_cache_event)


def _compile(lowered: jax.stages.Lowered, counter: collections.Counter) -> jax.stages.Compiled:
    """``lowered.compile()``, its persistent-cache hits and misses added to ``counter``."""
    _PROGRAM_EVENTS.counter = counter
    try:
        return lowered.compile()
    finally:
        _PROGRAM_EVENTS.counter = None


class _SamplerKey(NamedTuple):
    """The sampling executable of ``rows`` rows in the background compile queue (beside
    step shapes)."""

    rows: int


def _wait_for(deferred: DeferredCompiles | None, key) -> None:
    """Waits for the background thread's compile of ``key`` if it has it in hand (a failed
    one is compiled again by the caller, in its own thread)."""
    fut = deferred.future(key) if deferred is not None else None
    if fut is not None and not fut.cancelled():
        try:
            fut.result()
        except Exception:  # noqa: BLE001 - compiled by the caller
            pass


Program = tuple[jax.stages.Compiled, PackedLayout]


class StepPrograms:
    """The executables of one runner, compiled from ``lowering`` and kept by key: ``steps``
    and ``passes`` by bucket shape, ``samplers`` by rows."""

    def __init__(self, lowering: StepLowering):
        self.lowering = lowering
        self.spp, self.sample_rows = lowering.spp, lowering.sample_rows
        self.steps: dict[tuple[int, int], Program] = {}
        self.passes: dict[tuple[int, int], Program] = {}
        self.samplers: dict[int, jax.stages.Compiled] = {}
        self.compile_count = 0
        self.compile_seconds = 0.0  # wall time spent lowering and compiling
        self.compiled_up_front = 0  # programs compiled by ``warmup`` (before the engine is ready)
        self.cache_events: collections.Counter = collections.Counter()  # cache_hits/_misses
        self.deferred: DeferredCompiles | None = None  # after ``defer()``
        self.padded: collections.Counter = collections.Counter()  # (needed, ran as) -> steps
        self.compile_times: dict[str, float] = {}  # program -> seconds, from ``warmup``
        self.threads = 0  # ``warmup``'s compile threads
        # Set before ``warmup`` (``factory``): whether the swap programs (``page_io``)
        # compile with the step programs.
        self.swaps = False
        self.movers: page_io.PageMovers | None = None
        self._lock = threading.Lock()  # the caches and counters, shared with that thread

    # -- compiled on first use -----------------------------------------------------------
    def compiled(self, shape: tuple[int, int], launch: Launch = Launch.STEP) -> Program:
        """The executable that runs ``launch`` at ``shape``, and its layout, compiled on
        first use (a shape the background thread has in hand: waits for it): the pass
        executable for ``Launch.PASS`` (spp > 1), the step (spp > 1: tick) for the others."""
        cache = self.passes if launch is Launch.PASS else self.steps
        entry = cache.get(shape)
        if entry is None and cache is self.steps:
            _wait_for(self.deferred, shape)
            entry = cache.get(shape)
        if entry is None:
            t0 = time.perf_counter()
            lowered, layout = self.lowering.lower(shape, launch)
            exe = _compile(lowered, self.cache_events)
            with self._lock:
                entry = cache.setdefault(shape, (exe, layout))
                self.compile_count += 1
                self.compile_seconds += time.perf_counter() - t0
        return entry

    def sampler(self, rows: int | None = None, wait: bool = True) -> jax.stages.Compiled:
        """The sampling executable on ``rows`` padded rows (default: the largest step's),
        compiled on first use; ``wait``: if the background thread has it in hand, wait for
        it rather than compile it a second time."""
        rows = rows or self.sample_rows
        if rows not in self.samplers and wait:
            _wait_for(self.deferred, _SamplerKey(rows))
        with self._lock:
            exe = self.samplers.get(rows)
        if exe is None:
            t0 = time.perf_counter()
            exe = _compile(self.lowering.lower_sampler(rows), self.cache_events)
            with self._lock:
                if rows in self.samplers:  # the other thread was first
                    return self.samplers[rows]
                self.samplers[rows] = exe
                self.compile_count += 1
                self.compile_seconds += time.perf_counter() - t0
        return exe

    def burst_ready(self, shape: tuple[int, int]) -> bool:
        """Whether a decode burst of the all-decode ``shape`` can run now (spp == 1): its
        step program, which runs the bursts too (``StepLowering.modes.burst_steps``), is compiled.
        If not, with background compiles (``defer``) it is queued and the caller steps one
        at a time meanwhile, padded up; without, it compiles now."""
        if shape in self.steps:
            return True
        if self.deferred is not None:
            self.deferred.request(shape)
            return False
        self.compiled(shape)
        return True

    def _keep(self, cache: dict, key, program, t0: float) -> None:
        """Stores a program compiled since ``t0`` unless another thread stored one first,
        and counts it."""
        with self._lock:
            if key not in cache:
                cache[key] = program
                self.compile_count += 1
                self.compile_seconds += time.perf_counter() - t0

    def buffer_shapes(self, shape: tuple[int, int], launch: Launch = Launch.STEP
                      ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The packed int32 and float32 buffers a ``launch`` of ``shape`` takes: one step's,
        or with spp > 1 one per pipeline slot ([spp, size]) unless a pass (one step's); and
        its bitmask (``PackedLayout``)."""
        return self.lowering.buffer_shapes(self.compiled(shape, launch)[1], launch)

    def reset(self, args: tuple) -> bool:
        """The arrays a runner built on specs is given, as abstract arguments (params, KV
        cache, state): False when they differ from the specs in a way the programs see;
        then the programs are dropped, to compile again against ``args``."""
        def signature(tree):
            return (jax.tree.structure(tree),
                    [(x.shape, np.dtype(x.dtype), x.sharding) for x in jax.tree.leaves(tree)])
        with self._lock:
            same = signature(args[:2]) == signature(self.lowering.args[:2])
            if not same:
                self.lowering.args = args
                self.steps.clear()
                self.samplers.clear()
                self.movers = None
        return same

    # -- compiled in the background after start ------------------------------------------
    def defer(self, compile_rest: bool = False) -> None:
        """From now on a step shape not compiled yet runs padded up (``ready_shape``) while
        it compiles in the background; ``compile_rest``: queue every bucket shape not
        compiled yet now, smallest first. The sampling executable (spp == 1: only a step
        whose masks come late runs it) is queued first, unless compiled already."""
        self.deferred = DeferredCompiles(self._compile_in_background)
        for rows in self._sampler_rows():
            if rows not in self.samplers:
                self.deferred.request(_SamplerKey(rows))
        if compile_rest:
            for shape in sorted(self.deferred_shapes(), key=lambda s: (s[0] + s[1], s)):
                self.deferred.request(shape)

    def deferred_shapes(self) -> list[tuple[int, int]]:
        """Bucket shapes whose step is not compiled (yet)."""
        with self._lock:
            return [s for s in self.lowering.buckets.all_shapes() if s not in self.steps]

    def _compile_in_background(self, shape: "tuple[int, int] | _SamplerKey") -> None:
        if isinstance(shape, _SamplerKey):
            self.sampler(shape.rows, wait=False)
            return
        t0 = time.perf_counter()
        lowered, layout = self.lowering.lower(shape)
        self._keep(self.steps, shape, (_compile(lowered, self.cache_events), layout), t0)

    def ready_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The shape to run a step of bucket ``shape`` at now: itself once compiled; while
        it is not (``defer``), the smallest compiled shape at least as large in both
        dimensions, and its compile is queued; with none, itself (compiled on the spot)."""
        if self.deferred is None or shape in self.steps:
            return shape
        with self._lock:
            cover = [s for s in self.steps if s[0] >= shape[0] and s[1] >= shape[1]]
        if not cover:
            return shape
        self.deferred.request(shape)
        ran = min(cover, key=lambda s: (s[0] + s[1], s))
        self.padded[(shape, ran)] += 1
        return ran

    @property
    def compiled_later(self) -> int:
        """Programs compiled after ``warmup``: in the background or on first use."""
        return self.compile_count - self.compiled_up_front

    def wait_compiles(self, timeout: float | None = None) -> bool:
        """Blocks until the background compiles requested so far are done (tests, benches)."""
        return self.deferred is None or self.deferred.wait(timeout)

    def _sampler_rows(self) -> list[int]:
        """The row counts of the sampling executables steps use (``rows_for``)."""
        return list(dict.fromkeys((self.sample_rows, self.lowering.plain_rows)))

    def samplers_missing(self) -> int:
        """Sampling executables not compiled (yet): ``defer`` queues them."""
        return sum(rows not in self.samplers for rows in self._sampler_rows())

    # -- compiled before the engine is ready ---------------------------------------------
    def core_shapes(self) -> list[tuple[int, int]]:
        """What ``warmup(core=True)`` compiles before the engine is ready: the largest step,
        which every other step fits in padded, and the smallest decode-only step (one
        stream decoding: the common steady state, where padding would cost the most)."""
        b = self.lowering.buckets
        largest = (b.decode_rows[-1], b.prefill_tokens[-1])
        smallest_decode = b.shape_for(1, 0)
        return [smallest_decode, largest] if smallest_decode != largest else [largest]

    def pass_warmup_shapes(self) -> list[tuple[int, int]]:
        """The shapes whose pass ``warmup`` compiles (spp > 1): every bucket shape's (a lone
        batch runs as a pass when the pipeline is empty: a lone prefill, a lone decode), so
        nothing compiles while serving."""
        return [] if self.spp == 1 else self.lowering.buckets.all_shapes()

    def _warmup_jobs(self, core: bool):
        """(name, key, lowered) of each program ``warmup`` compiles, lowered here as it is
        asked for (the GIL gives nothing to lowering in threads, and the workers compile the
        ones before meanwhile), longest first; the swap programs' key is ``"swap"`` and
        their lowering is the worker's (the scatter takes the compiled gather's output
        shardings)."""
        shapes = self.core_shapes() if core else self.lowering.buckets.all_shapes()
        todo = [(s, Launch.STEP) for s in shapes if s not in self.steps]
        todo += [(s, Launch.PASS) for s in self.pass_warmup_shapes() if s not in self.passes]
        todo.sort(key=lambda job: -sum(job[0]))  # the longest compiles start first
        for s, launch in todo:
            yield (f"{'pass' if launch is Launch.PASS else 'step'} {s[0]}x{s[1]}",
                   (s, launch), self.lowering.lower(s, launch))
        # A plain step samples in its own executable; the sampling executable serves only
        # steps whose masks come late, so with ``core`` it compiles after start (``defer``).
        if self.spp > 1 or not core:
            for rows in self._sampler_rows():
                if rows not in self.samplers:
                    yield (f"sampler {rows} rows", _SamplerKey(rows),
                           self.lowering.lower_sampler(rows))
        if self.swaps and self.movers is None and not core:
            yield f"swap read+write {page_io.SWAP_CHUNK} pages", "swap", None

    def warmup(self, threads: int | None = None, progress: bool | None = None,
               core: bool = False) -> None:
        """Compiles the whole program set before the engine is ready: every bucket's step
        (spp: tick, and each shape's pass), the sampling executables and the swap programs
        (when ``swaps``);
        with ``core`` only ``core_shapes`` (spp == 1: ``defer`` queues the rest).
        Tracing and lowering run here one after another; XLA compiles, or reads the
        persistent cache, in ``threads`` worker threads (default: one per two cores, at
        least 2), which release the GIL. Each program's seconds (its lowering plus its
        compile or cache read) land in ``compile_times``. ``progress``: a tqdm bar (None:
        only on a terminal)."""
        t0 = time.perf_counter()
        self.threads = threads = threads or max(2, (os.cpu_count() or 2) // 2)
        with ThreadPoolExecutor(threads) as pool, \
                tqdm(desc="compiling step programs", unit="program",
                     disable=None if progress is None else not progress) as bar:
            futures = {}
            for name, key, lowered in self._warmup_jobs(core):
                futures[pool.submit(self._compile_timed, key, lowered)] = name, key
                bar.total = len(futures)
            for fut in as_completed(futures):
                name, key = futures[fut]
                program, seconds = fut.result()
                self._warmed(key, program)
                self.compile_times[name] = seconds
                bar.update()
        self.compile_seconds += time.perf_counter() - t0
        self.compiled_up_front = self.compile_count
        log.info("compiled %d programs in %.1f s (%d threads; %.1f s of compiles)",
                 len(futures), time.perf_counter() - t0, threads,
                 sum(self.compile_times.values()))

    def _compile_timed(self, key, lowered) -> tuple[object, float]:
        """A worker's job: the compiled program of ``key`` and its seconds."""
        t0 = time.perf_counter()
        if key == "swap":
            gather, lower_scatter = page_io.lower_movers(self.lowering.args[1],
                                                         self.lowering.replicated)
            read = _compile(gather, self.cache_events)
            return (page_io.PageMovers(read, _compile(lower_scatter(read), self.cache_events)),
                    time.perf_counter() - t0)
        if isinstance(lowered, tuple):  # a step or pass: (lowered, its layout)
            return ((_compile(lowered[0], self.cache_events), lowered[1]),
                    time.perf_counter() - t0)
        return _compile(lowered, self.cache_events), time.perf_counter() - t0

    def _warmed(self, key, program) -> None:
        """Keeps a program ``warmup`` compiled and counts it (the swap programs as two)."""
        with self._lock:
            if key == "swap":
                self.movers = program
                self.compile_count += 2
                return
            if isinstance(key, _SamplerKey):
                self.samplers[key.rows] = program
            else:
                shape, launch = key
                (self.passes if launch is Launch.PASS else self.steps)[shape] = program
            self.compile_count += 1
