"""``jserve bench serve`` and aiperf against the same ``jserve serve``, one after the other, the
same workload (``harness.serve_vs_aiperf``), on the built-in model (aiperf counting with
an HF copy of its byte tokenizer) and on the tests' trained-BPE Llama-3 checkpoint
(``tests/hf_models.py``; needs the ``test`` extra):

    python scripts/bench_serve_vs_aiperf.py [--num-prompts 200] [--input-len 512] \\
        [--output-len 128] [--concurrency 8] [--rounds 1] [--models default llama3] \\
        [--out out/serve_vs_aiperf]

Each server is warmed up (every step shape compiled) before the first run. Writes each tool's
results and ``report.md`` (the tables printed at the end) under ``--out``.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout; tests/hf_models.py

from harness import aiperf  # noqa: E402
from harness.machine import cores, cpu_model, uptime  # noqa: E402
from harness.serve_vs_aiperf import compare, render  # noqa: E402
from harness.served import Served  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="bench serve then aiperf, N times")
    ap.add_argument("--models", nargs="+", default=["default", "llama3"],
                    choices=["default", "llama3"])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "serve_vs_aiperf")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    def step(msg: str) -> None:
        print(f"[bench_serve_vs_aiperf {time.monotonic() - t_start:6.0f} s] {msg}", flush=True)

    sections = []
    for name in a.models:
        if name == "default":
            model, tokenizer = "default", aiperf.write_byte_tokenizer(a.out / "byte-tokenizer")
        else:
            from hf_models import llama3_chat_dir
            model = tokenizer = str(llama3_chat_dir())
        step(f"starting jserve serve --model {model} (compiling every step shape first)")
        served = Served("--model", model, "--max-num-seqs", str(max(8, a.concurrency)),
                        "--max-num-batched-tokens", "256",
                        "--max-model-len", str(a.input_len + a.output_len + 64),
                        "--log-level", "WARNING", warmup=True)
        served_name = served.line.split()[2]  # "jserve: serving NAME (--model ...)"
        try:
            table = compare(served.url, served_name, tokenizer, a, a.out / name, step)
        finally:
            served.stop(30)
        sections.append(render(f"{name} model ({served_name})", table))
    header = (f"{a.num_prompts} requests, random {a.input_len} tokens in / {a.output_len} out "
              f"(EOS ignored), {a.concurrency} at a time, streaming /v1/completions; "
              f"{platform.machine()} {cpu_model()}, {cores()} cores (load average "
              f"{uptime().split('load average: ')[-1]} at the end); "
              f"`python {' '.join(['scripts/bench_serve_vs_aiperf.py', *sys.argv[1:]])}`")
    report = "\n\n".join([header, *sections])
    (a.out / "report.md").write_text(report + "\n")
    step(f"done; results under {a.out}")
    print(report)


if __name__ == "__main__":
    main()
