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
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_device_check_smoke_mode_passes(tmp_path):
    out = tmp_path / "device.json"
    docs = ROOT / "docs" / "device" / "check.md"
    before = docs.stat().st_mtime_ns if docs.exists() else None
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one plain CPU device
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
    assert {(r["batch"], r["burst"]) for r in t["decode"]} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(r["step_ms"] > 0 and r["tok_s"] > 0 for r in t["decode"])
    assert len(t["prefill"]) == 3 and len(t["chunked"]) == 1
    assert res["peaks"] == {"tflops": None, "tbps": None} or res["backend"] != "cpu"

    # The report went next to the JSON, not over docs/device/check.md.
    assert (tmp_path / "device.md").read_text().startswith("# Device check")
    assert (docs.stat().st_mtime_ns if docs.exists() else None) == before
