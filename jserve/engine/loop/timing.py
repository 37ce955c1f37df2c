"""The runtime predictor the live engine's deadline-aware scheduler packs with.

A predictor fitted by ``jserve profile`` is only valid for one model on one kind of device
with one mesh, so it is stored under a key naming all three and loaded at start. Without one
the engine falls back to a FLOP/byte estimate (and says so): good enough to shape chunks,
not to hold deadlines tightly.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import jax

from jserve.config import ModelConfig
from jserve.copy_rate import CopyRate
from jserve.engine.config import EngineConfig
from jserve.model.params import active_params
from jserve.scheduler.predictor import FEATURES, LinearPredictor
from sharding.mesh import MeshConfig

log = logging.getLogger(__name__)

# Rough sustained rates for the fallback estimate, by platform: (FLOP/s, bytes/s, step overhead s).
_NOMINAL_RATES = {"cpu": (5e10, 1e10, 2e-3), "gpu": (2e14, 1.5e12, 5e-4),
                  "tpu": (2e14, 1e12, 5e-4)}
# Device <-> host copies (bytes/s, seconds per transfer): PCIe-class links on accelerators,
# memcpy plus dispatch on CPU.
_HOST_COPY = {"cpu": (5e9, 1e-3), "gpu": (2e10, 1e-4), "tpu": (2e10, 1e-4)}


def host_round_trip_seconds(num_bytes: int) -> float:
    """Swap out now and back in later."""
    bandwidth, latency = _HOST_COPY.get(jax.devices()[0].platform, _HOST_COPY["gpu"])
    return 2 * (latency + num_bytes / bandwidth)


def host_copy_rate() -> CopyRate:
    """The host tier's copy rate before it has timed a copy: the platform's nominal link."""
    bandwidth, latency = _HOST_COPY.get(jax.devices()[0].platform, _HOST_COPY["gpu"])
    return CopyRate(bandwidth, latency)


def predictor_key(cfg: ModelConfig, mesh: str = "1") -> str:
    """model + hardware + mesh."""
    model = hashlib.sha1(json.dumps(cfg.to_hf_dict(), sort_keys=True).encode())
    device = jax.devices()[0].device_kind.replace(" ", "_")
    return f"{model.hexdigest()[:12]}-{device}-mesh{mesh}"


def default_predictor_path(cfg: ModelConfig, config: EngineConfig) -> Path:
    return Path(config.compilation_cache_dir or ".").parent / "predictors" / (
        predictor_key(cfg, MeshConfig.parse(config.mesh).key()) + ".json")


def estimated_predictor(cfg: ModelConfig) -> LinearPredictor:
    """FLOPs and KV bytes at nominal platform rates, in ``plan_features`` terms."""
    flops, bandwidth, overhead = _NOMINAL_RATES.get(jax.devices()[0].platform,
                                                    _NOMINAL_RATES["gpu"])
    layers, q_dim = cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim
    kv_bytes = 2 * layers * cfg.num_key_value_heads * cfg.head_dim * cfg.np_dtype.itemsize
    per_token = 2 * active_params(cfg) / flops  # an MoE token: its k experts'
    attn_flop = 4 * layers * q_dim / flops       # QK^T and PV per (query, key) pair
    coef = dict(constant=overhead, tokens=per_token, decodes=0.0,
                decode_context=kv_bytes / bandwidth + attn_flop,
                prefill_attention=attn_flop / 2,  # causal: half the pairs
                prefill_seqs=0.0)
    return LinearPredictor(tuple(coef[f] for f in FEATURES), {"estimated": True},
                           cfg.kv_window)  # a sliding window caps the keys a query reads


def load_predictor(cfg: ModelConfig, config: EngineConfig) -> LinearPredictor:
    path = Path(config.predictor_path) if config.predictor_path else default_predictor_path(
        cfg, config)
    if path.exists():
        return LinearPredictor.load(path)
    if config.predictor_path:
        raise FileNotFoundError(f"predictor file {path} does not exist")
    log.warning("no profiled runtime predictor at %s; using a FLOP estimate "
                "(run `jserve profile` for deadlines the scheduler can keep)", path)
    return estimated_predictor(cfg)


class StepClock:
    """Each plan's step time as the host sees it when it reads the plan's tokens: from the
    later of its launch and the previous read. Synchronous, that is launch to tokens. Async,
    the device runs steps back to back, so it is the step's own time while the host keeps up
    and the iteration's wall time when the host falls behind (what a request's TPOT feels).
    It feeds ``step_log`` and the predictor's online correction."""

    def __init__(self):
        self._last_read = 0.0

    def read(self, launched_at: float) -> float:
        now = time.perf_counter()
        seconds = now - max(launched_at, self._last_read)
        self._last_read = now
        return seconds
