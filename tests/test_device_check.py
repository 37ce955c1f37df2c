"""scripts/device_check.py in its CPU smoke mode, end to end in a subprocess: the Pallas
kernels (both flavours, interpreted) against the reference on decode, prefill and mixed
batches, the cache writes, the engine's greedy tokens with pallas_gpu against the reference,
and the timing code paths. Every check must pass and the report must land where it was told
(never docs/device/check.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from devices import harness_env, xla_flags
from harness.device_flags import CONTROL_FLOW_GRAPHS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# The smoke run's items, most valuable first (harness.device_check._items).
SMOKE_ITEMS = ["kernels context 64", "kernels context 256", "kernels over quantized KV pages",
               "engine greedy tokens", "decode tiny b=1", "decode tiny b=1 bursts of 4",
               "decode tiny b=2", "decode tiny b=2 bursts of 4", "prefill tiny 32 in one chunk",
               "HF generate tiny", "decode tiny b=1 layer_loop=indexed",
               "decode tiny b=1 layer_loop=indexed bursts of 4",
               "decode tiny b=1, loops and conditionals in command buffers",
               "prefill tiny 128 in chunks of 16/32"]


def test_device_check_smoke_mode_passes(tmp_path):
    out = tmp_path / "device.json"
    docs = ROOT / "docs" / "device" / "check.md"
    before = docs.stat().st_mtime_ns if docs.exists() else None
    env = {**os.environ, "XLA_FLAGS": xla_flags()}  # one plain CPU device
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"),
                           "--smoke", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "smoke" and res["passed"]
    assert res["checks"] and all(c["status"] == "pass" for c in res["checks"]), [
        c for c in res["checks"] if c["status"] != "pass"]

    # Both flavours on every batch kind and context, within the float32 tolerance.
    seen = {(r["impl"], r["kind"], r["context"]) for r in res["kernels"]}
    assert seen == {(impl, kind, ctx) for impl in ("pallas_gpu", "pallas_tpu")
                    for kind in ("decode", "prefill", "mixed") for ctx in (64, 256)}
    for r in res["kernels"]:
        assert r["max_abs_err_out"] < 1e-4 and r["max_abs_err_lse"] < 1e-4, r
        assert r["empty_rows"] > 0 and not r["nan"], r  # padding rows: 0 / -inf, no NaN
    # Quantized KV pages: each flavour over int8 and fp8 pages matches the reference on them.
    assert {(r["impl"], r["kv_cache_dtype"]) for r in res["kernels_quantized"]} == {
        (impl, kv) for impl in ("pallas_gpu", "pallas_tpu") for kv in ("int8", "fp8_e4m3")}
    assert all(r["status"] == "pass" and r["max_abs_err_out"] < 1e-4
               for r in res["kernels_quantized"]), res["kernels_quantized"]
    assert {(r["impl"], r["context"]) for r in res["kv_write"]} == {
        (impl, ctx) for impl in ("pallas_gpu", "pallas_tpu") for ctx in (64, 256)}

    # The engine compared every greedy token of a mixed batch, and they were identical.
    e = res["engine"]
    assert e["impl"] == "pallas_gpu" and e["identical"] and e["first_mismatch"] is None
    assert e["tokens_compared"] == sum(e["max_tokens"]) >= 20

    # The timing paths ran and produced figures (not judged on a CPU).
    t = res["timings"]
    assert not t["errors"]
    plain = [r for r in t["decode"] if not {"xla_flags", "layer_loop"} & set(r)]
    assert {(r["batch"], r["burst"]) for r in plain} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    # The same batch-1 rows with the layers as one indexed loop, then from a child process
    # with control flow in command buffers.
    assert [(r["batch"], r["burst"], r.get("layer_loop"), r.get("xla_flags"))
            for r in t["decode"][len(plain):]] == [
        (1, 1, "indexed", None), (1, 4, "indexed", None), (1, 1, None, CONTROL_FLOW_GRAPHS),
        (1, 4, None, CONTROL_FLOW_GRAPHS)]
    assert all(r["step_ms"] > 0 and r["tok_s"] > 0 for r in t["decode"])
    assert len(t["prefill"]) == 3 and len(t["chunked"]) == 1
    assert res["peaks"] == {"tflops": None, "tbps": None} or res["backend"] != "cpu"
    # HF transformers' generate on the same decode shapes, in the same run.
    assert [(r["model"], r["batch"]) for r in res["hf"]] == [("tiny", 1), ("tiny", 2)]
    assert all(r["tpot_ms"] > 0 and r["device"] == "cpu" for r in res["hf"])
    # Every item ran, in order, with each compile timed per program.
    assert [i["name"] for i in res["items"]] == SMOKE_ITEMS
    assert all(i["status"] == "done" for i in res["items"]) and not res["cut_short"]
    assert any(c["program"] == "jit(_step)" and c["seconds"] > 0 for c in res["compiles"])

    # The report went next to the JSON, not over docs/device/check.md.
    assert (tmp_path / "device.md").read_text().startswith("# Device check")
    assert (docs.stat().st_mtime_ns if docs.exists() else None) == before


def test_a_tiny_budget_ends_the_run_in_time_and_says_what_was_skipped(tmp_path):
    """20 s for a run of minutes: what fits runs, in the planned order, and the rest is
    skipped, either before it starts (too little time left) or by the deadline (the item
    in hand cut short, exit 3); the JSON and markdown say which."""
    out = tmp_path / "device.json"
    env = {**os.environ, "XLA_FLAGS": xla_flags()}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"),
                           "--smoke", "--budget", "20", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    res = json.loads(out.read_text())
    assert proc.returncode == (3 if res["cut_short"] else 0), proc.stdout[-3000:]
    assert res["budget_s"] == 20 and res["elapsed_s"] < 40
    items = res["items"]
    assert [i["name"] for i in items] == SMOKE_ITEMS
    statuses = [i["status"] for i in items]
    assert statuses[0] != "skipped"  # the first item starts with the whole budget
    ran = statuses.index("skipped")
    assert set(statuses[:ran - 1]) <= {"done"} and statuses[ran - 1] in ("done", "cut short")
    assert statuses[ran:] == ["skipped"] * (len(items) - ran)
    assert all(i["reason"].startswith("budget") for i in items[ran:])
    assert "HF generate tiny" in {i["name"] for i in items[ran:]}
    assert all(c["status"] == "pass" for c in res["checks"])  # what ran, passed
    assert not any(c["name"].startswith("engine timings") for c in res["checks"])
    assert (tmp_path / "device.md").read_text().startswith("# Device check")
    if res["cut_short"]:
        assert "cut short" in proc.stdout


def test_the_deadline_ends_an_item_in_hand_and_keeps_the_results(tmp_path):
    """An item still running at the deadline: the process ends (exit 3) with the JSON
    saying what was done, what was cut short and what never started."""
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from harness.device_budget import Budget, Item
        res = {{"checks": []}}
        Budget(3, Path({str(tmp_path / "cut.json")!r}), res).run_all([
            Item("quick", lambda: res.update(quick=1), floor_s=0),
            Item("slow", lambda: time.sleep(60), floor_s=0),
            Item("never", lambda: res.update(never=1), floor_s=0)])
        print("returned")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=harness_env())
    assert proc.returncode == 3 and "returned" not in proc.stdout, proc.stderr[-2000:]
    res = json.loads((tmp_path / "cut.json").read_text())
    assert res["cut_short"] and res["quick"] == 1 and "never" not in res
    assert [(i["name"], i["status"]) for i in res["items"]] == [
        ("quick", "done"), ("slow", "cut short"), ("never", "skipped")]
    assert 3 <= res["elapsed_s"] < 10


def test_budget_skips_what_does_not_fit_and_keeps_going_after_a_failure(tmp_path):
    """In process, items that finish within the budget: the JSON on disk is whole at every
    item, an item with more floor than time left is skipped, a failure is recorded and the
    next item still runs."""
    from harness.device_budget import Budget, Item

    path = tmp_path / "partial.json"
    res: dict = {"checks": []}
    seen = []

    def peek():
        seen.append([(i["name"], i["status"]) for i in json.loads(path.read_text())["items"]])

    def fail():
        raise ValueError("no device")

    budget = Budget(60, path, res)
    budget.run_all([Item("a", lambda: res.update(a=1)), Item("b", fail),
                    Item("c", lambda: res.update(c=1), floor_s=120), Item("d", peek)])
    assert seen == [[("a", "done"), ("b", "failed"), ("c", "skipped"), ("d", "running")]]
    final = json.loads(path.read_text())
    assert [(i["name"], i["status"]) for i in final["items"]] == [
        ("a", "done"), ("b", "failed"), ("c", "skipped"), ("d", "done")]
    assert final["a"] == 1 and "c" not in final and not final["cut_short"]
    assert final["items"][1]["error"] == "ValueError: no device"
    assert final["items"][2]["reason"].startswith("budget: ")
