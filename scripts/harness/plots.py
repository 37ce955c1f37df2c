"""PNG plots of benchmark results (matplotlib, headless): the TTFT CDF per policy (Medha's
Figures 9 and 13), TPOT P50/P90 bars, and latency-against-QPS curves of a load sweep."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from jserve.bench.metrics import ttft


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ttft_cdf(records: Mapping[str, Sequence[dict]], path: str | Path, *, title: str,
             long_prompt_tokens: int) -> None:
    """One panel per group (short, long): the fraction of requests whose first token came
    within x seconds, per policy, on a log x axis. A curve that stops below 1 has requests
    that never got a first token in the run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, group in zip(axes, ("short", "long")):
        for policy, recs in records.items():
            xs = sorted(ttft(r) for r in recs
                        if (r["prompt_tokens"] >= long_prompt_tokens) == (group == "long"))
            if not xs:
                continue
            done = [x for x in xs if not math.isinf(x)]
            ax.step(done, [(i + 1) / len(xs) for i in range(len(done))], where="post",
                    label=f"{policy} ({len(xs) - len(done)} never)" if len(done) < len(xs)
                    else policy)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("TTFT (s)")
        ax.set_title(f"{group} requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tpot_bars(summaries: Mapping[str, dict], path: str | Path, *, title: str) -> None:
    """TPOT P50 and P90 per policy, short and long requests side by side."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    policies = list(summaries)
    keys = [f"{g}_tpot_p{q}" for g in ("short", "long") for q in (50, 90)]
    width = 0.8 / len(keys)
    for k, key in enumerate(keys):
        vals = [summaries[p][key] * 1e3 for p in policies]
        ax.bar([i + k * width for i in range(len(policies))],
               [0 if math.isnan(v) else v for v in vals], width, label=key[:-9] + " "
               + key[-3:].upper())
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(policies))], policies)
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def qps_sweep(rows: Sequence[dict], path: str | Path, *, title: str,
              keys: Sequence[str] = ("short_ttft_p50", "short_ttft_p90"),
              dashed: Sequence[str] = ()) -> None:
    """One panel per key: the metric against QPS, a line per policy (rows carry ``policy``,
    ``qps`` and the keys). Values that never happened are drawn as x at the top of the
    panel (the longest ``window_s``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), sharey=True,
                             squeeze=False)
    top = max(r["window_s"] for r in rows)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for ax, key in zip(axes[0], keys):
        for p in policies:
            pts = sorted((r["qps"], r[key]) for r in rows if r["policy"] == p)
            line, = ax.plot([q for q, _ in pts], [min(v, top) for _, v in pts], marker="o",
                            label=p, linestyle="--" if p in dashed else "-")
            never = [(q, top) for q, v in pts if math.isinf(v)]
            if never:
                ax.plot(*zip(*never), "x", color=line.get_color(), markersize=10)
        ax.set_yscale("log")
        ax.set_xlabel("QPS")
        ax.set_title(key.replace("_", " "))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("seconds (x: never, drawn at the window)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
