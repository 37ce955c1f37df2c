"""Costs of elastic sequence parallelism (ESP) for the LoongServe baseline: prefill time of a
batch on d instances, one decode iteration on one instance, and KV migration between
instances. ``jserve.sim.loongserve_manager.GlobalManager`` decides with them and
``jserve.sim.loongserve`` charges them, so decisions and simulated time use one model.

- An *instance* is one TP group running the whole (non-pipelined) model (LoongServe §4,
  "elastic instances"); its step times are ``GpuTimeModel(tp=instance_tp)``.
- Prefill on d instances (striped attention, LoongServe §2.3): every instance holds 1 / d of
  every prompt's tokens, so its linear ops see 1 / d of the tokens and its attention 1 / d of
  the queries against the causal context (striping balances the triangle over instances).
  Timed as ``CAUSAL_SLICES`` chunks of n / (d x slices) queries at contexts n / slices apart,
  so the causal triangle counts half the square (as a chunked prefill's chunks do on the
  mesh). The ring's KV passes are taken as hidden under attention (the paper's premise; it
  favours the baseline).
- Decode on one instance (§4.2 multi-master decoding): the linear layers, embedding and
  sampling of the requests it masters, as one decode batch of the instance's model, plus
  one query's attention over every KV piece it holds (its masters' and other masters'
  requests'); query/output exchange is taken as overlapped (§4.2).
- Migration: the KV bytes of ``tokens`` tokens (all layers) over one GPU pair per TP rank in
  parallel, timed by the Vidur ``send_recv`` profile, NVLink inside a DGX node and
  InfiniBand across nodes.
"""
from __future__ import annotations

import functools
from pathlib import Path

from jserve.data import profiles_root
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.sim.hardware import (
    BF16,
    GPUS_PER_NODE,
    GpuTimeModel,
    _load_network,
    _nearest_config,
)

CAUSAL_SLICES = 16


class EspCosts:
    def __init__(self, model: str, hardware: str, instance_tp: int, *,
                 data_dir: Path | None = None):
        self.instance = GpuTimeModel(model, hardware, tp=instance_tp, data_dir=data_dir)
        self.tp = instance_tp
        s = self.instance.shape
        self.kv_bytes_per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * BF16
        data = Path(data_dir) if data_dir is not None else profiles_root()
        curves = _load_network(data / "profiles" / "network" / f"{hardware}_dgx"
                               / "send_recv.csv")
        self._nvlink = _nearest_config(curves, 2, 2)
        self._infiniband = _nearest_config(curves, 2, 1)

    def capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        return self.instance.kv_cache_tokens(memory_fraction)

    def node_of(self, instance: int) -> int:
        return instance * self.tp // GPUS_PER_NODE

    # One EspCosts per configuration lives for the process (``jserve.sim.policies`` caches
    # it), so the cache holding ``self`` is intended.
    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019
    def prefill(self, lengths: tuple[int, ...], degree: int) -> float:
        """Seconds to prefill prompts of ``lengths`` as one batch on ``degree`` instances."""
        chunks = []
        for i, n in enumerate(lengths):
            k = min(CAUSAL_SLICES, n)
            for j in range(k):
                end, q = n * (j + 1) // k, -(-(n * (j + 1) // k - n * j // k) // degree)
                chunks.append(ScheduledChunk(f"{i}.{j}", end - q, q, j == k - 1))
        return self.instance.predict(BatchPlan((), tuple(chunks)))

    def decode(self, contexts: tuple[int, ...]) -> float:
        """Seconds of one decode iteration of an instance mastering rows of these contexts
        with all their KV local."""
        return self.decode_instance(len(contexts), contexts)

    def decode_instance(self, masters: int, pieces: tuple[int, ...]) -> float:
        """Seconds of one multi-master decode iteration on one instance: the linear layers
        of ``masters`` rows (run on the master only, §4.2) and one query's attention over
        each KV piece of ``pieces`` tokens it holds."""
        if not masters and not pieces:
            return 0.0
        m = self.instance
        linear = m.predict(BatchPlan(tuple(ScheduledChunk(str(i), 0, 1, True)
                                           for i in range(masters)), ())) if masters else 0.0
        attention = sum(m._attention_at(max(c - 1, 0), 1) for c in pieces)
        return linear + attention * m.shape.num_layers

    def decode_batch_threshold(self, ratio: float = 2.0, largest: int = 4096) -> int:
        """§5.4's profiled batch size past which a decode batch turns compute-bound (the
        linear layers stop being a read of the weights): the smallest power of two whose
        linear-layer time is ``ratio`` times a one-row batch's."""
        one = self.decode_instance(1, ())
        b = 1
        while b < largest and self.decode_instance(b, ()) < ratio * one:
            b *= 2
        return b

    def migrate(self, tokens: int, src: int, dst: int) -> float:
        """Seconds to move ``tokens`` tokens of KV from instance ``src`` to ``dst``."""
        if tokens <= 0 or src == dst:
            return 0.0
        curve = self._nvlink if self.node_of(src) == self.node_of(dst) else self._infiniband
        return curve(tokens * self.kv_bytes_per_token / self.tp)
