"""Trace files in, record files out: the workload format shared by the simulator, the live
replay (``jserve.bench.replay``) and the benchmark harness. Pure Python + numpy (no JAX), so
any tool can import it.

A trace is CSV or JSONL with ``num_prefill_tokens`` and ``num_decode_tokens`` per request and
``arrived_at`` (seconds) unless arrivals are drawn from a Poisson process at a given QPS. The
readers take a path or the name of a packaged trace (``jserve.data.TRACES``: ``sharegpt4``,
``azure-conv``).
A record is one JSON object per request with every one of ``RECORD_FIELDS`` and optionally
``token_times_s`` (the time of every output token, which TBT needs); ``first_token_s`` and
``finish_s`` are null when the run ended before the request got there. All times are seconds
from the start of the run.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from jserve.data import trace_path

RECORD_FIELDS = ("request_id", "prompt_tokens", "output_tokens", "arrival_s", "first_token_s",
                 "finish_s", "finish_reason", "policy")
# replica: cluster runs; prefill_replica, transfer_s, kv_import: disaggregated ones
# (jserve.sim.disagg)
OPTIONAL_RECORD_FIELDS = ("token_times_s", "replica", "prefill_replica", "transfer_s",
                          "kv_import")

# Medha-SWE's published statistics (no public trace): prompt P50 393K / P90 839K tokens in
# 128K-1M, output P50 518 / P90 808. Only a log-normal fitted to the two quantiles is known.
MEDHA_SWE_PROMPT = (393_000, 839_000)
MEDHA_SWE_OUTPUT = (518, 808)
MEDHA_SWE_PROMPT_RANGE = (128 * 1024, 1024 * 1024)

_Z90 = 1.2815515655446004  # standard normal 90th percentile


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_deadline_s: float | None = None  # relative to arrival; None: the policy's default
    # Prefix caching studies: the prompt starts with ``prefix_tokens`` of shared document
    # ``prefix_id`` (requests with the same id share them).
    prefix_id: str | None = None
    prefix_tokens: int = 0


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    raise ValueError(f"{path}: trace must be .csv or .jsonl")


def read_trace(trace: str | Path, *, qps: float | None = None, seed: int = 0,
               max_requests: int | None = None) -> list[TraceRequest]:
    """The first ``max_requests`` requests of a trace; with ``qps`` their arrivals are
    drawn by ``poisson_arrivals`` (the file's ``arrived_at`` is then ignored)."""
    path = trace_path(trace)
    rows = _rows(path)[:max_requests]
    if not rows:
        raise ValueError(f"{path}: no requests")
    arrivals = poisson_arrivals(len(rows), qps, seed) if qps is not None else None
    out = []
    for i, r in enumerate(rows):
        where = f"{path} request {i}"
        try:
            prompt, output = int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])
            arrival = float(arrivals[i] if arrivals is not None else r["arrived_at"])
        except KeyError as e:
            raise ValueError(f"{where}: missing {e.args[0]!r} (arrived_at is needed "
                             f"unless qps is given)") from None
        if prompt < 1 or output < 1:
            raise ValueError(f"{where}: token counts must be >= 1, got {prompt}, {output}")
        out.append(TraceRequest(str(r.get("request_id", i)), arrival, prompt, output))
    return out


def read_lengths(trace: str | Path) -> list[tuple[int, int]]:
    """(prompt, output) tokens of every request of a trace, arrivals ignored: the pool that
    benchmark workloads draw their requests' lengths from."""
    return [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
            for r in _rows(trace_path(trace))]


def poisson_arrivals(n: int, qps: float, seed: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process at ``qps``. The same seed gives the same
    unit-rate draws at every QPS (times scale by 1 / qps), so a load sweep varies only load."""
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    return np.cumsum(np.random.default_rng(seed).standard_exponential(n)) / qps


def write_trace(path: str | Path, requests: Iterable[TraceRequest], *,
                arrivals: bool = True) -> None:
    """CSV or JSONL by suffix, in the column names ``read_trace`` expects."""
    rows = [{**({"arrived_at": t.arrival_s} if arrivals else {}),
             "num_prefill_tokens": t.prompt_tokens, "num_decode_tokens": t.output_tokens}
            for t in requests]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        raise ValueError(f"{path}: trace must be .csv or .jsonl")


def empty_record(t: TraceRequest, policy: str) -> dict:
    """A request's record before anything has happened to it (runs fill it in)."""
    return {"request_id": t.request_id, "prompt_tokens": t.prompt_tokens, "output_tokens": 0,
            "arrival_s": t.arrival_s, "first_token_s": None, "finish_s": None,
            "finish_reason": None, "policy": policy, "token_times_s": []}


def write_records(path: str | Path, records: Iterable[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in RECORD_FIELDS + OPTIONAL_RECORD_FIELDS
                                if k in r}) + "\n")


def read_records(path: str | Path) -> list[dict]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            r = json.loads(line)
            missing = set(RECORD_FIELDS) - set(r)
            unknown = set(r) - set(RECORD_FIELDS) - set(OPTIONAL_RECORD_FIELDS)
            if missing or unknown:
                raise ValueError(f"{path} line {i + 1}: missing fields {sorted(missing)}, "
                                 f"unknown fields {sorted(unknown)}")
            out.append(r)
    return out


def lognormal_lengths(rng: np.random.Generator, n: int, p50: float, p90: float,
                      lo: int = 1, hi: int | None = None) -> np.ndarray:
    """``n`` integer lengths from the log-normal with the given median and 90th percentile,
    clipped to [lo, hi]: the most one can build from two published quantiles."""
    sigma = math.log(p90 / p50) / _Z90
    x = rng.lognormal(math.log(p50), sigma, n)
    return np.clip(np.rint(x), lo, hi if hi is not None else np.inf).astype(np.int64)


def mix_long_requests(short: Sequence[tuple[int, int]], n: int, long_fraction: float,
                      seed: int) -> list[tuple[int, int]]:
    """``n`` (prompt, output) pairs: shorts drawn with replacement from ``short``, and
    round(long_fraction * n) of them, at random positions, replaced by Medha-SWE-like long
    requests (``lognormal_lengths`` on the published quantiles)."""
    rng = np.random.default_rng(seed)
    pairs = [tuple(short[i]) for i in rng.integers(0, len(short), n)]
    n_long = round(long_fraction * n)
    where = rng.choice(n, n_long, replace=False)
    prompts = lognormal_lengths(rng, n_long, *MEDHA_SWE_PROMPT, *MEDHA_SWE_PROMPT_RANGE)
    outputs = lognormal_lengths(rng, n_long, *MEDHA_SWE_OUTPUT)
    for i, p, o in zip(where, prompts, outputs):
        pairs[i] = (int(p), int(o))
    return pairs
