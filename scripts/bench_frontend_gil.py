"""What the front end costs the engine thread: the same decode at ``--batch`` rows with no front
end (``LLM.generate`` in its own process) and behind ``jserve serve`` with 0... ``--clients``
concurrent streaming HTTP clients (``/v1/completions``, ``stream: true``; this process is the
clients, the server another), alternated for ``--reps`` rounds after a warm-up.

The engine and its front ends share one Python process, so the event loop's and the intake
threads' Python work takes the GIL from the engine thread. Two figures say how much:

- **engine TPOT**: a request's mean gap between its tokens (first to last token over the
  tokens after the first), taken on the engine thread: the server's
  ``jserve_request_time_per_output_token_seconds``, offline the same from each output's
  ``metrics.token_times``. Every request makes the same tokens, so both are the decode time
  over the tokens, however the steps were cut (single steps or bursts). At ``--batch`` rows
  this is the step time per token as the engine lives it. Its ratio against the offline run is
  what the front end costs the engine, contention for the cores included.
- **front-end CPU**: the CPU seconds of the server's event-loop and intake threads over the
  run's wall time (``/proc/PID/task``): the share of the run those threads were running
  Python, an upper bound on the time they could hold the GIL against the engine thread.

    python scripts/bench_frontend_gil.py [--model bench | default | DIR] [--batch 32]
        [--clients 32,256] [--prompt-len 64] [--max-tokens 64] [--reps 3] [--pin | --split]
        [--switch-interval S] [--engine-process]

``--pin``: the server (every thread) and the offline run on core 0, the clients on core 1, so
the clients' own work takes no cycle from the engine's process; the server's threads then
share one core, where the front end's work and the step's serialize as they would under the
GIL alone. ``--split``: the engine (its thread and XLA's workers; with ``--engine-process``
its whole process) and the offline run on core 0, the front end (the event loop, the intake
and pipe threads) and the clients on core 1: no core is shared between the engine and the
front end, so what the engine still loses is the GIL alone.

``--switch-interval S``: the server and the offline run with ``sys.setswitchinterval(S)``
(Python's default 0.005 s: how long a thread that wants the GIL waits before the holder is
made to drop it).

``--engine-process``: the server runs its engine core in a process of its own
(``jserve serve --engine-process``), where the front end's Python holds no GIL the engine
thread wants; engine TPOT is still the engine thread's, front-end CPU the server process's.

``--model bench``: the transformers-written Llama of ``bench_vs_vllm.py`` (hidden 768, 12
layers, BPE vocabulary of 32,000; ``harness.bench_checkpoint.llama_bpe_checkpoint``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.served import Served, engine_tpot
from jserve.bench.replay import run_http
from jserve.sim.trace import TraceRequest

ENGINE_FLAGS = ("--max-model-len", "1024", "--max-num-batched-tokens", "256")
PER_REQUEST = "jserve_request_time_per_output_token_seconds"


def offline_child(model: str, batch: int, prompt_len: int, max_tokens: int, rounds: int,
                  pin: bool) -> None:
    """Prints one JSON line per round: the mean token gap of ``batch`` greedy requests
    through ``LLM.generate`` (no front end), the first round a warm-up."""
    import random

    if pin:  # before any thread starts: they all inherit it
        os.sched_setaffinity(0, {0})

    from jserve import LLM, SamplingParams
    llm = LLM(model=model, max_num_seqs=batch, max_model_len=1024,
              max_num_batched_tokens=256)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rng = random.Random(0)
    for _ in range(rounds + 1):
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert all(len(o.token_ids) == max_tokens for o in outs)
        t = [o.metrics.token_times for o in outs]
        tpot = statistics.fmean((r[-1] - r[0]) / (len(r) - 1) for r in t)
        print(json.dumps({"engine_tpot": tpot}), flush=True)


def with_path(path: str) -> str:
    """``$PYTHONPATH`` with ``path`` first."""
    return os.pathsep.join([path, *filter(None, [os.environ.get("PYTHONPATH")])])


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread group of server ``pid`` and its engine-core process (with
    ``--engine-process``): the engine thread, the front end (the event loop, the intake
    threads, the pipe's threads on the server's side) and the rest (XLA's workers, the core's
    own reader and loop)."""
    tick = os.sysconf("SC_CLK_TCK")
    groups = {"engine": 0.0, "front": 0.0, "other": 0.0}
    for task, group in threads(pid):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        groups[group] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return groups


def threads(pid: int):
    """(/proc task, group) of each thread of server ``pid`` and its children."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for proc in [str(pid), *(children.read_text().split() if children.exists() else [])]:
        for task in Path(f"/proc/{proc}/task").iterdir():
            try:
                comm = (task / "comm").read_text().strip()
            except OSError:
                continue
            front = proc == str(pid) and (task.name == proc or comm.startswith(
                ("jserve-intake", "jserve-core")))
            yield task, ("engine" if comm == "jserve-engine" else "front" if front
                               else "other")


def pin(pid: int, split: bool) -> None:
    """Every thread of server ``pid`` and its engine-core process on core 0; with ``split``
    the front end's threads (``thread_cpu``'s) on core 1 instead."""
    for task, group in threads(pid):
        os.sched_setaffinity(int(task.name), {1} if split and group == "front" else {0})


def served_round(served: Served, clients: int, prompt_len: int, max_tokens: int) -> dict:
    trace = [TraceRequest(str(i), 0.0, prompt_len, max_tokens) for i in range(clients)]
    pid = served.proc.pid
    before, cpu0, t = engine_tpot(served.url, PER_REQUEST), thread_cpu(pid), time.perf_counter()
    records = asyncio.run(run_http(served.url, trace, progress=False))
    wall, cpu1 = time.perf_counter() - t, thread_cpu(pid)
    after = engine_tpot(served.url, PER_REQUEST)
    assert all(r["error"] is None and r["output_tokens"] == max_tokens for r in records)
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    front = cpu["front"]
    return {"engine_tpot": (after[0] - before[0]) / max(1.0, after[1] - before[1]),
            "front_cpu": front / wall, "front_per_token": front / (clients * max_tokens),
            "engine_cpu": cpu["engine"] / wall, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--batch", type=int, default=32, help="max_num_seqs")
    ap.add_argument("--clients", default="32,256")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pin", action="store_true", help="server on core 0, clients on core 1")
    ap.add_argument("--split", action="store_true",
                    help="engine on core 0, front end and clients on core 1")
    ap.add_argument("--switch-interval", type=float, default=None)
    ap.add_argument("--engine-process", action="store_true",
                    help="the server with its engine core in a process of its own")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.model == "bench":
        from harness.bench_checkpoint import llama_bpe_checkpoint
        a.model = str(llama_bpe_checkpoint())
    if a.child:
        return offline_child(a.model, a.batch, a.prompt_len, a.max_tokens, a.reps,
                             a.pin or a.split)
    clients = [int(c) for c in a.clients.split(",")]
    if a.switch_interval is not None:  # both processes set it at start (sitecustomize)
        site = Path(tempfile.mkdtemp())
        (site / "sitecustomize.py").write_text(
            f"import sys\nsys.setswitchinterval({a.switch_interval!r})\n")
        os.environ["PYTHONPATH"] = with_path(str(site))
    offline = subprocess.Popen(
        [sys.executable, __file__, "--child", "--model", a.model, "--batch", str(a.batch),
         "--prompt-len", str(a.prompt_len), "--max-tokens", str(a.max_tokens),
         "--reps", str(a.reps), *(["--pin"] if a.pin or a.split else [])],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": with_path(str(Path(__file__).parent))})
    # The offline child first, alone (its rounds run back to back); then the server's.
    base = [json.loads(line)["engine_tpot"] for line in offline.stdout][1:]
    assert offline.wait() == 0 and len(base) == a.reps
    served = Served("--model", a.model, "--max-num-seqs", str(a.batch), *ENGINE_FLAGS,
                    "--log-level", "WARNING", *(["--engine-process"] if a.engine_process
                                                else []), warmup=True)
    if a.pin or a.split:
        pin(served.proc.pid, a.split)
        os.sched_setaffinity(0, {1})
    rounds: dict[int, list[dict]] = {c: [] for c in clients}
    try:
        for rnd in range(a.reps + 1):  # round 0 warms the server's paths and is dropped
            for c in clients:
                got = served_round(served, c, a.prompt_len, a.max_tokens)
                if rnd:
                    rounds[c].append(got)
    finally:
        served.stop(30)
    off = statistics.median(base)
    print(f"{a.model}: batch {a.batch}, {a.prompt_len} prompt + {a.max_tokens} generated "
          f"tokens each, greedy; median of {a.reps} rounds; {os.cpu_count()} cores"
          f"{' (server on core 0, clients on core 1)' if a.pin else ''}"
          f"{' (engine on core 0, front end and clients on core 1)' if a.split else ''}"
          f"{f'; switch interval {a.switch_interval} s' if a.switch_interval else ''}"
          f"{'; engine core in its own process' if a.engine_process else ''}; "
          f"load {os.getloadavg()[0]:.1f}")
    print("| front end | clients | engine TPOT | vs offline | front-end CPU / wall "
          "| front-end CPU / token | engine thread CPU / wall |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| none (LLM.generate) | 0 | {off * 1e3:.1f} ms | 1.00x | | | |")
    for c, rs in rounds.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| HTTP, streaming | {c} | {med['engine_tpot'] * 1e3:.1f} ms | "
              f"{med['engine_tpot'] / off:.2f}x | {100 * med['front_cpu']:.1f}% | "
              f"{med['front_per_token'] * 1e6:.0f} us | {100 * med['engine_cpu']:.1f}% |")
    print("every round's engine TPOT vs offline: " + "; ".join(
        f"{c} clients " + " ".join(f"{r['engine_tpot'] / off:.2f}" for r in rs)
        for c, rs in rounds.items()))


if __name__ == "__main__":
    main()
