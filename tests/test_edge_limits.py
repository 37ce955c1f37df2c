"""The bounded edge under the HTTP ports (issue 39, jserve/serving/edge.py, docs/server.md
"Limits"), against a real ``jserve serve``: connections that never finish a request head are
closed within the head timeout, heads over the cap get 431 unbuffered, a body over the limit
gets a 413 the client can read, connections over the cap get 503, and the metrics port holds
idle connections without a thread each. The edge is the same whatever serves the tokens, so
these run ``jserve serve --fake-engine`` (no model, no JAX in the process)."""
from __future__ import annotations

import re
import select
import socket
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest
import requests

from conftest import Served

HEAD_TIMEOUT = 2.0
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
