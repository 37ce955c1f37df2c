"""``jserve bench serve`` (vLLM's ``bench serve`` on jserve's replay harness) against a real
``jserve serve`` on a real port: exact request and token counts against the server's own
/metrics counters, ``--ignore-eos`` lengths, vLLM's definitions of TTFT, TPOT, ITL and E2EL
recomputed from the per-request lists, ``--max-concurrency`` held (the harness's in-flight peak
and the server's gauges), ``--request-rate`` spacing, the ShareGPT and custom files with a
trained tokenizer (the client's and the server's), Bearer auth, failed requests, bad flags."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest

from conftest import Served, gauges
from hf_models import llama3_chat_dir
from jserve import cli
from jserve.bench.datasets import LocalTokenizer, arrival_times, random_samples
from jserve.bench.serve_bench import bench_serve
from jserve.tokenizer import HFTokenizer

KEY = "bench-key"


@pytest.fixture(scope="module")
def default_served():
    s = Served("--max-model-len", "256")  # the built-in model, its byte tokenizer
    yield s
    s.close()


@pytest.fixture(scope="module")
def llama3_served():
    s = Served("--model", str(llama3_chat_dir()), "--max-model-len", "256", "--api-key", KEY)
    yield s
    s.close()


def counter(g: dict, name: str, model: str, **labels) -> float:
    return g.get(f"vllm:{name}" + json.dumps({"model_name": model, **labels}, sort_keys=True), 0.0)


def deltas(before: dict, after: dict, model: str) -> tuple[float, float, float]:
    """(prompt tokens, generated tokens, requests finished at their length) between two scrapes."""
    return tuple(counter(after, n, model, **k) - counter(before, n, model, **k) for n, k in (
        ("prompt_tokens_total", {}), ("generation_tokens_total", {}),
        ("request_success_total", {"finished_reason": "length"})))


@pytest.mark.slow  # a server of its own (or the trained checkpoint)
def test_random_completions_exact_counts_and_vllms_definitions(default_served, tmp_path):
    url = default_served.url
    before = gauges(url)
    proc = subprocess.run(
        [sys.executable, "-m", "jserve.cli", "bench", "serve", "--base-url", url,
         "--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "8",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
         "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
         "--result-filename", "r.json", "--disable-tqdm"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = gauges(url)
    res = json.loads((tmp_path / "r.json").read_text())
    out = proc.stdout
    assert f"{' Serving Benchmark Result ':=^50}" in out
    assert f"{'Successful requests:':<40} {12:<10}" in out
    assert f"{'Mean TPOT (ms):':<40} {res['mean_tpot_ms']:<10.2f}" in out
    # Every prompt 24 token ids, every output 8 tokens (random: EOS ignored); the server saw
    # exactly these tokens and requests.
    assert (res["completed"], res["failed"], res["num_prompts"]) == (12, 0, 12)
    assert res["input_lens"] == [24] * 12 and res["output_lens"] == [8] * 12
    assert (res["total_input_tokens"], res["total_output_tokens"]) == (288, 96)
    assert deltas(before, after, "default") == (288, 96, 12)
    d = res["duration"]
    assert res["request_throughput"] == pytest.approx(12 / d, rel=1e-12)
    assert res["output_throughput"] == pytest.approx(96 / d, rel=1e-12)
    assert res["total_token_throughput"] == pytest.approx(384 / d, rel=1e-12)
    assert d >= max(res["start_times"][i] + res["latencies"][i] for i in range(12))
    # vLLM's definitions, recomputed with numpy from the per-request lists: TPOT leaves the
    # first token out; ITL is every gap between chunks (a chunk a step: one token, or a
    # decode burst's tokens together), within the request's time after its first token.
    ttfts, lats = np.array(res["ttfts"]), np.array(res["latencies"])
    itls = [g for r in res["itls"] for g in r]
    for gaps, ttft, lat in zip(res["itls"], ttfts, lats):
        assert 1 <= len(gaps) <= 7 and 0 <= sum(gaps) <= lat - ttft + 1e-9
    want = {"ttft": ttfts, "tpot": (lats - ttfts) / 7, "itl": np.array(itls), "e2el": lats}
    for m, xs in want.items():
        assert res[f"mean_{m}_ms"] == pytest.approx(xs.mean() * 1e3, rel=1e-9), m
        assert res[f"median_{m}_ms"] == pytest.approx(np.median(xs) * 1e3, rel=1e-9), m
        assert res[f"std_{m}_ms"] == pytest.approx(xs.std() * 1e3, rel=1e-9, abs=1e-9), m
        for q in (50, 90, 99):
            assert res[f"p{q}_{m}_ms"] == pytest.approx(np.percentile(xs, q) * 1e3,
                                                        rel=1e-9), (m, q)
    assert res["max_concurrent_requests"] <= 12 and res["max_output_tokens_per_s"] >= 1
    assert (res["model_id"], res["backend"], res["request_rate"], res["burstiness"]) == \
        ("default", "openai", "inf", 1.0)


def _peak_load(url: str, stop: threading.Event, peak: list[float]) -> None:
    while not stop.is_set():
        g = gauges(url)
        peak[0] = max(peak[0], g['vllm:num_requests_running{"model_name": "default"}']
                      + g['vllm:num_requests_waiting{"model_name": "default"}'])
        time.sleep(0.01)


@pytest.mark.slow  # a server of its own (or the trained checkpoint)
def test_max_concurrency_is_held_and_range_ratio_spreads_lengths(default_served):
    url = default_served.url
    before = gauges(url)
    stop, peak = threading.Event(), [0.0]
    poller = threading.Thread(target=_peak_load, args=(url, stop, peak))
    poller.start()
    try:
        res = bench_serve(["--base-url", url, "--num-prompts", "12", "--max-concurrency", "3",
                           "--random-input-len", "20", "--random-output-len", "12",
                           "--random-range-ratio", "0.5", "--seed", "3", "--save-detailed",
                           "--disable-tqdm"])
    finally:
        stop.set()
        poller.join()
    after = gauges(url)
    assert res["completed"] == 12 and res["max_concurrency"] == 3
    assert res["max_concurrent_requests"] == 3  # the harness's own in-flight count
    assert 1 <= peak[0] <= 3  # the server never held more (4 would fit its batch)
    ins, outs = res["input_lens"], res["output_lens"]
    assert all(10 <= n <= 30 for n in ins) and all(6 <= n <= 18 for n in outs)
    assert len(set(ins)) > 1 and len(set(outs)) > 1
    assert deltas(before, after, "default") == (sum(ins), sum(outs), 12)


@pytest.mark.slow  # a server of its own (or the trained checkpoint)
def test_request_rate_spaces_the_sends(default_served):
    res = bench_serve(["--base-url", default_served.url, "--num-prompts", "10",
                       "--request-rate", "20", "--burstiness", "2", "--random-input-len", "8",
                       "--random-output-len", "4", "--save-detailed", "--disable-tqdm"])
    starts = res["start_times"]
    assert res["completed"] == 10 and (res["request_rate"], res["burstiness"]) == (20.0, 2.0)
    assert starts == sorted(starts) and starts[0] > 0
    assert starts[-1] == pytest.approx(10 / 20, rel=1e-12)  # the last arrival at n / rate
    assert res["duration"] >= 0.5


def test_arrival_gaps_follow_the_gamma_shape():
    assert arrival_times(5, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 5
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5)):  # gamma: std / mean = 1 / sqrt(shape)
        t = arrival_times(4000, 50.0, burstiness, np.random.default_rng(1))
        gaps = np.diff([0.0, *t])
        assert t[-1] == pytest.approx(80.0, rel=1e-12) and (gaps > 0).all()
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, 0.0, np.random.default_rng(0))


@pytest.mark.slow  # a server of its own (or the trained checkpoint)
def test_random_text_prompts_encode_to_their_length():
    tok = LocalTokenizer(llama3_chat_dir())
    samples = random_samples(30, 48, 4, 0.25, tok.vocab_size, np.random.default_rng(0), tok)
    assert all(isinstance(s.prompt, str) and len(tok.encode(s.prompt)) == s.prompt_len
               for s in samples)
    assert {s.prompt_len for s in samples} <= set(range(36, 61))
    assert len({s.prompt_len for s in samples}) > 1


WORDS = "the quick brown fox jumps over a lazy dog while the warm sun sets on the hill".split()


def _sharegpt(path) -> list[tuple[str, str]]:
    """Six usable pairs, and three vLLM's filter leaves out: one turn only, a prompt of under
    4 tokens, an answer of under 4 tokens."""
    pairs = [(" ".join(WORDS[i:i + 5 + i]), " ".join(WORDS[:4 + i])) for i in range(6)]
    convs = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
             for q, a in pairs]
    convs += [{"conversations": [{"from": "human", "value": "one turn only here"}]},
              {"conversations": [{"from": "human", "value": "hi"},
                                 {"from": "gpt", "value": "a long enough answer to count"}]},
              {"conversations": [{"from": "human", "value": "a long enough question here"},
                                 {"from": "gpt", "value": "ok"}]}]
    path.write_text(json.dumps(convs))
    return pairs


@pytest.mark.slow  # a server of its own (or the trained checkpoint)
def test_sharegpt_file_with_the_clients_tokenizer(llama3_served, tmp_path):
    url, model = llama3_served.url, "llama3-chat"
    pairs = _sharegpt(tmp_path / "sg.json")
    tok = HFTokenizer(llama3_chat_dir())
    args = ["--base-url", url, "--api-key", KEY, "--dataset-name", "sharegpt",
            "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "6", "--ignore-eos",
            "--tokenizer", str(llama3_chat_dir()), "--save-detailed", "--disable-tqdm"]
    before = gauges(url, KEY)
    res = bench_serve(args)
    after = gauges(url, KEY)
    assert (res["completed"], res["tokenizer_id"]) == (6, str(llama3_chat_dir()))
    # Each usable pair exactly once: the answers' lengths are the outputs asked for and made.
    assert sorted(res["output_lens"]) == sorted(
        len(tok.encode(a, add_special_tokens=False)) for _, a in pairs)
    assert sorted(res["input_lens"]) == sorted(len(tok.encode(q)) for q, _ in pairs)
    assert deltas(before, after, model) == (sum(res["input_lens"]), sum(res["output_lens"]), 6)
    fixed = bench_serve([*args, "--sharegpt-output-len", "5"])
    assert fixed["output_lens"] == [5] * 6


@pytest.mark.slow  # a server of its own (or the trained checkpoint)
def test_custom_file_on_the_chat_endpoint_with_the_servers_tokenizer(llama3_served, tmp_path):
    url, model = llama3_served.url, "llama3-chat"
    lines = [{"prompt": "tell me about " + " ".join(WORDS[:3 + i]),
              **({"output_tokens": 3 + i} if i % 2 else {})} for i in range(5)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    before = gauges(url, KEY)
    res = bench_serve(["--base-url", url, "--api-key", KEY, "--dataset-name", "custom",
                       "--dataset-path", str(tmp_path / "c.jsonl"), "--num-prompts", "5",
                       "--custom-output-len", "6", "--ignore-eos", "--endpoint",
                       "/v1/chat/completions", "--save-detailed", "--disable-tqdm"])
    after = gauges(url, KEY)
    assert (res["completed"], res["backend"], res["tokenizer_id"]) == (5, "openai-chat",
                                                                        "server")
    assert sorted(res["output_lens"]) == sorted(x.get("output_tokens", 6) for x in lines)
    assert deltas(before, after, model) == (res["total_input_tokens"], sum(res["output_lens"]), 5)
    # The chat template's tokens count: each prompt is longer than its text alone.
    assert min(res["input_lens"]) > len(HFTokenizer(llama3_chat_dir()).encode(lines[0]["prompt"]))


@pytest.mark.slow  # a server of its own (or the trained checkpoint)
def test_failed_requests_are_counted_not_raised(default_served):
    """Prompts past the server's 256-token limit: each answered 400, each a failed request."""
    res = bench_serve(["--base-url", default_served.url, "--num-prompts", "3",
                       "--random-input-len", "300", "--random-output-len", "4",
                       "--save-detailed", "--disable-tqdm"])
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (0, 3, 0)
    assert all(e.startswith("HTTP 400") for e in res["errors"]), res["errors"]


@pytest.mark.slow  # a server of its own (or the trained checkpoint)
def test_bad_flags_and_auth_exit_2_naming_the_problem(llama3_served, capsys):
    url = llama3_served.url
    for argv, message in (
            (["--dataset-name", "sharegpt"], "needs --dataset-path"),
            (["--dataset-path", "x.json"], "for sharegpt and custom"),
            (["--percentile-metrics", "ttft,foo"], "foo not among"),
            (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
            (["--metric-percentiles", "p99"], "--metric-percentiles"),
            (["--random-range-ratio", "1.5"], "--random-range-ratio"),
            ([], "answered HTTP 401")):  # no --api-key: the server refuses
        code = cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "2",
                         "--disable-tqdm", *(["--api-key", KEY] if argv else []), *argv])
        assert code == 2 and message in capsys.readouterr().err, argv
    assert cli.main(["bench", "serve", "--port", "1", "--num-prompts", "1"]) == 2
    assert "no server at http://127.0.0.1:1" in capsys.readouterr().err
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401


def test_every_flag_says_what_it_does_and_its_default():
    import argparse

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    serve = next(a for a in bench._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    formatter = serve._get_formatter()
    for action in serve._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help and "%(default)" in formatter._get_help_string(action), action
    a = serve.parse_args([])  # vLLM's defaults
    assert (a.endpoint, a.dataset_name, a.num_prompts, a.request_rate, a.burstiness,
            a.percentile_metrics, a.metric_percentiles, a.port) == (
        None, "random", 1000, float("inf"), 1.0, "ttft,tpot,itl", "99", 8000)


def test_the_servers_threads_carry_their_names_to_the_os(default_served):
    """A profile of the server (``top -H``, ``py-spy``, ``/proc``) tells its threads apart:
    the engine thread and the intake threads (started by the requests before) by name."""
    pid = default_served.proc.pid
    bench_serve(["--base-url", default_served.url, "--num-prompts", "2", "--random-input-len",
                 "8", "--random-output-len", "2", "--disable-tqdm"])
    names = {(task / "comm").read_text().strip()
             for task in Path(f"/proc/{pid}/task").iterdir()}
    assert "jserve-engine" in names and "jserve-intake_0" in names, names
