"""The engine core's messages to the front end (``core_process`` to ``process_engine``):
length-prefixed pickled lists of messages on the pipe's socket.

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
import os
import pickle
import socket
import struct
import threading
from typing import Iterator

from jserve.os_threads import name_os_thread

log = logging.getLogger(__name__)

_HEAD = struct.Struct("!Q")


def dumps(msgs: list) -> bytes:
    """``msgs`` pickled; a reply that does not pickle becomes the error saying so."""
    try:
        return pickle.dumps(msgs, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - find the one that does not, keep the rest
        out = []
        for m in msgs:
            try:
                pickle.dumps(m, pickle.HIGHEST_PROTOCOL)
                out.append(m)
            except Exception as e:  # noqa: BLE001 - only a reply carries the caller's data
                log.exception("a message to the front end does not pickle")
                if m[0] == "reply":
                    out.append(("reply", m[1], None, RuntimeError(f"{type(e).__name__}: {e}")))
        return pickle.dumps(out, pickle.HIGHEST_PROTOCOL)


class FrameSender:
    """Frames to the other end of the connection ``fileno``, in order, from any thread."""

    def __init__(self, fileno: int):
        self._sock = socket.socket(fileno=os.dup(fileno))
        self._cond = threading.Condition()
        self._backlog: list[bytes] = []   # what the socket did not take yet
        self._writing = False             # the thread is writing the backlog
        self._broken = False
        threading.Thread(target=self._drain, name="jserve-core-sender", daemon=True).start()

    def send(self, msgs: list) -> None:
        data = dumps(msgs)
        frame = _HEAD.pack(len(data)) + data
        with self._cond:
            if self._broken:
                return
            if not self._backlog and not self._writing:
                try:  # (MSG_DONTWAIT: this write only; the reader's socket stays blocking)
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


def read_frames(fileno: int) -> Iterator[list]:
    """The message lists ``FrameSender`` sent to the other end of ``fileno``; EOFError when
    that end is closed."""
    sock = socket.socket(fileno=os.dup(fileno))
    try:
        while True:
            (n,) = _HEAD.unpack(_recv(sock, _HEAD.size))
            yield pickle.loads(_recv(sock, n))
    finally:
        sock.close()


def _recv(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the engine core closed the pipe")
        got += k
    return buf
