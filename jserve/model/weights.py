"""Getting params: random init, HF safetensors checkpoints, and orbax checkpoints.

All loaders return the pytree described in :mod:`jserve.model` with leaves of ``cfg.dtype``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
from safetensors import safe_open
from tqdm.auto import tqdm

from jserve import backend as jserve_backend
from jserve.config import (
    BUILTIN_MODELS,
    DTYPE_CHOICES,
    DTYPES,
    ModelConfig,
    auto_dtype,
    model_dir,
    resolve_model_dir,
    stored_dtype,
)
from jserve.model import checkpoint_files, quant, tp_layout
from jserve.model.families import family_of, read_config_file
from jserve.model.params import Params, param_shapes, runtime_param_shapes
from jserve.tokenizer import (
    TOKENIZER_FILES,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    load_tokenizer_dir,
)

# Sized so the whole engine can be exercised on a CPU; vocab covers ByteTokenizer's 259 ids.
DEFAULT_CONFIG = ModelConfig(
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


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """Random params (normal(0, 0.02) matrices and biases, unit norms), drawn with numpy so
    a seed gives the same weights on every backend."""
    rng = np.random.default_rng(seed)
    dtype = cfg.np_dtype

    def make(path, shape: tuple[int, ...]) -> jax.Array:
        name = str(getattr(path[-1], "key", ""))
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        if name == "lm_head":  # drawn [hidden, vocab] as before its layout changed: a seed
            # keeps its weights
            return jnp.asarray(rng.normal(0.0, 0.02, size=shape[::-1]).astype(np.float32).T,
                               dtype=dtype)
        return jnp.asarray(rng.normal(0.0, 0.02, size=shape).astype(np.float32), dtype=dtype)

    params = jax.tree_util.tree_map_with_path(make, param_shapes(cfg), is_leaf=_is_shape)
    return quant.quantize_params(params, cfg.quantization)


def _hf_name_map(cfg: ModelConfig) -> dict[str, tuple[tuple[str | int, ...], bool]]:
    """HF tensor name -> (path into params, whether to transpose torch's [out, in]), from the
    family's tensors (``jserve.model.families``); an expert's path ends with its index into
    the stacked leaf."""
    family = family_of(cfg)
    names = {stored_name(cfg, t.hf): ((key,), t.transpose)
             for key, t in family.top_tensors(cfg).items()}
    per_layer = family.layer_tensors(cfg)
    for i in range(cfg.num_hidden_layers):
        pre = stored_name(cfg, family.layer_prefix.format(i))
        for key, t in per_layer.items():
            for e, name in enumerate(t.names()):
                names[pre + name] = (("layers", i, key, *((e,) if t.experts else ())),
                                     t.transpose)
    return names


def stored_name(cfg: ModelConfig, name: str) -> str:
    """A family's tensor name as ``cfg``'s checkpoint stores it: a base model's
    (``ModelConfig.base_model``) without the ``model.`` of its ForCausalLM's."""
    return name.removeprefix("model.") if cfg.base_model else name


def _leaf_shape(shapes: Params, path: tuple[str | int, ...]) -> tuple[int, ...]:
    """The checkpoint tensor's shape at ``path`` (``_hf_name_map``) in ``param_shapes``: an
    expert's is its stack's without the expert axis."""
    node = shapes
    for key in path[:3] if path[0] == "layers" else path:
        node = node[key]
    return node[1:] if len(path) > 3 else node


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors some checkpoints store that we recompute or share instead of loading."""
    if name.endswith("rotary_emb.inv_freq"):  # recomputed from the config
        return True
    return cfg.tie_word_embeddings and name == "lm_head.weight"  # a copy of the embedding


def load_hf_safetensors(model_dir: str | Path, cfg: ModelConfig) -> Params:
    """Load a HF safetensors checkpoint into the params layout.

    Tensors are read one at a time (safetensors' flax framework, which handles bf16 where
    numpy cannot) and transposed/cast immediately, so at most one raw tensor is alive beside
    the converted params. With ``cfg.quantization`` each layer matrix is quantized as soon
    as it is read (``jserve.model.quant``).
    """
    dtype = cfg.np_dtype
    shapes = param_shapes(cfg)
    # Fresh containers holding expected shapes; every leaf is replaced by its tensor below
    # (an expert stack is filled expert by expert).
    params = jax.tree.map(lambda s: s, shapes, is_leaf=_is_shape)
    experts = [n for n, t in family_of(cfg).layer_tensors(cfg).items() if t.experts]
    for layer in params["layers"]:
        layer.update({name: np.empty(layer[name], dtype) for name in experts})
    layout = _checked_layout(Path(model_dir), cfg)
    for f, name, path, transpose in _mapped_tensors(layout, cfg, "flax"):
        tensor = checkpoint_files.read(f, name)
        tensor = (tensor.T if transpose else tensor).astype(dtype)
        _check_shape(name, tensor.shape, _leaf_shape(shapes, path))
        node = params
        for key in path[:-1]:
            node = node[key]
        if cfg.quantization != "none" and path[-1] in quant.QUANTIZED_LEAVES:
            tensor = quant.quantize_weight(tensor, cfg.quantization)
        node[path[-1]] = tensor
    for layer in params["layers"]:  # the stacks filled expert by expert, quantized whole
        layer.update({name: quant.quantize_weight(layer[name], cfg.quantization)
                      if cfg.quantization != "none" and name in quant.QUANTIZED_LEAVES
                      else jnp.asarray(layer[name]) for name in experts})
    return params


# ---------------------------------------------------------------------------------------
# Streaming: HF safetensors straight into the runtime layout and its target sharding.

def _read_slice(f, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """``f[name][index]`` read from the file without reading the rest of the tensor (one
    contiguous-range slice per axis; numpy framework, which keeps bf16 as
    ``ml_dtypes.bfloat16``; a view, ``checkpoint_files``). The one place the streaming
    loader reads tensor data."""
    return checkpoint_files.read(f, name, index)


def _runs(src: np.ndarray, rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Group (source id, source row) pairs into maximal runs ``(src, start, stop)`` of
    consecutive rows in one source, in order."""
    out: list[tuple[int, int, int]] = []
    for s, r in zip(src.tolist(), rows.tolist()):
        if out and out[-1][0] == s and out[-1][2] == r:
            out[-1] = (s, out[-1][1], r + 1)
        else:
            out.append((s, r, r + 1))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class _LeafSource:
    """How one runtime leaf (one layer's, for layer leaves) is read from HF tensors.

    ``names``: the source tensors (their rows side by side for a fused leaf, ``w_gate_up``).
    ``transpose``: our ``[in, out]`` is torch's ``[out, in]``; then our column ``c`` is row
    (untransposed: column) ``col_src[c]``, ``col_row[c]`` of the sources (the tp reordering
    in index space). A vector (a bias) with ``col_row`` reads its element ``col_row[c]`` as
    our ``c``.
    """
    names: tuple[str, ...]
    transpose: bool
    col_src: np.ndarray | None = None
    col_row: np.ndarray | None = None

    def read(self, files: dict[str, Any], index: tuple[slice, ...], shape: tuple[int, ...],
             dtype: np.dtype) -> np.ndarray:
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
        if self.col_row is None:
            out = _read_slice(files[self.names[0]], self.names[0], index)
        else:
            *rows, cols = index
            if cols.step != 1:
                raise ValueError(f"strided column read {cols} of {self.names}")
            pieces = []
            for s, a, b in _runs(self.col_src[cols], self.col_row[cols]):
                name = self.names[s]
                # Transposed, our columns [a, b) are their rows and our rows their columns;
                # a vector's columns are its elements.
                at = (slice(a, b), *rows) if self.transpose else (*rows, slice(a, b))
                pieces.append(_read_slice(files[name], name, at))
            axis = 0 if self.transpose else -1
            out = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)
            out = out.T if self.transpose else out
        return np.ascontiguousarray(out.astype(dtype, copy=False))


@dataclasses.dataclass(frozen=True, eq=False)
class _ExpertStack:
    """A runtime leaf stacked from one source per expert (``Tensor.experts``): the first
    axis of a read picks the experts, each read as its own ``_LeafSource``."""
    experts: tuple[_LeafSource, ...]

    def read(self, files: dict[str, Any], index: tuple[slice, ...], shape: tuple[int, ...],
             dtype: np.dtype) -> np.ndarray:
        return np.stack([self.experts[e].read(files, index[1:], shape[1:], dtype)
                         for e in range(*index[0].indices(shape[0]))])


def _leaf_sources(cfg: ModelConfig, tp: int) -> dict[str, Any]:
    """Runtime leaf name -> ``_LeafSource`` (layer leaves: a function of the layer index),
    from the family's tensors, with the columns of the KV-head leaves (wk/wv, bk/bv) and of
    the fused ones (``tp_layout.FUSED``) in ``tp_layout.column_sources``'s order."""
    family = family_of(cfg)

    def plain(n_cols: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(n_cols, np.int64), np.arange(n_cols)

    per_layer = family.layer_tensors(cfg)
    fused = tp_layout.fused_in(per_layer)
    taken = {p for parts in fused.values() for p in parts}
    columns = {name: tp_layout.column_sources(name, cfg, tp)
               for name in (*tp_layout.KV_HEAD_COLUMNS, *fused)}

    def source(name: str, t) -> tuple:
        if name in tp_layout.KV_HEAD_COLUMNS:
            return columns[name]
        return plain(t.shape[-1]) if t.transpose else (None, None)

    stacked = lambda sources, experts: _ExpertStack(tuple(sources)) if experts else sources[0]


    def layer(i: int) -> dict[str, _LeafSource | _ExpertStack]:
        pre = stored_name(cfg, family.layer_prefix.format(i))
        leaves = {name: stacked([_LeafSource((pre + n,), t.transpose, *source(name, t))
                                 for n in t.names()], t.experts)
                  for name, t in per_layer.items() if name not in taken}
        for name, parts in fused.items():  # an expert leaf's sources: e0's parts, e1's, ...
            names = [n for each in zip(*(per_layer[p].names() for p in parts)) for n in each]
            leaves[name] = _LeafSource(tuple(pre + n for n in names),
                                       per_layer[parts[0]].transpose, *columns[name])
        return leaves

    sources: dict[str, Any] = {name: _LeafSource((stored_name(cfg, t.hf),), t.transpose,
                                                 *source(name, t))
                               for name, t in family.top_tensors(cfg).items()}
    sources["layers"] = layer
    return sources


def _checked_layout(model_dir: Path, cfg: ModelConfig) -> dict[Path, list[str]]:
    """The file layout, after checking the checkpoint has exactly the tensors ``cfg`` needs."""
    name_map = _hf_name_map(cfg)
    layout = checkpoint_files.view_layout(checkpoint_files.safetensors_layout(model_dir),
                                          name_map)
    present = {name for names in layout.values() for name in names}
    missing = sorted(name_map.keys() - present)
    unexpected = sorted(n for n in present - name_map.keys() if not _ignorable(n, cfg))
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_dir} does not match its config.json: "
                         f"missing tensors {missing}, unexpected tensors {unexpected}")
    return layout


def _mapped_tensors(layout: dict[Path, list[str]], cfg: ModelConfig, framework: str):
    """(open file, tensor name, param path, transposed) of every tensor of ``layout`` (from
    ``_checked_layout``) that jserve maps, file by file."""
    name_map = _hf_name_map(cfg)
    for file, names in layout.items():
        with safe_open(file, framework=framework) as f:
            for name in names:
                if name in name_map:
                    yield (f, name, *name_map[name])


def _check_shape(name: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"tensor {name} has shape {tuple(got)} (after transpose), "
                         f"config.json implies {tuple(want)}")


def _check_checkpoint(model_dir: Path, cfg: ModelConfig) -> dict[Path, list[str]]:
    """The file layout, after checking the tensor names and shapes match ``cfg`` (headers
    only; no tensor data is read)."""
    layout = _checked_layout(model_dir, cfg)
    shapes = param_shapes(cfg)
    for f, name, path, transpose in _mapped_tensors(layout, cfg, "numpy"):
        got = checkpoint_files.shape(f, name)
        _check_shape(name, got[::-1] if transpose else got, _leaf_shape(shapes, path))
    return layout


def load_hf_runtime(model_dir: str | Path, cfg: ModelConfig,
                    mesh: jax.sharding.Mesh | None = None) -> Params:
    """A HF safetensors checkpoint streamed straight into the runtime layout
    (``to_runtime_layout``), tp-laid-out and placed on ``mesh`` by :mod:`jserve.model.tp_layout`
    (the placement ``sharding.specs.shard_params`` gives; one device when ``mesh`` is None):
    equal to ``shard_params(to_runtime_layout(load_hf_safetensors(...)), cfg, mesh)``, for
    ``ModelRunner(params_placed=True)``.

    Every device shard is read from the file on its own (``jax.make_array_from_callback``
    with a callback that reads only the requested slice, the tp reordering of wk/wv and
    w_gate_up mapped back to source rows), and layer leaves are built one layer at a time
    and written in place into their preallocated stacked array, so the host holds about one
    tensor (one layer's) at a time instead of one copy of the model per device. Tensors are
    cast to ``cfg.dtype`` slice by slice: a bf16 checkpoint stays bf16.

    With ``cfg.quantization`` a layer matrix is read whole on the host (one layer's tensor:
    per-output-channel scales need every input row), quantized there
    (``quant.quantize_host``), and only its quantized shards go to the devices, so a model
    that fits only quantized loads.
    """
    model_dir = Path(model_dir)
    layout = _check_checkpoint(model_dir, cfg)
    tp = mesh.shape["tp"] if mesh is not None else 1
    if tp > 1:
        tp_layout.check_tp(cfg, tp)  # the index maps below assume tp splits evenly
    sources = _leaf_sources(cfg, tp)
    shapes = _stored_shapes(cfg, tp)
    sharding_of = functools.partial(_sharding_of, mesh)
    handles = {}
    n = cfg.num_hidden_layers
    bar = tqdm(total=len(shapes) - 1 + n * len(shapes["layers"]), desc="loading weights",
               unit="tensor", disable=None)
    try:
        files: dict[str, Any] = {}
        for file, names in layout.items():
            handles[file] = safe_open(file, framework="numpy")
            files.update(dict.fromkeys(names, handles[file]))
        params: Params = {}
        for name, src in sources.items():
            if name != "layers":
                params[name] = _build(src, files, shapes[name], sharding_of(P()), cfg.np_dtype)
                bar.update()
        layers: Params = {}
        for name, shape in shapes["layers"].items():
            stream = (_stream_quantized if cfg.quantization != "none"
                      and name in quant.QUANTIZED_LEAVES else _stream_layers)
            layers[name] = stream(cfg, [sources["layers"](i)[name] for i in range(n)], files,
                                  shape, P(*tp_layout.layer_axes(name)), sharding_of, bar)
        params["layers"] = layers
    finally:
        bar.close()
        for h in handles.values():
            h.__exit__(None, None, None)
    return params


def _stored_shapes(cfg: ModelConfig, tp: int) -> Params:
    """The runtime layout's shapes as stored under ``tp``: wk/wv (bk/bv) and the fused
    leaves holding them hold the stored KV heads (copies when tp exceeds the KV heads)."""
    shapes = runtime_param_shapes(cfg)
    if tp > 1:
        laid = set(tp_layout.KV_HEAD_COLUMNS) | set(tp_layout.FUSED)
        for name in laid & set(shapes["layers"]):
            stored = len(tp_layout.column_sources(name, cfg, tp)[0])
            shapes["layers"][name] = (*shapes["layers"][name][:-1], stored)
    return shapes


def _sharding_of(mesh: jax.sharding.Mesh | None, spec: P):
    if mesh is None:
        return SingleDeviceSharding(jax.local_devices()[0])
    return NamedSharding(mesh, spec)


def _build(source: _LeafSource, files: dict[str, Any], shape: tuple[int, ...], sharding,
           dtype: np.dtype) -> jax.Array:
    """One leaf, each device's shard read from the files on its own."""
    cache: dict[tuple, np.ndarray] = {}  # shards replicated on several devices: read once

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            cache[key] = source.read(files, index, shape, dtype)
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)


def _stream_layers(cfg: ModelConfig, sources: list, files: dict[str, Any],
                   shape: tuple[int, ...], spec, sharding_of, bar):
    """One stacked layer leaf, each layer's slice built (``_build``) and written in place
    into the preallocated stacked array (``load_hf_runtime``)."""
    dtype = cfg.np_dtype
    stacked = sharding_of(spec)
    per_layer = sharding_of(P(*spec[1:]))
    buf = jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=stacked)()
    write = jax.jit(lambda b, x, i: jax.lax.dynamic_update_index_in_dim(b, x, i, 0),
                    donate_argnums=0, out_shardings=stacked)
    for i, source in enumerate(sources):
        x = _build(source, files, shape[1:], per_layer, dtype)
        buf = write(buf, x, np.int32(i))
        del x
        bar.update()
    return buf


def _stream_quantized(cfg: ModelConfig, sources: list, files: dict[str, Any],
                      shape: tuple[int, ...], spec, sharding_of, bar):
    """One stacked quantized layer leaf: each layer's matrix read whole on the host,
    quantized there, and its values' and scales' shards placed (``load_hf_runtime``)."""
    specs = (spec, quant.scale_spec(spec))
    abstract = quant.abstract_weight(shape, cfg.quantization)
    stacked = quant.from_parts(*map(sharding_of, specs), cfg.quantization)
    per_layer = [sharding_of(P(*sp[1:])) for sp in specs]
    buf = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
                  out_shardings=stacked)()
    write = jax.jit(lambda b, x, i: jax.tree.map(
        lambda bb, xx: jax.lax.dynamic_update_index_in_dim(bb, xx, i, 0), b, x),
        donate_argnums=0, out_shardings=stacked)
    for i, source in enumerate(sources):
        whole = source.read(files, (slice(None),) * (len(shape) - 1), shape[1:], cfg.np_dtype)
        parts = quant.quantize_host(whole, cfg.quantization)
        del whole
        x = quant.from_parts(*(jax.make_array_from_callback(h.shape, sh, lambda idx, h=h: h[idx])
                               for h, sh in zip(parts, per_layer)), cfg.quantization)
        buf = write(buf, x, np.int32(i))
        del x, parts
        bar.update()
    return buf


@dataclasses.dataclass(frozen=True)
class LazyCheckpoint:
    """A HF safetensors checkpoint not read yet (``load_model(..., lazy=True)``): the engine
    calls ``place(cfg, mesh)`` once it has built its mesh and gets the runtime params streamed
    onto it (:func:`load_hf_runtime`). Names and shapes are checked when it is made."""
    model_dir: Path
    model_config: ModelConfig

    def __post_init__(self) -> None:
        _check_checkpoint(self.model_dir, self.model_config)

    def place(self, cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None) -> Params:
        return load_hf_runtime(self.model_dir, cfg, mesh)

    def load(self) -> Params:
        """The eager checkpoint-layout params (:func:`load_hf_safetensors`)."""
        return load_hf_safetensors(self.model_dir, self.model_config)


def _abstract_params(cfg: ModelConfig, stored: str = "none") -> Params:
    """Restore targets; the sharding makes orbax return jax arrays on the default device.
    ``stored``: the quantization the checkpoint was saved with."""
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    dtype = cfg.np_dtype
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype, sharding=sharding),
                          param_shapes(cfg), is_leaf=_is_shape)
    if stored != "none":
        params["layers"] = [{k: quant.abstract_weight(v.shape, stored, sharding, sharding)
                             if k in quant.QUANTIZED_LEAVES else v for k, v in layer.items()}
                            for layer in params["layers"]]
    return params


# config.json key of a checkpoint whose LM head is [vocab, hidden] (``save_orbax``).
LM_HEAD_KEY = "jserve_lm_head"


def save_orbax(ckpt_dir: str | Path, cfg: ModelConfig, params: Params,
               tokenizer_dir: str | Path | None = None,
               tokenizer: Tokenizer | None = None) -> None:
    """Write a self-describing checkpoint: config.json, orbax ``params/``, tokenizer files
    (copied from ``tokenizer_dir``, or the built-in byte tokenizer's marker). Quantized
    params (``cfg.quantization``) are saved as stored: values and scales."""
    ckpt_dir = Path(ckpt_dir).absolute()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    config = {**cfg.to_hf_dict(), LM_HEAD_KEY: "vocab_major"}
    (ckpt_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    import orbax.checkpoint as ocp  # 0.35 s of import: only for orbax checkpoints

    with ocp.StandardCheckpointer() as ckptr:  # leaving the block waits for the async save
        ckptr.save(ckpt_dir / "params", params)
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer.save(ckpt_dir)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (src := Path(tokenizer_dir) / name).exists():
                shutil.copy2(src, ckpt_dir / name)


def restore_orbax(ckpt_dir: str | Path, cfg: ModelConfig) -> Params:
    """Read ``params/`` from :func:`save_orbax`, cast to ``cfg.dtype``; a full-precision
    checkpoint asked for with ``cfg.quantization`` is quantized after reading."""
    ckpt_dir = Path(ckpt_dir).absolute()
    config = json.loads((ckpt_dir / "config.json").read_text())
    stored = config.get("jserve_quantization", "none")
    target = _abstract_params(cfg, stored)
    # Written before the LM head kept HF's [vocab, hidden] (no marker): [hidden, vocab].
    old_head = "lm_head" in target and config.get(LM_HEAD_KEY) != "vocab_major"
    if old_head:
        head = target["lm_head"]
        target["lm_head"] = jax.ShapeDtypeStruct(head.shape[::-1], head.dtype,
                                                 sharding=head.sharding)
    import orbax.checkpoint as ocp  # 0.35 s of import: only for orbax checkpoints

    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(ckpt_dir / "params", target)
    if old_head:
        params["lm_head"] = params["lm_head"].T
    return quant.quantize_params(params, cfg.quantization)


def resolve_dtype(model: str, dtype: str | None = "auto",
                  backend: str | None = None) -> tuple[str, str]:
    """The dtype ``model`` computes in for ``dtype`` (auto | float32 | bfloat16 | None: as
    stored) and why, in the start-up line's words: ``("float32", "auto: bf16 checkpoint, CPU
    backend")`` (``jserve.config.auto_dtype``). ``backend``: JAX's default one unless given
    (asking starts JAX's backends: after ``jax.distributed.initialize`` in multi-host runs)."""
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES} (or None), got {dtype!r}")
        return dtype, "as asked"
    what = "checkpoint"
    if model == "default":
        stored, what = DEFAULT_CONFIG.dtype, "built-in model"
    elif (path := resolve_model_dir(model) / "config.json").is_file():
        stored = stored_dtype(json.loads(path.read_text()))
    else:
        stored = load_config(model).dtype  # raises what a missing model or config.json raises
    if dtype is None:
        return load_config(model).dtype, f"the {what}'s own"
    return auto_dtype(stored, backend or jserve_backend.current(), what)


def load_config(model: str, dtype: str | None = None,
                quantization: str | None = None) -> ModelConfig:
    """The config ``load_model`` would use, without reading any weights. ``dtype``: auto
    (``resolve_dtype``: float32 on a CPU backend, else the checkpoint's), float32, bfloat16
    or None (as stored). ``quantization`` None: as stored (none, or a quantized orbax
    checkpoint's)."""
    if dtype == "auto":
        dtype = resolve_dtype(model, dtype)[0]
    if model == "default":
        return dataclasses.replace(DEFAULT_CONFIG, dtype=dtype or DEFAULT_CONFIG.dtype,
                                   quantization=quantization or "none")
    path = resolve_model_dir(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is not a directory (built-in models: 'default', "
                                f"the random model, and {', '.join(map(repr, BUILTIN_MODELS))})")
    if not (path / "config.json").exists():
        raise ValueError(f"model directory {path} has no config.json")
    return read_config_file(path / "config.json", dtype=dtype, quantization=quantization)


def load_model(model: str, dtype: str | None = None, seed: int = 0, *, lazy: bool = False,
               quantization: str | None = None, tokenizer: str | Path | None = None
               ) -> tuple[ModelConfig, Params | LazyCheckpoint, Tokenizer | None]:
    """Resolve ``--model``: "default" (built-in random model), "tiny-tasks" (the packaged
    trained model), an orbax or a HF directory. ``lazy``: a HF safetensors directory gives a
    :class:`LazyCheckpoint` (nothing read yet) that ``LLMEngine`` streams onto its mesh.
    ``quantization`` (none | int8 | fp8): weight-only quantization of the layer matrices on
    load (None: as stored). ``tokenizer``: a directory to read the tokenizer from instead
    of the model's (vLLM's ``tokenizer``; ``load_tokenizer_dir``: its vocabulary must fit the
    embedding)."""
    cfg = load_config(model, dtype, quantization)
    path = model_dir(model)
    own = tokenizer is None
    tok = None if own else load_tokenizer_dir(tokenizer, cfg.vocab_size, path)
    if path is None:
        return cfg, init_params(cfg, seed), ByteTokenizer() if own else tok
    if (path / "params").is_dir():
        params = restore_orbax(path, cfg)
    elif (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        params = LazyCheckpoint(path, cfg) if lazy else load_hf_safetensors(path, cfg)
    else:
        raise ValueError(f"model directory {path} has config.json but neither an orbax params/ "
                         "directory nor model.safetensors[.index.json]")
    return cfg, params, load_tokenizer(path) if own else tok
