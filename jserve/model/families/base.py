"""What a model family is (:class:`Family`) and the checks its config reading shares.

A family says, in one module (``jserve/model/families/<name>.py``): how its ``config.json``
reads beyond the fields every family shares (``read_config``), its per-layer tensors (our
leaf name -> HF name, shape, whether stored transposed: ``layer_tensors``; the top-level
embedding, final norm and LM head follow HF's usual names unless it says otherwise), and its
decoder layer (``decoder_layer``, built from ``jserve.model.layers``).

Leaf names are one vocabulary across families (``wq`` is a query projection wherever it
appears), and a leaf's tensor-parallel split, whether it is quantized and which checkpoint
leaves a runtime leaf fuses follow from what it is: ``jserve.model.tp_layout.LEAVES``, the
one table of leaf kinds (a leaf it does not list is a replicated vector in the model's
dtype). A family that brings a new kind of leaf adds it there once.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jserve.config import ModelConfig
from jserve.model.layers import rms_norm


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor: its HF name (a layer's: after the layer prefix), our shape
    (matrices ``[in, out]``), and whether HF stores it transposed (torch's ``[out, in]``).
    ``experts``: one tensor per expert in the checkpoint (``hf`` holds ``{e}``, the expert's
    index), stacked at load on the first axis of ``shape`` ([experts, in, out]);
    ``transpose`` is then each expert's."""

    hf: str
    shape: tuple[int, ...]
    transpose: bool = False
    experts: bool = False

    def names(self) -> tuple[str, ...]:
        """The checkpoint names this tensor is read from: one, or one per expert in order."""
        if not self.experts:
            return (self.hf,)
        return tuple(self.hf.format(e=e) for e in range(self.shape[0]))


def hf_top_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """The embedding, the final norm and the LM head (absent when tied) under HF's usual
    names; the LM head as HF stores it, [vocab, hidden] like the embedding."""
    d, v = cfg.hidden_size, cfg.vocab_size
    top = {"embed": Tensor("model.embed_tokens.weight", (v, d)),
           "final_norm": Tensor("model.norm.weight", (d,))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = Tensor("lm_head.weight", (v, d))
    if cfg.num_labels:  # a sequence classifier's head, as HF stores it
        top["score"] = Tensor("score.weight", (cfg.num_labels, d))
    return top


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, keyed in the registry by its HF ``architectures`` names.

    ``read_config(config_json) -> dict``: the :class:`ModelConfig` fields this family sets
    beyond ``jserve.config.hf_config_fields`` (raises ValueError on what it cannot serve).
    ``layer_tensors(cfg)``: leaf -> :class:`Tensor` of one decoder layer (the checkpoint
    layout; the runtime one stacks the layers and fuses ``w_gate``/``w_up``).
    ``decoder_layer(layer, x, cos, sin, attend, *, cfg, tp_axis) -> (x, aux)``: its block.
    ``norm(x, w, eps)``: its RMSNorm, the final one's too (Gemma's scales by 1 + w).
    ``scaled_embedding``: the embedding's rows are multiplied by sqrt(hidden) (Gemma)."""

    name: str
    architectures: tuple[str, ...]
    model_type: str
    read_config: Callable[[dict[str, Any]], dict[str, Any]]
    layer_tensors: Callable[[ModelConfig], dict[str, Tensor]]
    decoder_layer: Callable
    top_tensors: Callable[[ModelConfig], dict[str, Tensor]] = hf_top_tensors
    layer_prefix: str = "model.layers.{}."
    norm: Callable = rms_norm
    scaled_embedding: bool = False


def refuse_flags(hf: dict[str, Any], *flags: str) -> None:
    """Raises ValueError naming the first of ``flags`` the config.json sets true."""
    for flag in flags:
        if hf.get(flag):
            raise ValueError(f"config.json sets {flag}=true, which jserve does not support "
                             f"for {hf.get('architectures')}")


def require_act(hf: dict[str, Any], act: str, key: str = "hidden_act") -> None:
    got = hf.get(key, act)
    if got != act:
        raise ValueError(f"unsupported {key} {got!r} (this family uses {act!r})")


def qwen_layer_windows(hf: dict[str, Any]) -> tuple[int, ...]:
    """Qwen2/Qwen3's per-layer windows, as transformers reads them: ``sliding_window`` counts
    only with ``use_sliding_window`` (default 4096 then); the layers are ``layer_types``
    where given, else layer i slides when i >= ``max_window_layers`` (default 28). Raises
    ValueError on a layer kind it has no attention for, or sliding layers without a window
    (transformers would run them unwindowed under a sliding mask)."""
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    kinds = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28)
        else "full_attention" for i in range(n)]
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown or len(kinds) != n:
        raise ValueError(f"config.json's layer_types {sorted(set(kinds))} ({len(kinds)} for "
                         f"{n} layers): jserve serves full_attention and sliding_attention")
    if "sliding_attention" not in kinds:
        return ()
    if not (isinstance(window, int) and window > 0):
        raise ValueError("config.json's layer_types has sliding_attention layers but no "
                         f"window (use_sliding_window={hf.get('use_sliding_window')}, "
                         f"sliding_window={hf.get('sliding_window')!r})")
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)



MLP_LEAVES = ("w_gate", "w_up", "w_down")


def moe_tensors(cfg: ModelConfig, block: str, gate: str, up: str, down: str
                ) -> dict[str, Tensor]:
    """The router (``<block>gate.weight``) and the routed experts (``<block>experts.{e}.``
    ``gate``/``up``/``down`` ``.weight``, one tensor per expert, stacked at load): the MoE
    leaves in place of a dense layer's ``MLP_LEAVES``."""
    d, f, e = cfg.hidden_size, cfg.expert_size, cfg.num_experts
    expert = block + "experts.{e}."
    return {"router": Tensor(block + "gate.weight", (d, e), True),
            "we_gate": Tensor(f"{expert}{gate}.weight", (e, d, f), True, True),
            "we_up": Tensor(f"{expert}{up}.weight", (e, d, f), True, True),
            "we_down": Tensor(f"{expert}{down}.weight", (e, f, d), True, True)}


def qwen_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE/Qwen3-MoE's expert fields. Every layer must be sparse: a layer that
    ``decoder_sparse_step`` or ``mlp_only_layers`` makes dense would need a second layer
    kind in the stacked layers (the released Qwen MoE models have none)."""
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not (isinstance(experts, int) and experts > 0):
        raise ValueError(f"config.json's num_experts must be a positive integer, got "
                         f"{experts!r}")
    if not (isinstance(step, int) and step > 0):
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    only = hf.get("mlp_only_layers") or []
    dense = sorted(set(only) | {i for i in range(n) if (i + 1) % step})
    if dense:
        raise ValueError(f"config.json makes layers {dense} dense (decoder_sparse_step={step}, "
                         f"mlp_only_layers={only}): jserve serves MoE models whose every "
                         "layer is sparse")
    return {"num_experts": experts, "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}
