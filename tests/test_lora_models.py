"""The LoRA fixture itself (tests/lora_models.py): PEFT's own files and names, adapters that
visibly change transformers' greedy tokens, and the bad adapters' faults."""
from __future__ import annotations

import json

from safetensors import safe_open

from hf_models import tiny_hf_config, tiny_llama_dir
from lora_models import (
    ADAPTERS,
    BAD_ADAPTERS,
    BASE,
    PROMPTS,
    bad_adapters_dir,
    half_scaling,
    peft_adapter_dir,
    peft_greedy,
    write_peft_adapter,
)

N = 8


def _shapes(path) -> dict[str, list[int]]:
    with safe_open(path, "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def _expected_shapes(targets, rank: int, hidden: int = 64) -> dict[str, list[int]]:
    """PEFT's keys and torch shapes (lora_A [r, in], lora_B [out, r]) on BASE's layers."""
    cfg = tiny_hf_config(BASE)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    mlp = cfg.intermediate_size
    dims = {"q_proj": ("self_attn", hidden, q), "k_proj": ("self_attn", hidden, kv),
            "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", q, hidden),
            "gate_proj": ("mlp", hidden, mlp), "up_proj": ("mlp", hidden, mlp),
            "down_proj": ("mlp", mlp, hidden)}
    out = {}
    for layer in range(cfg.num_hidden_layers):
        for t in targets:
            block, d_in, d_out = dims[t]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{t}"
            out[f"{prefix}.lora_A.weight"] = [rank, d_in]
            out[f"{prefix}.lora_B.weight"] = [d_out, rank]
    return out


def test_adapters_are_peft_files_with_peft_names_and_config():
    for key, spec in ADAPTERS.items():
        d = peft_adapter_dir(BASE, key)
        assert sorted(p.name for p in d.iterdir()) == [
            "README.md", "adapter_config.json", "adapter_model.safetensors"]
        assert _shapes(d / "adapter_model.safetensors") == _expected_shapes(
            spec["targets"], spec["rank"])
        config = json.loads((d / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
        assert (config["r"], config["lora_alpha"]) == (spec["rank"], spec["alpha"])
        assert config["use_rslora"] is spec.get("use_rslora", False)
        assert sorted(config["target_modules"]) == sorted(spec["targets"])
        assert config["base_model_name_or_path"] == str(tiny_llama_dir(BASE))
        assert (config["bias"], config["use_dora"], config["modules_to_save"]) == (
            "none", False, None)
        assert not config["rank_pattern"] and not config["alpha_pattern"]
    assert json.loads((peft_adapter_dir(BASE, "b") / "adapter_config.json").read_text())[
        "use_rslora"] is True


def test_each_adapter_changes_greedy_tokens_and_its_scaling_matters(tmp_path):
    base_dir = tiny_llama_dir(BASE)
    base = peft_greedy(base_dir, None, PROMPTS, N)
    assert all(len(t) == N for t in base)
    seen = [base]
    for key, spec in ADAPTERS.items():
        toks = peft_greedy(base_dir, peft_adapter_dir(BASE, key), PROMPTS, N)
        half = peft_greedy(base_dir, write_peft_adapter(
            base_dir, tmp_path / key, **half_scaling(spec)), PROMPTS, N)
        for prompt, t, b, h in zip(PROMPTS, toks, base, half):
            assert len(t) == N and all(0 <= x < 512 for x in t)
            assert t != b, (key, prompt, t)  # every prompt, not just one
            assert t != h, (key, prompt, t)  # the scaling (alpha / r, rsLoRA) shows too
            assert len(set(t)) > 1, (key, prompt, t)
        assert toks not in seen  # and no two adapters agree
        seen.append(toks)
    # Cached: the same tokens again, from the same loaded models.
    assert peft_greedy(base_dir, peft_adapter_dir(BASE, "a"), PROMPTS, N) == seen[1]


def test_bad_adapters_hold_their_one_fault():
    bad = bad_adapters_dir(BASE)
    assert sorted(bad) == sorted(BAD_ADAPTERS)
    a = _expected_shapes(ADAPTERS["a"]["targets"], ADAPTERS["a"]["rank"])

    unknown = bad["unknown_module"]
    foo = "base_model.model.model.layers.0.self_attn.foo_proj"
    assert _shapes(unknown / "adapter_model.safetensors") == a | {
        f"{foo}.lora_A.weight": [8, 64], f"{foo}.lora_B.weight": [64, 8]}
    assert "foo_proj" in json.loads((unknown / "adapter_config.json").read_text())[
        "target_modules"]

    big = bad["rank_too_large"]
    assert json.loads((big / "adapter_config.json").read_text())["r"] == 64
    assert _shapes(big / "adapter_model.safetensors") == _expected_shapes(
        ADAPTERS["a"]["targets"], 64)

    wide = _shapes(bad["shape_mismatch"] / "adapter_model.safetensors")
    assert sorted(wide) == sorted(a) and wide != a
    assert all(s[1] == 96 for k, s in wide.items() if ".lora_A." in k)
    assert all(s[0] == 96 for k, s in wide.items() if ".q_proj.lora_B." in k)

    assert [p.name for p in bad["missing_file"].iterdir()] == ["adapter_config.json"]
