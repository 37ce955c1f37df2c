"""How a pooling engine's vectors are made and served (``EngineConfig.runner =
"pooling"``, vLLM's pooling runner): what a checkpoint says of its pooling (``PoolingSpec``,
``read_spec``), a pooled vector as served (``finish``), a cross-encoder's score (``score``)
and pairs (``pairs``), and ``LLM.embed``/``score``'s outputs. The values the engine and the
serving layer share; the engine's own part is ``jserve.engine.requests.pooling``.

The step captures the final norm's output; ``jserve.engine.requests.pooling.Pooler`` keeps each
request's vector: the last token's state (``last``: Qwen3-Embedding's) or the mean over the
prompt (``mean``), or a classifier's logits of the last token's state. ``dimensions`` and
normalization are applied by ``finish`` (as vLLM's pooler: truncation first, then the
norm).

A checkpoint says how it pools in its sentence-transformers files (``read_spec``):
``modules.json``'s Pooling module and whether a Normalize module follows; with none,
last-token pooling, normalized (vLLM's default for decoder embedding models). ``dimensions``
(Matryoshka) is allowed where config.json says so: ``matryoshka_dimensions`` (those sizes) or
``is_matryoshka`` (any), vLLM's keys. A ``*ForSequenceClassification`` checkpoint is a
cross-encoder: last token, not normalized, its score the activation of its one logit. No JAX
here."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jserve.config import CLASSIFIER_SUFFIX
from jserve.sampling.params import SamplingParams

MODES = ("last", "mean")
# A classifier's score of its logit (sentence-transformers' activation_fn class names).
ACTIVATIONS = {None: None, "sigmoid": "Sigmoid", "identity": "Identity"}
# sentence-transformers' pooling modes (``pooling_mode``; before 6.0 a flag each,
# ``pooling_mode_lasttoken``...) -> ours; the others (cls, max, ...) are refused by name.
_ST_MODES = {"lasttoken": "last", "mean": "mean", "mean_tokens": "mean"}


# What an embedding request runs with: its prefill's one sampled token is dropped.
POOLED = SamplingParams(max_tokens=1, temperature=0.0)


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass(frozen=True)
class ScoringOutput:
    score: float


@dataclasses.dataclass(frozen=True)
class PoolingRequestOutput:
    """A pooled prompt's result, in vLLM's shape: ``outputs`` an ``EmbeddingOutput``
    (``LLM.embed``) or a ``ScoringOutput`` (``LLM.score``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """``LLM.embed``'s, per prompt (``outputs.embedding``)."""


class ScoringRequestOutput(PoolingRequestOutput):
    """``LLM.score``'s, per pair (``outputs.score``)."""


@dataclasses.dataclass(frozen=True)
class PoolingSpec:
    """How an embedding is made of a prompt (vLLM's ``--pooler-config`` fields, lower
    case): ``mode`` last | mean; ``normalize``: to unit L2 norm; ``dimensions``: the sizes
    ``dimensions`` may ask for (Matryoshka), ``()`` none, ``None`` any. A sequence
    classifier's (cross-encoder's) logit becomes a score by ``activation``: sigmoid |
    identity (sentence-transformers' ``activation_fn``; None: not a classifier)."""

    mode: str = "last"
    normalize: bool = True
    dimensions: tuple[int, ...] | None = ()
    activation: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"pooling mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooling normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None:
            object.__setattr__(self, "dimensions", tuple(self.dimensions))
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"pooling activation must be one of {list(ACTIVATIONS)}, got "
                             f"{self.activation!r}")

    @classmethod
    def of(cls, value: PoolingSpec | dict) -> PoolingSpec:
        if isinstance(value, PoolingSpec):
            return value
        if not isinstance(value, dict) or set(value) - {f.name for f in dataclasses.fields(
                cls)}:
            raise ValueError(f"pooler_config takes mode, normalize, dimensions and "
                             f"activation, got {value!r}")
        return cls(**value)

    def check_dimensions(self, dimensions: int, hidden: int) -> str | None:
        """Why ``dimensions`` cannot be asked for (None: it can)."""
        if not 1 <= dimensions <= hidden:
            return f"dimensions must be in [1, {hidden}], got {dimensions}"
        if dimensions == hidden or self.dimensions is None or dimensions in self.dimensions:
            return None
        if not self.dimensions:
            return ("this model was not trained for shorter embeddings (no "
                    "matryoshka_dimensions or is_matryoshka in its config.json), so "
                    "dimensions cannot be set")
        return f"dimensions must be one of {list(self.dimensions)} for this model"


def unserved(spec: PoolingSpec | None, num_labels: int, scores: bool) -> str | None:
    """Why a model (its engine's ``spec``, None when it generates; its classifier labels)
    cannot give embeddings, or scores (``scores``): a cross-encoder gives only scores, one
    label's; an embedding model only embeddings. None: it can."""
    if spec is None:
        return ("it generates text; embeddings and scores need an embedding model or "
                "cross-encoder run with runner='pooling' (--runner pooling)")
    if scores and num_labels != 1:
        return ("it is not a one-label cross-encoder (a *ForSequenceClassification "
                "checkpoint): it gives embeddings (/v1/embeddings, LLM.embed), not scores")
    if not scores and num_labels:
        return ("it is a cross-encoder: it gives scores (/v1/score, /v1/rerank; offline, "
                "call score()), not embeddings")
    return None


def read_spec(model_dir: Path | None) -> PoolingSpec:
    """A checkpoint's pooling, from its sentence-transformers files and config.json (see
    the module's doc); a built-in model's (``model_dir`` None): the default."""
    if model_dir is None:
        return PoolingSpec()
    mode, normalize = "last", True
    modules_file = model_dir / "modules.json"
    if modules_file.exists():
        modules = json.loads(modules_file.read_text())
        kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
        normalize = "Normalize" in kinds
        pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
        if pooling is not None:
            mode = _st_mode(model_dir, json.loads(
                (model_dir / pooling["path"] / "config.json").read_text()))
    config = model_dir / "config.json"
    hf = json.loads(config.read_text()) if config.exists() else {}
    if any(a.endswith(CLASSIFIER_SUFFIX) for a in hf.get("architectures") or ()):
        return PoolingSpec("last", False, (), _activation(model_dir))  # HF's: the last token
    dims = hf.get("matryoshka_dimensions")
    dimensions = tuple(dims) if dims else (None if hf.get("is_matryoshka") else ())
    return PoolingSpec(mode, normalize, dimensions)


def _activation(model_dir: Path) -> str:
    """A cross-encoder's activation (``config_sentence_transformers.json``'s
    ``activation_fn``; sigmoid without one, sentence-transformers' and vLLM's default for one
    label)."""
    st = model_dir / "config_sentence_transformers.json"
    name = json.loads(st.read_text()).get("activation_fn") if st.exists() else None
    if name is None:
        return "sigmoid"
    ours = {v: k for k, v in ACTIVATIONS.items()}.get(name.rsplit(".", 1)[-1])
    if ours is None:
        raise ValueError(f"{model_dir}: activation_fn {name} is not supported by jserve "
                         f"(Sigmoid or Identity)")
    return ours


def score(logits: np.ndarray, spec: PoolingSpec) -> float:
    """A one-label classifier's score of its logits (``spec.activation``)."""
    x = float(logits[0])
    return 1.0 / (1.0 + np.exp(-x)) if spec.activation == "sigmoid" else x


def pairs(first: str | list[str], second: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one with one, one with each, or each with its own."""
    a = [first] if isinstance(first, str) else list(first)
    b = [second] if isinstance(second, str) else list(second)
    if len(a) == 1:
        return [(a[0], x) for x in b]
    if len(a) != len(b):
        raise ValueError(f"text_1 has {len(a)} texts and text_2 {len(b)}: give one text_1, "
                         f"or as many as text_2")
    return list(zip(a, b))


def _st_mode(model_dir: Path, st: dict) -> str:
    """Our mode of a sentence-transformers Pooling config (either spelling)."""
    given = st.get("pooling_mode")
    modes = ([given] if isinstance(given, str) else list(given)) if given is not None else [
        k.removeprefix("pooling_mode_") for k, v in st.items()
        if k.startswith("pooling_mode_") and v is True]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {modes} is not "
                         f"supported by jserve (one of lasttoken, mean)")
    if st.get("include_prompt", True) is not True:
        raise ValueError(f"{model_dir}: sentence-transformers pooling with include_prompt "
                         f"false is not supported by jserve")
    return _ST_MODES[modes[0]]


def finish(vector: np.ndarray, spec: PoolingSpec, dimensions: int | None = None
           ) -> np.ndarray:
    """A pooled vector as served: its first ``dimensions`` entries, then normalized when
    the spec says so (float32)."""
    v = np.asarray(vector, np.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if spec.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)  # as torch's F.normalize
    return v
