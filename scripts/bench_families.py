"""Per model family: jserve against HF transformers ``generate`` on this CPU, and the KV
pages a 32K-token request holds (windowed families against full attention).

    python scripts/bench_families.py                         # every family, 3 repetitions
    python scripts/bench_families.py --families mistral,gemma3 --reps 5 --out fam.json
    python scripts/bench_families.py --families dense-active,mixtral --prompts 1

Each family's seeded random checkpoint (the same body for all: scripts/harness/families.py) is
written by transformers; 8 prompts of 128 tokens, 32 greedy new tokens each, EOS ignored, run
by jserve (every program compiled first, not timed) and by HF ``generate`` back to back in
each repetition; tokens/s from the medians. The KV pages are the allocator's own count
(``held_pages``) for one request of ``--long-tokens``. Recorded in docs/models.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP


def main() -> int:
    from harness.families import FAMILIES, Workload, run
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8, help="the batch (8 prompts of 128 tokens)")
    p.add_argument("--long-tokens", type=int, default=32768)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    results = run(a.families.split(","), Workload(prompts=a.prompts, reps=a.reps,
                                                      long_tokens=a.long_tokens))
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
