"""The device check's settings (``scripts/device_check.py``): the full check's real shapes and
the CPU smoke run's tiny ones, the random-weight models it times, and the device peak table its
utilisations divide by."""
from __future__ import annotations

import dataclasses

from jserve.config import ModelConfig

# (substring of device_kind, dense bf16 FLOP/s, memory bytes/s), first match wins. Vendor
# datasheet figures (SXM parts unless named); an H100 NVL is left unknown (n/a), not guessed.
PEAKS = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", None, None),
    ("H100", 989e12, 3.35e12),
    ("A100", 312e12, 2.0e12),
    ("TPU v5 lite", 197e12, 0.819e12),
    ("TPU v5", 459e12, 2.765e12),   # v5p
    ("TPU v6 lite", 918e12, 1.64e12),
    ("TPU v4", 275e12, 1.2e12),
)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Everything that differs between the full check and the CPU smoke run."""

    name: str
    # kernel checks
    hq: int
    hkv: int
    d: int
    dtype: str
    page: int
    contexts: tuple[int, ...]
    decode_batch: int
    prefill_chunk: int
    mixed: tuple[int, int, int]     # (decodes, chunk at the end of the context, fresh prompt)
    tol: float
    reps: int
    fixed_shapes: bool              # one pool and table size for every context: one compile
    # engine check
    engine_model: dict
    engine_prompts: tuple[int, ...]
    engine_tokens: tuple[int, ...]  # greedy tokens of each prompt
    engine_kwargs: dict
    # timings
    timing_models: dict
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_tokens: int
    decode_max_model_len: int
    decode_burst: int               # each decode batch again in bursts of this many steps
    prefill_len: int                # one prompt prefilled in one chunk (the MFU figure)
    chunk_context: int              # the long prompt prefilled in chunks of ...
    chunk_sizes: tuple[int, ...]


def llama_cfg(**kw) -> ModelConfig:
    base = dict(rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                bos_token_id=1, eos_token_ids=(2,))
    return ModelConfig(**{**base, **kw})


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, tie_word_embeddings=True, dtype="bfloat16")


LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, tie_word_embeddings=False, dtype="bfloat16")


FULL = Profile(
    name="full", hq=32, hkv=8, d=128, dtype="bfloat16", page=16,
    contexts=(1024, 4096, 8192, 32768), decode_batch=32, prefill_chunk=512,
    mixed=(16, 256, 128), tol=2e-2, reps=10, fixed_shapes=False,
    # Real attention shapes (32/8 heads, head_dim 128) in a 4-layer float32 model; prompts
    # cross pages, chunks (budget 512) and decode buckets.
    engine_model=dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096,
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, tie_word_embeddings=False, dtype="float32"),
    engine_prompts=(7, 100, 513, 1500, 33, 260, 900, 16), engine_tokens=(32,) * 8,
    engine_kwargs=dict(max_num_seqs=8, max_num_batched_tokens=512, max_prefill_seqs=4,
                       max_model_len=2048, page_size=16),
    timing_models={"llama-3.2-1b-shaped": LLAMA_1B, "llama-3-8b-shaped": LLAMA_8B},
    decode_batches=(1, 32), decode_prompt=1024, decode_tokens=64, decode_max_model_len=8192,
    decode_burst=8, prefill_len=2048, chunk_context=32768, chunk_sizes=(256, 2048))


SMOKE = Profile(
    name="smoke", hq=4, hkv=2, d=32, dtype="float32", page=16,
    contexts=(64, 256), decode_batch=4, prefill_chunk=32, mixed=(3, 16, 8), tol=1e-4, reps=3,
    fixed_shapes=True,
    engine_model=dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, tie_word_embeddings=False, dtype="float32"),
    # Budget 32: the first step prefills 5 + 27 tokens, the next mixes a decode with the
    # 13-token rest of the long prompt, then both decode and finish together: a mixed batch
    # in three compiled shapes.
    engine_prompts=(5, 40), engine_tokens=(12, 11),
    engine_kwargs=dict(max_num_seqs=2, max_num_batched_tokens=32, max_prefill_seqs=2,
                       max_model_len=256, page_size=16),
    timing_models={"tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                dtype="float32")},
    # Prompts of 16 (b=1) and 2 x 16 (b=2) prefill in one step each; the 32-token budget
    # engine also serves the 32-token chunks at context 128: five compiled shapes.
    decode_batches=(1, 2), decode_prompt=16, decode_tokens=8, decode_max_model_len=144,
    decode_burst=4, prefill_len=32, chunk_context=128, chunk_sizes=(16, 32))


def peak_figures(device_kind: str, tflops: float | None, tbps: float | None):
    """(FLOP/s, bytes/s) of the device, each None when unknown."""
    flops, bw = next(((f, b) for name, f, b in PEAKS if name in device_kind), (None, None))
    return (tflops * 1e12 if tflops else flops), (tbps * 1e12 if tbps else bw)


def ratio(a, b):
    return None if a is None or b is None or not b else a / b
