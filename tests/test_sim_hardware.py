"""GpuTimeModel against the raw Vidur profiles, and the shape of its answers: monotone in work,
parallelism helping where it should, and a 1M-token prefill in a physically plausible range."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from jserve.data import profiles_root
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.sim.hardware import LAYER_OPS, MODEL_SHAPES, GpuTimeModel

DATA = profiles_root()
PROFILE = DATA / "profiles" / "compute" / "a100" / "Meta-Llama-3-8B" / "mlp.csv"

LAYERS = MODEL_SHAPES["llama3-8b"].num_layers


def prefill(n: int, start: int = 0, samples: bool = False) -> BatchPlan:
    return BatchPlan((), (ScheduledChunk("p", start, n, samples),))


def decodes(batch: int, context: int) -> BatchPlan:
    return BatchPlan(tuple(ScheduledChunk(f"d{i}", context, 1, True) for i in range(batch)), ())


def raw_rows(path: Path, **match: int) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if all(int(r[k]) == v for k, v in match.items())]


@pytest.fixture(scope="module")
def a100_tp8() -> GpuTimeModel:
    return GpuTimeModel("llama3-8b", "a100", tp=8)


@pytest.mark.parametrize("tp", [1, 8])
def test_profiled_points_match_the_csv(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = GpuTimeModel("llama3-8b", "a100", tp=tp)
    monkeypatch.setattr(model, "_attention", lambda chunk: 0.0)
    monkeypatch.setattr(model, "_tp_all_reduce", None)
    for n in (1, 1024, 2048, 8192, 16384, 32768):
        rows = raw_rows(PROFILE, num_tokens=n, num_tensor_parallel_workers=tp)
        # Per-op medians x layers, plus the once-per-step embedding; duplicate rows averaged.
        expected = sum(LAYERS * sum(float(r[f"time_stats.{op}.median"]) for op in LAYER_OPS)
                       + float(r["time_stats.emb.median"]) for r in rows) / len(rows) * 1e-3
        assert model.predict(prefill(n)) == pytest.approx(expected, rel=0.01), n

    profiled = sorted({int(r["num_tokens"])
                       for r in raw_rows(PROFILE, num_tensor_parallel_workers=tp)})
    lo, hi = profiled[-2], profiled[-1]
    t_lo, t_mid, t_hi = (model.predict(prefill(n)) for n in (lo, (lo + hi) // 2, hi))
    assert t_lo <= t_mid <= t_hi
    assert t_mid == pytest.approx((t_lo + t_hi) / 2, rel=1e-3)


def test_monotone_in_tokens_and_context(a100_tp8: GpuTimeModel) -> None:
    # The chunk-size binary search needs this at every token count, not just profiled ones.
    times = [a100_tp8.predict(prefill(n, start=4096)) for n in range(1, 40_000, 61)]
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert a100_tp8.predict(prefill(2048, 512 * 1024)) > a100_tp8.predict(prefill(2048, 0))
    assert a100_tp8.predict(decodes(32, 65536)) > a100_tp8.predict(decodes(32, 4096))

    one, many = a100_tp8.predict(decodes(1, 4096)), a100_tp8.predict(decodes(128, 4096))
    assert one < many < 128 * one / 4  # decode is weight-bound: batching is nearly free


def test_tensor_parallel_splits_compute_and_adds_all_reduce(
        a100_tp8: GpuTimeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    big = prefill(16384)
    assert a100_tp8.predict(big) < GpuTimeModel("llama3-8b", "a100", tp=1).predict(big) / 2

    # What TP adds is 2 all-reduces per layer of the step's activations, as profiled:
    # 2048 tokens x 4096 hidden x 2 bytes = 16 MiB among 8 GPUs on one node.
    rows = raw_rows(DATA / "profiles" / "network" / "a100_dgx" / "all_reduce.csv",
                    num_workers=8, devices_per_node=8, size=2048 * 4096 * 2)
    median_s = sum(float(r["time_stats.all_reduce.median"]) for r in rows) / len(rows) * 1e-3
    with_comm = a100_tp8.predict(prefill(2048))
    monkeypatch.setattr(a100_tp8, "_tp_all_reduce", None)
    assert with_comm - a100_tp8.predict(prefill(2048)) == pytest.approx(
        2 * LAYERS * median_s, rel=0.01)


def test_kv_parallel_speeds_up_long_decode() -> None:
    million = decodes(1, 1 << 20)
    kvp1 = GpuTimeModel("llama3-8b", "a100", tp=8).predict(million)
    kvp4 = GpuTimeModel("llama3-8b", "a100", tp=8, kvp=4).predict(million)
    assert kvp4 < kvp1


def test_stream_pipeline_adds_send_recv() -> None:
    plan = prefill(2048)
    spp1 = GpuTimeModel("llama3-8b", "a100", tp=8).predict(plan)
    spp2 = GpuTimeModel("llama3-8b", "a100", tp=8, spp=2).predict(plan)
    assert spp1 < spp2 < spp1 * 1.2  # same layers in sequence, plus one stage hand-off


def test_million_token_prefill_is_plausible(a100_tp8: GpuTimeModel) -> None:
    n, chunk = 1 << 20, 2048
    total = sum(a100_tp8.predict(prefill(chunk, s, s + chunk == n)) for s in range(0, n, chunk))
    print(f"\n{a100_tp8.describe()}: 1M-token prefill in 2048-token chunks = {total:.1f} s")
    # Lower bound: the attention FLOPs alone (4 x heads x head_dim x layers x sum of chunk x
    # context ~ 2.9e17) at 100% of 8 A100s' peak take ~115 s. Upper bound: 600 s would mean
    # under ~20% utilisation, well below what FlashAttention reaches on long sequences.
    s = MODEL_SHAPES["llama3-8b"]
    flops = 4 * s.num_heads * s.head_dim * s.num_layers * sum(
        chunk * (start + chunk) for start in range(0, n, chunk))
    peak_bound = flops / (8 * 312e12)
    assert peak_bound == pytest.approx(115, rel=0.05)
    assert peak_bound < total < 600


def test_h100_uses_nearest_profile_scaled() -> None:
    h100 = GpuTimeModel("llama3-8b", "h100", tp=8)
    assert h100.profile_name == "Llama-2-7b-hf"
    a100 = GpuTimeModel("llama3-8b", "a100", tp=8)
    for plan in (prefill(16384), decodes(32, 4096)):
        assert h100.predict(plan) < a100.predict(plan)
    assert "llama3-8b" in h100.describe() and "h100" in h100.describe()


def test_empty_plan_and_bad_names(a100_tp8: GpuTimeModel) -> None:
    assert a100_tp8.predict(BatchPlan((), ())) == 0.0
    with pytest.raises(ValueError, match="llama9"):
        GpuTimeModel("llama9", "a100")
    with pytest.raises(ValueError, match="tpu-v9"):
        GpuTimeModel("llama3-8b", "tpu-v9")
    with pytest.raises(ValueError, match="tp=16"):
        GpuTimeModel("llama3-8b", "a100", tp=16)
    assert math.isfinite(a100_tp8.predict(decodes(1, 1)))


def test_an_moe_model_computes_by_its_active_experts_and_stores_them_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-30B-A3B's shape (128 experts 768 wide, top 8) against the dense model of its
    active MLP width (one MLP of 8 x 768): the same step times, while the weights the GPU
    holds (and so the KV room left) are every expert's."""
    import dataclasses

    moe = MODEL_SHAPES["qwen3-30b-a3b"]
    dense = dataclasses.replace(moe, name="dense-active", intermediate=8 * 768, num_experts=0,
                                experts_per_token=0)
    monkeypatch.setitem(MODEL_SHAPES, "dense-active", dense)
    a, b = (GpuTimeModel(name, "h100") for name in ("qwen3-30b-a3b", "dense-active"))
    assert a.profile_name == b.profile_name
    for plan in (prefill(4096), decodes(32, 4096), decodes(1, 100)):
        assert a.predict(plan) == pytest.approx(b.predict(plan), rel=1e-12)
    # 48 layers x 3 x 2048 x 768 x (128 - 8) more weights, in bf16 on the one GPU.
    extra = 48 * 3 * 2048 * 768 * 120 * 2
    assert (b.kv_cache_tokens() - a.kv_cache_tokens()) * a.kv_token_bytes() == pytest.approx(
        extra, rel=1e-4)
