"""The engine interface of the serving layer (``jserve/serving/engine_api.py``) and its fake:
``FakeEngine`` imports no JAX and behaves as the interface says (scripted tokens through the
real engine loop, stop strings held back, aborts freeing blocks, deadlines, the admission
queue, faults, the prefix cache in the reports); the serving layer reads the engine only
through the interface, and its modules import each other without cycles, imports inside
functions included."""
from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jserve import SamplingParams
from jserve.serving.engine_api import (
    ALREADY_EXISTS,
    DEADLINE,
    EXHAUSTED,
    INTERNAL,
    EngineClient,
)
from jserve.serving.fake_engine import TEXT, FakeEngine

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "jserve" / "serving"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# -- the interface's contract --------------------------------------------------------------
_NO_JAX = """
import sys

class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib"):
            raise ImportError(f"{name} imported where no JAX is allowed")

sys.meta_path.insert(0, NoJax())
import jserve.serving.fake_engine, jserve.serving.app, jserve.serving.http_server
from jserve import SamplingParams
from jserve.serving.fake_engine import FakeEngine
print(FakeEngine().generate("Hi", SamplingParams(temperature=0.0, max_tokens=5)).text)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib")))
"""


def test_the_fake_engine_and_the_servers_import_no_jax():
    proc = subprocess.run([sys.executable, "-c", _NO_JAX], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text, loaded = proc.stdout.splitlines()
    start = sum([256, 72, 105])  # "Hi" with the byte tokenizer's BOS
    assert text == "".join(TEXT[(start + i) % len(TEXT)] for i in range(5))
    assert loaded == "[]"


def _imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports, at any depth (functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n.split(".")[len(package.split("."))] for n in names
                     if n.startswith(package + "."))
    return found


def _cycles(directory: Path, package: str) -> list[list[str]]:
    """Import cycles among the modules of ``directory`` (a module importing itself, as
    ``ray_app`` does to reach its own globals from Ray's pickled copies, is no cycle)."""
    graph = {p.stem: _imports(p, package) - {p.stem} for p in directory.glob("*.py")}
    cycles, done = [], set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            cycles.append(path[path.index(m):] + [m])
            return
        if m in done or m not in graph:
            return
        for n in sorted(graph[m]):
            visit(n, path + [m])
        done.add(m)
    for m in sorted(graph):
        visit(m, [])
    return cycles


def test_serving_has_no_import_cycles():
    assert _cycles(SERVING, "jserve.serving") == []


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    (tmp_path / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg import a\n")
    assert _cycles(tmp_path, "pkg") == [["a", "b", "a"]]


# What only the engine's adapter may read: the engine's parts, and its own modules.
_INTERNALS = {"allocator", "runner", "predictor", "intake", "speculator", "cfg", "requests"}
_ENGINE_MODULES = ("jserve.engine", "jserve.scheduler", "jserve.cache", "jserve.model")


def _reads_of_internals(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in _INTERNALS | {"scheduler"}:
            owner = ast.unparse(node.value)
            if node.attr == "scheduler" and owner in ("info", "a"):
                continue  # EngineInfo.scheduler, the CLI's --scheduler
            if owner.split(".")[-1] in ("engine", "eng", "core", "_engine"):
                out.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                _ENGINE_MODULES) and node.module != "jserve.engine.requests.output":
            out.append(f"{path.name}:{node.lineno} imports {node.module}")
    return out


def test_serving_reads_the_engine_only_through_the_interface():
    """Outside the two engines (``live_engine``, the adapter; ``fake_engine``, which runs the
    engine's own JAX-free intake), no serving module reads the engine's scheduler,
    allocator, runner, predictor or config, nor imports the engine's modules (the output
    types excepted). ``commands`` and ``ray_app`` build engines (the CLI's, Ray's
    replicas') and may read their settings; ``process_engine`` runs the engine's intake, as
    the fake engine does, against what the engine core's process sends it."""
    reads = [r for p in sorted(SERVING.glob("*.py"))
             if p.name not in ("live_engine.py", "fake_engine.py", "commands.py", "ray_app.py",
                               "process_engine.py")
             for r in _reads_of_internals(p)]
    assert reads == []
    # ... and the check finds them where they are.
    assert any("engine.scheduler" in r or "engine.allocator" in r
               for r in _reads_of_internals(SERVING / "live_engine.py"))


# -- the fake engine, driven as the gateway drives an EngineClient ---------------------------
async def _drain(sink: asyncio.Queue, timeout: float = 30.0) -> list:
    deltas = []
    while not (deltas and deltas[-1].last):
        deltas.append(await asyncio.wait_for(sink.get(), timeout))
    return deltas


def _run(fake: FakeEngine, body):
    """``body(fake)`` on a running engine thread (a coroutine function)."""
    async def main():
        fake.start()
        try:
            return await body(fake)
        finally:
            fake.shutdown()
    return asyncio.run(main())


def test_deltas_follow_the_script_and_hold_back_a_stop_strings_start():
    fake = FakeEngine()
    assert isinstance(fake, EngineClient)
    full = fake.generate("Hello", GREEDY).text
    stop = full[20:23]  # a stop string the scripted text contains
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], logprobs=2)
    want = fake.generate("Hello", params)

    async def body(fake):
        sink = fake.submit("r", fake.prepare("Hello", params), arrival_time=time.monotonic())
        return await _drain(sink), await fake.stats()
    deltas, stats = _run(fake, body)
    assert want.finish_reason == "stop" and want.text == full[:20]
    assert "".join(d.text for d in deltas) == want.text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    sent = ""
    for d in deltas[:-1]:  # what was sent never reaches into a stop string's start
        sent += d.text
        assert len(sent) <= len(want.text)
    last = deltas[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == (
        "stop", 6, len(want.token_ids))
    assert [lp.token_id for d in deltas for lp in d.logprobs] == want.token_ids
    assert all(len(lp.top) == 2 for d in deltas for lp in d.logprobs)
    assert 0 <= last.timings["time_to_first_token"] <= last.timings["e2e_seconds"]
    assert stats["in_flight"] == stats["pages_used"] == stats["engine_requests"] == 0


def test_an_abort_frees_the_requests_blocks_and_a_deadline_ends_it():
    async def body(fake):
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        sink = fake.submit("a", fake.prepare([3, 4], long), arrival_time=time.monotonic())
        await asyncio.wait_for(sink.get(), 10)
        busy = await fake.stats()
        fake.abort("a")
        idle = await fake.stats()
        after = [sink.get_nowait() for _ in range(sink.qsize())]
        late = fake.submit("d", fake.prepare([3, 4], long), arrival_time=time.monotonic(),
                           deadline=time.monotonic() + 0.1)
        return busy, idle, after, await _drain(late)
    busy, idle, after, deadline = _run(FakeEngine(), body)
    assert busy["running"] == 1 and busy["pages_used"] == 26  # ceil(402 / 16)
    assert idle["pages_used"] == idle["running"] == idle["in_flight"] == 0
    assert not any(d.last for d in after)  # an aborted stream just stops
    assert deadline[-1].error[0] == DEADLINE and len(deadline) < 400


def test_the_admission_queue_and_an_id_in_use_are_refused():
    """One request runs at a time: q0 runs, q1 and q2 wait, q3 finds the queue full."""
    async def body(fake):
        long = fake.prepare([1], SamplingParams(max_tokens=300, ignore_eos=True))
        q0, q1 = (fake.submit(f"q{i}", long, arrival_time=time.monotonic()) for i in range(2))
        await q0.get()
        again = fake.submit("q0", long, arrival_time=time.monotonic())
        q2 = fake.submit("q2", long, arrival_time=time.monotonic())
        q3 = fake.submit("q3", long, arrival_time=time.monotonic())
        ends = await _drain(again), await _drain(q3)
        queued = await fake.stats()
        for rid in ("q0", "q1", "q2"):
            fake.abort(rid)
        return (*ends, queued, q1.empty() and q2.empty(), await fake.stats())
    again, q3, queued, waited, idle = _run(
        FakeEngine(max_num_seqs=1, step_s=0.01, max_waiting=2), body)
    assert again[-1].error == (ALREADY_EXISTS, "request_id 'q0' is already in use")
    assert q3[-1].error == (EXHAUSTED, "admission queue full (2 requests waiting)")
    assert (queued["running"], queued["waiting"]) == (1, 2) and waited
    assert idle["running"] == idle["waiting"] == idle["engine_requests"] == 0


class _Death(BaseException):
    pass


def test_injected_faults_fail_a_step_a_request_or_the_engine_thread():
    died = []

    async def body(fake):
        p = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        sink = fake.submit("s", fake.prepare([1, 2], p), arrival_time=time.monotonic())
        await sink.get()
        fake.fail_steps(RuntimeError("injected"))
        failed = await _drain(sink)
        fake.fail_requests(lambda prepared: prepared.prompt_ids == [9])
        victim = fake.submit("v", fake.prepare([9], p), arrival_time=time.monotonic())
        healthy = fake.submit("h", fake.prepare([8], p), arrival_time=time.monotonic())
        results = failed, await _drain(victim), await _drain(healthy)
        held = fake.submit("x", fake.prepare([7], p), arrival_time=time.monotonic())
        await held.get()
        fake.fail_steps(_Death("killed"))
        dead = await _drain(held)
        for _ in range(100):
            if died:
                break
            await asyncio.sleep(0.01)
        return (*results, dead)

    fake = FakeEngine()

    async def main():
        fake.start(on_crash=died.append)
        try:
            return await body(fake)
        finally:
            fake.shutdown()
    failed, victim, healthy, dead = asyncio.run(main())
    assert failed[-1].error == (INTERNAL, "engine iteration failed: injected")
    assert victim[-1].error == (INTERNAL, "injected request fault")
    assert healthy[-1].finish_reason == "length" and healthy[-1].completion_tokens == 100
    assert dead[-1].error == (INTERNAL, "engine loop crashed: killed")
    assert isinstance(fake.crashed, _Death) and not fake.alive and died == [fake.crashed]


def test_reports_see_the_prefix_cache_and_the_queue():
    doc = list(range(100, 164))  # 4 pages of 16

    async def body(fake):
        first = fake.submit("doc", fake.prepare(doc + [1], SamplingParams(max_tokens=2)),
                            arrival_time=time.monotonic())
        await _drain(first)
        hit = await fake.predicted_wait("r", doc + [5, 6], 66)
        miss = await fake.predicted_wait("r", [9] + doc, 65)
        blind = await fake.predicted_wait("r", None, 66, ttft_slo=1.0)
        return hit, miss, blind, await fake.load_report("r", healthy=False)
    hit, miss, blind, load = _run(FakeEngine(), body)
    assert (hit.cached_tokens, miss.cached_tokens, blind.cached_tokens) == (64, 0, 0)
    assert 0 < hit.predicted_ttft_s < blind.predicted_ttft_s
    assert blind.predicted_ttft_s == pytest.approx(66e-4)
    assert (load.replica, load.healthy, load.waiting, load.running) == ("r", False, 0, 0)
    assert load.max_num_seqs == 8 and load.table.time(100) == pytest.approx(0.01)


def test_intake_refuses_as_the_engine_does():
    fake = FakeEngine(max_model_len=64, num_kv_pages=2, tokenizer=None)
    for prompt, params, words in (
            ("hi", None, "no tokenizer"), ([], None, "prompt is empty"),
            ([320], None, "outside the vocabulary [0, 320)"),
            ([1] * 64, None, "prompt has 64 tokens; the context holds 64"),
            ([1] * 60, SamplingParams(max_tokens=5), "exceeds the context of 64"),
            ([1] * 30, SamplingParams(max_tokens=10), "request needs 3 KV pages; the pool has 2"),
            ([1], SamplingParams(top_k=321), "top_k must be <= vocab_size=320")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)")):
            fake.prepare(prompt, params)
    assert fake.prepare([1, 2], SamplingParams(max_tokens=8)).prompt_ids == [1, 2]


def test_prompt_logprobs_and_max_tokens_0_as_the_engine():
    """Prompt logprobs: the first None, one (made-up) entry per later prompt token with its
    alternatives; ``max_tokens=0`` scores the prompt and generates nothing."""
    out = FakeEngine().generate([5, 6, 7], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert (out.finish_reason, out.token_ids, out.text) == ("length", [], "")
    assert out.prompt_logprobs[0] is None
    assert [(e.token_id, len(e.top)) for e in out.prompt_logprobs[1:]] == [(6, 2), (7, 2)]
    plain = FakeEngine().generate([5, 6, 7], SamplingParams(max_tokens=3))
    assert plain.prompt_logprobs is None and len(plain.token_ids) == 3


def test_tokenize_and_detokenize_through_the_interface():
    fake = FakeEngine()  # the byte tokenizer, a vocabulary of 320
    assert fake.tokenize("hi") == [256, 104, 105]
    assert fake.tokenize("hi", add_special_tokens=False) == [104, 105]
    assert fake.tokenize([3, 4], add_special_tokens=False) == [3, 4]  # ids as they are
    assert fake.detokenize([256, 104, 105, 257]) == "<bos>hi<eos>"
    assert fake.detokenize([300]) == ""  # in the model's vocabulary, past the tokenizer's
    for bad in ([320], [-1]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            fake.detokenize(bad)
    bare = FakeEngine(tokenizer=None)
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.detokenize([1])
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.tokenize("hi", add_special_tokens=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        fake.tokenize("", add_special_tokens=False)
