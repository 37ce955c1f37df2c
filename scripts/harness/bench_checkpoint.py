"""The bench model's shape with a realistic vocabulary, as a checkpoint a user brings: a
seeded random ``LlamaForCausalLM`` written by transformers (``save_pretrained``) with the
byte tokenizer (enough for profiling token ids), cached under ``~/.cache/jserve`` so the
profiling scripts and the HF comparison load the same weights (``scripts/profile_step.py
--model bench-32k``, ``scripts/bench_engine.py --vocab 32768``). Real vocabularies are
32K-256K: what a step does per vocabulary entry shows here and not on the 8K bench model.

``llama_bpe_checkpoint``: a larger Llama (hidden 768, 12 layers, GQA 12/4) with a trained
32,000-token BPE tokenizer and a chat template, the checkpoint jserve and vLLM both load in
``scripts/bench_vs_vllm.py`` (a tokenizer that vLLM's server and offline API accept as
they accept a user's)."""
from __future__ import annotations

import os
from pathlib import Path

from jserve.tokenizer import ByteTokenizer

# Built-in checkpoint names (``bench_model``) and their vocabulary sizes.
BENCH_CHECKPOINTS = {"bench-32k": 32768}

# The bench model's shape (``harness.decode_step.BENCH_MODEL``) in HF LlamaConfig terms.
BENCH_KWARGS = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, intermediate_size=1536,
                    max_position_embeddings=4096, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_checkpoint(out_dir: Path, vocab: int, seed: int = 0):
    """Writes the seeded random model with ``vocab`` tokens to ``out_dir`` and returns it
    (float32, eval mode) for a HF side to run."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, **BENCH_KWARGS)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out_dir)
    ByteTokenizer().save(out_dir)
    return model


def _cached(name: str, write) -> Path:
    """``~/.cache/jserve/bench/NAME``, written by ``write(directory)`` on first use into a
    temporary directory renamed when complete (so a complete one has config.json)."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jserve" / "bench"
    out = root / name
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        write(tmp)
        tmp.rename(out)
    return out


def bench_checkpoint(vocab: int, seed: int = 0) -> Path:
    """The checkpoint's directory, written on first use (a complete one has config.json)."""
    return _cached(f"llama-bench-v{vocab}-s{seed}", lambda d: write_checkpoint(d, vocab, seed))


# ``llama_bpe_checkpoint``'s shape in HF LlamaConfig terms (vocabulary and MLP width apart).
BPE_KWARGS = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=16384,
                  tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def write_bpe_checkpoint(out_dir: Path, vocab: int = 32000, intermediate: int = 2048,
                         seed: int = 0) -> None:
    """The seeded random Llama of ``BPE_KWARGS`` saved by transformers (float32) beside its
    trained BPE tokenizer (``harness.bpe_tokenizer``); EOS: Llama 3's three ids."""
    import torch
    import transformers

    from harness.bpe_tokenizer import EOS_TOKENS, write_tokenizer

    ids = write_tokenizer(out_dir, vocab, BPE_KWARGS["max_position_embeddings"])
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, intermediate_size=intermediate, bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=[ids[t] for t in EOS_TOKENS], **BPE_KWARGS)
    transformers.LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(out_dir)


def llama_bpe_checkpoint(intermediate: int = 2048, seed: int = 0) -> Path:
    """``write_bpe_checkpoint``'s directory (32,000 tokens), written on first use."""
    return _cached(f"llama-h768-l12-i{intermediate}-bpe32000-s{seed}",
                   lambda d: write_bpe_checkpoint(d, 32000, intermediate, seed))
