"""``jserve simulate`` end to end on a tiny trace: a records file with every field, a summary."""
from __future__ import annotations

import pytest

from jserve.cli import main
from jserve.sim.trace import RECORD_FIELDS, read_lengths, read_records

TRACE = ("arrived_at,num_prefill_tokens,num_decode_tokens\n"
         "0.0,200000,4\n0.5,300,5\n0.6,1200,3\n2.0,50,2\n")


@pytest.mark.parametrize("policy", ["lars-ss", "loongserve", "sarathi"])
def test_simulate_writes_every_record_field_and_a_summary(tmp_path, capsys, policy):
    trace, out = tmp_path / "trace.csv", tmp_path / "records.jsonl"
    trace.write_text(TRACE)
    assert main(["simulate", "--trace", str(trace), "--policy", policy, "--model", "llama3-8b",
                 "--hardware", "a100", "--tp", "8", "--spp", "2", "--out", str(out)]) == 0
    records = read_records(out)
    assert [r["request_id"] for r in records] == ["0", "1", "2", "3"]
    assert [r["prompt_tokens"] for r in records] == [200000, 300, 1200, 50]
    assert [r["output_tokens"] for r in records] == [4, 5, 3, 2]
    for r in records:
        assert list(r) == list(RECORD_FIELDS) + ["token_times_s"]
        assert len(r["token_times_s"]) == r["output_tokens"]
        assert (r["token_times_s"][0] == r["first_token_s"]
                and r["token_times_s"][-1] == r["finish_s"])
        assert r["policy"] == policy and r["finish_reason"] == "length"
        assert r["arrival_s"] <= r["first_token_s"] <= r["finish_s"]
    long, short = records[0], records[1]
    short_ttft = short["first_token_s"] - short["arrival_s"]
    if policy == "lars-ss":  # the short overtakes the 200K-token prefill (~6 s)
        assert short_ttft < 0.5 < long["first_token_s"] - 5
    else:                    # it waits for (nearly) all of it: FCFS
        assert short_ttft > long["first_token_s"] - 0.6
    text = capsys.readouterr().out
    assert "short (3, completed 3): TTFT P50" in text and "long (1, completed 1)" in text


def test_simulate_with_poisson_arrivals_and_a_window(tmp_path, capsys):
    trace, out = tmp_path / "lengths.jsonl", tmp_path / "records.jsonl"
    trace.write_text('{"num_prefill_tokens": 900000, "num_decode_tokens": 2}\n'
                     + '{"num_prefill_tokens": 100, "num_decode_tokens": 2}\n' * 5)
    assert main(["simulate", "--trace", str(trace), "--policy", "fcfs", "--qps", "2",
                 "--seed", "1", "--max-requests", "4", "--horizon", "5", "--out",
                 str(out)]) == 0
    records = read_records(out)
    assert len(records) == 4 and records[0]["arrival_s"] > 0
    assert all(r["finish_s"] is None for r in records)  # 900K tokens take far beyond 5 s
    assert "long (1, completed 0)" in capsys.readouterr().out


def test_simulate_rejects_a_trace_without_arrivals_or_qps(tmp_path, capsys):
    trace = tmp_path / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n10,2\n")
    assert main(["simulate", "--trace", str(trace), "--policy", "lars",
                 "--out", str(tmp_path / "r.jsonl")]) == 2
    assert "arrived_at" in capsys.readouterr().err


@pytest.mark.parametrize("trace, flags", [("azure-conv", []), ("sharegpt4", ["--qps", "2"])])
def test_simulate_reads_a_packaged_trace_by_name(tmp_path, capsys, trace, flags):
    out = tmp_path / "records.jsonl"
    assert main(["simulate", "--trace", trace, *flags, "--policy", "sarathi",
                 "--max-requests", "20", "--out", str(out)]) == 0
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in read_records(out)] == (
        read_lengths(trace)[:20])


def test_simulate_names_the_packaged_traces_for_a_missing_one(tmp_path, capsys):
    assert main(["simulate", "--trace", "sharegpt", "--qps", "1", "--policy", "lars",
                 "--out", str(tmp_path / "r.jsonl")]) == 2
    assert "no trace file 'sharegpt'; packaged traces: sharegpt4, azure-conv" in (
        capsys.readouterr().err)
