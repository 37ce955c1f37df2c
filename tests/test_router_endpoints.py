"""What routers read from one replica: vLLM-named gauges equal to jserve's own, SGLang's load
endpoint, the replica's predicted wait (less its cached prefix), and a drain notice during
which /health fails while requests are still served. The endpoints are tested on a
``FakeEngine`` (scripted tokens, a prefix cache of whole pages); the live engine's own reports
once, end to end."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jserve.serving.app import BackgroundServer, ServerConfig
from jserve.serving.fake_engine import FakeEngine, text_script


def _samples(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            label = s.labels.get("model_name")
            out[s.name + (f"[{label}]" if label else "")] = s.value
    return out


def _complete(url: str, prompt, n: int = 4, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "default", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, **kw})


def test_vllm_names_and_load_endpoints_report_the_engine():
    engine = FakeEngine(step_s=0.005)  # 300 tokens: 1.5 s at least
    server = BackgroundServer(engine, ServerConfig(port=0, metrics_port=None, http_port=0))
    url = server.http_url
    try:
        doc = list(range(100, 164))  # 64 tokens: 4 pages of 16
        assert _complete(url, doc + [5, 6, 7]).status_code == 200
        # A request still running shows in both name sets and in /get_load.
        streaming = threading.Event()

        def long():
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                    "model": "default", "prompt": [3, 4], "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streaming.set()
        t = threading.Thread(target=long)
        t.start()
        assert streaming.wait(60)
        busy = _samples(url)
        load = httpx.get(url + "/get_load", timeout=10).json()
        t.join(120)
        assert busy["vllm:num_requests_running[default]"] == \
            busy["jserve_num_requests_running"] == 1
        used, free = busy["jserve_kv_blocks_used"], busy["jserve_kv_blocks_free"]
        assert used > 0 and busy["vllm:kv_cache_usage_perc[default]"] == \
            pytest.approx(used / (used + free))
        assert busy["vllm:gpu_cache_usage_perc[default]"] == \
            busy["vllm:kv_cache_usage_perc[default]"]
        assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 1
        assert load[0]["num_waiting_reqs"] == 0 and load[0]["num_tokens"] > 0
        # The same document again: its 4 pages are prefix hits, under both names.
        assert _complete(url, doc + [8, 9]).status_code == 200
        idle = _samples(url)
        assert idle["vllm:prefix_cache_hits_total[default]"] == \
            idle["jserve_prefix_cache_hit_tokens_total"] == 64
        assert idle["vllm:prefix_cache_queries_total[default]"] == \
            idle["jserve_prefix_cache_queried_tokens_total"]
        assert idle["vllm:num_requests_waiting[default]"] == 0
        assert idle["vllm:generation_tokens_total[default]"] == \
            idle["jserve_generation_tokens_total"] == 4 + 300 + 4
        assert httpx.get(url + "/get_load", timeout=10).json()[0]["num_reqs"] == 0
        assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert info["dp_size"] == 1 and info["prefix_caching"] is True

        # What a request would wait here: the cached document is not prefilled again.
        def wait(body):
            return httpx.post(url + "/v1/route/wait", json=body, timeout=30)
        hit = wait({"prompt": doc + [1, 2, 3]}).json()
        miss = wait({"prompt": [9] + doc + [1, 2]}).json()
        assert hit["cached_tokens"] == 64 and miss["cached_tokens"] == 0
        assert hit["prompt_tokens"] == miss["prompt_tokens"] == 67
        assert 0 < hit["predicted_ttft_s"] < miss["predicted_ttft_s"]
        assert hit["load"]["running"] == 0 and hit["load"]["prefills"] == []
        by_length = wait({"prompt_tokens": 67}).json()
        assert by_length["cached_tokens"] == 0
        assert by_length["predicted_ttft_s"] == pytest.approx(miss["predicted_ttft_s"])
        for bad in ({"prompt_tokens": 0}, {"prompt": []}, {"prompt": [10**9]},
                    {"prompt_tokens": 5, "ttft_slo": -1}, [1, 2]):
            r = wait(bad)
            assert r.status_code == 400 and r.json()["error"]["message"], bad
        assert httpx.post(url + "/v1/route/wait", content=b"{", timeout=10).status_code == 400
        st = server.stats()
        assert st["pages_used"] == 0 and st["in_flight"] == 0
    finally:
        server.stop(grace=0)


def test_health_fails_during_the_drain_notice_while_requests_are_served():
    # A notice far longer than the checks, ended by ``hurry`` once they are done: the checks
    # do not race the notice's clock (with 1.5 s, a loaded machine ran out of it). ``hurry``
    # cuts the grace too, so what the drain refuses is the next test's.
    server = BackgroundServer(FakeEngine(), ServerConfig(port=0, metrics_port=None, http_port=0,
                                                   drain_notice=60.0))
    url = server.http_url
    hurry = asyncio.Event()
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        stopping = threading.Thread(target=server.run,
                                    args=(server.server.stop(5.0, hurry=hurry),))
        stopping.start()
        while not server.server.gateway.leaving:
            time.sleep(0.005)
        h = httpx.get(url + "/health", timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "draining"
        assert httpx.get(url + "/health_generate", timeout=10).status_code == 503
        r = _complete(url, [3, 4, 5], 2)  # still served
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert not server.server.draining
        server._loop.call_soon_threadsafe(hurry.set)
        stopping.join(10)
        assert server.server.draining and not stopping.is_alive()
    finally:
        server.stop(grace=0)


def test_the_drain_refuses_new_requests_and_lets_those_in_flight_finish():
    """A request held in the engine keeps the drain open (within the grace) while a new one
    is refused with 503; released, it finishes. (With none in flight the server closes its
    ports at once: a request then finds them closed, so one is held.)"""
    held, entered, release = [7, 7, 7], threading.Event(), threading.Event()

    def script(prompt_ids, params, i):
        if list(prompt_ids) == held and i >= 1:
            entered.set()
            assert release.wait(30), "never released"
        return text_script(prompt_ids, params, i)

    server = BackgroundServer(FakeEngine(script=script),
                              ServerConfig(port=0, metrics_port=None, http_port=0))
    url = server.http_url
    try:
        done = []
        holder = threading.Thread(target=lambda: done.append(_complete(url, held, 3)))
        holder.start()
        assert entered.wait(30)
        stopping = threading.Thread(target=server.run, args=(server.server.stop(30.0),))
        stopping.start()
        while not server.server.draining:
            time.sleep(0.005)
        refused = _complete(url, [3, 4, 5], 2)
        assert refused.status_code == 503, refused.text
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        release.set()
        holder.join(30)
        assert done[0].status_code == 200 and done[0].json()["choices"][0]["finish_reason"] \
            == "length"
        stopping.join(10)
        assert not stopping.is_alive()
    finally:
        release.set()
        server.stop(grace=0)


@pytest.mark.slow
def test_the_live_engine_reports_its_prefix_cache_and_load():
    """The same reports from the live engine (``LiveEngine``): its prefix cache's hits under
    both names and in the predicted wait, its scheduler's load."""
    from llm_helpers import small_llm
    server = BackgroundServer(small_llm().engine, ServerConfig(port=0, metrics_port=None,
                                                               http_port=0))
    url = server.http_url
    try:
        doc = list(range(100, 164))  # 64 tokens: 4 pages of 16
        for tail in ([5, 6, 7], [8, 9]):
            assert _complete(url, doc + tail).status_code == 200
        idle = _samples(url)
        assert idle["vllm:prefix_cache_hits_total[default]"] == \
            idle["jserve_prefix_cache_hit_tokens_total"] == 64
        # vLLM's latency histograms: the live engine's timings, the same as jserve's own.
        for phase in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds"):
            vllm, own = f"vllm:{phase}", f"jserve_{phase}"
            assert idle[vllm + "_count[default]"] == idle[own + "_count"] == 2, phase
            assert idle[vllm + "_sum[default]"] == idle[own + "_sum"] > 0, phase
        hit = httpx.post(url + "/v1/route/wait", json={"prompt": doc + [1, 2, 3]},
                         timeout=30).json()
        miss = httpx.post(url + "/v1/route/wait", json={"prompt": [9] + doc + [1, 2]},
                          timeout=30).json()
        assert hit["cached_tokens"] == 64 and miss["cached_tokens"] == 0
        assert 0 < hit["predicted_ttft_s"] < miss["predicted_ttft_s"]
        load = httpx.get(url + "/v1/route/load", timeout=10).json()
        assert (load["replica"], load["waiting"], load["running"], load["order"]) == (
            "default", 0, 0, "fifo")
        assert load["table"]["times"][-1] > 0 and load["max_num_seqs"] == 4
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert (info["scheduler"], info["page_size"], info["prefix_caching"]) == (
            "sarathi", 16, True)
    finally:
        server.stop(grace=0)
