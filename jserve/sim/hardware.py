"""Profile-driven GPU time model: ``GpuTimeModel.predict(plan) -> seconds`` for any BatchPlan.

Non-attention ops come from Vidur per-op profiles (``profiles/compute``), collectives from
Vidur network profiles (``profiles/network``), and attention, which was not profiled, from a
roofline. The profiles ship in ``jserve.data`` (``$JSERVE_SHARED_DATA`` or ``data_dir`` points
elsewhere). The simulator and the prefill-time cache use it as their ``RuntimePredictor``. No
JAX here: the simulator runs without it.
"""
from __future__ import annotations

import bisect
import csv
import dataclasses
import functools
import math
import operator
from collections import defaultdict
from pathlib import Path
from typing import Callable

from jserve.data import profiles_root
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.predictor import ChunkTimer

BF16 = 2  # bytes
_START, _NUM_TOKENS, _SAMPLES = (operator.itemgetter(i) for i in (1, 2, 3))  # ScheduledChunk
_MEMO_LIMIT = 1 << 17  # entries per memo table (a few MB)
GPUS_PER_NODE = 8  # DGX A100 / H100: collectives among up to 8 GPUs stay on NVLink


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The dimensions the time model needs. ``num_layers`` is 0 for shapes read from a profile
    (profiles are per layer). A mixture-of-experts layer has ``num_experts`` MLPs
    ``intermediate`` wide of which a token runs ``experts_per_token``: its compute follows
    the active width, its memory every expert (the router's small matmul and the dispatch
    are not modelled)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token's FLOPs run through."""
        return self.intermediate * (self.experts_per_token if self.num_experts else 1)

    @property
    def stored_intermediate(self) -> int:
        """The MLP width the weights hold (every expert)."""
        return self.intermediate * (self.num_experts or 1)


MODEL_SHAPES: dict[str, ModelShape] = {
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 768, 151936, 128, 8),
}


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One GPU. Its profiles live under ``profiles/compute/<name>`` and
    ``profiles/network/<name>_dgx``."""

    name: str
    peak_flops: float      # dense bf16 FLOP/s
    hbm_bandwidth: float   # bytes/s
    memory_bytes: int


HARDWARE_SPECS: dict[str, HardwareSpec] = {
    "a100": HardwareSpec("a100", 312e12, 2.0e12, 80 * 2**30),
    "h100": HardwareSpec("h100", 989e12, 3.35e12, 80 * 2**30),
}

# Per-layer non-attention ops in mlp.csv; ``emb`` (the embedding lookup) runs once per step.
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def _op_work(s: ModelShape) -> dict[str, float]:
    """Per-token FLOPs (matmuls) or elements touched (elementwise ops) of each profiled op:
    the ratio between two models' values scales one model's profiled time to the other."""
    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return {
        "emb": s.hidden,
        "input_layernorm": s.hidden,
        "attn_pre_proj": s.hidden * (q_dim + 2 * kv_dim),
        "attn_rope": q_dim + kv_dim,
        "attn_post_proj": q_dim * s.hidden,
        "post_attention_layernorm": s.hidden,
        "mlp_up_proj": s.hidden * 2 * s.active_intermediate,  # gate and up, fused
        "mlp_act": s.active_intermediate,
        "mlp_down_proj": s.active_intermediate * s.hidden,
        "add": s.hidden,
    }


def _isotonic(ys: list[float]) -> list[float]:
    """Closest non-decreasing sequence (pool adjacent violators). Profiled medians dip by up
    to ~15% between neighbouring sizes from measurement noise; the chunk-size binary search
    needs predicted time non-decreasing in tokens, and pooling removes the dips unbiased."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


@dataclasses.dataclass(frozen=True)
class _Curve:
    """Time (seconds) against a size, from profiled points: linear between them, the first
    point's time below them, proportional to size beyond the last (large ops are throughput
    bound, and the last two points are too close together for a reliable slope). Answers
    are memoized: the simulator asks about the same few thousand sizes millions of times."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    _memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_points(cls, points: dict[float, list[float]]) -> "_Curve":
        xs = sorted(points)
        # Repeated measurements of one size (the CSVs hold a few) are averaged.
        ys = _isotonic([sum(points[x]) / len(points[x]) for x in xs])
        return cls(tuple(xs), tuple(ys))

    def __call__(self, x: float) -> float:
        y = self._memo.get(x)
        if y is None:
            y = self._eval(x)
            if len(self._memo) < _MEMO_LIMIT:
                self._memo[x] = y
        return y

    def _eval(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x >= xs[-1]:
            return ys[-1] * x / xs[-1]
        i = bisect.bisect_right(xs, x)
        if i == 0:
            return ys[0]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclasses.dataclass(frozen=True)
class _ComputeProfile:
    shape: ModelShape
    medians_ms: dict[int, dict[str, dict[int, list[float]]]]  # tp -> op -> tokens -> medians


@functools.lru_cache(maxsize=None)
def _load_compute(path: Path) -> _ComputeProfile:
    medians: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        tp, n = int(r["num_tensor_parallel_workers"]), int(r["num_tokens"])
        for op in ("emb", *LAYER_OPS):
            medians[tp][op][n].append(float(r[f"time_stats.{op}.median"]))
    r = rows[0]
    heads, hidden = int(r["n_head"]), int(r["n_embd"])
    shape = ModelShape(path.parent.name, 0, hidden, heads, int(r["n_kv_head"]),
                       hidden // heads, int(r["n_expanded_embd"]), int(r["vocab_size"]))
    return _ComputeProfile(shape, {tp: {op: dict(d) for op, d in ops.items()}
                                   for tp, ops in medians.items()})


@functools.lru_cache(maxsize=None)
def _load_network(path: Path) -> dict[tuple[int, int], _Curve]:
    """(num_workers, devices_per_node) -> time against message bytes. ``devices_per_node`` <
    ``num_workers`` means the collective crosses nodes (InfiniBand rather than NVLink)."""
    points: dict = defaultdict(lambda: defaultdict(list))
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            median = next(v for k, v in r.items() if k.endswith(".median"))
            points[(int(r["num_workers"]), int(r["devices_per_node"]))][int(r["size"])].append(
                float(median) * 1e-3)
    return {k: _Curve.from_points(v) for k, v in points.items()}


def _nearest_config(curves: dict[tuple[int, int], _Curve], workers: int, per_node: int
                    ) -> _Curve:
    """The profiled (workers, devices per node) closest to the one asked for: H100 has no
    cross-node all-reduce profile, so there the NVLink figures stand in (optimistic)."""
    key = min(curves, key=lambda k: (abs(math.log(k[0] / workers)), abs(k[1] - per_node)))
    return curves[key]


class GpuTimeModel:
    """Seconds of one iteration of a ``tp × spp × kvp`` replica of ``model`` on ``hardware``.

    Per layer: the profiled non-attention ops at the step's token count (all chunks share the
    matmuls), plus roofline attention per sequence, plus 2 TP all-reduces of the step's
    activations, plus (kvp > 1) one all-reduce among the KV groups merging partial attention
    outputs and LSEs. With kvp > 1 every sequence's context is split evenly over the groups
    and every token pays the merge: exact for the long request KVP exists for, pessimistic for
    short ones that a real deployment keeps on one group.
    Once per step: the embedding lookup of all tokens and the lm_head of the sampled ones
    (estimated from the profiled up projection, the same kind of matmul).

    Where ``hardware`` has no profile of ``model`` (H100 has only Llama-2-7b/-70b), the
    profiled model with the nearest per-layer FLOPs stands in, each op's time scaled by the
    ratio of that op's FLOPs (elements, for elementwise ops); Llama-2-70b and Llama-3-70B have
    identical layers, so that case is exact.

    ``spp`` stages: the predictor answers for one batch passing through every stage, i.e.
    the slowest stage's time × spp plus (spp - 1) activation send/recvs. In a live pipeline
    consecutive chunks of a request overlap across stages: ``stage_time`` is the interval
    at which the simulator issues batches into the pipeline (``jserve.sim.simulator``).
    """

    def __init__(self, model: str, hardware: str, tp: int = 1, spp: int = 1, kvp: int = 1,
                 attention_efficiency: float = 0.6, data_dir: Path | None = None) -> None:
        if model not in MODEL_SHAPES:
            raise ValueError(f"unknown model {model!r}; known: {sorted(MODEL_SHAPES)}")
        if hardware not in HARDWARE_SPECS:
            raise ValueError(f"unknown hardware {hardware!r}; known: {sorted(HARDWARE_SPECS)}")
        self.shape, self.hw = MODEL_SHAPES[model], HARDWARE_SPECS[hardware]
        if not 1 <= spp <= self.shape.num_layers:
            raise ValueError(f"spp={spp} must be in [1, {self.shape.num_layers}] for {model}")
        if kvp < 1:
            raise ValueError(f"kvp={kvp} must be >= 1")
        if not 0 < attention_efficiency <= 1:
            raise ValueError(f"attention_efficiency={attention_efficiency} must be in (0, 1]")
        self.tp, self.spp, self.kvp, self.eff = tp, spp, kvp, attention_efficiency
        data = Path(data_dir) if data_dir is not None else profiles_root()

        profile = self._nearest_profile(data / "profiles" / "compute" / hardware)
        if tp not in profile.medians_ms:
            raise ValueError(f"tp={tp} not profiled for {hardware}; "
                             f"profiled: {sorted(profile.medians_ms)}")
        self.profile_name = profile.shape.name
        target, source = _op_work(self.shape), _op_work(profile.shape)
        ops = profile.medians_ms[tp]

        def curve(weights: dict[str, float]) -> _Curve:
            points: dict[float, list[float]] = {}
            for n in ops["add"]:
                rows = len(ops["add"][n])
                points[n] = [sum(w * ops[op][n][i] for op, w in weights.items()) * 1e-3
                             for i in range(rows)]
            return _Curve.from_points(points)

        self._layer = curve({op: target[op] / source[op] for op in LAYER_OPS})
        self._emb = curve({"emb": target["emb"] / source["emb"]})
        # lm_head (hidden -> vocab) is a matmul like the profiled up projection
        # (hidden -> 2 * intermediate): scale that by the output widths.
        self._lm_head = curve({"mlp_up_proj": target["mlp_up_proj"] / source["mlp_up_proj"]
                               * self.shape.vocab / (2 * self.shape.active_intermediate)})

        net = data / "profiles" / "network" / f"{hardware}_dgx"
        all_reduce = _load_network(net / "all_reduce.csv")
        self._tp_all_reduce = (_nearest_config(all_reduce, tp, min(tp, GPUS_PER_NODE))
                               if tp > 1 else None)
        # KV groups are tp GPUs apart: how many of them share a node.
        self._kvp_all_reduce = (
            _nearest_config(all_reduce, kvp, max(1, min(kvp, GPUS_PER_NODE // tp)))
            if kvp > 1 else None)
        self._send_recv = (
            _nearest_config(_load_network(net / "send_recv.csv"), 2,
                            2 if tp * kvp * spp <= GPUS_PER_NODE else 1)
            if spp > 1 else None)
        self._stage_layers = math.ceil(self.shape.num_layers / spp)
        # Attention's constants (``_attention_at`` runs for every decode of every step):
        # heads and KV heads per GPU (KV heads replicate when tp > KV heads), the head size,
        # and the attainable FLOP/s and bytes/s.
        s = self.shape
        self._roofline = (s.num_heads / tp, max(s.num_kv_heads / tp, 1.0), s.head_dim,
                          self.hw.peak_flops * attention_efficiency,
                          self.hw.hbm_bandwidth * attention_efficiency)
        # Memos of the hot path (see _parts and _sums).
        self._last_plan: BatchPlan | None = None
        self._last_parts = (0.0, 0.0, 0.0)
        self._last_decodes: tuple | None = None
        self._decode_sums = (0.0, 0)
        self._token_terms: dict[int, tuple] = {}  # _terms_of, from these curves:
        self._terms_curves: tuple = (None,) * 5

    def _nearest_profile(self, compute_dir: Path) -> _ComputeProfile:
        paths = sorted(compute_dir.glob("*/mlp.csv"))
        if not paths:
            raise FileNotFoundError(f"no compute profiles under {compute_dir}")
        flops = sum(_op_work(self.shape)[op] for op in LAYER_OPS)
        return min((_load_compute(p) for p in paths), key=lambda pr: abs(math.log(
            sum(_op_work(pr.shape)[op] for op in LAYER_OPS) / flops)))

    def predict(self, plan: BatchPlan) -> float:
        """Latency of one batch through every pipeline stage."""
        return self._latency(*self._parts(plan)) if not plan.is_empty else 0.0

    def stage_time(self, plan: BatchPlan) -> float:
        """The pipeline's issue interval for this batch: its slowest stage (the layers of one
        stage plus the embedding, lm_head and one activation send, all charged to it). With
        spp = 1 this is ``predict``."""
        return self._stage(*self._parts(plan)) if not plan.is_empty else 0.0

    def chunk_timer(self, plan: BatchPlan) -> ChunkTimer:
        """``predict(plan + one prefill chunk)`` with the plan's sums taken once (the
        scheduler's chunk-size search probes a dozen sizes against one plan)."""
        return self._chunk_timer(plan, self._latency)

    def stage_chunk_timer(self, plan: BatchPlan) -> ChunkTimer:
        """``stage_time(plan + one prefill chunk)``, as ``chunk_timer``."""
        return self._chunk_timer(plan, self._stage)

    def _latency(self, layer: float, once: float, send: float) -> float:
        return layer * self._stage_layers * self.spp + once + (self.spp - 1) * send

    def _stage(self, layer: float, once: float, send: float) -> float:
        return layer * self._stage_layers + once + (send if self.spp > 1 else 0.0)

    def _chunk_timer(self, plan: BatchPlan, total: Callable[[float, float, float], float]
                     ) -> ChunkTimer:
        tokens, attention, sampled = self._sums(plan)
        self._check_terms()
        combine, chunk_attention = self._combine, self._attention_at

        def time(request_id: str, start: int, n: int, samples: bool) -> float:
            return total(*combine(tokens + n, attention + chunk_attention(start, n),
                                  sampled + samples))
        return time

    def _parts(self, plan: BatchPlan) -> tuple[float, float, float]:
        """(one layer's time, once-per-step time, one inter-stage send) of a non-empty plan;
        the last plan's answer is kept (the simulator asks for latency and stage time)."""
        if plan is not self._last_plan:
            self._check_terms()
            self._last_plan, self._last_parts = plan, self._combine(*self._sums(plan))
        return self._last_parts

    def _check_terms(self) -> None:
        """Forget the ``_terms_of`` memo if one of its curves was replaced since (a test
        may drop the all-reduce, say)."""
        curves = (self._layer, self._tp_all_reduce, self._kvp_all_reduce, self._emb,
                  self._send_recv)
        if any(a is not b for a, b in zip(curves, self._terms_curves)):
            self._token_terms.clear()
            self._terms_curves = curves

    def _sums(self, plan: BatchPlan) -> tuple[int, float, int]:
        """(tokens, one layer's attention time, sampled rows). The decodes' share is kept for
        the last decode tuple seen: the scheduler tries many prefill chunks beside one."""
        if plan.decodes is not self._last_decodes:
            self._last_decodes = plan.decodes
            decodes = plan.decodes
            self._decode_sums = (sum(map(self._attention_at, map(_START, decodes),
                                         map(_NUM_TOKENS, decodes))),
                                 sum(map(_SAMPLES, decodes)))
        attention, sampled = self._decode_sums
        tokens = len(plan.decodes)
        for c in plan.prefills:
            attention += self._attention(c)
            sampled += c.samples
            tokens += c.num_tokens
        return tokens, attention, sampled

    def _combine(self, tokens: int, attention: float, sampled: int
                 ) -> tuple[float, float, float]:
        terms = self._token_terms.get(tokens)
        if terms is None:
            terms = self._terms_of(tokens)
        matmuls, tp_all_reduce, kvp_all_reduce, once, send = terms
        layer = matmuls + attention
        if tp_all_reduce is not None:
            layer += tp_all_reduce
        if kvp_all_reduce is not None:
            layer += kvp_all_reduce
        if sampled:
            once += self._lm_head(sampled)
        return layer, once, send

    def _terms_of(self, tokens: int) -> tuple[float, float | None, float | None, float, float]:
        """What a step's time takes from its token count alone (memoized: the chunk search
        prices a few dozen sizes per step): one layer's non-attention ops, its TP and KVP
        all-reduces (None without), the embedding, and one inter-stage send."""
        s = self.shape
        act_bytes = tokens * s.hidden * BF16
        tp = 2 * self._tp_all_reduce(act_bytes) if self._tp_all_reduce is not None else None
        kvp = None
        if self._kvp_all_reduce is not None:  # partial outputs (bf16) + LSEs (fp32)
            heads = s.num_heads / self.tp
            kvp = self._kvp_all_reduce(tokens * heads * (s.head_dim * BF16 + 4))
        send = self._send_recv(act_bytes) if self._send_recv is not None else 0.0
        terms = (self._layer(tokens), tp, kvp, self._emb(tokens), send)
        if len(self._token_terms) < _MEMO_LIMIT:
            self._token_terms[tokens] = terms
        return terms

    def kv_cache_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV entries the replica holds: per GPU, ``memory_fraction`` of memory less its share
        of the bf16 weights, over one token's KV on that GPU (its stage's layers, its KV
        heads, 1 / kvp of the context)."""
        s = self.shape
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        params = (s.num_layers * (s.hidden * (q_dim + 2 * kv_dim) + q_dim * s.hidden
                                  + 3 * s.hidden * s.stored_intermediate + 2 * s.hidden)
                  + 2 * s.vocab * s.hidden)
        free = self.hw.memory_bytes * memory_fraction - params * BF16 / (self.tp * self.spp)
        if free <= 0:
            raise ValueError(f"{self.describe()}: weights do not fit in memory")
        return int(free / self.kv_token_bytes())

    def kv_token_bytes(self) -> float:
        """One token's KV on one GPU (its stage's layers, its KV heads, 1 / kvp of the
        context): what each GPU moves over its own host link per token copied."""
        s = self.shape
        kv_heads = max(s.num_kv_heads / self.tp, 1.0)
        return (2 * math.ceil(s.num_layers / self.spp) * kv_heads * s.head_dim * BF16
                / self.kvp)

    def _attention(self, c: ScheduledChunk) -> float:
        return self._attention_at(c.start, c.num_tokens)

    def _attention_at(self, start: int, q: int) -> float:
        """One layer's attention for a chunk of ``q`` tokens from ``start`` on one GPU:
        roofline over heads / tp and the 1 / kvp share of the context; the chunk's causal
        triangle is counted as full."""
        heads, kv_heads, head_dim, flop_rate, byte_rate = self._roofline
        ctx = (start + q) / self.kvp
        flops = 4 * q * ctx * heads * head_dim
        kv_read = ctx * 2 * kv_heads * head_dim * BF16
        q_side = q * (2 * heads + 2 * kv_heads) * head_dim * BF16  # Q in, O out, new K/V
        return max(flops / flop_rate, (kv_read + q_side) / byte_rate)

    def describe(self) -> str:
        return (f"{self.shape.name} on {self.hw.name} tp={self.tp} spp={self.spp} "
                f"kvp={self.kvp} attention_efficiency={self.eff} "
                f"(profile {self.profile_name})")


class StageTimes:
    """A ``RuntimePredictor`` answering a model's ``stage_time``: the time a prefill takes
    when its chunks stream through the pipeline stages one issue interval apart (SPP), which
    is what isolated prefill times (TTFT deadlines, slack) should sum on a pipelined mesh."""

    def __init__(self, model: GpuTimeModel):
        self.model = model

    def predict(self, plan: BatchPlan) -> float:
        return self.model.stage_time(plan)

    def chunk_timer(self, plan: BatchPlan) -> ChunkTimer:
        return self.model.stage_chunk_timer(plan)
