"""Model configuration read from a Hugging Face ``config.json``.

One frozen dataclass (``ModelConfig``) holds everything the forward pass needs, for every
model family; nothing is read from globals. What every family reads alike from a
``config.json`` is here (``hf_config_fields``); the family registry
(``jserve.model.families``) picks the family by architecture and adds its own fields. No JAX
here: the CLI and ``MeshConfig`` import it. The name stays ``config.py`` after the HF file it
mirrors (``config.json``), and every layer imports it as ``jserve.config``; the engine's
settings are ``jserve/engine/config.py``.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# How KV pages may be stored (jserve.kernels.kv_quant) and weights quantized
# (jserve.model.quant); here, without JAX, so configs and the CLI can validate them.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("none", "int8", "fp8")
# What the forward pass computes in, and what ``--dtype`` / ``LLM(dtype=...)`` take: ``auto``
# is the checkpoint's dtype except on a CPU backend (``auto_dtype``); None: as stored.
DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = ("auto", *DTYPES)
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "f32"}


def stored_dtype(cfg: dict[str, Any]) -> str:
    """A ``config.json``'s weight dtype as written (``dtype``, ``torch_dtype`` before
    transformers 5; float32 when neither is there)."""
    return cfg.get("dtype") or cfg.get("torch_dtype") or "float32"


def auto_dtype(stored: str, backend: str, what: str = "checkpoint") -> tuple[str, str]:
    """What ``dtype="auto"`` computes in for weights stored as ``stored`` on a JAX ``backend``
    ("cpu", "gpu", "tpu"), and why in words (the start-up line's): the checkpoint's dtype
    (float16 as bfloat16), except float32 for 16-bit weights on CPU, where XLA runs bf16
    matmuls about 100x slower than f32 (issue 41: 32 tokens in 25 s against 0.22 s)."""
    short = _SHORT.get(stored, stored)
    if stored in ("bfloat16", "float16"):
        if backend == "cpu":
            return "float32", f"auto: {short} {what}, CPU backend"
        return "bfloat16", f"auto: {short} {what}, {backend.upper()} backend"
    return "float32", f"auto: {short} {what}"


CAUSAL_SUFFIX, BASE_SUFFIX = "ForCausalLM", "Model"  # Qwen3ForCausalLM, Qwen3Model
CLASSIFIER_SUFFIX = "ForSequenceClassification"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: Llama 3.1's frequency-dependent kind (``rope_type == "llama3"``),
    ``"linear"`` (every frequency divided by ``factor``: Gemma 3's global layers), which
    uses only ``factor``, or ``"yarn"`` (gpt-oss, long-context Qwen: the frequencies ramped
    between extrapolated and interpolated by ``beta_fast``/``beta_slow`` rotations over
    ``original_max_position_embeddings``, and cos/sin scaled by ``attention_factor``)."""

    factor: float
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs of any model family. ``architecture`` (the HF
    ``architectures`` name) picks the family (``jserve.model.families``: its tensors and its
    layer); the registry reads a ``config.json`` into this (``read_config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    dtype: str = "float32"  # "float32" | "bfloat16"
    # Weight-only quantization of the layer matrices (jserve.model.quant): none | int8 | fp8.
    # An orbax checkpoint saved quantized records it in its config.json.
    quantization: str = "none"
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"  # config.json's, written back to an orbax checkpoint
    # The checkpoint is the family's base model (``Qwen3Model``, as sentence-transformers
    # saves embedding models): its tensor names lack ``model.`` and it stores no LM head, so
    # the embedding stands in for one (tied). Only a pooling engine serves it.
    base_model: bool = False
    # A sequence classifier (``Qwen3ForSequenceClassification``: cross-encoders): its head
    # ``score`` [num_labels, hidden] reads the last token's final norm, and it stores no LM
    # head (tied, as a base model). 0: none. Only a pooling engine serves it.
    num_labels: int = 0
    # Sliding-window attention, one entry per layer (0: full attention): a query at position
    # p reads the keys at positions k with p - window < k <= p (HF's convention). Empty: no
    # layer is windowed.
    layer_windows: tuple[int, ...] = ()
    # Gemma 3's (jserve.model.families.gemma3; neutral defaults for the other families): the
    # MLP's activation as config.json names it; the RoPE base of the windowed layers where it
    # differs from ``rope_theta`` (HF keys RoPE by layer type, the type ``layer_windows``
    # records: those layers read this unscaled table); the attention scale's denominator
    # (scores * query_pre_attn_scalar ** -0.5; None: head_dim); a tanh cap on the logits
    # (cap * tanh(logits / cap); None: none).
    hidden_act: str = "silu"
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (jserve/model/moe.py; 0: a dense MLP): each layer's MLP is
    # ``num_experts`` experts ``moe_intermediate_size`` wide (0: ``intermediate_size``,
    # Mixtral's) of which each token's router picks ``num_experts_per_tok``, their softmax
    # weights renormalised to sum to one when ``norm_topk_prob`` (Mixtral always; Qwen's
    # MoE families as their config says), plus a shared expert ``shared_expert_size`` wide
    # (0: none) gated per token by a sigmoid (Qwen2-MoE's).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_size: int = 0
    # gpt-oss's experts (jserve.model.families.gpt_oss; None: the gated SiLU): a clamped
    # SwiGLU, the gate clamped above and the up projection on both sides at
    # ``swiglu_limit``, then (up + 1) * gate * sigmoid(swiglu_alpha * gate).
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, got "
                             f"{self.num_experts_per_tok}")

    @property
    def expert_size(self) -> int:
        """Each routed expert's intermediate width."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def mlp_widths(self) -> dict[str, int]:
        """The intermediate width of every MLP a layer has (what tp must divide), by the
        config.json name of its size: the dense one, or the routed experts' and the shared
        expert's."""
        if not self.num_experts:
            return {"intermediate_size": self.intermediate_size}
        widths = {"moe_intermediate_size" if self.moe_intermediate_size
                  else "intermediate_size": self.expert_size}
        if self.shared_expert_size:
            widths["shared_expert_intermediate_size"] = self.shared_expert_size
        return widths

    @property
    def kv_window(self) -> int | None:
        """The most recent tokens any layer still reads when every layer is windowed (their
        KV is all a request must hold), else None (some layer reads the whole context)."""
        if self.layer_windows and all(self.layer_windows):
            return max(self.layer_windows)
        return None

    @property
    def np_dtype(self) -> np.dtype:
        """The params' and KV cache's element type (jnp accepts numpy dtypes)."""
        return np.dtype(ml_dtypes.bfloat16 if self.dtype == "bfloat16" else np.float32)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` form, so an orbax checkpoint directory is self-describing
        (what a family implies by its architecture, like Qwen2's biases, is not written)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture.removesuffix(CAUSAL_SUFFIX) + (
                BASE_SUFFIX if self.base_model else CLASSIFIER_SUFFIX if self.num_labels
                else CAUSAL_SUFFIX)],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "hidden_act": self.hidden_act,
            "torch_dtype": self.dtype,
        }
        if self.quantization != "none":  # an orbax checkpoint of quantized weights
            d["jserve_quantization"] = self.quantization
        s = self.rope_scaling
        if s is not None:
            d["rope_scaling"] = ({"rope_type": "linear", "factor": s.factor}
                                 if s.rope_type == "linear" else dataclasses.asdict(s))
        if self.layer_windows:  # HF's per-layer attention kinds
            d["sliding_window"] = max(self.layer_windows)
            d["layer_types"] = ["sliding_attention" if w else "full_attention"
                                for w in self.layer_windows]
            d["use_sliding_window"] = True  # what Qwen2/Qwen3 read the window under
        elif self.model_type == "mistral":  # transformers reads a missing one as 4096
            d["sliding_window"] = None
        if self.num_experts:  # under each MoE family's own names (each reads its own)
            d.update(num_local_experts=self.num_experts, num_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.expert_size,
                     norm_topk_prob=self.norm_topk_prob,
                     shared_expert_intermediate_size=self.shared_expert_size)
        if self.swiglu_limit is not None:
            d.update(swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        for key, value in (("rope_local_base_freq", self.rope_local_theta),
                           ("query_pre_attn_scalar", self.query_pre_attn_scalar),
                           ("final_logit_softcapping", self.final_logit_softcapping)):
            if value is not None:
                d[key] = value
        return d


def refuse_quantized_checkpoint(cfg: dict[str, Any]) -> None:
    """Raises ValueError, naming the method, on a checkpoint stored quantized by another
    tool (``quantization_config``: GPTQ, AWQ, FP8 blocks, ...): jserve reads float weights
    and quantizes them itself (``--quantization``). MXFP4 (gpt-oss's released experts) is
    decoded to float at load (``jserve.model.checkpoint_files``)."""
    qc = cfg.get("quantization_config")
    if not qc:
        return
    method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else qc
    if method == "mxfp4":
        return
    raise ValueError(f"config.json's quantization_config stores the weights as "
                     f"{method!r}; jserve reads float checkpoints (and MXFP4 experts) and "
                     "quantizes them itself (--quantization int8 or fp8)")


def hf_config_fields(cfg: dict[str, Any], dtype: str | None = None,
                     quantization: str | None = None) -> dict[str, Any]:
    """The :class:`ModelConfig` fields every family reads alike from a ``config.json``
    (sizes, RoPE, special tokens, dtype, quantization); a family adds its own and checks
    what it cannot serve (``jserve.model.families``). ``dtype`` None: as stored;
    ``quantization`` None: what the checkpoint was saved with (``jserve_quantization``,
    none for HF checkpoints); a quantized checkpoint cannot be loaded as another kind."""
    n_heads = cfg["num_attention_heads"]
    rope_theta = cfg.get("rope_theta", 10000.0)
    raw_scaling = cfg.get("rope_scaling")
    if raw_scaling is None and isinstance(cfg.get("rope_parameters"), dict):
        # transformers >= 5 writes rope settings under ``rope_parameters``.
        raw_scaling = cfg["rope_parameters"]
        rope_theta = raw_scaling.get("rope_theta", rope_theta)
    scaling = None
    if raw_scaling:
        kind = raw_scaling.get("rope_type", raw_scaling.get("type", "default"))
        if kind == "llama3":
            scaling = RopeScaling(
                factor=float(raw_scaling["factor"]),
                low_freq_factor=float(raw_scaling["low_freq_factor"]),
                high_freq_factor=float(raw_scaling["high_freq_factor"]),
                original_max_position_embeddings=int(raw_scaling["original_max_position_embeddings"]),
            )
        elif kind == "linear":
            scaling = RopeScaling(factor=float(raw_scaling["factor"]), rope_type="linear")
        elif kind == "yarn":
            scaling = yarn_scaling(raw_scaling, cfg)
        elif kind != "default":
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, "
                             "linear, yarn)")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    if dtype is None:
        dtype = "bfloat16" if stored_dtype(cfg) in ("bfloat16", "float16") else "float32"
    refuse_quantized_checkpoint(cfg)
    stored = cfg.get("jserve_quantization", "none")
    if quantization is None:
        quantization = stored
    elif stored != "none" and quantization != stored:
        raise ValueError(f"the checkpoint's weights are stored quantized as {stored!r}; "
                         f"it cannot be loaded with quantization={quantization!r}")
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=dtype,
        quantization=quantization,
    )


def yarn_scaling(raw: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """YaRN's parameters as transformers reads them: ``factor`` (absent: the context's growth
    over the original), ``attention_factor`` (absent: 0.1 ln(factor) + 1, or DeepSeek's
    mscale ratio), ``beta_fast``/``beta_slow`` (32/1), ``truncate`` (true)."""
    original = int(raw["original_max_position_embeddings"])
    factor = raw.get("factor") or cfg.get("max_position_embeddings", original) / original
    factor = float(factor)
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("YaRN with partial_rotary_factor != 1 is not supported")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = raw.get("attention_factor")
    if attention is None:
        m, m_all = raw.get("mscale"), raw.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(factor=factor, original_max_position_embeddings=original,
                       rope_type="yarn", beta_fast=float(raw.get("beta_fast") or 32),
                       beta_slow=float(raw.get("beta_slow") or 1),
                       truncate=bool(raw.get("truncate", True)),
                       attention_factor=float(attention))


def _yarn_frequencies(pos: np.ndarray, dim: int, base: float, s: RopeScaling) -> np.ndarray:
    """YaRN's inverse frequencies from ``pos`` = base ** (2i / dim), step by step as
    transformers computes them."""
    def correction(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(s.beta_fast), correction(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolate = (np.float32(1) - ramp).astype(np.float32)
    inv = (np.float32(1.0) / pos).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(s.factor) * pos)).astype(np.float32)
    return (interpolated * (1 - extrapolate) + inv * extrapolate).astype(np.float32)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor RoPE's cos and sin are multiplied by (YaRN's; 1 otherwise)."""
    s = cfg.rope_scaling
    return s.attention_factor if s is not None and s.rope_type == "yarn" else 1.0


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies in float32, with Llama 3.1 scaling when configured.

    Computed in float32 step by step as Hugging Face does, so f32 logits match to rounding.
    """
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos = (np.float32(cfg.rope_theta) ** exponents).astype(np.float32)
    inv = (np.float32(1.0) / pos).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return (inv / np.float32(s.factor)).astype(np.float32)
    if s.rope_type == "yarn":
        return _yarn_frequencies(pos, dim, cfg.rope_theta, s)
    old_len = np.float32(s.original_max_position_embeddings)
    low_wavelen = old_len / np.float32(s.low_freq_factor)
    high_wavelen = old_len / np.float32(s.high_freq_factor)
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(s.factor), inv).astype(np.float32)
    smooth = (old_len / wavelen - np.float32(s.low_freq_factor)) / np.float32(
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


# Checkpoints that ship with the package, by name (``--model tiny-tasks``; written by
# scripts/train_task_model.py).
BUILTIN_MODELS = {"tiny-tasks": Path(__file__).resolve().parent / "assets" / "tiny_tasks"}


def resolve_model_dir(model: str) -> Path:
    """The directory of a built-in model name, else ``model`` as a path."""
    return BUILTIN_MODELS.get(model, Path(model))


def model_dir(model: str) -> Path | None:
    """``--model``'s directory; None for the built-in random model, which has none."""
    return None if model == "default" else resolve_model_dir(model)
