"""jserve against vLLM's CPU build on one transformers-written checkpoint
(``scripts/bench_vs_vllm.py``, issue 56): the offline API's throughput, batch-1 TTFT and
TPOT, greedy token agreement, and the convoy over HTTP (``harness.vs_vllm_convoy``).

Every side is a process of its own (``harness.vs_vllm_child``: jserve from jserve's venv,
vLLM from vLLM's), loaded once and kept, so that the repetitions alternate the sides (the
order rotates each repetition) and a change of load on this shared machine hits them all;
each figure is the median over ``--reps``. Each repetition draws its own prompts (the same
for every side), so no side's prefix cache serves a repetition from an earlier one. vLLM runs
once per ``--vllm-bind`` value (``VLLM_CPU_OMP_THREADS_BIND``: ``auto`` binds one core of
two and keeps the other for its scheduler; ``0-1`` binds both)."""
from __future__ import annotations

import json
import os
import queue
import random
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).resolve().parent
ROOT = HARNESS.parents[1]
CHILD = HARNESS / "vs_vllm_child.py"
MARK = "@@vs_vllm "


@dataclass
class Side:
    """One engine under test: its name in the tables, its python and environment."""
    name: str
    kind: str          # "jserve" or "vllm"
    python: str
    env: dict = field(default_factory=dict)


def sides(a) -> list[Side]:
    """jserve, then vLLM once per ``--vllm-bind`` value (with ``--vllm-env`` over it)."""
    extra = dict(kv.split("=", 1) for kv in a.vllm_env)
    out = [Side("jserve", "jserve", a.jserve_python, {"JAX_PLATFORMS": "cpu"})]
    for bind in a.vllm_bind:
        out.append(Side(f"vllm[{bind}]", "vllm", a.vllm_python,
                        {"VLLM_CPU_OMP_THREADS_BIND": bind, **extra}))
    return out


def child_env(side: Side) -> dict:
    """The environment a side's process runs in: ours, this checkout first on the path for
    jserve, nothing of jserve's venv on it for vLLM."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if side.kind == "jserve":
        env["PYTHONPATH"] = str(ROOT)
    return {**env, **side.env}


class Child:
    """A ``vs_vllm_child`` process: ``ask(job)`` sends one job and waits for its answer. A
    thread reads its stdout, keeps the marked lines and writes the rest to its log."""

    def __init__(self, side: Side, cfg: dict, log: Path, timeout: float):
        self.side, self.log = side, log
        self.logf = log.open("a")
        self.proc = subprocess.Popen(
            [side.python, str(CHILD), json.dumps({**cfg, "side": side.kind})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.logf, text=True,
            env=child_env(side), cwd=HARNESS)
        self.rows: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._next(timeout)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.rows.put(json.loads(line[len(MARK):]))
            else:
                self.logf.write(line)
                self.logf.flush()
        self.rows.put(None)  # exited

    def _next(self, timeout: float) -> dict:
        try:
            row = self.rows.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.side.name}: no answer in {timeout:.0f} s "
                               f"(log: {self.log})") from None
        if row is None:
            raise RuntimeError(f"{self.side.name} exited ({self.proc.wait()}): "
                               f"{self.log.read_text()[-3000:]}")
        if "error" in row:
            raise RuntimeError(f"{self.side.name}: {row['traceback']}")
        return row

    def ask(self, job: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"job": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


def ordinary_ids(model: Path) -> list[int]:
    """Token ids a random prompt may use: the vocabulary without its added tokens."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tok = json.loads((model / "tokenizer.json").read_text())
    added = {t["id"] for t in tok.get("added_tokens", [])}
    return [i for i in range(vocab) if i not in added]


def random_prompts(ids: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(ids, k=length) for _ in range(n)]


def text_prompts(n: int, chars: int = 240) -> list[str]:
    """``n`` pieces of the standard library's source (what the tokenizer was trained on is
    text it tokenizes as a user's text), ``chars`` characters each, from different files."""
    from harness.bpe_tokenizer import corpus_files

    files = corpus_files()
    step = max(1, len(files) // n)
    out = []
    for path in files[::step][:n]:
        text = path.read_text(encoding="utf-8", errors="replace")
        mid = len(text) // 2
        out.append(text[mid:mid + chars])
    return out


def rotated(items: list, rep: int) -> list:
    k = rep % len(items)
    return items[k:] + items[:k]


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def offline_and_batch1(children: dict[str, Child], a, ids: list[int], step) -> dict:
    """Per side, the median offline tok/s and batch-1 TTFT / TPOT over ``a.reps``, the sides
    alternated in a rotating order (each repetition's prompts seeded by the repetition)."""
    results: dict[str, dict[str, list]] = {n: {"offline": [], "batch1": []} for n in children}
    parts = [p for p in ("offline", "batch1") if p in a.parts]
    for rep in range(a.reps):
        for part in parts:
            if part == "offline":
                job = {"job": "offline", "max_tokens": a.offline_output,
                       "prompts": random_prompts(ids, a.offline_prompts, a.offline_input,
                                                 1000 + rep)}
            else:
                job = {"job": "batch1", "max_tokens": a.batch1_output,
                       "prompts": random_prompts(ids, 2, a.batch1_input, 2000 + rep)}
            for name in rotated(list(children), rep):
                time.sleep(a.settle_s)
                row = children[name].ask(job, a.job_timeout)
                results[name][part].append(row)
                step(f"rep {rep + 1}/{a.reps} {part:8s} {name:12s} " + ", ".join(
                    f"{k} {v:.4g}" for k, v in row.items() if isinstance(v, float)))
    out = {}
    for name, r in results.items():
        out[name] = {}
        if r["offline"]:
            out[name]["offline_tok_s"] = median_of(r["offline"], "tok_s")
        if r["batch1"]:
            out[name]["batch1_ttft_ms"] = 1e3 * median_of(r["batch1"], "ttft_s")
            out[name]["batch1_tpot_ms"] = 1e3 * median_of(r["batch1"], "tpot_s")
        out[name]["reps"] = r
    return out


def common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    for a, b in zip(x, y):
        if a != b:
            break
        n += 1
    return n


def tokens_agree(children: dict[str, Child], a) -> dict:
    """Each vLLM side's greedy outputs against jserve's on the same text prompts: identical
    prompt tokenizations, identical output sequences, mean common output prefix."""
    job = {"job": "tokens", "prompts": text_prompts(a.tokens_prompts),
           "max_tokens": a.tokens_output}
    got = {name: c.ask(job, a.job_timeout) for name, c in children.items()}
    ref = got.pop("jserve")
    out = {}
    for name, g in got.items():
        pairs = list(zip(ref["output_ids"], g["output_ids"]))
        out[name] = {
            "prompts_same": sum(x == y for x, y in zip(ref["prompt_ids"], g["prompt_ids"])),
            "outputs_same": sum(x == y for x, y in pairs),
            "mean_prefix": statistics.mean(common_prefix(x, y) for x, y in pairs),
            "n": len(pairs), "tokens": a.tokens_output}
    return out


def child_config(a, model: Path) -> dict:
    return {"model": str(model), "dtype": a.dtype, "max_model_len": a.max_model_len,
            "max_num_seqs": a.max_num_seqs, "kv_gib": a.kv_gib,
            "max_num_batched_tokens": a.max_num_batched_tokens}


def run_offline(a, model: Path, step) -> dict:
    """Starts every side's child (loading and compiling, untimed), warms each up with the
    parts' shapes, runs the selected offline parts and closes them."""
    ids = ordinary_ids(model)
    children: dict[str, Child] = {}
    try:
        for side in sides(a):
            step(f"starting {side.name} (LLM load and compile)")
            children[side.name] = c = Child(side, child_config(a, model),
                                            a.out / f"{side.name}.log", a.start_timeout)
            step(f"{side.name} ready in {c.ready['load_s']:.1f} s")
            warm = [[random_prompts(ids, min(4, a.offline_prompts), a.offline_input, 1), 2],
                    [random_prompts(ids, 1, a.batch1_input, 2), 2]]
            c.ask({"job": "warmup", "batches": warm}, a.job_timeout)
        result = {"load_s": {n: c.ready["load_s"] for n, c in children.items()}}
        if {"offline", "batch1"} & set(a.parts):
            result["perf"] = offline_and_batch1(children, a, ids, step)
        if "tokens" in a.parts:
            step("tokens: greedy outputs of every side")
            result["tokens"] = tokens_agree(children, a)
        return result
    finally:
        for c in children.values():
            c.close()


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def ratio_cell(js: float | None, other: float | None, higher_better: bool) -> str:
    """How many times better jserve is (>1: jserve ahead), or ``-``."""
    if not js or not other:
        return "-"
    return f"{(js / other if higher_better else other / js):.2f}x"


def perf_table(perf: dict) -> str:
    """The offline parts' markdown table: a row per metric, a column per side, and jserve's
    advantage over each vLLM side (>1: jserve better)."""
    names = list(perf)
    vllms = [n for n in names if n.startswith("vllm")]
    rows = [("offline output tok/s", "offline_tok_s", True, 1),
            ("batch-1 TTFT ms", "batch1_ttft_ms", False, 1),
            ("batch-1 TPOT ms", "batch1_tpot_ms", False, 2)]
    head = ["metric", *names, *[f"jserve / {v}" for v in vllms]]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for label, key, higher, digits in rows:
        if not any(key in perf[n] for n in names):
            continue
        cells = [fmt(perf[n].get(key), digits) for n in names]
        ratios = [ratio_cell(perf["jserve"].get(key), perf[v].get(key), higher) for v in vllms]
        lines.append("| " + " | ".join([label, *cells, *ratios]) + " |")
    return "\n".join(lines)


def tokens_table(tokens: dict) -> str:
    lines = ["| vs jserve | same prompt ids | same outputs | mean common prefix |",
             "|---|---:|---:|---:|"]
    for name, t in tokens.items():
        lines.append(f"| {name} | {t['prompts_same']}/{t['n']} | {t['outputs_same']}/{t['n']} "
                     f"| {t['mean_prefix']:.1f} of {t['tokens']} |")
    return "\n".join(lines)
