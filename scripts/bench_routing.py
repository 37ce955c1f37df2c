"""Routing across replicas, compared per router: live on this machine and simulated at scale.

    python scripts/bench_routing.py live [--requests 48] [--qps 3] [--reps 3]
    python scripts/bench_routing.py sim  [--requests 600] [--qps 20]
    python scripts/bench_routing.py all  (both; writes docs/scale_out/bench_routing.json)

(a) live: two ``jserve serve`` replicas (the built-in model, small batches) on loopback; a
heterogeneous open-loop trace (Poisson arrivals): documents of ~1,200 tokens each asked three
times (shared prefixes) among short chats. Routers: ``round_robin``, ``least_load``,
``prefix``, ``deadline`` (``jserve.routing.choose`` on each replica's ``/v1/route/wait`` answer,
asked per request by this script's router, which then streams from the chosen replica), and
``smg`` (SGLang's gateway, ``--policy cache_aware``). Each router runs ``--reps`` times with
fresh document texts (the replicas' caches never hold an earlier run's documents); the figures
are the medians over repetitions of: short-request TTFT P50 / P90, short SLO attainment (TTFT
within ``--short-slo``), and the prefix hit rate (prompt tokens found cached / looked up, from
the replicas' ``vllm:prefix_cache_*`` counters).

(b) sim: 4 replicas of Llama-3 8B on TP8 x SPP2 A100 meshes (64 GPUs) behind each router
(``jserve.sim.cluster``), once per replica scheduler (``--replica-policies``: ``lars-ss``, and
``sarathi``, the FIFO chunked prefill of vLLM-like replicas) and share of long documents
(``--long-fractions``: 5%, the Medha-scale trace, and 1%); the trace is
``harness.workload``'s ShareGPT4 chats with Medha-SWE-like 128K-1M documents, with half
of every chat of 256+ tokens a shared system prompt (8 of them; prefix caching on). Each
router's goodput: the highest QPS (geometric bisection to ``--rel-tol``) at which 90% of short
requests meet their TTFT deadline (the deadline policies' default, max(1.5 x isolated prefill,
0.5 s)); then every router's row (TTFT, short and long attainment) at the best load- or
prefix-based router's goodput.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.routing_live import live  # noqa: E402
from harness.routing_sim import sim, table  # noqa: E402
from jserve.routing import ROUTERS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", choices=("live", "sim", "all"))
    p.add_argument("--requests", type=int, default=48, help="live: requests a run")
    p.add_argument("--qps", type=float, default=3.0, help="live: Poisson arrival rate")
    p.add_argument("--reps", type=int, default=3, help="live: runs per router (median)")
    p.add_argument("--short-slo", type=float, default=0.25, help="live: short TTFT SLO (s)")
    p.add_argument("--sim-requests", type=int, default=600)
    p.add_argument("--replica-policies", default="lars-ss,sarathi",
                   help="sim: each replica's scheduler (comma list; one table each)")
    p.add_argument("--long-fractions", default="0.05,0.01",
                   help="sim: shares of 128K-1M-token documents (comma list)")
    p.add_argument("--lo", type=float, default=2.0, help="sim: goodput search's first bracket")
    p.add_argument("--table-qps", type=float, default=None,
                   help="sim: only each router's row at this rate (no goodput search)")
    p.add_argument("--hi", type=float, default=8.0)
    p.add_argument("--rel-tol", type=float, default=0.1, help="sim: goodput resolution (ratio)")
    p.add_argument("--seeds", default="0",
                   help="sim: trace seeds (comma list); every probe runs each, figures are means")
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help="sim: routers to compare (comma list); 'pooled' adds one replica with "
                   "the cluster's compute, KV and slots")
    p.add_argument("--out", default=str(ROOT / "docs" / "scale_out" / "bench_routing.json"))
    a = p.parse_args()
    a.seeds = [int(x) for x in a.seeds.split(",")]
    # A run of one part keeps the other part's last figures in the file.
    prev = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    out = {"command": " ".join(["python", "scripts/bench_routing.py", *sys.argv[1:]]),
           "uptime_before": os.popen("uptime").read().strip()}
    out.update({k: prev[k] for k in ("live", "sim") if k in prev and a.what not in (k, "all")})
    if a.what in ("live", "all"):
        out["live"] = live(a)
        print(table(out["live"]["table"], ["short_ttft_p50", "short_ttft_p90",
                                           "short_attainment", "prefix_hit_rate"]))
    if a.what in ("sim", "all"):
        out["sim"] = sim(a)
        for name, c in out["sim"]["configs"].items():
            print(f"{name} (rows at {c['table_qps']:.2f} req/s)")
            print(table(c["table"], ["short_ttft_p50", "short_ttft_p90", "short_attainment",
                                    "long_attainment", "missed_with_slots_full",
                                    "missed_with_long_everywhere", "goodput_qps"]))
    out["uptime_after"] = os.popen("uptime").read().strip()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
