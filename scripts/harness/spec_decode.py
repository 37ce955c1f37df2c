"""Speculative decoding against plain decoding, side by side in one run
(``scripts/bench_speculative.py``): TPOT and mean accepted length per workload and batch, the
modes alternating within each repetition; the workloads and engine settings are shared with
``scripts/profile_speculative.py``."""
from __future__ import annotations

import statistics

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


def bench(a) -> None:
    """Every (workload, batch) cell in every mode, ``a.reps`` times, then the table.
    ``a``: ``scripts/bench_speculative.py``'s flags."""
    modes = {w: ["base", "ngram", "ngram-sync"] + (["draft"] if w == "countdown"
                                                    and a.draft_model else [])
             for w in a.workloads}
    cells = [(w, b) for w in a.workloads for b in a.batches]
    results = measure(a, modes, cells)
    print_table(results, modes, cells)


def measure(a, modes: dict[str, list[str]], cells: list[tuple[str, int]]
            ) -> dict[tuple[str, int, str], list[tuple[float, float, int]]]:
    """(TPOT, accepted length, tokens) of every run, by (workload, batch, mode)."""
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": a.k,
                         "prompt_lookup_max": 4, "prompt_lookup_min": 1},
               "draft": {"method": "draft_model", "model": a.draft_model,
                         "num_speculative_tokens": a.k}}
    engine_of = {"base": "base", "ngram": "ngram", "ngram-sync": "ngram", "draft": "draft"}
    wanted = sorted({(workloads(1)[w][0], engine_of[m])
                     for w in a.workloads for m in modes[w]})
    engines: dict[tuple[str, str], LLM] = {}
    for model, kind in tqdm(wanted, desc="engines (compiling)"):
        engines[model, kind] = LLM(model, speculative_config=configs.get(kind), **SETTINGS)
    results: dict[tuple[str, int, str], list[tuple[float, float, int]]] = {}
    for rep in tqdm(range(a.reps), desc="repetitions"):
        for w, b in cells:
            model, prompts, params = workloads(b)[w]
            order = modes[w] if rep % 2 == 0 else modes[w][::-1]
            for mode in order:
                llm = engines[model, engine_of[mode]]
                llm.engine.async_scheduling = mode != "ngram-sync"
                results.setdefault((w, b, mode), []).append(run(llm, prompts, params))
    return results


def print_table(results: dict, modes: dict[str, list[str]], cells: list[tuple[str, int]]
                ) -> None:
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
