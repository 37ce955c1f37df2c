"""XLA:CPU flags against none, on the decode step's share of the matmul ceiling.

    python scripts/profile_xla_flags.py [--batch 32] [--rounds 3] [--reps 3]
                                        [--flag=--xla_... ...]

XLA reads its flags once, when the backend starts, so each setting needs its own process.
Each round runs ``profile_step.py --batch B --reps R`` once per setting (no flag first,
then each ``--flag``), in the same order every round, so a change of machine load
reaches all settings alike; the report is the median over rounds of each setting's shares
(wall and CPU) of the ceiling that run measured itself. ``uptime`` is printed at start and
end.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

DEFAULT_FLAGS = (
    "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "--xla_cpu_experimental_ynn_fusion_type=+eltwise,+reduce",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
)
ROWS = ("engine step (async)", "device-only step", "step executable alone")
_ROW = re.compile(r"^\s+(.+?)\s+([\d.]+) ms\s+([\d.]+)%\s+CPU\s+([\d.]+) ms\s+([\d.]+)%")
_CEILING = re.compile(r"ceiling ([\d.]+) GFLOP/s wall, ([\d.]+) per CPU second")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run_once(flag: str, batch: int, reps: int) -> dict[str, tuple[float, float, float, float]]:
    """{row: (wall ms, wall share %, CPU ms, CPU share %)} and the ceiling, for one process
    with ``flag`` appended to XLA_FLAGS."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(here / "profile_step.py"), "--batch", str(batch),
                          "--reps", str(reps)], capture_output=True, text=True, env=env,
                         cwd=here.parent)
    if out.returncode:
        raise RuntimeError(f"profile_step failed with XLA_FLAGS={env['XLA_FLAGS']!r}:\n"
                           f"{out.stderr[-2000:]}")
    rows = {}
    for line in out.stdout.splitlines():
        if (m := _CEILING.search(line)):
            rows["ceiling GFLOP/s"] = (float(m.group(1)), 0.0, float(m.group(2)), 0.0)
        elif (m := _ROW.match(line)) and m.group(1) in ROWS:
            rows[m.group(1)] = tuple(float(m.group(i)) for i in range(2, 6))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batch", type=int, default=32, help="decode rows")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all settings")
    ap.add_argument("--reps", type=int, default=3, help="profile_step repetitions per process")
    ap.add_argument("--flag", action="append", default=None,
                    help="a setting to compare with none (one XLA_FLAGS addition; repeat the "
                         "option for several; write it --flag=--xla_...); default: "
                         + " ".join(DEFAULT_FLAGS))
    a = ap.parse_args()
    print(f"load at start: {uptime()}")
    settings = [""] + (a.flag or list(DEFAULT_FLAGS))
    results: dict[str, list[dict]] = {s: [] for s in settings}
    with tqdm(total=a.rounds * len(settings), desc="processes", unit="run") as bar:
        for _ in range(a.rounds):
            for s in settings:
                results[s].append(run_once(s, a.batch, a.reps))
                bar.update()
    print(f"batch {a.batch}, median of {a.rounds} processes per setting "
          f"(wall ms, share of ceiling; CPU ms, share)")
    for s in settings:
        print(f"{s or '(no flag)'}")
        for row in ("ceiling GFLOP/s",) + ROWS:
            v = np.median([r[row] for r in results[s]], axis=0)
            if row.startswith("ceiling"):
                print(f"  {row:24s} {v[0]:7.1f} wall, {v[2]:.1f} per CPU second")
            else:
                print(f"  {row:24s} {v[0]:7.2f} ms {v[1]:5.1f}%   CPU {v[2]:7.2f} ms {v[3]:5.1f}%")
    print(f"load at end: {uptime()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
