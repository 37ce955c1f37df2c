"""HF transformers' plain ``generate`` on the device check's decode shapes, as the baseline
of the same run (``scripts/device_check.py``): a random-weight ``LlamaForCausalLM`` of a
timing model's shape, greedy, a batch of random prompts; time per output token TPOT =
(t(n + 1) - t(1)) / n, each the best of two runs after a warm-up.

It runs in a child process (``python -m harness.device_hf``): torch then never shares
the process with JAX's device memory pool, and the parent bounds it by the budget left."""
from __future__ import annotations

import json
import sys
import time

from harness.child_rows import child_rows


def measure(shape: dict, batches: list[int], prompt: int, new_tokens: int, seed: int
            ) -> list[dict]:
    """One row per batch: prefill seconds (t(1)) and TPOT in ms, on CUDA when torch has it
    (bf16 there when the shape says so), else on the CPU in float32."""
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda and shape.get("dtype") == "bfloat16" else torch.float32
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
    cfg = transformers.LlamaConfig(rms_norm_eps=1e-5, rope_theta=500000.0,
                                   max_position_embeddings=prompt + new_tokens + 16,
                                   **{k: shape[k] for k in keys})
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).eval()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for b in batches:
        ids = torch.randint(3, shape["vocab_size"], (b, prompt), device=device)

        def run(n: int, ids=ids) -> float:
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
            sync()
            return time.perf_counter() - t0

        run(4)  # warm-up
        # Minimums of five: load only adds time, and with two each a loaded host's prefill
        # timing once came out above the whole run's (a TPOT below zero, smoke mode in CI).
        t1 = min(run(1) for _ in range(5))
        tn = min(run(new_tokens + 1) for _ in range(5))
        rows.append(dict(batch=b, prompt=prompt, new_tokens=new_tokens, device=device,
                         dtype=str(dtype).removeprefix("torch."), prefill_s=t1,
                         tpot_ms=(tn - t1) / new_tokens * 1e3,
                         tok_s=b * new_tokens / (tn - t1), torch=torch.__version__,
                         transformers=transformers.__version__))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_in_child(shape: dict, batches: list[int], prompt: int, new_tokens: int, seed: int,
                     timeout: float) -> list[dict]:
    """``measure`` in a fresh process, killed after ``timeout`` seconds (the rows it printed
    by then are kept); RuntimeError when it printed none."""
    return child_rows("harness.device_hf", dict(
        shape=shape, batches=batches, prompt=prompt, new_tokens=new_tokens, seed=seed),
        timeout, "HF baseline")


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    measure(a["shape"], a["batches"], a["prompt"], a["new_tokens"], a["seed"])
