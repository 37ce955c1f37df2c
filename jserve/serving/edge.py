"""The bounded edge under both HTTP ports of ``jserve serve`` (the OpenAI API and
``--metrics-port``): uvicorn on the server's event loop (no thread per connection) with a
protocol that bounds what uvicorn 0.54's httptools protocol leaves open.

From uvicorn itself:
- ``limit_concurrency``, set to ``max_connections + 1`` (it counts the asking connection
  too): a request head that completes while more than ``max_connections`` connections are
  open on the port gets 503 and the connection is closed. Every connection counts from
  accept, under TLS too (below).
- ``timeout_keep_alive``: a connection idle after a response is closed.
- ``ws="none"``: an ``Upgrade: websocket`` request is not handed to a websocket protocol,
  which would sit outside these bounds (nothing here serves websockets).
uvicorn's ``h11_max_incomplete_event_size`` bounds heads in its h11 protocol only; its
httptools protocol (the fast one, used here) has no bound on a head's size or time.

Added here (``EdgeProtocol``, a subclass of uvicorn's ``HttpToolsProtocol``):
- **Head timeout**: from accept (the TLS handshake included), and from the first byte of a
  new request on a reused connection, to the end of the request head; past it the
  connection is closed (with a 408 when part of a head came). uvicorn's keep-alive timer
  runs only between a response and the next byte, so a connection that never sent a head,
  or sent one a byte a second, stayed open for ever.
- **Body timeout**: a total, from the end of a request's head to the end of its body (not an
  idle gap between reads, which a body a byte a second never exceeds); past it the request
  gets 408 and the connection is closed, or, if its response has started, is just closed.
  It runs only while the body is read: not for a request queued behind a pipelined one
  (whose body the server is not reading yet), not while lingering, and never over a
  response (an SSE stream runs for minutes after its request's body was read). Before, a
  body a byte a second after a complete head was bounded by nothing.
- **Head size**: a head over ``max_head_bytes`` gets 431. httptools is fed at most that much
  of a head, so a connection holds at most the cap plus one read (asyncio reads 256 KiB at
  most); before, httptools buffered a header of any size (128 MB on /health got a 200).
- **Lingering close**: a response that ends before its request's body was read (413, and
  401, 503... on a big POST) ends the connection, but first the rest of the body is read and
  dropped, for at most ``linger_s`` and ``linger_bytes``, with our side already shut for
  writing (nginx's lingering close). Closing at once made the kernel reset the connection
  while the client was still sending, and urllib, requests and httpx then report the reset
  instead of the answer. (uvicorn, answering early on a kept-alive connection, instead read
  and parsed the rest of the body with no bound at all.)
- **TLS from accept**: with a certificate the listening socket is plain TCP and each
  connection starts its own handshake (``loop.start_tls``) in ``connection_made``, so it is
  counted toward ``max_connections`` from accept and its handshake is within the head
  timeout. Before, asyncio ran the handshake (``create_server(ssl=...)``) and called the
  protocol's ``connection_made``, where uvicorn counts, only after it, with asyncio's own
  60 s handshake timeout: connections that opened TCP and never finished a handshake were
  uncounted, each held 60 s, so any number of them fit past the cap.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import resource
import socket
import ssl

import uvicorn
from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EdgeLimits:
    """Per port (``jserve serve`` flags and ``ServerConfig`` fields of the same names)."""

    head_timeout: float = 10.0         # accept (or a new request's first byte) to head's end
    body_timeout: float = 30.0         # a request head's end to its body's end; later: 408
    max_head_bytes: int = 64 << 10     # request line and headers; larger: 431
    max_connections: int = 2048        # open at once; a request on one more gets 503
    keep_alive: float = 30.0           # idle seconds between requests (uvicorn's)
    linger_s: float = 30.0             # nginx's lingering_time
    linger_bytes: int = 256 << 20      # 64x the default --max-request-bytes

    @classmethod
    def of(cls, config) -> EdgeLimits:
        """The limits a ``ServerConfig`` sets."""
        return cls(head_timeout=config.head_timeout, body_timeout=config.body_timeout,
                   max_head_bytes=config.max_head_bytes, max_connections=config.max_connections)


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head and body timeouts, a head size cap, a lingering
    close and, given ``tls``, its own TLS handshake (see the module's docstring)."""

    def __init__(self, *args, limits: EdgeLimits, tls: ssl.SSLContext | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.tls = tls
        self._head: int | None = 0   # bytes of the head being read; None: reading a body
        self._heads = 0              # heads read so far
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_left: int | None = None  # bytes still to drop; None: not lingering
        self._linger_timer: asyncio.TimerHandle | None = None
        self._raw: asyncio.Transport | None = None  # under TLS: the TCP transport
        self._handshake: asyncio.Task | None = None
        self._early: list[bytes] = []  # TLS data that came before ``connection_made`` ran

    def connection_made(self, transport) -> None:
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)
        if self.tls is None:
            super().connection_made(transport)
            return
        # Accepted, the handshake still to come: counted from now (uvicorn counts in
        # ``connection_made``, which asyncio's own TLS calls only after the handshake).
        self._raw = transport
        self.connections.add(self)
        transport.pause_reading()  # start_tls takes the reading over
        self._handshake = self.loop.create_task(self._start_tls(transport))

    async def _start_tls(self, raw) -> None:
        tls = None
        try:
            tls = await self.loop.start_tls(raw, self, self.tls, server_side=True,
                                            ssl_handshake_timeout=self.limits.head_timeout)
        except OSError:  # a failed handshake (ssl.SSLError), asyncio's timeout, a reset
            pass
        finally:
            self._handshake = None
            if tls is None:  # failed, or closed meanwhile (the head timer, a shutdown)
                self.connections.discard(self)
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None
                raw.close()
        if tls is None:
            return
        super().connection_made(tls)
        if self._early:  # the TLS layer hands data on as soon as the handshake ends
            early, self._early = b"".join(self._early), []
            self.data_received(early)

    def connection_lost(self, exc) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.transport is None:  # still in the TLS handshake
            self._raw.close()
            return
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self.transport is None:  # TLS: after the handshake, before ``connection_made``
            self._early.append(data)
            return
        if self._linger_left is not None:
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.transport.close()
            return
        if self._head is not None:
            room = self.limits.max_head_bytes - self._head
            if len(data) > room:  # the head must end within what fits
                heads = self._heads
                if room:
                    self._head += room
                    super().data_received(data[:room])
                if self.transport.is_closing() or self._linger_left is not None:
                    return
                if self._heads == heads:
                    return self._refuse(431, f"the request head is over this server's limit "
                                             f"of {self.limits.max_head_bytes} bytes", True)
                return self.data_received(data[room:])  # a body, or the next head
            self._head += len(data)
        super().data_received(data)

    # -- parser callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a new request on a reused connection
            self._head_timer = self.loop.call_later(self.limits.head_timeout,
                                                    self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._heads += 1
        self._head = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:  # the cycle's close() ends the connection our way
            self.cycle.transport = _Closer(self, self.cycle)
        if not self.pipeline:  # its body is read now (a queued one's: once it starts)
            self._start_body_timer()

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()
        self._head = 0  # whatever comes next is the next request's head

    def on_response_complete(self) -> None:
        if self._linger_left is None and not self.pipeline and self.cycle.more_body:
            self.end(self.cycle)  # answered before its body was read: no keep-alive
        if self._linger_left is not None:
            self.server_state.total_requests += 1
            return
        super().on_response_complete()
        if not self.pipeline and self.cycle.more_body and not self.transport.is_closing():
            self._start_body_timer()  # a pipelined request started with its body unread

    def _start_body_timer(self) -> None:
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_timeout,
                                                    self._body_timed_out)

    # -- ending ----------------------------------------------------------------------------
    def end(self, cycle) -> None:
        """Closes the connection after ``cycle``'s response: at once if its request was read
        whole (or the client left), else after lingering."""
        if cycle.more_body and not cycle.disconnected and not self.transport.is_closing():
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        self._linger_left = self.limits.linger_bytes
        self._unset_keepalive_if_required()
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        if self.cycle is not None:
            self.cycle.body = bytearray()
        self.flow.resume_reading()
        if self.transport.can_write_eof():  # (not under TLS)
            self.transport.write_eof()  # after what is buffered; the client's EOF closes
        self._linger_timer = self.loop.call_later(self.limits.linger_s, self.transport.close)

    def _refuse(self, status: int, message: str, linger: bool, instead=None) -> None:
        """Answers ``status`` and ends the connection: between responses, or in place of the
        response of ``instead`` (the request being read) while that has not started; else
        (mid-response) the connection is just closed."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle is not instead or cycle.response_started:
                self.transport.close()
                return
            cycle.disconnected = True  # its app reads http.disconnect; what it sends is dropped
            cycle.message_event.set()
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": None}}).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        if linger:
            self._linger()
        else:
            self.transport.close()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None:  # still in the TLS handshake
            self._raw.close()
            return
        if self.transport.is_closing():
            return
        if self._head:  # part of a head came
            self._refuse(408, f"the request head did not arrive within "
                              f"{self.limits.head_timeout:g} s", False)
        else:
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or not self.cycle.more_body:
            return
        self._refuse(408, f"the request body did not arrive within "
                          f"{self.limits.body_timeout:g} s of its head", False, self.cycle)


class _Closer:
    """What a request's cycle writes through: closing it ends the connection the edge's way
    (uvicorn's cycle uses only these three)."""

    def __init__(self, protocol: EdgeProtocol, cycle):
        self.write = protocol.transport.write
        self.is_closing = protocol.transport.is_closing
        self.close = functools.partial(protocol.end, cycle)


class EdgeServer:
    """A uvicorn server with ``EdgeProtocol`` serving ``app`` on the running loop."""

    def __init__(self, app, limits: EdgeLimits, *, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None):
        self.limits = limits
        # uvicorn's own TLS context (its defaults), handed to the protocol instead of to
        # uvicorn: the listening socket stays plain TCP and each connection does its own
        # handshake (the module's docstring).
        tls = None if ssl_certfile is None else create_ssl_context(
            certfile=ssl_certfile, keyfile=ssl_keyfile, password=None,
            ssl_version=SSL_PROTOCOL_VERSION, cert_reqs=ssl.CERT_NONE, ca_certs=None,
            ciphers=None)
        config = uvicorn.Config(
            app, interface="asgi3", http=functools.partial(EdgeProtocol, limits=limits, tls=tls),
            ws="none", lifespan="off", log_level="warning", access_log=False,
            proxy_headers=False, timeout_graceful_shutdown=0.2,
            timeout_keep_alive=limits.keep_alive,
            limit_concurrency=limits.max_connections + 1)
        self.server = _Uvicorn(config)
        self.task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> int:
        """Binds and serves; returns the port."""
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say so; with
        # it on, every write after the first unacknowledged one waited for the client's
        # delayed ACK (about 40 ms on Linux): SSE events came in 40 ms bursts.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
        _check_file_limit(self.limits.max_connections)
        self.task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise OSError(f"HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self, timeout: float) -> None:
        if self.task is None:
            return
        self.server.should_exit = self.server.force_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout + 0.2)
        except asyncio.TimeoutError:
            self.task.cancel()


@functools.cache
def _check_file_limit(connections: int) -> None:
    """Every connection is a file descriptor: below the cap (plus the process's own files),
    accept() fails (EMFILE) before the cap is reached, and new connections wait instead of
    getting 503. Said once per value."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < connections + 256:
        log.warning("the open-file limit (ulimit -n %d) is below --max-connections %d + 256: "
                    "raise it or lower --max-connections", soft, connections)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process's SIGTERM drain owns that."""

    def capture_signals(self):
        return contextlib.nullcontext()
