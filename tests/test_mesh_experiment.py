"""scripts/mesh_experiment.py at smoke scale: one row per mesh x chunk x context, TP gives the
one-device tokens, a mesh the engine rejects is an error row with the reason.

The script runs in a subprocess: it sets the simulated host device count itself before JAX
starts, so this process keeps one CPU device."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness.mesh_sweep import SweepSettings, compare_outputs, digest, make_prompt, parse_list
from jserve.model.weights import DEFAULT_CONFIG
from jserve.sampling.params import SamplingParams
from llm_helpers import small_llm

ROOT = Path(__file__).resolve().parent.parent
MESHES = ["1", "tp=2", "tp=3"]
CONTEXTS = [24, 72]
CHUNKS = [16, 64]
DECODE = 6


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mesh_experiment.py"), "--smoke",
         "--meshes", ";".join(MESHES), "--contexts", ",".join(map(str, CONTEXTS)),
         "--chunks", ",".join(map(str, CHUNKS)), "--decode-tokens", str(DECODE),
         "--cpu-devices", "4", "--out-dir", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "mesh_experiment.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return out, rows, proc.stdout


@pytest.mark.slow
def test_one_row_per_mesh_chunk_context(result):
    _, rows, _ = result
    keys = [(r["mesh"], int(r["chunk"]), int(r["context"])) for r in rows]
    assert sorted(keys) == sorted((m, c, x) for m in MESHES for c in CHUNKS for x in CONTEXTS)


@pytest.mark.slow
def test_valid_meshes_have_positive_finite_times(result):
    _, rows, _ = result
    for r in rows:
        if r["mesh"] in ("1", "tp=2"):
            assert r["status"] == "ok", r
            assert r["devices"] == {"1": "1", "tp=2": "2"}[r["mesh"]]
            for key in ("ttft_s", "tbt_s"):
                assert 0 < float(r[key]) < math.inf, r


@pytest.mark.slow
def test_tp_gives_the_one_device_tokens(result):
    _, rows, stdout = result
    by = {(r["mesh"], r["chunk"], r["context"]): r["tokens_digest"] for r in rows}
    for c in CHUNKS:
        for x in CONTEXTS:
            assert by[("tp=2", str(c), str(x))] == by[("1", str(c), str(x))] != ""
    assert "every mesh that ran produced the same tokens as the one-device run" in stdout


@pytest.mark.slow
def test_digest_is_the_greedy_output_of_the_seeded_prompt(result):
    """The CSV's digest is what a plain one-device engine generates for the same prompt."""
    _, rows, _ = result
    llm = small_llm(max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    for x in CONTEXTS:
        [out] = llm.generate([make_prompt(x, DEFAULT_CONFIG.vocab_size, 0)], params)
        assert len(out.token_ids) == DECODE
        want = {r["tokens_digest"] for r in rows if r["mesh"] == "1" and r["context"] == str(x)}
        assert want == {digest(out.token_ids)}


@pytest.mark.slow
def test_rejected_mesh_is_an_error_row_with_the_reason(result):
    out, rows, _ = result
    bad = [r for r in rows if r["mesh"] == "tp=3"]
    assert len(bad) == len(CHUNKS) * len(CONTEXTS)
    for r in bad:
        assert r["status"] == "error" and r["ttft_s"] == "" and r["tokens_digest"] == ""
        assert "tp=3 does not divide num_attention_heads" in r["error"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["platform"] == "cpu" and summary["device_count"] == 4
    assert summary["reference"] == "1"
    assert summary["same_as_reference"] == {"1": True, "tp=2": True, "tp=3": None}


@pytest.mark.slow
def test_plot_is_written(result):
    out, _, _ = result
    png = out / "mesh_experiment.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_settings_raise_value_error():
    with pytest.raises(ValueError, match="decode_tokens"):
        SweepSettings(decode_tokens=1)
    with pytest.raises(ValueError, match="every entry must be int"):
        parse_list("256,abc", ",", int)
    with pytest.raises(ValueError, match="chunk sizes"):
        SweepSettings(chunks=(0,))


def test_compare_outputs_flags_a_mesh_whose_tokens_differ():
    def row(mesh, devices, chunk, context, d, status="ok"):
        return {"mesh": mesh, "devices": devices, "chunk": chunk, "context": context,
                "tokens_digest": d, "status": status}
    rows = [row("1", 1, 16, 24, "a"), row("1", 1, 16, 72, "b"),
            row("tp=2", 2, 16, 24, "a"), row("tp=2", 2, 16, 72, "b"),
            row("tp=4", 4, 16, 24, "a"), row("tp=4", 4, 16, 72, "X"),
            row("kvp=2", 2, 16, 24, "", "error")]
    assert compare_outputs(rows) == {"reference": "1", "same_as_reference": {
        "1": True, "tp=2": True, "tp=4": False, "kvp=2": None}}
    assert compare_outputs(rows[2:])["reference"] is None
