"""Step programs compiled after the engine is ready, in one background thread.

At start the engine compiles only its core programs (``StepPrograms.core_shapes``: the
largest step, which covers any other, and the one-row decode); every other bucket shape is
compiled here when a step first needs it (``warmup="core"``) or right after start
(``warmup="background"``). Until a shape is ready, its steps run padded up to the smallest
compiled shape that covers them (``StepPrograms.ready_shape``): padding rows and tokens are
what every bucket already carries, so the tokens are the same, only that step is slower.

One thread, not a pool: on a small host the serving loop needs the other cores. The thread
ends when its queue is empty (a dropped engine's runner is not kept alive) and, so a process
never waits for compiles it will not use, when the main thread has ended (it finishes the
program in hand first: killing XLA mid-compile at exit can crash the interpreter).
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Hashable

from jserve.os_threads import name_os_thread

log = logging.getLogger(__name__)


class DeferredCompiles:
    """A queue of programs (by key) compiled one at a time by ``compile_one(key)`` in a
    background thread; ``future(key)`` lets a caller that cannot wait for padding wait for
    the program itself instead of compiling it a second time."""

    def __init__(self, compile_one: Callable[[Hashable], None], name: str = "jserve-compile"):
        self._compile_one = compile_one
        self._name = name
        self._queue: queue.Queue = queue.Queue()
        self._futures: dict[Hashable, Future] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.failed: dict[Hashable, BaseException] = {}

    def request(self, key: Hashable) -> None:
        """Queues ``key`` unless it is queued, compiling or done already."""
        with self._lock:
            if key in self._futures:
                return
            self._futures[key] = Future()
            self._queue.put(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name)
                self._thread.start()

    def future(self, key: Hashable) -> Future | None:
        with self._lock:
            return self._futures.get(key)

    @property
    def pending(self) -> int:
        """Programs requested and not finished yet."""
        with self._lock:
            return sum(not f.done() for f in self._futures.values())

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every requested program is compiled (True) or ``timeout`` passes."""
        with self._lock:
            futures = list(self._futures.values())
        for f in futures:
            try:
                f.exception(timeout=timeout)
            except TimeoutError:
                return False
        return True

    def _run(self) -> None:
        name_os_thread()
        main = threading.main_thread()
        while True:
            with self._lock:
                if self._queue.empty() or not main.is_alive():
                    self._thread = None
                    for f in self._futures.values():  # never compiled: waiting callers go on
                        f.cancel()
                    return
                key = self._queue.get()
                fut = self._futures[key]
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                self._compile_one(key)
            except BaseException as e:  # noqa: BLE001 - the step keeps running padded
                log.exception("background compile of %s failed; its steps stay padded", key)
                self.failed[key] = e
                fut.set_exception(e)
            else:
                fut.set_result(None)
