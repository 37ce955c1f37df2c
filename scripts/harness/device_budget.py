"""A time budget for the device check (``scripts/device_check.py --budget S``): a GPU machine
is often lent for about 15 minutes, machine start and transfers included, and on a fresh one
every program compiles cold. The check's items run most valuable first; before each, the
results so far are written (valid JSON, replaced atomically), an item that would start with
less than its floor of time left is skipped, and a watchdog thread ends the process at the
deadline after writing what was measured and what was not (``cut_short``). Every XLA compile
(or persistent-cache read) is timed per program from JAX's monitoring events and printed."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import jax

from harness.device_report import error_text, say

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
PRINT_COMPILES_OVER_S = 0.5  # smaller compiles are summed in one line per item
CUT_SHORT_EXIT = 3           # exit status when the watchdog ends the run


@dataclasses.dataclass
class Item:
    """One measurement: ``run()`` fills the results itself (and raises on failure);
    ``floor_s``: skipped when less than this is left of the budget."""

    name: str
    run: Callable[[], None]
    floor_s: float = 10.0
    quiet: bool = False  # bookkeeping (freeing memory, a summary): run, never recorded


class Budget:
    """Runs ``Item``s in order within ``seconds`` (None: no limit), recording each one's
    status, seconds and compiles in ``res["items"]`` and writing ``res`` to ``path`` before
    and after each."""

    def __init__(self, seconds: float | None, path: Path, res: dict,
                 on_cut: Callable[[], None] | None = None):
        """``on_cut``: called by the watchdog after the JSON is written (the markdown)."""
        self.seconds, self.path, self.res, self.on_cut = seconds, path, res, on_cut
        self.start = time.monotonic()
        self.deadline = None if seconds is None else self.start + seconds
        self.current: dict | None = None
        self.pending: list[Item] = []
        self.compiles: list[tuple[str, float]] = []  # (program, seconds) of the current item
        self._lock = threading.Lock()
        self._finished = threading.Event()  # run_all returned: the watchdog stands down
        res.update(budget_s=seconds, cut_short=False, items=[], compiles=[])
        jax.monitoring.register_event_duration_secs_listener(self._compiled)

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def _compiled(self, event: str, secs: float, fun_name: str = "?", **_) -> None:
        if event == BACKEND_COMPILE:
            self.compiles.append((str(fun_name), float(secs)))

    def write(self) -> None:
        """``res`` as JSON at ``path``, whole or not at all (a reader never sees half)."""
        with self._lock:
            self.res["elapsed_s"] = time.monotonic() - self.start
            for attempt in range(3):  # the watchdog may write while an item adds a row
                try:
                    text = json.dumps(self.res, indent=1, default=str) + "\n"
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
                    time.sleep(0.05)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)

    def run_all(self, items: list[Item]) -> None:
        self.pending = list(items)
        watchdog = None
        if self.deadline is not None:
            watchdog = threading.Thread(target=self._watch, name="device-check-budget",
                                        daemon=True)
            watchdog.start()
        while self.pending:
            item = self.pending.pop(0)
            if item.quiet:
                self._run_quiet(item)
                continue
            if self.left() < item.floor_s:
                self._skip(item, f"budget: {max(self.left(), 0):.0f} s left, needs "
                                 f"{item.floor_s:.0f} s")
                continue
            self._run(item)
        self._finished.set()
        jax.monitoring.unregister_event_duration_listener(self._compiled)
        self.write()

    @staticmethod
    def _run_quiet(item: Item) -> None:
        try:
            item.run()
        except Exception:  # noqa: BLE001 - bookkeeping; the next items still run
            traceback.print_exc()

    def _skip(self, item: Item, reason: str) -> None:
        self.res["items"].append(dict(name=item.name, status="skipped", reason=reason))
        say(f"[skip] {item.name}: {reason}")

    def _run(self, item: Item) -> None:
        self.current = dict(name=item.name, status="running",
                            started_s=round(time.monotonic() - self.start, 1))
        self.res["items"].append(self.current)
        self.compiles = []
        self.write()
        t0 = time.perf_counter()
        try:
            item.run()
            self.current["status"] = "done"
        except Exception as e:  # noqa: BLE001 - the next items still run
            traceback.print_exc()
            self.current.update(status="failed", error=error_text(e))
        self.current["seconds"] = round(time.perf_counter() - t0, 2)
        say(f"[{self.current['status']}] {item.name}: {self.current['seconds']:.1f} s, "
            f"{max(self.left(), 0):.0f} s of the budget left" if self.deadline else
            f"[{self.current['status']}] {item.name}: {self.current['seconds']:.1f} s")
        self._report_compiles(item.name)
        self.current = None
        self.write()

    def _report_compiles(self, name: str) -> None:
        """Prints the item's compiles (each over ``PRINT_COMPILES_OVER_S``, the rest summed)
        and keeps them all in ``res["compiles"]``."""
        done, self.compiles = self.compiles, []
        for program, secs in done:
            self.res["compiles"].append(dict(item=name, program=program, seconds=round(secs, 3)))
            if secs >= PRINT_COMPILES_OVER_S:
                say(f"  compile {program}: {secs:.1f} s")
        small = [s for _, s in done if s < PRINT_COMPILES_OVER_S]
        if small:
            say(f"  compile {len(small)} small programs: {sum(small):.1f} s")
        if self.current is not None:
            self.current["compile_s"] = round(sum(s for _, s in done), 2)
            self.current["compiles"] = len(done)

    def _watch(self) -> None:
        """At the deadline: the item in hand and every pending one recorded as cut short or
        skipped, the results written, the process ended (a compile or a device call cannot
        be interrupted from Python)."""
        while self.left() > 0:
            if self._finished.wait(min(1.0, max(self.left(), 0.01))):
                return
        with self._lock:
            if self._finished.is_set():
                return
            self.res["cut_short"] = True
            if self.current is not None:
                self.current.update(status="cut short",
                                    seconds=round(time.monotonic() - self.start
                                                  - self.current["started_s"], 1))
            for item in (i for i in self.pending if not i.quiet):
                self.res["items"].append(dict(name=item.name, status="skipped",
                                              reason="budget: the run was cut short"))
            self.pending = []
        self._report_compiles(self.current["name"] if self.current else "?")
        self.res["passed"] = all(c["status"] == "pass" for c in self.res.get("checks", []))
        self.write()
        if self.on_cut is not None:
            self.on_cut()
        say(f"budget of {self.seconds:.0f} s spent: cut short"
            + (f" in {self.current['name']}" if self.current else "")
            + f"; wrote {self.path}")
        os._exit(CUT_SHORT_EXIT)
