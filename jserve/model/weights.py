"""Getting params: random init, HF safetensors checkpoints, and orbax checkpoints.

All loaders return the pytree described in :mod:`jserve.model` with leaves of ``cfg.dtype``.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open

from jserve.config import LlamaConfig
from jserve.tokenizer import TOKENIZER_FILES, ByteTokenizer, Tokenizer, load_tokenizer

Params = dict[str, Any]

# Sized so the whole engine can be exercised on a CPU; vocab covers ByteTokenizer's 259 ids.
DEFAULT_CONFIG = LlamaConfig(
    vocab_size=320,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    bos_token_id=ByteTokenizer.BOS,
    eos_token_ids=(ByteTokenizer.EOS,),
    dtype="float32",
)


def param_shapes(cfg: LlamaConfig) -> Params:
    """The params pytree with shape tuples as leaves: the single source of the layout."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
             "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    shapes: Params = {"embed": (v, d), "layers": [dict(layer) for _ in range(cfg.num_hidden_layers)],
                      "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def init_params(cfg: LlamaConfig, seed: int = 0) -> Params:
    """Random params (normal(0, 0.02) matrices, unit norms), drawn with numpy so a seed gives
    the same weights on every backend."""
    rng = np.random.default_rng(seed)
    dtype = cfg.np_dtype

    def make(shape: tuple[int, ...]) -> jax.Array:
        if len(shape) == 1:
            return jnp.ones(shape, dtype)
        return jnp.asarray(rng.normal(0.0, 0.02, size=shape).astype(np.float32), dtype=dtype)

    return jax.tree.map(make, param_shapes(cfg), is_leaf=_is_shape)


def _hf_name_map(cfg: LlamaConfig) -> dict[str, tuple[tuple[str | int, ...], bool]]:
    """HF tensor name -> (path into params, whether to transpose torch's [out, in])."""
    names: dict[str, tuple[tuple[str | int, ...], bool]] = {
        "model.embed_tokens.weight": (("embed",), False),
        "model.norm.weight": (("final_norm",), False),
    }
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), True)
    per_layer = {"input_layernorm.weight": ("attn_norm", False),
                 "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
                 "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
                 "post_attention_layernorm.weight": ("mlp_norm", False),
                 "mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True),
                 "mlp.down_proj.weight": ("w_down", True)}
    for i in range(cfg.num_hidden_layers):
        for suffix, (key, transpose) in per_layer.items():
            names[f"model.layers.{i}.{suffix}"] = (("layers", i, key), transpose)
    return names


def _ignorable(name: str, cfg: LlamaConfig) -> bool:
    """Tensors some checkpoints store that we recompute or share instead of loading."""
    if name.endswith("rotary_emb.inv_freq"):  # recomputed from the config
        return True
    return cfg.tie_word_embeddings and name == "lm_head.weight"  # a copy of the embedding


def _safetensors_layout(model_dir: Path) -> dict[Path, list[str]]:
    """Which tensor names live in which file, for a single or an index-sharded checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name, file in json.loads(index.read_text())["weight_map"].items():
            by_file[model_dir / file].append(name)
        return dict(by_file)
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor "
                                "model.safetensors.index.json")
    with safe_open(single, framework="flax") as f:
        return {single: list(f.keys())}


def load_hf_safetensors(model_dir: str | Path, cfg: LlamaConfig) -> Params:
    """Load a HF Llama safetensors checkpoint into the params layout.

    Tensors are read one at a time (safetensors' flax framework, which handles bf16 where
    numpy cannot) and transposed/cast immediately, so at most one raw tensor is alive beside
    the converted params.
    """
    model_dir = Path(model_dir)
    layout = _safetensors_layout(model_dir)
    name_map = _hf_name_map(cfg)
    present = {name for names in layout.values() for name in names}
    missing = sorted(name_map.keys() - present)
    unexpected = sorted(n for n in present - name_map.keys() if not _ignorable(n, cfg))
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir} does not match its config.json: "
                         f"missing tensors {missing}, unexpected tensors {unexpected}")

    dtype = cfg.np_dtype
    # Fresh containers holding expected shapes; every leaf is replaced by its tensor below.
    params = jax.tree.map(lambda s: s, param_shapes(cfg), is_leaf=_is_shape)
    for file, names in layout.items():
        with safe_open(file, framework="flax") as f:
            for name in names:
                if name not in name_map:
                    continue
                path, transpose = name_map[name]
                tensor = f.get_tensor(name)
                tensor = (tensor.T if transpose else tensor).astype(dtype)
                node = params
                for key in path[:-1]:
                    node = node[key]
                if tensor.shape != node[path[-1]]:
                    raise ValueError(f"tensor {name} has shape {tensor.shape} (after transpose), "
                                     f"config.json implies {node[path[-1]]}")
                node[path[-1]] = tensor
    return params


def _abstract_params(cfg: LlamaConfig) -> Params:
    """Restore targets; the sharding makes orbax return jax arrays on the default device."""
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    dtype = cfg.np_dtype
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype, sharding=sharding),
                        param_shapes(cfg), is_leaf=_is_shape)


def save_orbax(ckpt_dir: str | Path, cfg: LlamaConfig, params: Params,
               tokenizer_dir: str | Path | None = None,
               tokenizer: Tokenizer | None = None) -> None:
    """Write a self-describing checkpoint: config.json, orbax ``params/``, tokenizer files
    (copied from ``tokenizer_dir``, or the built-in byte tokenizer's marker)."""
    ckpt_dir = Path(ckpt_dir).absolute()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    with ocp.StandardCheckpointer() as ckptr:  # leaving the block waits for the async save
        ckptr.save(ckpt_dir / "params", params)
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer.save(ckpt_dir)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (src := Path(tokenizer_dir) / name).exists():
                shutil.copy2(src, ckpt_dir / name)


def restore_orbax(ckpt_dir: str | Path, cfg: LlamaConfig) -> Params:
    """Read ``params/`` from :func:`save_orbax`, cast to ``cfg.dtype``."""
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(Path(ckpt_dir).absolute() / "params", _abstract_params(cfg))


# Built-in checkpoints shipped inside the package, by name (scripts/train_task_model.py).
BUILTIN_MODELS = {"tiny-tasks": Path(__file__).resolve().parents[1] / "assets" / "tiny_tasks"}


def resolve_model_dir(model: str) -> Path:
    """The directory of a built-in model name, else ``model`` as a path."""
    return BUILTIN_MODELS.get(model, Path(model))


def load_config(model: str, dtype: str | None = None) -> LlamaConfig:
    """The config ``load_model`` would use, without reading any weights."""
    if model == "default":
        return DEFAULT_CONFIG if dtype is None else dataclasses.replace(DEFAULT_CONFIG, dtype=dtype)
    path = resolve_model_dir(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is not a directory (built-in models: 'default', "
                                f"the random model, and {', '.join(map(repr, BUILTIN_MODELS))})")
    if not (path / "config.json").exists():
        raise ValueError(f"model directory {path} has no config.json")
    return LlamaConfig.from_json_file(path / "config.json", dtype=dtype)


def load_model(model: str, dtype: str | None = None,
               seed: int = 0) -> tuple[LlamaConfig, Params, Tokenizer | None]:
    """Resolve ``--model``: "default" (built-in random model), "tiny-tasks" (the packaged
    trained model), an orbax or a HF directory."""
    cfg = load_config(model, dtype)
    if model == "default":
        return cfg, init_params(cfg, seed), ByteTokenizer()
    path = resolve_model_dir(model)
    if (path / "params").is_dir():
        params = restore_orbax(path, cfg)
    elif (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        params = load_hf_safetensors(path, cfg)
    else:
        raise ValueError(f"model directory {path} has config.json but neither an orbax params/ "
                         "directory nor model.safetensors[.index.json]")
    return cfg, params, load_tokenizer(path)
