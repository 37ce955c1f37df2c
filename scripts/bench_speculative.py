"""Speculative decoding against plain decoding, side by side in one run: TPOT and mean
accepted length at batch 1 and 8 on four workloads.

    python scripts/bench_speculative.py [--reps 3] [--batches 1 8] [--k 4]

Workloads (one engine per model and mode, all buckets compiled before timing):
  quote      tiny-tasks "list N fruits" (N = 16...), greedy: the answer repeats its own
             earlier lines, the fruit names every eight lines, while the numbers count
             down. The stand-in for document QA that quotes: no model here copies a
             document (docs/speculative.md says what was tried)
  countdown  tiny-tasks "count down from N" (N = 60...), greedy: the tens digit repeats, the
             units do not, so prompt lookup drafts little; also run with a draft model
             (``--draft-model``, default tiny-tasks itself: every draft is right, so this is
             the best any draft model can do at its cost per draft token)
  free       the random default model's free text sampled at temperature 1 (seeded),
             ignore_eos: drafts are rarely accepted and requests stop speculating (greedy,
             this model falls into loops that prompt lookup drafts well)
  loop       (the ceiling) the random default model's greedy text, which falls into a
             short loop within a few tokens: prompt lookup drafts nearly every token, so
             this shows what speculation gives on this machine when drafts are accepted,
             whatever the workload
Modes: ``base`` (no speculation, async scheduling on), ``ngram`` (prompt lookup, k drafts,
n from 1 to 4; plans that carry speculating requests are read back before the next is
planned), ``ngram-sync`` (the same with async scheduling off: what the overlap still buys),
``draft`` (countdown only: the draft model proposes k tokens).
Per run: the median over requests of (last token time - first token time) / (tokens - 1);
per cell: the median over ``--reps`` repetitions, the modes alternating within each
repetition. Prints a markdown table and the machine load (``uptime``) before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess

from tqdm import tqdm

from jserve import LLM, SamplingParams
from jserve.train.length_task import count_down, format_prompt, list_fruits

SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_seqs=2,
                max_model_len=512, warmup=True)
WORKLOADS = ("quote", "countdown", "free", "loop")


def workloads(batch: int) -> dict[str, tuple[str, list, SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=200)
    return {
        "quote": ("tiny-tasks", [format_prompt(list_fruits(16 + i).prompt)
                                 for i in range(batch)], greedy),
        "countdown": ("tiny-tasks", [format_prompt(count_down(60 + i).prompt)
                                     for i in range(batch)], greedy),
        "free": ("default", [f"free text number {i}: the " for i in range(batch)],
                 SamplingParams(temperature=1.0, seed=1, max_tokens=128, ignore_eos=True)),
        "loop": ("default", [f"free text number {i}: the " for i in range(batch)],
                 SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)),
    }


def tpot(outputs) -> float:
    per = []
    for o in outputs:
        t = o.metrics.token_times
        if len(t) > 1:
            per.append((t[-1] - t[0]) / (len(t) - 1))
    return statistics.median(per)


def run(llm: LLM, prompts, params) -> tuple[float, float, int]:
    """(TPOT, mean accepted length of this run, tokens generated)."""
    spec = llm.engine.speculator
    before = spec.stats() if spec.config else None
    outs = llm.generate(prompts, params)
    length = 1.0
    if before is not None:
        after = spec.stats()
        steps = after["drafts"] - before["drafts"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        length = (accepted + steps) / steps if steps else 1.0
    return tpot(outs), length, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--draft-model", default="tiny-tasks",
                    help="the countdown's draft model ('' : no draft mode)")
    a = ap.parse_args()
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout
          .strip(), f"({os.cpu_count()} CPUs)")
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": a.k,
                         "prompt_lookup_max": 4, "prompt_lookup_min": 1},
               "draft": {"method": "draft_model", "model": a.draft_model,
                         "num_speculative_tokens": a.k}}
    modes = {w: ["base", "ngram", "ngram-sync"] + (["draft"] if w == "countdown"
                                                    and a.draft_model else [])
             for w in a.workloads}
    engine_of = {"base": "base", "ngram": "ngram", "ngram-sync": "ngram", "draft": "draft"}
    wanted = sorted({(workloads(1)[w][0], engine_of[m])
                     for w in a.workloads for m in modes[w]})
    engines: dict[tuple[str, str], LLM] = {}
    for model, kind in tqdm(wanted, desc="engines (compiling)"):
        engines[model, kind] = LLM(model, speculative_config=configs.get(kind), **SETTINGS)
    cells = [(w, b) for w in a.workloads for b in a.batches]
    results: dict[tuple[str, int, str], list[tuple[float, float, int]]] = {}
    for rep in tqdm(range(a.reps), desc="repetitions"):
        for w, b in cells:
            model, prompts, params = workloads(b)[w]
            order = modes[w] if rep % 2 == 0 else modes[w][::-1]
            for mode in order:
                llm = engines[model, engine_of[mode]]
                llm.engine.async_scheduling = mode != "ngram-sync"
                results.setdefault((w, b, mode), []).append(run(llm, prompts, params))
    print()
    print("| workload | batch | TPOT base | TPOT ngram | base / ngram | TPOT ngram, "
          "async off | accepted length | TPOT draft model | base / draft | draft accepted "
          "length | tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w, b in cells:
        med = {m: statistics.median(r[0] for r in results[w, b, m]) for m in modes[w]}
        length = {m: statistics.median(r[1] for r in results[w, b, m]) for m in modes[w]}
        tokens = results[w, b, "base"][0][2]
        draft = (f"{med['draft'] * 1e3:.2f} ms | {med['base'] / med['draft']:.2f}x | "
                 f"{length['draft']:.2f}" if "draft" in med else "- | - | -")
        print(f"| {w} | {b} | {med['base'] * 1e3:.2f} ms | {med['ngram'] * 1e3:.2f} ms | "
              f"{med['base'] / med['ngram']:.2f}x | {med['ngram-sync'] * 1e3:.2f} ms | "
              f"{length['ngram']:.2f} | {draft} | {tokens} |")
    print()
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout
          .strip())


if __name__ == "__main__":
    main()
