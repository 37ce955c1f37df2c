"""Embeddings throughput (inputs/s): jserve's pooling runner (``LLM.embed``) against
sentence-transformers' ``encode`` on the same CPU, checkpoint and texts, in one run.

    python scripts/bench_embeddings.py [--model ST_DIR] [--inputs 128] [--reps 5]
        [--hidden 512 --layers 8 --heads 8] [--max-num-batched-tokens 2048]
        [--max-prefill-seqs 16] [--batch-size 32] [--json out.json]

Without ``--model`` it writes a random-weight Qwen3-Embedding-shaped checkpoint through
sentence-transformers (``tests/hf_models.write_qwen3_embedding_checkpoint``: a ``Qwen3Model``,
last-token pooling, normalized, a trained 1.2K-token BPE) of the given sizes. The texts are
``--inputs`` word strings of 8 to 200 words (seeded). Each side runs once untimed (jserve
compiles its step shapes there), then ``--reps`` timed runs, the two sides alternated so
that machine noise falls on both; the figure is inputs / the median run. The vectors of
the two are compared too (max abs difference)."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

WORDS = ("the key value cache holds every token a sequence has seen so attention reads "
         "pages of it while the scheduler packs prefill chunks beside decodes under a "
         "time budget and the compiler turns each step into one program").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a sentence-transformers directory (default: written)")
    ap.add_argument("--inputs", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-prefill-seqs", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers'")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from jserve import LLM
    model = args.model
    if model is None:
        from hf_models import write_qwen3_embedding_checkpoint
        model = str(write_qwen3_embedding_checkpoint(
            Path(tempfile.mkdtemp(prefix="jserve-bench-emb-")) / "st",
            hidden_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 4),
            head_dim=args.hidden // args.heads, intermediate_size=3 * args.hidden))
    inputs = texts(args.inputs)
    st = SentenceTransformer(model, device="cpu")
    llm = LLM(model, runner="pooling", max_num_batched_tokens=args.max_num_batched_tokens,
              max_prefill_seqs=args.max_prefill_seqs, max_num_seqs=args.max_prefill_seqs,
              max_model_len=1024)
    runs = {"jserve": lambda: np.array([o.outputs.embedding for o in llm.embed(inputs)]),
            "sentence-transformers": lambda: st.encode(inputs, batch_size=args.batch_size,
                                                        convert_to_numpy=True)}
    vectors = {name: run() for name, run in runs.items()}  # untimed: compiles, warms
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in inputs)
    result = {"model": model, "inputs": len(inputs), "tokens": tokens,
              "max_abs_diff": float(np.abs(vectors["jserve"] - vectors[
                  "sentence-transformers"]).max()),
              "seconds": times, "loadavg": os.getloadavg(), "cpus": os.cpu_count()}
    base = args.inputs / statistics.median(times["sentence-transformers"])
    print(f"{len(inputs)} inputs, {tokens} tokens; max |jserve - st| = "
          f"{result['max_abs_diff']:.2e}")
    print(f"{'runner':<24}{'median s':>10}{'inputs/s':>10}{'vs st':>8}")
    for name, ts in times.items():
        rate = args.inputs / statistics.median(ts)
        print(f"{name:<24}{statistics.median(ts):>10.3f}{rate:>10.1f}{rate / base:>8.2f}")
    print("load average " + ", ".join(f"{x:.1f}" for x in result["loadavg"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
