"""Medha's figures on the simulator, against the LoongServe baseline (jserve.sim.loongserve) and
the vLLM-like baseline (``sarathi``: FCFS chunked prefill, 512-token chunks) on the same 16
A100s: writes docs/reproduction.md (tables beside the paper's numbers) and its PNGs. Every
figure and every sentence with a number in the generated page comes from this run; the
hand-written parts are the model description and a section marked commentary.

    python scripts/medha_reproduction.py                 # ~15-25 min on 2 busy cores
    python scripts/medha_reproduction.py --quick         # 300 requests, for a look

1. Goodput of every simulated policy and both baselines (jserve.sim.goodput): the highest
   QPS, by bisection on one trace, at which 90% of short requests meet a 2 s TTFT deadline,
   90% of long ones 2x their isolated TTFT, and 90% of all a 0.1 s TPOT;
2. short TTFT P50/P90/P99 at 80% of each policy's own saturation QPS (time model,
   jserve.sim.capacity), and lars against LoongServe at LoongServe's goodput;
3. the three systems at 80% of the lowest saturation and at the paper's 0.75 QPS, and
   lars's TTFT-deadline attainment with each of its ordering rules off;
4. 1M-token prefill time against SPP degree; decode TPOT at long context against KVP
   degree (Llama-3 70B, H100, TP8, from the time model); the time model's error against
   held-out rows of the Vidur per-op profiles.
Long requests are synthetic (Medha-SWE is not public): log-normal on its published P50/P90.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from harness.medha import attainment_rows, load
from harness.medha_page import write
from harness.medha_tables import attainment_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="300 requests instead of 1000")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--out-dir", type=Path, default=Path("docs"), help="where reproduction.md goes")
    ap.add_argument("--attainment-only", action="store_true",
                    help="only lars's TTFT-deadline attainment with each rule off (~1 min); "
                         "prints its table, writes nothing")
    a = ap.parse_args()
    ld = load(300 if a.quick else 1000, a.seed)
    if a.attainment_only:
        rows = attainment_rows(ld, a.jobs)
        print(f"{ld.n} requests, seed {a.seed}; {ld.qps} QPS is 80% of saturation")
        print("\n".join(attainment_table(rows)))
        return
    print(write(ld, a.jobs, a.out_dir, a.quick))


if __name__ == "__main__":
    main()
