"""Real PEFT LoRA adapters for the tiny Llama checkpoints, and transformers' greedy tokens
with them (unmerged), for the LoRA tests.

``write_peft_adapter`` wraps the model saved at a directory with ``peft.get_peft_model`` and
draws every lora_A and lora_B weight from a seeded normal (PEFT starts B at zero, which would
make the adapter a no-op), then ``save_pretrained``\\s it: the directory holds what PEFT
writes (adapter_config.json, adapter_model.safetensors and its README.md model card).
``peft_adapter_dir`` caches the fixed set ``ADAPTERS`` per process, as ``tests/hf_models.py``
does its checkpoints; ``write_bad_adapters`` writes adapters a server must refuse at load;
``peft_greedy`` is the reference. Cached directories and models are shared between tests:
treat them as read-only.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from hf_models import _cache_root, tiny_llama_dir  # noqa: E402

# The checkpoint the adapters are for: Llama 3's shape (hidden 64, 4 query heads on 2 KV
# heads of 16, so k/v_proj are 32 wide where q/o_proj are 64), 2 layers, vocabulary 512.
BASE = "llama3"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# Three adapters: attention only (q, v), every projection with rsLoRA (scaling alpha /
# sqrt(r) = 4, not alpha / r = 2), and o_proj plus the MLP's up/down at a higher rank.
# ``scale``: the weights' standard deviation, chosen (PEFT 0.21.2, torch 2.13) so that
# on every one of PROMPTS each adapter's greedy tokens leave the base model's at once, and
# leave those of the same weights at half the scaling (alpha / 2; b: alpha / r, rsLoRA off)
# within 8 tokens, so a server applying the wrong scaling shows; and so that they are not
# one token repeated (tests/test_lora_models.py holds all three).
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": dict(rank=8, alpha=16, targets=["q_proj", "v_proj"], seed=1, scale=0.6),
    "b": dict(rank=4, alpha=8, targets=ATTENTION + MLP, seed=2, use_rslora=True, scale=0.5),
    "c": dict(rank=16, alpha=16, targets=["o_proj", "down_proj", "up_proj"], seed=3,
              scale=0.4),
}


# Prompts (token ids, BOS first) the fixture is checked on; any ids under the vocabulary do.
PROMPTS: list[list[int]] = [[1, 17, 42, 99, 200, 7], [1, 300, 301, 5, 88],
                            [1, 450, 12, 12, 64, 33, 128, 9, 250]]

BAD_ADAPTERS = ("unknown_module", "rank_too_large", "shape_mismatch", "missing_file")
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def half_scaling(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with its LoRA scaling halved, weights unchanged: rsLoRA's alpha / sqrt(r) at
    r = 4 becomes plain alpha / r, any other's alpha is halved."""
    if spec.get("use_rslora") and spec["rank"] == 4:
        return dict(spec, use_rslora=False)
    return dict(spec, alpha=spec["alpha"] / 2)


def _load_base(base_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32).eval()


def write_peft_adapter(base_dir: Path, out_dir: Path, *, rank: int, alpha: float,
                       targets: list[str], seed: int, use_rslora: bool = False,
                       scale: float = 0.5) -> Path:
    """A LoRA adapter for the checkpoint at ``base_dir``, saved by PEFT into ``out_dir``:
    rank ``rank``, ``lora_alpha`` ``alpha`` on the modules ``targets``, every lora_A and
    lora_B weight drawn from N(0, scale²) by a generator seeded with ``seed`` (in the order
    of their sorted names)."""
    model = peft.get_peft_model(_load_base(base_dir), peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(seed)
    lora = sorted((n, p) for n, p in model.named_parameters() if ".lora_A." in n
                  or ".lora_B." in n)
    assert lora, f"no LoRA weights on {targets}"
    with torch.no_grad():
        for _, p in lora:
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float32))
    model.save_pretrained(out_dir)
    return out_dir


@functools.cache
def peft_adapter_dir(base_name: str = BASE, key: str = "a") -> Path:
    """Process-wide cached ``write_peft_adapter`` of ``ADAPTERS[key]`` for
    ``tiny_llama_dir(base_name)``: each is written once. Read-only."""
    if key not in ADAPTERS:
        raise KeyError(f"unknown adapter {key!r}; choose from {sorted(ADAPTERS)}")
    return write_peft_adapter(tiny_llama_dir(base_name),
                              _cache_root() / f"peft-{base_name}-{key}", **ADAPTERS[key])


def _edit_weights(adapter_dir: Path, edit) -> None:
    """Rewrite the adapter's safetensors as ``edit({name: tensor})`` returns them."""
    path = adapter_dir / WEIGHTS
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})


def _edit_config(adapter_dir: Path, **fields) -> None:
    path = adapter_dir / CONFIG
    path.write_text(json.dumps(json.loads(path.read_text()) | fields, indent=2,
                               sort_keys=True))


def write_bad_adapters(base_dir: Path, root: Path) -> dict[str, Path]:
    """Adapters for ``base_dir``'s model that a server must refuse at load, each a directory
    as PEFT writes one, by name (``BAD_ADAPTERS``):

    - unknown_module: adapter "a" (q_proj, v_proj) whole, plus a copy of layer 0's q_proj
      pair under a ``foo_proj`` the model lacks
      (``base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight``, ``lora_B``), and
      foo_proj in target_modules (the only fault: no key is missing; PEFT itself loads it,
      ignoring foo_proj);
    - rank_too_large: rank 64 (alpha 128) on q_proj and v_proj (over the usual maximum LoRA
      rank of 16, at the hidden size itself);
    - shape_mismatch: written for a model 32 wider (hidden 96): every lora_A takes 96 inputs,
      q_proj's lora_B gives 96 outputs;
    - missing_file: adapter_config.json only, no adapter_model.safetensors.

    Each but missing_file holds PEFT's three files. PEFT refuses shape_mismatch (size
    mismatch) and missing_file, and loads unknown_module and rank_too_large.
    """
    spec = dict(ADAPTERS["a"])
    out = {name: root / name for name in BAD_ADAPTERS}

    write_peft_adapter(base_dir, out["unknown_module"], **spec)
    _edit_weights(out["unknown_module"], lambda w: w | {
        k.replace(".q_proj.", ".foo_proj."): v.clone() for k, v in w.items()
        if ".layers.0.self_attn.q_proj." in k})
    _edit_config(out["unknown_module"], target_modules=sorted(spec["targets"] + ["foo_proj"]))

    write_peft_adapter(base_dir, out["rank_too_large"], **dict(spec, rank=64, alpha=128))

    def widen(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(99)
        new = {}
        for k, v in w.items():
            shape = list(v.shape)
            if ".lora_A." in k:
                shape[1] += 32
            elif ".q_proj.lora_B." in k:
                shape[0] += 32
            new[k] = v if shape == list(v.shape) else spec["scale"] * torch.randn(
                shape, generator=gen)
        return new

    write_peft_adapter(base_dir, out["shape_mismatch"], **spec)
    _edit_weights(out["shape_mismatch"], widen)

    write_peft_adapter(base_dir, out["missing_file"], **spec)
    for f in out["missing_file"].iterdir():
        if f.name != CONFIG:
            f.unlink() if f.is_file() else shutil.rmtree(f)
    return out


@functools.cache
def bad_adapters_dir(base_name: str = BASE) -> dict[str, Path]:
    """Process-wide cached ``write_bad_adapters`` for ``tiny_llama_dir(base_name)``.
    Read-only."""
    return write_bad_adapters(tiny_llama_dir(base_name), _cache_root() / f"peft-{base_name}-bad")


@functools.lru_cache(maxsize=8)
def _reference_model(base_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    """The float32 base model, or a fresh one under ``PeftModel.from_pretrained`` (which
    injects the adapter's layers into the model it is given: one base per adapter)."""
    model = _load_base(base_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    return model


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """Transformers' greedy continuation (the new token ids) of each prompt, one at a time,
    float32, with the adapter at ``adapter_dir`` unmerged (None: the base model). EOS does
    not stop it: exactly ``max_new_tokens`` come out per prompt, EOS ids among them where
    they are the argmax (as a server ignoring EOS gives)."""
    model = _reference_model(Path(base_dir), None if adapter_dir is None else Path(adapter_dir))
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            new = gen[0, ids.shape[1]:].tolist()
            assert len(new) == max_new_tokens, (len(new), max_new_tokens)
            out.append(new)
    return out


def peft_logits(base_dir: Path, adapter_dir: Path | None, ids: list[int]):
    """Transformers' float32 logits at every position of one sequence ``ids`` (a [len(ids),
    vocab] numpy array), with the adapter unmerged (None: the base model). The tiny models'
    logits are small (|logit| < 1, top-two gaps ~0.03, some under 1e-3): compare logits, or
    tokens in float32 only."""
    model = _reference_model(Path(base_dir), None if adapter_dir is None else Path(adapter_dir))
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0].numpy()


def reference_tokens(prompts: list[list[int]], n: int,
                     keys: tuple = (None, "a", "b", "c")) -> dict:
    """``peft_greedy`` of ``prompts`` on ``BASE`` per adapter key of ``ADAPTERS`` (None: the
    base model): what the engine and server tests compare with."""
    base = tiny_llama_dir(BASE)
    return {k: peft_greedy(base, None if k is None else peft_adapter_dir(BASE, k), prompts, n)
            for k in keys}
