"""PEFT's LoRA checkpoints as PEFT writes them (``adapter_config.json`` and
``adapter_model.safetensors``), read for a base model and checked against it: every way an
adapter can be wrong for it is refused here, by name, before any slot or request sees it.

Keys are ``base_model.model.<module>.lora_A.weight`` ([r, in], torch's layout) and
``...lora_B.weight`` ([out, r]), ``<module>`` the base model's own name of the matrix (the
family's layer tensor, ``jserve.model.families``). PEFT's delta is ``B(A(x)) * scaling``,
``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``); it is folded into B here.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from jserve.config import ModelConfig
from jserve.fields import FieldError
from jserve.model.lora_pool import pool_targets, target_shape

_PREFIX = "base_model.model."
_REFUSED = {"use_dora": "DoRA adapters", "rank_pattern": "per-module ranks (rank_pattern)",
            "alpha_pattern": "per-module alphas (alpha_pattern)",
            "modules_to_save": "fully trained modules (modules_to_save)"}


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter read for a base model: ``weights`` target -> (A [layers, in, r], B
    [layers, r, out] scaled), float32, zeros for a layer it does not adapt; ``nbytes``
    what it holds."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _bad(path: str, why: str) -> FieldError:
    return FieldError("lora_path", f"adapter {path}: {why}")


def read_config(path: Path) -> dict:
    """The adapter's ``adapter_config.json``, refused unless it is a LoRA jserve serves."""
    f = path / "adapter_config.json"
    if not f.is_file():
        raise _bad(str(path), "no adapter_config.json (not a PEFT adapter directory)")
    try:
        conf = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise _bad(str(path), f"adapter_config.json does not read: {e}") from None
    if not isinstance(conf, dict):
        raise _bad(str(path), "adapter_config.json is not an object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise _bad(str(path), f"peft_type {conf.get('peft_type')!r}: only LoRA is served")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise _bad(str(path), f"r={r!r}, lora_alpha={alpha!r}: needs a positive integer r "
                              "and a number lora_alpha")
    return conf


def read_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Adapter ``name`` at ``path`` for base model ``cfg`` (FieldError on ``lora_path``
    naming what is wrong: no such directory, files missing, a module the model has not,
    a rank over ``max_rank``, shapes that are not the base model's)."""
    root = Path(path)
    if not root.is_dir():
        raise _bad(path, "no such directory")
    conf = read_config(root)
    r = conf["r"]
    if r > max_rank:
        raise _bad(path, f"rank {r} is over --max-lora-rank {max_rank}")
    scaling = conf["lora_alpha"] / (math.sqrt(r) if conf.get("use_rslora") else r)
    tensors = _read_tensors(root, path)
    modules = _modules(cfg)
    pairs: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        module, side = _split_key(key, path)
        if module not in modules:
            raise _bad(path, f"{key}: the base model has no module {module!r} an adapter "
                             f"may target (targets: {sorted(set(_short(m) for m in modules))})")
        pairs.setdefault(modules[module], {})[side] = value
    _refuse_kinds(conf, path)  # after the modules: an experts adapter says it is one
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    n = cfg.num_hidden_layers
    for (target, layer), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise _bad(path, f"layer {layer} {target}: lora_A and lora_B come in pairs")
        d_in, d_out = target_shape(cfg, target)
        a, b = sides["A"], sides["B"]
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise _bad(path, f"layer {layer} {target}: lora_A {list(a.shape)} and lora_B "
                             f"{list(b.shape)}, the base model needs [{r}, {d_in}] and "
                             f"[{d_out}, {r}]")
        if target not in weights:
            weights[target] = (np.zeros((n, d_in, r), np.float32),
                               np.zeros((n, r, d_out), np.float32))
        weights[target][0][layer] = a.T
        weights[target][1][layer] = b.T * scaling
    if not weights:
        raise _bad(path, "adapter_model.safetensors holds no LoRA weights")
    return Adapter(name, path, r, weights)


def _refuse_kinds(conf: dict, path: str) -> None:
    """The PEFT LoRA variants jserve does not serve (DoRA, biases, per-module ranks, ...)."""
    for key, what in _REFUSED.items():
        if conf.get(key):
            raise _bad(path, f"{what} are not supported")
    if conf.get("bias", "none") != "none":
        raise _bad(path, f"bias={conf['bias']!r}: adapters with biases are not supported")


def _read_tensors(root: Path, path: str) -> dict[str, np.ndarray]:
    f = root / "adapter_model.safetensors"
    if not f.is_file():
        why = ("adapter_model.bin only: save it with safe_serialization (safetensors)"
               if (root / "adapter_model.bin").is_file() else "no adapter_model.safetensors")
        raise _bad(path, why)
    from safetensors import safe_open

    try:
        with safe_open(f, framework="numpy") as st:
            return {k: st.get_tensor(k).astype(np.float32) for k in st.keys()}
    except Exception as e:  # a truncated or foreign file: safetensors' own error types
        raise _bad(path, f"adapter_model.safetensors does not read: {e}") from None


def _split_key(key: str, path: str) -> tuple[str, str]:
    """(module, "A" | "B") of a PEFT key."""
    for side in ("A", "B"):
        suffix = f".lora_{side}.weight"
        if key.endswith(suffix):
            module = key[:-len(suffix)]
            return (module[len(_PREFIX):] if module.startswith(_PREFIX) else module), side
    raise _bad(path, f"{key}: not a LoRA weight (lora_A / lora_B); embedding adapters and "
                     "other PEFT kinds are not supported")


def _modules(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """The base model's adaptable modules, by their checkpoint name -> (target, layer)."""
    from jserve.model.families import family_of

    fam = family_of(cfg)
    tensors = fam.layer_tensors(cfg)
    out = {}
    for t in pool_targets(cfg):
        hf = tensors[t].hf.removesuffix(".weight")
        for i in range(cfg.num_hidden_layers):
            out[fam.layer_prefix.format(i) + hf] = (t, i)
    return out


def _short(module: str) -> str:
    return module.rsplit(".", 1)[-1]
