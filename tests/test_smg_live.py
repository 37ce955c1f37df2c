"""Two ``jserve serve`` replicas behind SGLang's model gateway (``smg launch --policy
cache_aware``) and behind vllm-router (``--policy cache_aware``, which fills every request with
its own defaults of SGLang's extra fields) on loopback ports: each shared document's requests
land on one replica, whose prefix hit rate is a lone replica's; behind smg a replica killed
mid-stream ends its stream with an error, and every later request is served by the other;
nothing hangs."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Served

pytestmark = pytest.mark.slow
SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
VLLM_ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or \
    shutil.which("vllm-router")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counters(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.startswith("vllm:") and s.name.endswith("_total"):
                out[s.name] = s.value
    return out


class Gateway:
    """``smg`` or ``vllm-router`` in front of ``workers``, ready when both see every worker
    healthy (the two share the ``/readiness`` endpoint of SGLang's router they come from)."""

    def __init__(self, workers: list[str], kind: str = "smg"):
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        common = ["--host", "127.0.0.1", "--port", port, "--policy", "cache_aware",
                  "--worker-urls", *workers, "--health-check-interval-secs", "1",
                  # both default to port 29000 for their own metrics
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
        cmd = ([SMG, "launch", *common, "--disable-tokenizer-autoload", "--log-level", "warn"]
               if kind == "smg" else [VLLM_ROUTER, *common, "--log-level", "warning"])
        if cmd[0] is None:
            pytest.fail(f"{kind} is not installed (pip install jserve[test])")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        end = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(self.url + "/readiness", timeout=2)
                if r.status_code == 200 and r.json()["healthy_workers"] == len(workers):
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                self.proc.kill()
                err = self.proc.communicate()[1][:3000]
                raise RuntimeError(f"{kind} did not get ready: {err}")
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def cluster():
    if SMG is None:
        pytest.fail("smg is not installed (pip install jserve[test])")
    replicas = [Served("--max-model-len", "512") for _ in range(2)]
    gw = None
    try:
        gw = Gateway([r.url for r in replicas])
        yield replicas, gw
    finally:
        if gw is not None:
            gw.close()
        for r in replicas:
            r.close()


def _complete(url: str, prompt: str, n: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "default", "prompt": prompt, "max_tokens": n, "temperature": 0})


def _document(d: int) -> str:
    return f"Document {d}. " + "".join(chr(97 + (i * 7 + d * 5) % 26) for i in range(300))


@pytest.mark.parametrize("kind", ["smg", "vllm-router"])
def test_shared_documents_land_on_one_replica_with_a_lone_replicas_hit_rate(cluster, kind):
    replicas, smg = cluster
    urls = [r.url for r in replicas]
    gw = smg if kind == "smg" else Gateway(urls, kind)
    try:
        _shared_documents(urls, gw, offset=0 if kind == "smg" else 10)
    finally:
        if gw is not smg:
            gw.close()


def _shared_documents(urls: list[str], gw: Gateway, offset: int) -> None:

    def rate(before, after):
        q = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        return (after["vllm:prefix_cache_hits_total"]
                - before["vllm:prefix_cache_hits_total"]) / q
    # A lone replica's hit rate on one document asked three times.
    before = _counters(urls[0])
    for q in range(3):
        assert _complete(urls[0], _document(99 + offset) + f" Question {q}?").status_code == 200
    lone = rate(before, _counters(urls[0]))
    assert lone > 0.5
    # Through the gateway: three documents, three questions each.
    start = [_counters(u) for u in urls]
    placed = {}
    for d in range(offset, offset + 3):
        for q in range(3):
            before = [_counters(u) for u in urls]
            r = _complete(gw.url, _document(d) + f" Question {q}?")
            assert r.status_code == 200, r.text
            after = [_counters(u) for u in urls]
            (where,) = [i for i in range(2) if after[i]["vllm:prompt_tokens_total"]
                        > before[i]["vllm:prompt_tokens_total"]]
            placed.setdefault(d, set()).add(where)
    assert all(len(w) == 1 for w in placed.values()), placed
    end = [_counters(u) for u in urls]
    for i in {w for ws in placed.values() for w in ws}:
        assert abs(rate(start[i], end[i]) - lone) <= 0.10, (i, rate(start[i], end[i]), lone)


def test_a_killed_replica_ends_its_streams_and_the_other_serves_the_rest(cluster):
    replicas, gw = cluster
    result, events = {}, []

    def long():
        t0 = time.monotonic()
        try:
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=60, json={
                    "model": "default", "prompt": "a long story", "max_tokens": 480,
                    "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.TransportError as e:
            result["error"] = repr(e)
        result["seconds"] = time.monotonic() - t0
    t = threading.Thread(target=long)
    t.start()
    victim = None
    end = time.monotonic() + 30
    while len(events) < 5 and time.monotonic() < end:  # streaming, far from done
        time.sleep(0.005)
    while victim is None and time.monotonic() < end and t.is_alive():
        loads = [httpx.get(r.url + "/get_load", timeout=5).json()[0]["num_reqs"]
                 for r in replicas]
        victim = loads.index(1) if 1 in loads else None
    assert victim is not None, "the long request never showed on a replica"
    os.kill(replicas[victim].proc.pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "the stream on the killed replica hung"
    assert result["seconds"] < 30
    ended_with_error = "error" in result or (
        events and events[-1] == "[DONE]" and '"error"' in events[-2])
    assert ended_with_error, events[-3:]
    assert len([e for e in events if '"error"' not in e]) < 480  # it did not complete
    survivor = replicas[1 - victim].url
    before = _counters(survivor)["vllm:prompt_tokens_total"]
    for i in range(6):
        t0 = time.monotonic()
        r = _complete(gw.url, f"hello {i}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - t0 < 30
    assert _counters(survivor)["vllm:prompt_tokens_total"] > before
