"""Streaming HF safetensors checkpoints straight into their target sharding
(``jserve.model.weights.load_hf_runtime``): the placed params equal the eager path's
``shard_params(to_runtime_layout(load_hf_safetensors(...)))`` leaf for leaf (values, dtype,
sharding) on one device, tp=2, tp=4 (KV head copies), spp=2 and spp=2,tp=2, in float32 and
bfloat16; every read is one device shard (never more than one tensor on the host); and an
engine built from the streamed checkpoint gives the eager engine's greedy tokens.

The mesh cases run in one subprocess with 8 forced host devices (as tests/test_mesh_matrix.py
does), so the rest of the suite keeps one CPU device."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from devices import run_on_devices
from jserve.config import ModelConfig
from jserve.model.families import read_config_file
from jserve.model.weights import LazyCheckpoint, load_hf_runtime, load_hf_safetensors, load_model

# 4 query / 2 KV heads, so tp=4 stores a copy of each KV head on two shards; 4 layers, so
# spp=2 puts two on each stage.
CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, bos_token_id=1,
           eos_token_ids=(2,), max_position_embeddings=256)


def write_checkpoint(model_dir: Path, dtype: str, tie: bool = False, files: int = 3,
                     seed: int = 0) -> ModelConfig:
    """A random HF Llama checkpoint as index-sharded safetensors written with numpy (bf16 as
    ``ml_dtypes.bfloat16``), names spread round-robin over ``files`` files."""
    cfg = ModelConfig(**CFG, tie_word_embeddings=tie, dtype=dtype)
    rng = np.random.default_rng(seed)
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def t(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.5, size=shape).astype(np.float32).astype(cfg.np_dtype)

    tensors = {"model.embed_tokens.weight": t(v, d), "model.norm.weight": t(d)}
    if not tie:
        tensors["lm_head.weight"] = t(v, d)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": t(d), p + "post_attention_layernorm.weight": t(d),
            p + "self_attn.q_proj.weight": t(q, d), p + "self_attn.k_proj.weight": t(kv, d),
            p + "self_attn.v_proj.weight": t(kv, d), p + "self_attn.o_proj.weight": t(d, q),
            p + "mlp.gate_proj.weight": t(f, d), p + "mlp.up_proj.weight": t(f, d),
            p + "mlp.down_proj.weight": t(d, f)})
    model_dir.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for k in range(files):
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = names[k::files]
        save_file({n: tensors[n] for n in part}, str(model_dir / file))
        weight_map.update(dict.fromkeys(part, file))
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return cfg


_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import jax, numpy as np
    import jserve.model.weights as weights
    from jserve.model.families import read_config_file
    from jserve.model.decoder import to_runtime_layout
    from sharding.mesh import MeshConfig, make_mesh
    from sharding.specs import shard_params

    ckpts, meshes, engine_mesh = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    reads = []  # (tensor name, bytes) of every slice read, in order
    builds = []  # bytes read while building each array (what the host holds at once)
    read_slice, make_array = weights._read_slice, jax.make_array_from_callback

    def counting_read(f, name, index):
        out = read_slice(f, name, index)
        reads.append((name, out.nbytes))
        return out

    def counting_make(*args, **kwargs):
        start = len(reads)
        out = make_array(*args, **kwargs)
        builds.append(sum(b for _, b in reads[start:]))
        return out

    weights._read_slice = counting_read
    jax.make_array_from_callback = counting_make
    result = {}
    for ckpt in ckpts:
        path = Path(ckpt)
        cfg = read_config_file(path / "config.json")
        eager = to_runtime_layout(weights.load_hf_safetensors(path, cfg))
        for mesh_text in meshes:
            mc = MeshConfig.parse(mesh_text)
            mesh = make_mesh(mc) if mc.size > 1 else None
            want = shard_params(eager, cfg, mesh) if mesh is not None else eager
            reads.clear(); builds.clear()
            got = weights.load_hf_runtime(path, cfg, mesh)
            leaves = {}
            for (kp, a), (kp2, b) in zip(jax.tree_util.tree_leaves_with_path(got),
                                         jax.tree_util.tree_leaves_with_path(want), strict=True):
                assert kp == kp2, (kp, kp2)
                same_sharding = (a.sharding == b.sharding if mesh is not None else
                                 a.sharding.device_set == {jax.devices()[0]})
                leaves[jax.tree_util.keystr(kp)] = {
                    "equal": bool(np.array_equal(np.asarray(a), np.asarray(b))),
                    "dtype": str(a.dtype), "want_dtype": str(b.dtype),
                    "shape": list(a.shape), "want_shape": list(b.shape),
                    "same_sharding": bool(same_sharding),
                    "devices": len(a.sharding.device_set)}
            result[f"{path.name}|{mesh_text}"] = {"leaves": leaves, "reads": list(reads),
                                                  "builds": list(builds)}
            del got, want

    # Greedy tokens: an engine from the streamed checkpoint (LLM: load_model(lazy=True)) and
    # one from the eager checkpoint-layout dict.
    from jserve import LLM, SamplingParams
    from jserve.engine.config import EngineConfig
    from jserve.engine.engine import LLMEngine
    path = Path(ckpts[0])
    settings = dict(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_seqs=2,
                    max_model_len=64, warmup=False, mesh=engine_mesh)
    prompts = [[1, 5, 9, 13, 20, 31, 40, 7, 8, 9], [1, 3, 4]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reads.clear()
    llm = LLM(str(path), **settings)
    streamed_reads = len(reads)
    streamed = [o.token_ids for o in llm.generate(prompts, sp)]
    cfg = llm.engine.model_config
    del llm
    eager_llm = LLM.__new__(LLM)
    eager_llm.engine = LLMEngine(cfg, weights.load_hf_safetensors(path, cfg), None,
                                 EngineConfig(**settings))
    eager_tokens = [o.token_ids for o in eager_llm.generate(prompts, sp)]
    result["engine"] = {"streamed": streamed, "eager": eager_tokens,
                        "streamed_reads": streamed_reads}
    print(json.dumps(result))
""")

MESHES = ["", "tp=2", "tp=4", "spp=2", "spp=2,tp=2"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("streaming")
    ckpts = [root / "f32", root / "bf16", root / "tied"]
    write_checkpoint(ckpts[0], "float32")
    write_checkpoint(ckpts[1], "bfloat16", seed=1)
    write_checkpoint(ckpts[2], "bfloat16", tie=True, seed=2)
    proc = run_on_devices(_SCRIPT, json.dumps([str(c) for c in ckpts]), json.dumps(MESHES),
                          "tp=4", timeout=900)
    return {"dirs": ckpts, **proc.result}


def tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Every tensor's size in bytes, from the safetensors headers."""
    from safetensors import safe_open
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    sizes = {}
    for file in set(index.values()):
        with safe_open(model_dir / file, framework="numpy") as f:
            for name in f.keys():
                s = f.get_slice(name)
                itemsize = {"F32": 4, "BF16": 2}[s.get_dtype()]
                sizes[name] = int(np.prod(s.get_shape())) * itemsize
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["f32", "bf16", "tied"])
@pytest.mark.parametrize("mesh", MESHES)
def test_streamed_params_equal_eager_sharded(streamed, ckpt: str, mesh: str) -> None:
    leaves = streamed[f"{ckpt}|{mesh}"]["leaves"]
    want_dtype = "float32" if ckpt == "f32" else "bfloat16"
    assert ("['lm_head']" in leaves) == (ckpt != "tied")
    assert len(leaves) == (9 if ckpt != "tied" else 8)  # wqkv and w_gate_up fused
    for name, leaf in leaves.items():
        assert leaf["equal"], (name, leaf)
        assert leaf["dtype"] == leaf["want_dtype"] == want_dtype, (name, leaf)  # bf16 stays bf16
        assert leaf["shape"] == leaf["want_shape"], (name, leaf)
        assert leaf["same_sharding"], (name, leaf)
        assert leaf["devices"] == max(1, int(np.prod([int(a.split("=")[1])
                                                      for a in mesh.split(",") if a])))


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["f32", "bf16"])
def test_reads_are_device_shards(streamed, ckpt: str) -> None:
    sizes = tensor_bytes(next(d for d in streamed["dirs"] if d.name == ckpt))
    largest = max(sizes.values())
    cfg = ModelConfig(**CFG)
    kv_bytes = sum(sizes[f"model.layers.{i}.self_attn.{p}_proj.weight"]
                   for i in range(cfg.num_hidden_layers) for p in "kv")
    # The biggest array built from reads: the largest tensor, or one layer's fused w_gate_up
    # (its gate and up tensors side by side) or wqkv.
    layer0 = lambda *names: sum(sizes[f"model.layers.0.{n}.weight"] for n in names)
    one_tensor = max(largest, layer0("mlp.gate_proj", "mlp.up_proj"),
                     layer0(*(f"self_attn.{p}_proj" for p in "qkv")))
    for mesh in MESHES:
        run = streamed[f"{ckpt}|{mesh}"]
        reads, builds = run["reads"], run["builds"]
        # No single read exceeds one tensor, nor do all reads behind one placed array (all the
        # host holds at once: stacked layer leaves are built and placed one layer at a time).
        assert max(b for _, b in reads) <= largest, mesh
        assert max(builds) <= one_tensor, mesh
        # One build per non-layer leaf and per layer of each layer leaf: never a stacked one.
        assert len(builds) == (3 if ckpt != "tied" else 2) + 6 * cfg.num_hidden_layers, mesh
        # Every tensor is read exactly once in total (replicated shards are read once, not
        # once per device), except the KV heads tp=4 stores twice (2 KV heads, 4 shards).
        total = sum(b for _, b in reads)
        assert total == sum(sizes.values()) + (kv_bytes if "tp=4" in mesh else 0), mesh
    # tp=4: a column- or row-split leaf reads a quarter of each tensor per call (wo, w_down;
    # wqkv: each shard's query heads, and one KV head of the two (copied to two shards) of
    # k and of v; w_gate_up: each shard's gate piece and its up piece).
    tp4 = streamed[f"{ckpt}|tp=4"]["reads"]
    for proj, part in (("self_attn.q_proj", 4), ("self_attn.k_proj", 2),
                       ("self_attn.v_proj", 2), ("self_attn.o_proj", 4), ("mlp.gate_proj", 4),
                       ("mlp.up_proj", 4), ("mlp.down_proj", 4)):
        name = f"model.layers.1.{proj}.weight"
        got = [b for n, b in tp4 if n == name]
        assert got == [sizes[name] // part] * 4, (name, got, sizes[name])
    # Replicated leaves are read whole, once.
    assert [b for n, b in tp4 if n == "model.embed_tokens.weight"] == \
        [sizes["model.embed_tokens.weight"]]


@pytest.mark.slow
def test_engine_from_streamed_checkpoint_matches_eager(streamed) -> None:
    engine = streamed["engine"]
    assert engine["streamed_reads"] > 0  # LLM(path) went through the streaming loader
    assert engine["streamed"] == engine["eager"]
    assert all(len(t) == 6 for t in engine["streamed"])


def test_load_model_lazy(tmp_path: Path) -> None:
    cfg = write_checkpoint(tmp_path / "ckpt", "bfloat16", files=2)
    loaded_cfg, lazy, tokenizer = load_model(str(tmp_path / "ckpt"), lazy=True)
    assert isinstance(lazy, LazyCheckpoint) and loaded_cfg == cfg and tokenizer is None
    _, eager, _ = load_model(str(tmp_path / "ckpt"))
    assert isinstance(eager, dict)
    _, default, _ = load_model("default", lazy=True)  # only HF directories are lazy
    assert isinstance(default, dict)
    placed = lazy.place(cfg)  # one device, runtime layout
    assert placed["layers"]["w_gate_up"].shape == (4, 32, 128)
    assert placed["layers"]["wqkv"].shape == (4, 32, 64)  # 4 query heads, 2 KV, of 8
    assert placed["layers"]["wqkv"].dtype == np.dtype(cfg.np_dtype)


def test_lazy_checkpoint_checks_shapes_up_front(tmp_path: Path) -> None:
    model_dir = tmp_path / "ckpt"
    write_checkpoint(model_dir, "float32", files=1)
    file = next(model_dir.glob("*.safetensors"))
    from safetensors.numpy import load_file
    tensors = load_file(str(file))
    tensors["model.layers.2.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="k_proj.*shape"):
        load_model(str(model_dir), lazy=True)
    with pytest.raises(ValueError, match="k_proj.*shape"):
        load_hf_runtime(model_dir, read_config_file(model_dir / "config.json"))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(file))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.self_attn.k_proj.weight"]
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing tensors"):
        load_model(str(model_dir), lazy=True)


def test_streamed_single_device_in_process(tmp_path: Path) -> None:
    """One device, in this process: equal to the eager runtime params, bf16 kept."""
    from jserve.model.decoder import to_runtime_layout
    cfg = write_checkpoint(tmp_path / "ckpt", "bfloat16")
    got = load_hf_runtime(tmp_path / "ckpt", cfg)
    want = to_runtime_layout(load_hf_safetensors(tmp_path / "ckpt", cfg))
    import jax
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype == np.dtype(cfg.np_dtype)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
