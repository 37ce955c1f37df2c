"""The markdown tables of the Medha reproduction page (docs/reproduction.md) from its runs'
result dicts (``harness.medha``)."""
from __future__ import annotations

import math
import re
import textwrap

from jserve.scheduler.registry import SIMULATED_POLICIES as POLICIES


def reflow(text: str, width: int = 96) -> str:
    """Markdown paragraphs and "- " bullets refilled (f-string values break the wrapping)."""
    out = []
    for block in text.strip().split("\n\n"):
        items = re.split(r"\n(?=- )", block)
        for item in items:
            words = " ".join(item.split())
            bullet = words.startswith("- ")
            out.append(textwrap.fill(words, width, subsequent_indent="  " if bullet else "",
                                     break_on_hyphens=False))
        out.append("")
    return "\n".join(out)


def fmt(x: float, digits: int = 2) -> str:
    return "never" if math.isinf(x) else ("-" if math.isnan(x) else f"{x:.{digits}f}")


def ratio(base: float, lars: float) -> str:
    if math.isinf(base):
        return "inf"
    return f"{base / lars:.1f}x" if lars > 0 else "-"


def comparison_table(rows: list[dict]) -> list[str]:
    out = ["| load | requests | system | short TTFT P50 (s) | P90 | P99 | short TPOT P50 (s) "
           "| P90 | short within deadline | long TTFT P50 (s) | long completed "
           "| goodput (req/s) | lars's P50 / P90 / P99 advantage |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lars = next(x for x in rows if x["policy"] == "lars" and x["n"] == r["n"]
                    and x["qps"] == r["qps"])
        adv = " / ".join(ratio(r[f"short_ttft_p{q}"], lars[f"short_ttft_p{q}"])
                         for q in (50, 90, 99)) if r["policy"] != "lars" else ""
        out.append(f"| {r['label']} | {r['n']} | {r['policy']} | " + " | ".join(
            fmt(r[k]) for k in ("short_ttft_p50", "short_ttft_p90", "short_ttft_p99")) + " | "
            + " | ".join(fmt(r[k], 3) for k in ("short_tpot_p50", "short_tpot_p90"))
            + f" | {r['short_attainment']:.1%}"
            + f" | {fmt(r['long_ttft_p50'], 1)} | {r['long_completed']}/{r['long']} "
            f"| {r['goodput_rps']:.3f} | {adv} |")
    return out


def attainment_table(rows: list[dict]) -> list[str]:
    """lars before / after the two changes: TTFT-deadline attainment, TTFT, TPOT, longs."""
    out = ["| load | lars | short within deadline (0.5 s) | long within deadline | short TTFT "
           "P50 / P90 / P99 (s) | short TPOT P50 / P90 (ms) | long TTFT P50 / P90 / max (s) "
           "| long completed |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "now (drain + due first + quick first)" if r["policy"] == "lars" else r["policy"]
        out.append(
            f"| {r['qps']} QPS | {name} | {r['short_attainment']:.1%} | "
            f"{r['long_attainment']:.0%} | "
            + " / ".join(fmt(r[f"short_ttft_p{q}"], 3) for q in (50, 90, 99)) + " | "
            + " / ".join(f"{r[f'short_tpot_p{q}'] * 1e3:.1f}" for q in (50, 90)) + " | "
            + " / ".join(fmt(r[k], 0) for k in ("long_ttft_p50", "long_ttft_p90",
                                                 "long_ttft_max"))
            + f" | {r['long_completed']}/{r['long']} |")
    return out


def times(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def goodput_table(good: dict, sat: dict) -> list[str]:
    out = ["| policy | saturation QPS (time model) | goodput QPS | goodput / saturation | "
           "short within 2 s | long within 2x isolated | TPOT within 0.1 s | vs loongserve "
           "| vs sarathi |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in POLICIES:
        g, at = good[p]["goodput"], good[p]["at_goodput"]
        cells = (" | ".join(f"{at[k]:.1%}" for k in ("short", "long", "tpot")) if at
                 else "- | - | -")
        out.append(f"| {p} | {sat[p]:.3f} | {g:.3f} | {times(g, sat[p]):.0%} | {cells} | "
                   + " | ".join(f"{times(g, good[b]['goodput']):.2f}x"
                                for b in ("loongserve", "sarathi")) + " |")
    return out


def own_load_table(rows: list[dict]) -> list[str]:
    out = ["| policy | QPS (80% of its saturation) | short TTFT P50 / P90 / P99 (s) | "
           "short TPOT P50 / P90 (ms) | long TTFT P50 / P90 (s) | long completed |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: POLICIES.index(r["policy"])):
        out.append(f"| {r['policy']} | {r['qps']:.3f} | "
                   + " / ".join(fmt(r[f"short_ttft_p{q}"], 3) for q in (50, 90, 99)) + " | "
                   + " / ".join(f"{r[f'short_tpot_p{q}'] * 1e3:.1f}" for q in (50, 90)) + " | "
                   + " / ".join(fmt(r[k], 1) for k in ("long_ttft_p50", "long_ttft_p90"))
                   + f" | {r['long_completed']}/{r['long']} |")
    return out


def targets_table(good: dict, sat: dict, at_loong: dict, floor_p50: float,
                  floor_p90: float) -> list[str]:
    """The issue's targets, each met or missed; a missed one shows the bound the time model
    puts on it."""
    lars, loong, sar = (good[p]["goodput"] for p in ("lars", "loongserve", "sarathi"))
    out = ["| target | measured | met | bound where missed |", "|---|---:|---|---|"]
    for name, base, goal in (("loongserve", loong, 1.5), ("sarathi", sar, 2.0)):
        x = times(lars, base)
        bound = (f"lars's goodput cannot pass its saturation {sat['lars']:.3f} QPS: at most "
                 f"{times(sat['lars'], base):.2f}x")
        out.append(f"| lars goodput >= {goal}x {name}'s | {x:.2f}x ({lars:.3f} / {base:.3f} "
                   f"QPS) | {'met' if x >= goal else 'MISSED'} | "
                   f"{'' if x >= goal else bound} |")
    lr, lg = at_loong["lars"], at_loong["loongserve"]
    x90 = times(lg["short_ttft_p90"], lr["short_ttft_p90"])
    out.append(f"| short TTFT P90 >= 10x lower than loongserve's at loongserve's goodput "
               f"({lg['qps']:.3f} QPS) | {x90:.1f}x ({lr['short_ttft_p90']:.3f} / "
               f"{lg['short_ttft_p90']:.3f} s) | {'met' if x90 >= 10 else 'MISSED'} | "
               + ("" if x90 >= 10 else f"the shorts' isolated TTFT P90 on lars's mesh is "
                  f"{floor_p90:.3f} s: at most {times(lg['short_ttft_p90'], floor_p90):.1f}x")
               + " |")
    ok50 = lr["short_ttft_p50"] <= lg["short_ttft_p50"]
    out.append(f"| short TTFT P50 no worse, same load | {lr['short_ttft_p50']:.3f} / "
               f"{lg['short_ttft_p50']:.3f} s | {'met' if ok50 else 'MISSED'} | "
               + ("" if ok50 else f"the shorts' isolated TTFT P50 on lars's mesh is "
                  f"{floor_p50:.3f} s") + " |")
    return out
