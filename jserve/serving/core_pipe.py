"""Messages between the engine core's process and the front end's (``core_process``,
``process_engine``): one pickled message a frame, length-prefixed, on a socket pair.

The engine thread sends each iteration itself, in one non-blocking write, because handing
the message to another thread costs more than the write: in a process whose cores XLA keeps
busy, every wake-up of another Python thread is a GIL handoff the engine thread then waits
to get back (profiled: 11% of the engine thread's time with a sender thread, 22% for the
thread engine's ``call_soon_threadsafe``). Only when the socket is full (the front end reads
late) does a thread of its own write the rest, and what is sent meanwhile queues behind it,
so the engine never waits for the front end and the order is kept.
"""
from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
from typing import Iterator

from jserve.os_threads import name_os_thread

log = logging.getLogger(__name__)

_HEAD = struct.Struct("!Q")


def dumps(msg: tuple) -> bytes:
    """``msg`` pickled; a reply that does not pickle becomes the error saying so."""
    try:
        return pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - only a reply carries the caller's data
        if msg[0] != "reply":
            raise
        log.exception("a reply to the front end does not pickle")
        return pickle.dumps(("reply", msg[1], None, RuntimeError(f"{type(e).__name__}: {e}")),
                            pickle.HIGHEST_PROTOCOL)


class FrameSender:
    """Messages to the other end of ``sock``, one a frame, in order, from any thread."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._cond = threading.Condition()
        self._backlog: list[bytes] = []   # what the socket did not take yet
        self._writing = False             # the thread is writing the backlog
        self._broken = False
        threading.Thread(target=self._drain, name="jserve-core-sender", daemon=True).start()

    def send(self, msg: tuple) -> None:
        data = dumps(msg)
        frame = _HEAD.pack(len(data)) + data
        with self._cond:
            if self._broken:
                return
            if not self._backlog and not self._writing:
                try:  # (MSG_DONTWAIT: this write only; the socket stays blocking to read)
                    n = self._sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    n = 0
                except OSError:  # the front end is gone (its reader hears that too)
                    self._broken = True
                    return
                if n == len(frame):
                    return
                frame = frame[n:]
            self._backlog.append(frame)
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Waits (up to ``timeout``) until everything sent has been written."""
        with self._cond:
            self._cond.wait_for(lambda: self._broken or not (self._backlog or self._writing),
                                timeout)

    def _drain(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._backlog)
                chunk, self._backlog, self._writing = b"".join(self._backlog), [], True
            try:
                self._sock.sendall(chunk)
            except OSError:
                with self._cond:
                    self._broken, self._writing = True, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def read_frames(sock: socket.socket) -> Iterator[tuple]:
    """The messages ``FrameSender`` sent to the other end of ``sock``; EOFError when that end
    is closed."""
    while True:
        (n,) = _HEAD.unpack(_recv(sock, _HEAD.size))
        yield pickle.loads(_recv(sock, n))


def _recv(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the engine core closed the pipe")
        got += k
    return buf
