"""HF transformers' plain ``generate`` on the device check's decode shapes, as the baseline
of the same run (``scripts/device_check.py``): a random-weight ``LlamaForCausalLM`` of a
timing model's shape, greedy, a batch of random prompts. Each token's time is stamped inside
one ``generate`` call (a stopping criterion sees every new token): prefill is the time to the
first token, TPOT the mean gap between the first and the last, the best of five runs after a
warm-up. (TPOT was once the difference of two separately timed runs, t(n + 1) - t(1); on a
loaded CI host that difference came out at or below zero.)

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

        def run(n: int, ids=ids) -> tuple[float, float]:
            """(seconds to the first token, seconds per token after it) of one generate."""
            stamps: list[float] = []

            def stamp(input_ids, scores, **kw):
                sync()
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0,
                               stopping_criteria=transformers.StoppingCriteriaList([stamp]))
            if len(stamps) != n:
                raise RuntimeError(f"generate stamped {len(stamps)} tokens of {n}")
            return stamps[0] - t0, (stamps[-1] - stamps[0]) / (n - 1)

        run(4)  # warm-up
        runs = [run(new_tokens + 1) for _ in range(5)]
        # Minimums: load only adds time.
        t1, tpot = min(r[0] for r in runs), min(r[1] for r in runs)
        rows.append(dict(batch=b, prompt=prompt, new_tokens=new_tokens, device=device,
                         dtype=str(dtype).removeprefix("torch."), prefill_s=t1,
                         tpot_ms=tpot * 1e3, tok_s=b / tpot, torch=torch.__version__,
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
