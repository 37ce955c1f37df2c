"""guidellm (vLLM's benchmark tool) next to jserve's own harness, for the same load: one
``jserve serve`` of a Hugging Face checkpoint with its tokenizer, then for each profile
(synchronous: one request at a time; concurrent: ``--streams`` at a time) guidellm on
synthetic data (``harness.guidellm``) and the harness (``jserve.bench.replay.run_http``:
the same OpenAI API, streaming completions) with the same prompt and output lengths, the same
number of requests and the same concurrency. Each run also gets the engine's own figures
from the server's metrics (TTFT and TPOT as the engine thread observed them, tokens per step
per request) and the SSE stream's tokens per chunk.

    python scripts/bench_guidellm.py [--model HF_DIR] [--prompt-tokens 64] \\
        [--output-tokens 64] [--sync-requests 12] [--streams 8] [--requests 64] \\
        [--guidellm-workers N] [--out out/guidellm]

Without ``--model`` it serves the tests' tiny random Llama with its tokenizer
(``tests/hf_models.py``; needs the ``test`` extra). Writes guidellm's JSON reports, the
harness's records and ``report.md`` (the tables printed at the end) under ``--out``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout; tests/hf_models.py

from harness.guidellm_compare import compare, render_report  # noqa: E402
from harness.served import Served  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an HF checkpoint directory with its "
                    "tokenizer (default: the tests' tiny random Llama)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--sync-requests", type=int, default=12)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64, help="of the concurrent profile")
    ap.add_argument("--guidellm-workers", type=int, default=None,
                    help="guidellm's worker processes at most (default: its own, up to 10; "
                         "they share the machine with the server)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "guidellm")
    a = ap.parse_args()
    t_start = time.monotonic()

    def step(msg: str) -> None:
        print(f"[bench_guidellm {time.monotonic() - t_start:6.0f} s] {msg}", flush=True)

    if a.model is None:
        step("writing the tests' tiny random Llama (tests/hf_models.py)")
        from hf_models import tiny_llama_dir
        model_dir = str(tiny_llama_dir("llama2", with_tokenizer=True))
    else:
        model_dir = str(Path(a.model).resolve())
    step(f"starting jserve serve --model {model_dir} (it compiles every step shape first)")
    served = Served("--model", model_dir, "--max-num-seqs", str(max(8, a.streams)),
                    "--max-num-batched-tokens", "256",
                    "--max-model-len", str(a.prompt_tokens + a.output_tokens + 64),
                    "--log-level", "WARNING", warmup=True)
    print(served.line.strip(), flush=True)
    model = httpx.get(served.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    try:
        tables = compare(served.url, model_dir, model, a, step)
    finally:
        served.stop(30)
    report = render_report(" ".join(["python", "scripts/bench_guidellm.py", *sys.argv[1:]]),
                           model, model_dir, a, tables)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.md").write_text(report + "\n")
    step(f"done; reports under {a.out}")
    print(report)


if __name__ == "__main__":
    main()
