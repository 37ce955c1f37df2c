"""What one client may do to a shared server (issue 25, docs/server.md "Limits"): SLO fields
within floors and a progress rule that no field can break, priorities within a range and
only from trusted clients, a bounded HTTP edge, tokenization off the event loop. The edge's
tests run ``jserve serve --fake-engine`` (scripted tokens, the model's tokenizer, no JAX); the
progress rule needs the live scheduler."""
from __future__ import annotations

import asyncio
import random
import socket
import statistics
import threading
import time
import types

import grpc
import httpx2 as httpx
import pytest

from conftest import Served
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.predictor import LinearPredictor
from jserve.serving.limits import ClientLimits, RequestLimits
from jserve.serving.live_engine import isolated_prefill, lone_decode_s

# 1 ms per token plus 2 ms a step: a lone decode takes 3 ms, a 600-token prefill 0.6 s+.
PREDICTOR = LinearPredictor((0.002, 1e-3, 0.0, 0.0, 0.0, 0.0))


def _limits(**kw) -> RequestLimits:
    """The limits of an engine with ``PREDICTOR`` and a deadline policy's prefill-time cache,
    as ``LiveEngine`` reports them."""
    scheduler = types.SimpleNamespace(cache=PrefillTimeCache(PREDICTOR, 4096, 0.05))
    engine = types.SimpleNamespace(
        info=types.SimpleNamespace(lone_decode_s=lone_decode_s(PREDICTOR)),
        isolated_prefill_s=isolated_prefill(scheduler))
    return RequestLimits(ClientLimits(**kw), engine)


def test_slo_floors_are_the_engines_own_times_or_the_configured_ones():
    lim = _limits(min_tpot_slo=0.001, min_ttft_slo=0.05)
    assert lim.tpot_floor == pytest.approx(0.003)  # the predictor's lone decode step
    assert _limits(min_tpot_slo=0.01).tpot_floor == 0.01
    isolated = PrefillTimeCache(PREDICTOR, 4096, 0.05).remaining(600, 0)
    assert isolated > 0.6 and lim.ttft_floor(600) == pytest.approx(isolated)
    assert lim.ttft_floor(10) == 0.05
    lim.check(600, isolated, 0.003, 0, False)  # at the floors: fine
    with pytest.raises(ValueError, match=r"tpot_slo=0.002 s is below this server's floor of "
                                         r"0.003 s"):
        lim.check(600, None, 0.002, 0, False)
    with pytest.raises(ValueError, match=r"ttft_slo=0.5 s is below this server's floor of "
                                         r"0\.6\d* s for a 600-token prompt"):
        lim.check(600, 0.5, None, 0, False)
    with pytest.raises(ValueError, match="tpot_slo_seconds must be > 0"):
        lim.check(1, None, float("nan"), 0, False, ("ttft_slo_seconds", "tpot_slo_seconds",
                                                    "priority"))


def test_priorities_stay_in_range_and_only_trusted_clients_go_first():
    lim = _limits()
    for p in (0, 3, 10):
        lim.check(1, None, None, p, False)  # yielding is anyone's right
    with pytest.raises(ValueError, match=r"priority=11 is outside this server's range "
                                         r"\[-10, 10\]"):
        lim.check(1, None, None, 11, True)
    with pytest.raises(ValueError, match="priority=-1 would run ahead of the default 0"):
        lim.check(1, None, None, -1, False)
    lim.check(1, None, None, -10, True)
    _limits(trust_priority=True).check(1, None, None, -10, False)
    with pytest.raises(ValueError, match="must contain the default 0"):
        ClientLimits(priority_range=(1, 10))


# -- against a real server -------------------------------------------------------------
LIMIT_FLAGS = ["--max-num-seqs", "8", "--max-model-len", "2048", "--max-num-batched-tokens",
               "256"]


def _prompt(rng: random.Random, n: int = 599) -> str:
    """599 bytes: 600 tokens with the byte tokenizer's BOS; fresh text (no cached prefix)."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


async def _victim_ttfts(url: str, hostile: dict, rng: random.Random) -> list[float]:
    """A long generation (with ``hostile`` fields), then 6 requests with 600-token prompts
    arriving while it decodes: their times to first token. The long one must still be
    decoding when the last victim's first token comes."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        long_done = asyncio.Event()
        started = asyncio.Event()

        async def long_gen():
            body = {"model": "default", "prompt": "long", "max_tokens": 1900,
                    "ignore_eos": True, "stream": True, "temperature": 0.0, **hostile}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        started.set()
            long_done.set()

        async def victim():
            t0 = time.monotonic()
            body = {"model": "default", "prompt": _prompt(rng), "max_tokens": 2,
                    "stream": True, "temperature": 0.0}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return time.monotonic() - t0

        task = asyncio.ensure_future(long_gen())
        await started.wait()
        await asyncio.sleep(0.2)
        ttfts = await asyncio.gather(*(victim() for _ in range(6)))
        assert not long_done.is_set(), "the long generation ended before the victims"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ttfts


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lars", "edf", "lrs"])
def test_the_smallest_accepted_tpot_slo_does_not_starve_other_prefills(policy, share=None):
    served = Served("--scheduler", policy, *LIMIT_FLAGS,
                    *(["--prefill-share", str(share)] if share is not None else []))
    try:
        model = httpx.get(served.url + "/v1/models", timeout=30).json()["data"][0]
        floor = model["min_tpot_slo"]
        below = httpx.post(served.url + "/v1/completions", timeout=30, json={
            "model": "default", "prompt": "x", "max_tokens": 1, "tpot_slo": floor / 2})
        assert below.status_code == 400 and below.json()["error"]["param"] == "tpot_slo"
        assert f"floor of {floor:.4g} s" in below.json()["error"]["message"]
        rng = random.Random(policy)
        asyncio.run(_victim_ttfts(served.url, {}, rng))  # compiles the shapes both runs use
        # Rounds of a plain run and a hostile one back to back, compared within the round.
        # Noise from the host (the other xdist worker compiling) only adds time, and it fell
        # on one run of a round in a CI failure (the 2nd hostile run 2.5x the 1st); a policy
        # that starves the victims makes every round's ratio large. So the best round counts.
        rounds = []
        for _ in range(2):
            plain = asyncio.run(_victim_ttfts(served.url, {}, rng))
            hostile = asyncio.run(_victim_ttfts(served.url, {"tpot_slo": floor}, rng))
            p, h = statistics.median(plain), statistics.median(hostile)
            print(f"{policy}: victim TTFT median {p:.3f} s plain, {h:.3f} s next to "
                  f"tpot_slo={floor:.4g} s")
            rounds.append((h / p, plain, hostile))
        assert min(r[0] for r in rounds) <= 2, (policy, rounds)
    finally:
        served.close()


@pytest.fixture(scope="module")
def edge():
    """A server with a 1 MiB request limit, a priority token and /metrics behind the auth
    token."""
    s = Served("--fake-engine", "--max-request-bytes", str(1 << 20), "--auth-token", "user",
               "--priority-token", "boss", "--max-choices", "64")
    yield s
    s.close()


def _auth(token: str = "user") -> dict:
    return {"authorization": f"Bearer {token}"}


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM"))


def _raw_post(url: str, head: list[str], body_chunks, result: dict) -> None:
    """POSTs by hand (so the body can be huge, or chunked, and cut off), keeping the status
    line of whatever answer came and how many body bytes went out."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(("\r\n".join(["POST /v1/completions HTTP/1.1", f"host: {host}",
                                "content-type: application/json", *head]) + "\r\n\r\n").encode())
        sent = 0
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed: the rest was never read
        result["sent"] = sent
        s.settimeout(30)
        result["status"] = s.recv(65536).split(b"\r\n", 1)[0].decode()


def test_a_64_mib_body_gets_413_unheld_and_a_small_request_is_not_held_up(edge):
    small = {"model": "default", "prompt": "hi", "max_tokens": 2, "temperature": 0.0}
    assert httpx.post(edge.url + "/v1/completions", json=small, headers=_auth(),
                      timeout=60).status_code == 200  # warm
    rss = _peak_rss(edge.proc.pid)
    size, piece = 64 << 20, b"x" * (1 << 20)
    declared, chunked = {}, {}
    big = threading.Thread(target=_raw_post, args=(
        edge.url, [f"content-length: {size}", "authorization: Bearer user"],
        (piece for _ in range(64)), declared))
    # No Content-Length: refused once the bytes read pass the limit.
    stream = threading.Thread(target=_raw_post, args=(
        edge.url, ["transfer-encoding: chunked", "authorization: Bearer user"],
        (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(64)), chunked))
    big.start()
    stream.start()
    t0 = time.monotonic()
    r = httpx.post(edge.url + "/v1/completions", json=small, headers=_auth(), timeout=60)
    answered = time.monotonic() - t0
    big.join(60)
    stream.join(60)
    assert r.status_code == 200 and answered < 1.0, answered
    assert declared["status"] == chunked["status"] == "HTTP/1.1 413 Request Entity Too Large"
    # The rest of each body is read and dropped (the lingering close lets the client read
    # its 413), never held: the peak RSS stays flat.
    grown = _peak_rss(edge.proc.pid) - rss
    assert grown < 16 << 20, f"peak RSS grew {grown >> 20} MiB"


def test_too_many_choices_get_400_naming_the_field(edge):
    for body, field in (({"prompt": ["a"] * 1000, "n": 16}, "prompt"),
                        ({"prompt": ["a"] * 8, "n": 16}, "n")):
        r = httpx.post(edge.url + "/v1/completions", headers=_auth(), timeout=30,
                       json={"model": "default", "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "limit of 64 choices" in r.json()["error"]["message"]


def test_priority_needs_the_priority_token_and_the_range(edge):
    def post(priority, token):
        return httpx.post(edge.url + "/v1/completions", headers=_auth(token), timeout=60,
                          json={"model": "default", "prompt": "p", "max_tokens": 1,
                                "priority": priority})
    for priority, token, status in ((-1, "user", 400), (11, "boss", 400), (5, "user", 200),
                                    (-10, "boss", 200), (0, "nobody", 401)):
        r = post(priority, token)
        assert r.status_code == status, (priority, token, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == "priority"
    from jserve.client import Client
    from jserve.sampling.params import SamplingParams
    one = SamplingParams(max_tokens=1)
    with Client(edge.target, auth_token="user") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("p", one, priority=-1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "priority=-1" in e.value.details()
    with Client(edge.target, auth_token="boss") as c:
        assert c.generate("p", one, priority=-1).finish_reason


def test_metrics_need_the_token_unless_open(edge):
    assert httpx.get(edge.url + "/metrics", timeout=30).status_code == 401
    r = httpx.get(edge.url + "/metrics", headers=_auth(), timeout=30)
    assert r.status_code == 200 and "jserve_requests_total" in r.text
    assert httpx.get(edge.url + "/health", timeout=30).status_code == 200  # probes stay open


@pytest.fixture(scope="module")
def hf_served():
    """The tiny HF Llama with its byte-level BPE tokenizer, a 6 MB request limit."""
    from hf_models import tiny_llama_dir
    model = tiny_llama_dir("llama2", with_tokenizer=True)
    s = Served("--fake-engine", "--model", str(model), "--max-request-bytes", str(6 << 20),
               "--max-model-len", "2048")
    s.model = str(model)
    s.name = model.name  # what it is served as: the directory's name
    yield s
    s.close()


@pytest.mark.slow  # 12 s in a --durations run of the full suite
def test_a_5_mb_prompt_is_tokenized_off_the_event_loop(hf_served):
    """While a 5 MB prompt (over max_model_len, so refused) is tokenized, another client's
    streams keep flowing: no gap between their chunks over half the tokenization time."""
    from jserve.tokenizer import HFTokenizer
    big = ("the " * (5_000_000 // 4))
    url = hf_served.url
    chunks: list[float] = []
    window: dict[str, float] = {}

    def send_big():
        window["sent"] = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": hf_served.name, "prompt": big, "max_tokens": 1})
        window["answered"] = time.monotonic()
        window["status"], window["error"] = r.status_code, r.json()["error"]

    body = {"model": hf_served.name, "prompt": "The quick brown fox", "max_tokens": 2000,
            "ignore_eos": True, "stream": True, "temperature": 0.0}
    sender = threading.Thread(target=send_big)
    # Streams one after another (one lasts ~3 s here) until the big prompt is answered.
    while not (chunks and "answered" in window and chunks[-1] > window["answered"] + 0.2):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks.append(time.monotonic())
                if len(chunks) == 5:
                    sender.start()
                if "answered" in window and chunks[-1] > window["answered"] + 0.2:
                    break
    sender.join()
    t0 = time.perf_counter()
    HFTokenizer(hf_served.model).encode(big)
    tokenize_s = time.perf_counter() - t0
    assert window["status"] == 400 and window["error"]["param"] == "prompt", window
    during = [b - a for a, b in zip(chunks, chunks[1:]) if b > window["sent"]
              and a < window["answered"]]
    print(f"tokenizing 5 MB: {tokenize_s:.2f} s here, answered after "
          f"{window['answered'] - window['sent']:.2f} s; {len(during)} stream gaps meanwhile, "
          f"longest {max(during):.3f} s")
    assert window["answered"] - window["sent"] > tokenize_s / 2  # it did take that long
    assert max(during) < tokenize_s / 2, (max(during), tokenize_s)


def test_a_chat_prompt_has_exactly_one_bos(hf_served):
    import transformers
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ref = transformers.AutoTokenizer.from_pretrained(hf_served.model)
    want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert want.count(ref.bos_token_id) == 1 and want[0] == ref.bos_token_id
    r = httpx.post(hf_served.url + "/v1/chat/completions", timeout=60, json={
        "model": hf_served.name, "messages": msgs, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
