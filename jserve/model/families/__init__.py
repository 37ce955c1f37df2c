"""The model-family registry: HF ``architectures`` name -> :class:`Family` (``base.py``).

Adding a family is one module here (its config reading, tensors and layer) and one line in
``FAMILIES``; docs/models.md says what each family needed. Everything that depends on the
family asks this registry through the model config (``family_of(cfg)``, by
``cfg.architecture``): the params' shapes (``jserve.model.params``), the weight loaders' HF
names (``jserve.model.weights``), the decoder layer the forward runs
(``jserve.model.decoder.decoder_layer``). Reading a ``config.json`` goes through
:func:`read_config`, which refuses an architecture it has no family for.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jserve.config import (
    BASE_SUFFIX,
    CAUSAL_SUFFIX,
    CLASSIFIER_SUFFIX,
    ModelConfig,
    hf_config_fields,
)
from jserve.model.families import (
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from jserve.model.families.base import Family, Tensor

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY,
                               mistral.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY,
                               qwen3_moe.FAMILY, gpt_oss.FAMILY)
BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(BY_ARCHITECTURE)


def _unsupported(archs: Any) -> ValueError:
    return ValueError(f"unsupported architecture {archs}; jserve serves "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def family_of(cfg: ModelConfig) -> Family:
    """The family of a model config (by ``cfg.architecture``)."""
    family = BY_ARCHITECTURE.get(cfg.architecture)
    if family is None:
        raise _unsupported([cfg.architecture])
    return family


def read_config(hf: dict[str, Any], dtype: str | None = None,
                quantization: str | None = None) -> ModelConfig:
    """The model config of a ``config.json`` dict: the fields every family shares
    (``jserve.config.hf_config_fields``; ``dtype`` and ``quantization`` as there) and its
    family's own. No ``architectures`` reads as Llama. A family's base model (``Qwen3Model``:
    no LM head, tensor names without ``model.``) reads as the family with ``base_model``, its
    sequence classifier (``Qwen3ForSequenceClassification``) with ``num_labels``."""
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    causal = {a: next((a.removesuffix(s) + CAUSAL_SUFFIX for s in (BASE_SUFFIX,
                                                                  CLASSIFIER_SUFFIX)
                       if a.endswith(s) and not a.endswith(CAUSAL_SUFFIX)), a) for a in archs}
    arch = next((a for a in archs if causal[a] in BY_ARCHITECTURE), None)
    if arch is None:
        raise _unsupported(archs)
    family = BY_ARCHITECTURE[causal[arch]]
    base, classifier = arch.endswith(BASE_SUFFIX), arch.endswith(CLASSIFIER_SUFFIX)
    # The family's fields win: a family may read a shared one its own way (Gemma 3's RoPE).
    fields = {**hf_config_fields(hf, dtype, quantization), **family.read_config(hf)}
    if base or classifier:
        fields["tie_word_embeddings"] = True  # no LM head stored: the embedding stands in
    if classifier:  # transformers' default is 2 labels
        fields["num_labels"] = int(hf.get("num_labels") or len(hf.get("id2label") or ()) or 2)
    return ModelConfig(**fields, architecture=causal[arch], model_type=family.model_type,
                       base_model=base)


def read_config_file(path: str | Path, dtype: str | None = None,
                     quantization: str | None = None) -> ModelConfig:
    """:func:`read_config` of a ``config.json`` file."""
    return read_config(json.loads(Path(path).read_text()), dtype, quantization)


__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "Family", "Tensor", "family_of",
           "read_config", "read_config_file"]
