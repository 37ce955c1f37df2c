"""What the gRPC layer costs: the same batch of greedy requests through ``LLM.generate`` and
through ``jserve serve`` (a subprocess with the same engine settings; loopback; one streaming
call per request, all at once). Each side runs ``--repeats`` times after one warm-up run
(which compiles the shapes it meets) and the best run is reported: the machine is shared.

    python scripts/bench_server.py [--requests 64] [--prompt-len 32] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import sys
import time

from jserve import LLM, SamplingParams
from jserve.client import AsyncClient


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    engine = dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=128, max_model_len=512)
    llm = LLM("default", warmup=False, **engine)

    def offline() -> float:
        t = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t

    offline()
    t_offline = min(offline() for _ in range(a.repeats))
    llm = None  # free the offline engine before the server builds its own
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    server = subprocess.Popen([sys.executable, "-m", "jserve.cli", "serve", "--no-warmup",
                               *flags, "--host", "127.0.0.1", "--port", "0",
                               "--metrics-port", "-1", "--log-level", "WARNING"],
                              stdout=subprocess.PIPE, text=True)
    target = "127.0.0.1:" + re.search(r":(\d+) ", server.stdout.readline()).group(1)

    async def served() -> tuple[float, list[float]]:
        async with AsyncClient(target) as c:
            t = time.perf_counter()
            outs = await asyncio.gather(*(c.generate(p, params) for p in prompts))
            wall = time.perf_counter() - t
        assert all(len(o.token_ids) == a.max_tokens for o in outs)
        return wall, [o.timings["time_to_first_token"] for o in outs]

    try:
        asyncio.run(served())
        runs = [asyncio.run(served()) for _ in range(a.repeats)]
        print("gRPC runs (s):", " ".join(f"{w:.2f}" for w, _ in runs))
        t_served, ttfts = min(runs)
    finally:
        server.terminate()
        server.wait()
    tokens = a.requests * a.max_tokens
    print(f"{a.requests} requests x {a.prompt_len} prompt + {a.max_tokens} generated tokens, "
          f"max_num_seqs={a.max_num_seqs}")
    print(f"offline LLM.generate : {t_offline:6.2f} s  {tokens / t_offline:7.0f} tok/s")
    print(f"gRPC, 1 stream each  : {t_served:6.2f} s  {tokens / t_served:7.0f} tok/s  "
          f"({t_served / t_offline:.2f}x offline wall time)")
    print(f"server TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms, "
          f"max {max(ttfts) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
