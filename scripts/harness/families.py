"""Per model family, on this CPU (``scripts/bench_families.py``): jserve's greedy generation
against Hugging Face transformers' ``generate`` on the same random-weight checkpoint in the
same run, and the KV pages a long request holds, windowed families against a full-attention
model of the same size.

Every family gets the same body (hidden 256, 4 layers, 8 query / 2 KV heads of 32, MLP 768,
vocab 8192, float32) plus what it is: Qwen2's q/k/v biases, Qwen3's q/k norms, Mistral's
sliding window, Gemma 3's local/global layers, (1 + w) norms, GeGLU and soft-capped logits,
Mixtral's experts (beside a dense Llama of its active parameters).

Import this after setting ``OMP_WAIT_POLICY`` (the script does: torch starts OpenMP here)."""
from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from harness.hf_compare import greedy, hf_generate, load_average, median, unpadded
from jserve.cache.allocator import held_pages
from jserve.llm import LLM

BODY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=32, intermediate_size=768, vocab_size=8192,
            max_position_embeddings=65536, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# family -> (transformers config class, model class, what the family adds to BODY)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=ROPE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters=ROPE)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_parameters=ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(rope_parameters=ROPE, sliding_window=4096)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=1024, query_pre_attn_scalar=32,
                    final_logit_softcapping=30.0,
                    layer_types=["sliding_attention"] * 3 + ["full_attention"],
                    rope_parameters={"full_attention": dict(ROPE, rope_theta=1e6),
                                     "sliding_attention": ROPE})),
    # Mixture of experts: 8 experts of BODY's MLP, top 2; and the dense model of the same
    # active parameters (one MLP twice as wide) it is measured against.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(rope_parameters=ROPE, num_local_experts=8, num_experts_per_tok=2)),
    "dense-active": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_parameters=ROPE, intermediate_size=2 * BODY["intermediate_size"])),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: int = 8
    prompt_len: int = 128
    new_tokens: int = 32
    reps: int = 3
    long_tokens: int = 32768  # the request whose held KV pages are counted
    page_size: int = 16
    chunk: int = 256  # the engine's prefill chunk (max_num_batched_tokens)


def write_checkpoint(family: str, out: Path, seed: int = 0) -> torch.nn.Module:
    """A seeded random ``family`` model saved to ``out``; returned in eval mode, set to
    decode exactly ``max_new_tokens`` (no EOS), as jserve's ``ignore_eos``."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**BODY, **extra})
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    model.save_pretrained(out)
    model.generation_config.eos_token_id = None
    model.generation_config.do_sample = False
    return model


def pages_held(family: str, w: Workload) -> dict:
    """KV pages a ``long_tokens`` request holds at its peak, by the allocator's own rule
    (``held_pages``: a windowed request drops the pages every layer's window has passed),
    against a full-attention model of the same size."""
    window = FAMILIES[family][2].get("sliding_window")
    every_layer = "layer_types" not in FAMILIES[family][2]
    kept = held_pages(w.long_tokens, w.page_size, window if every_layer else None, w.chunk)
    full = held_pages(w.long_tokens, w.page_size)
    return {"window": window, "every_layer_windowed": every_layer, "pages": kept,
            "full_attention_pages": full, "ratio": kept / full}


def bench_family(family: str, w: Workload, root: Path) -> dict:
    """Median tokens/s of the fixed workload on both sides, and whether the greedy tokens
    agree (they should: float32 both sides)."""
    model = write_checkpoint(family, root / family)
    llm = LLM(str(root / family), max_num_seqs=w.prompts, max_num_batched_tokens=w.chunk,
              enable_prefix_caching=False, warmup=True)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, BODY["vocab_size"], size=(w.prompts, w.prompt_len)).tolist()
    ids, mask = unpadded(prompts)
    params = greedy(w.new_tokens)
    ours, theirs, same = [], [], None
    for _ in range(w.reps + 1):  # the first of each side is untimed
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        ours.append(time.perf_counter() - t0)
        gen, dt = hf_generate(model, ids, mask, w.new_tokens)
        theirs.append(dt)
        same = [o.token_ids for o in outs] == gen.tolist()
    tokens = w.prompts * w.new_tokens
    jserve_tps, hf_tps = tokens / median(ours[1:]), tokens / median(theirs[1:])
    del llm
    return {"jserve_tokens_per_s": jserve_tps, "hf_tokens_per_s": hf_tps,
            "ratio": jserve_tps / hf_tps, "greedy_tokens_equal": same,
            **{f"kv_{k}": v for k, v in pages_held(family, w).items()}}


def run(families: list[str], w: Workload) -> dict:
    results = {"workload": dataclasses.asdict(w), "load_before": load_average()}
    with tempfile.TemporaryDirectory(prefix="jserve-families-") as tmp:
        for family in families:
            results[family] = bench_family(family, w, Path(tmp))
            r = results[family]
            print(f"{family:8s} jserve {r['jserve_tokens_per_s']:8.1f} tok/s  HF "
                  f"{r['hf_tokens_per_s']:8.1f} tok/s  x{r['ratio']:.2f}  greedy equal "
                  f"{r['greedy_tokens_equal']}  KV pages at {w.long_tokens} tokens: "
                  f"{r['kv_pages']} (full attention {r['kv_full_attention_pages']})",
                  flush=True)
    results["load_after"] = load_average()
    return results
