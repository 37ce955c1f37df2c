"""The bounded edge under the HTTP ports (issue 39, jserve/serving/edge.py, docs/server.md
"Limits"), against a real ``jserve serve``: connections that never finish a request head are
closed within the head timeout, heads over the cap get 431 unbuffered, a body over the limit
gets a 413 the client can read, a body that drips gets a 408 within the body timeout (and
streams are not cut by it), connections over the cap get 503, TLS connections count toward
the cap from accept (issue 61), and the metrics port holds idle connections without a thread
each. The edge is the same whatever serves the tokens, so these run ``jserve serve
--fake-engine`` (no model, no JAX in the process)."""
from __future__ import annotations

import json
import re
import select
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest
import requests

from conftest import Served

HEAD_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0  # > the drip's 1 s between bytes: only a bound on the total cuts it
TLS = Path(__file__).resolve().parent / "data" / "tls"  # test_server.py's self-signed pair
TOKEN = "tok"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SMALL = {"model": "default", "prompt": "hi", "max_tokens": 2, "temperature": 0.0}


def _served(*flags: str) -> Served:
    s = Served("--fake-engine", "--metrics-port", "0", "--auth-token", TOKEN, *flags)
    s.port = int(s.url.rsplit(":", 1)[1])
    s.metrics_port = int(re.search(r"metrics http://[\d.]+:(\d+)/metrics", s.line).group(1))
    return s


@pytest.fixture(scope="module")
def edge():
    # A 1 MiB request limit: a chunked body is refused once the bytes read pass it, so the
    # server holds at most that plus a chunk, well inside the 4 MiB the peak RSS may grow (a
    # process without a model has no free heap to hide the default 4 MiB in).
    s = _served("--head-timeout", str(HEAD_TIMEOUT), "--max-request-bytes", str(1 << 20))
    httpx.post(s.url + "/v1/completions", json=SMALL, headers=AUTH, timeout=60)  # warms
    yield s
    s.close()


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


class _PeakGrowth:
    """How far the process's peak RSS rose above its RSS at the start of the block (the
    kernel's peak is reset at entry, so a transient buffer shows too)."""

    def __init__(self, pid: int):
        self.pid = pid

    def __enter__(self):
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.rss = _status(self.pid, "VmRSS")
        return self

    def __exit__(self, *exc):
        self.grown = _status(self.pid, "VmHWM") - self.rss


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _health(s: socket.socket) -> bytes:
    """GET /health on a kept-alive connection; the whole response."""
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    got = b""
    while not got.endswith(b"}"):
        data = s.recv(65536)
        assert data, got
        got += data
    return got


def _wait_closed(socks: list[socket.socket], deadline: float) -> dict:
    """Reads every socket until the server closes it (or ``deadline``): {socket: (monotonic
    time of the close, bytes received)}; the ones still open are missing."""
    got = {s: b"" for s in socks}
    closed = {}
    while len(closed) < len(socks) and time.monotonic() < deadline:
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [],
                                       max(0.0, deadline - time.monotonic()))
        for s in readable:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            got[s] += data
            if not data:
                closed[s] = (time.monotonic(), got[s])
    return closed


def _dribble(socks: list[socket.socket], payload: bytes, stop: threading.Event) -> None:
    """Sends each socket the next byte of ``payload`` once a second (slowloris)."""
    for i in range(len(payload)):
        for s in socks:
            try:
                s.send(payload[i:i + 1])
            except OSError:
                pass
        if stop.wait(1.0):
            return


def test_silent_and_slowloris_connections_are_closed_within_the_head_timeout(edge):
    reused = _connect(edge.port)  # a kept-alive connection that then dribbles its next head
    assert _health(reused).startswith(b"HTTP/1.1 200 ")
    opened = {}  # socket: when its connect began (the server's timer starts later)
    for _ in range(270):
        t = time.monotonic()
        opened[_connect(edge.port)] = t
    silent, slow = list(opened)[:250], list(opened)[250:]
    t0 = opened[reused] = time.monotonic()  # (its timer starts at its first byte, after this)
    stop = threading.Event()
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 60
    dribbler = threading.Thread(target=_dribble, args=(slow + [reused], head, stop))
    dribbler.start()
    try:
        # Meanwhile the server answers others at once.
        for _ in range(3):
            t = time.monotonic()
            assert urllib.request.urlopen(edge.url + "/health", timeout=5).status == 200
            r = httpx.post(edge.url + "/v1/completions", json=SMALL, headers=AUTH, timeout=5)
            assert r.status_code == 200 and time.monotonic() - t < 1.0, time.monotonic() - t
        closed = _wait_closed(list(opened), t0 + HEAD_TIMEOUT + 3.0)
    finally:
        stop.set()
        dribbler.join()
    assert len(closed) == len(opened), f"{len(opened) - len(closed)} connections still open"
    for s, began in opened.items():
        when, data = closed[s]
        assert HEAD_TIMEOUT <= when - began and when - t0 <= HEAD_TIMEOUT + 2.0, \
            (when - began, when - t0)
        if s in silent:  # closed without a word: they asked nothing
            assert data == b""
        else:
            assert data.startswith(b"HTTP/1.1 408 "), data[:80]
        s.close()


def _post_raw_head(port: int, head: bytes, result: list) -> None:
    with _connect(port) as s:
        s.sendall(head)
        result.append(s.recv(65536))


def test_a_1_mb_header_gets_431_and_is_never_buffered(edge):
    head = (b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    answers: list[bytes] = []
    with _PeakGrowth(edge.proc.pid) as peak:
        senders = [threading.Thread(target=_post_raw_head, args=(edge.port, head, answers))
                   for _ in range(8)]  # 8 MB of heads at once
        for t in senders:
            t.start()
        for t in senders:
            t.join(30)
    assert len(answers) == 8 and all(a.startswith(b"HTTP/1.1 431 ") for a in answers), \
        [a[:40] for a in answers]
    assert b"over this server's limit of 65536 bytes" in answers[0]
    assert peak.grown < 3 << 20, f"peak RSS grew {peak.grown >> 10} KiB"
    # A head just under the cap is still served.
    ok: list[bytes] = []
    _post_raw_head(edge.port, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: "
                   + b"a" * (60 << 10) + b"\r\n\r\n", ok)
    assert ok[0].startswith(b"HTTP/1.1 200 ")


def test_a_64_mib_body_gets_a_413_the_client_reads(edge):
    body = b'{"model": "default", "prompt": "' + b"x" * (64 << 20) + b'"}'
    url = edge.url + "/v1/completions"
    headers = {**AUTH, "content-type": "application/json"}
    with _PeakGrowth(edge.proc.pid) as peak:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers),
                                   timeout=60)
        assert e.value.code == 413
        assert b'"code":"resource_exhausted"' in e.value.read()
        r = httpx.post(url, content=body, headers=headers, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "resource_exhausted"
        r = requests.post(url, data=body, headers=headers, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "resource_exhausted"
        # Sent in chunks (no Content-Length: refused once the bytes read pass the limit).
        r = httpx.post(url, content=(body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)),
                       headers=headers, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "resource_exhausted"
        # Any answer given before the body was read: 401 without the token.
        r = httpx.post(url, content=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
        client = openai.OpenAI(base_url=edge.url + "/v1", api_key=TOKEN, max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="default", prompt="x" * (64 << 20), max_tokens=1)
        assert e.value.status_code == 413 and e.value.body["code"] == "resource_exhausted"
    assert peak.grown < 4 << 20, f"peak RSS grew {peak.grown >> 10} KiB"
    # The server is fine afterwards.
    assert httpx.post(url, json=SMALL, headers=AUTH, timeout=30).status_code == 200


def test_connections_over_the_cap_get_503_and_are_served_again_once_others_close():
    s = _served("--max-connections", "4", "--metrics-open")
    try:
        holders = [_connect(s.port) for _ in range(4)]
        for h in holders:  # each served: open and kept alive
            assert _health(h).startswith(b"HTTP/1.1 200 ")
        r = httpx.get(s.url + "/health", timeout=5)
        assert r.status_code == 503 and r.headers["connection"] == "close"
        # A refused POST reads its 503 too (its body is drained, not reset).
        r = httpx.post(s.url + "/v1/completions", content=b"x" * (8 << 20), headers=AUTH,
                       timeout=30)
        assert r.status_code == 503
        for h in holders:
            h.close()
        deadline = time.monotonic() + 5
        while httpx.get(s.url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "still refused after the holders closed"
            time.sleep(0.05)
        # --metrics-open: the metrics port needs no token.
        r = httpx.get(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=5)
        assert r.status_code == 200 and "jserve_requests_total" in r.text
    finally:
        s.close()


def test_the_metrics_port_holds_idle_connections_without_threads(edge):
    pid, url = edge.proc.pid, f"http://127.0.0.1:{edge.metrics_port}/metrics"

    def threads() -> int:
        import os
        return len(os.listdir(f"/proc/{pid}/task"))
    before = threads()
    t0 = time.monotonic()
    idle = [_connect(edge.metrics_port) for _ in range(200)]
    # Answered after all 200 were accepted (one listening socket, accepted in order).
    r = httpx.get(url, headers=AUTH, timeout=5)
    assert r.status_code == 200 and "jserve_requests_total" in r.text
    assert httpx.get(url, timeout=5).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer wrong"},
                     timeout=5).status_code == 401
    assert threads() <= before + 2, (before, threads())
    closed = _wait_closed(idle, t0 + HEAD_TIMEOUT + 2.0)
    assert len(closed) == len(idle), f"{len(idle) - len(closed)} still open"
    assert all(when - t0 >= HEAD_TIMEOUT - 0.2 for when, _ in closed.values())
    for s in idle:
        s.close()
    assert httpx.get(url, headers=AUTH, timeout=5).status_code == 200


# -- the body timeout (issue 61) -------------------------------------------------------------
LONG = {"model": "default", "prompt": "hi", "max_tokens": 1500, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}  # >= 3 s: 2 ms a token


@pytest.fixture(scope="module")
def bodied():
    s = _served("--body-timeout", str(BODY_TIMEOUT), "--max-model-len", "4096")
    yield s
    s.close()


def _post_head(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer tok\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))


def _read_until(s: socket.socket, got: bytes, end: bytes) -> tuple[bytes, bytes]:
    """Reads until ``end`` has come: (what came up to and with it, what came after)."""
    while end not in got:
        data = s.recv(65536)
        assert data, got[-200:]
        got += data
    i = got.index(end) + len(end)
    return got[:i], got[i:]


def _streamed(result: dict) -> None:
    """A long streaming completion over httpx: its lines and how long it took."""
    t = time.monotonic()
    with httpx.stream("POST", result["url"] + "/v1/completions", json=LONG, headers=AUTH,
                      timeout=60) as r:
        result["status"] = r.status_code
        result["lines"] = [line for line in r.iter_lines() if line]
    result["took"] = time.monotonic() - t


def test_a_body_a_byte_a_second_gets_408_within_the_body_timeout_and_streams_run_on(bodied):
    body = json.dumps(SMALL).encode()
    drip = _connect(bodied.port)
    drip.sendall(_post_head(body))  # the head whole: the head timeout is done with it
    t0 = time.monotonic()
    stream = {"url": bodied.url}
    streamer = threading.Thread(target=_streamed, args=(stream,))
    stop = threading.Event()
    dribbler = threading.Thread(target=_dribble, args=([drip], body, stop))
    streamer.start()
    dribbler.start()
    try:
        # Meanwhile a normal POST on another connection is served at once.
        r = httpx.post(bodied.url + "/v1/completions", json=SMALL, headers=AUTH, timeout=5)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert time.monotonic() - t0 < BODY_TIMEOUT - 0.5, time.monotonic() - t0
        closed = _wait_closed([drip], t0 + BODY_TIMEOUT + 3.0)
    finally:
        stop.set()
        dribbler.join()
        streamer.join(60)
    assert drip in closed, "the dripping POST is still open"
    when, data = closed[drip]
    drip.close()
    # Bytes kept coming (one a second, under the 2 s), so only a bound on the total cut it.
    assert BODY_TIMEOUT <= when - t0 <= BODY_TIMEOUT + 1.0, when - t0
    assert data.startswith(b"HTTP/1.1 408 ") and b"connection: close\r\n" in data, data[:200]
    error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "invalid_request_error" and error["message"] == \
        f"the request body did not arrive within {BODY_TIMEOUT:g} s of its head"
    # The stream, which ran past the body timeout from the start, was not cut.
    assert stream["status"] == 200 and stream["took"] > BODY_TIMEOUT + 0.5, stream.get("took")
    assert stream["lines"][-1] == "data: [DONE]"
    assert json.loads(stream["lines"][-2][6:])["usage"]["completion_tokens"] == 1500
    assert httpx.post(bodied.url + "/v1/completions", json=SMALL, headers=AUTH,
                      timeout=5).status_code == 200


def test_a_pipelined_body_waits_behind_a_stream_without_timing_out(bodied):
    """The server reads a pipelined request's body only once the response before it ends: a
    body timer that ran meanwhile would close the connection, the stream with it."""
    first = json.dumps(LONG).encode()
    second = json.dumps(SMALL).encode()
    with _connect(bodied.port) as s:
        t0 = time.monotonic()
        s.sendall(_post_head(first) + first + _post_head(second) + second[:5])
        streamed, rest = _read_until(s, b"", b"data: [DONE]")
        streamed, rest = _read_until(s, streamed + rest, b"\r\n0\r\n\r\n")  # its end
        took = time.monotonic() - t0
        assert streamed.startswith(b"HTTP/1.1 200 ") and took > BODY_TIMEOUT + 0.5, took
        assert b'"completion_tokens": 1500' in streamed
        s.sendall(second[5:])  # now its body is read (and timed)
        answer, _ = _read_until(s, rest, b"\r\n0\r\n\r\n")  # (chunked too)
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"completion_tokens": 2' in answer, \
            answer


# -- TLS connections count from accept (issue 61) --------------------------------------------
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(TLS / "server.crt"))


def _tls_one_write(port: int, request: bytes) -> bytes:
    """A TLS client whose handshake's last flight and ``request`` go in one write (so the
    request reaches the server with the handshake's end); the response."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = _tls_context().wrap_bio(incoming, outgoing, server_hostname="localhost")
    with _connect(port) as s:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                s.sendall(outgoing.read())
                incoming.write(s.recv(65536))
        tls.write(request)
        s.sendall(outgoing.read())
        got = b""
        while not got.endswith(b"}"):
            try:
                got += tls.read(65536)
            except ssl.SSLWantReadError:
                data = s.recv(65536)
                assert data, got
                incoming.write(data)
        return got


def test_tls_handshakes_count_toward_the_cap_and_are_closed_at_the_head_timeout():
    s = _served("--tls-cert", str(TLS / "server.crt"), "--tls-key", str(TLS / "server.key"),
                "--max-connections", "2", "--head-timeout", "1")
    url = s.url.replace("http://", "https://")
    try:
        assert httpx.get(url + "/health", verify=_tls_context(), timeout=5).status_code == 200
        # A request that reaches the server with the handshake's end is served.
        got = _tls_one_write(s.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 "), got[:80]
        t0 = time.monotonic()
        silent = [_connect(s.port) for _ in range(2)]  # TCP only: no ClientHello, ever
        # They fill the cap: a real client finishes its handshake and its request gets 503.
        r = httpx.get(url + "/health", verify=_tls_context(), timeout=5)
        assert r.status_code == 503 and r.headers["connection"] == "close"
        # The head timeout closes them (the handshake is inside it), without a byte sent.
        closed = _wait_closed(silent, t0 + 1.0 + 2.0)
        assert len(closed) == 2, f"{2 - len(closed)} handshakes still open"
        for sock, (when, data) in closed.items():
            assert 1.0 <= when - t0 <= 1.0 + 1.0 and data == b"", (when - t0, data)
            sock.close()
        assert httpx.get(url + "/health", verify=_tls_context(), timeout=5).status_code == 200
    finally:
        s.close()
