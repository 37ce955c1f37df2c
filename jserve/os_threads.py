"""Python thread names made visible to the OS (``top -H``, ``py-spy``, ``/proc/PID/task/*/comm``),
which Python before 3.14 does not do: a profile of a server then tells the engine thread from
the intake threads and XLA's workers. Linux only (``prctl``); elsewhere nothing happens."""
from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15
_MAX_BYTES = 15  # the kernel's limit, without the terminating zero


def name_os_thread(name: str | None = None) -> None:
    """Gives the calling thread's OS thread ``name`` (default: its Python name)."""
    if not sys.platform.startswith("linux"):
        return
    raw = (name or threading.current_thread().name).encode()[:_MAX_BYTES]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the name stays the process's
        pass
