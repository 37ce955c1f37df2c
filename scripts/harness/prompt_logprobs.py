"""What prompt logprobs add to a prefill (``SamplingParams.prompt_logprobs``,
jserve/engine/requests/prompt_logprobs.py): one engine, one prompt in one chunk, the same prefill
without them and with ``prompt_logprobs=k`` for each ``k`` of ``tops`` (0: each token's own
logprob and rank, the LM head over the step's tokens, a log-sum-exp and a gather; 1: the best
alternative too, a max, what lm-eval's ``logprobs: 1`` asks; more: the top 20, a sort).

Two things timed per mode, the modes alternating rep by rep after a warm-up of each:
- ``request``: one request of ``max_tokens=1`` from ``add_request`` to its finish,
  synchronous (no step overlapped with it), prefix caching off (every rep computes the whole
  prompt): the host's share included (reading the entries back, making ``TokenLogprob``s).
- ``step``: the step's executable alone, replayed on the packed buffers the engine built
  for that request (blocking on its outputs): the device's share.
Each in wall time and in this process's CPU time (``time.process_time``: every thread's,
XLA's included), median over the reps: on a machine shared with other jobs the wall time
swings with their load, the CPU time much less (it counts the work, not the waiting); on an
idle machine the two agree. ``head_share`` (the LM head's FLOPs over the prompt against the
prefill's) is the floor of any exact method: every position's logprob needs its
full-vocabulary log-sum-exp, so the head's matmul over every prompt token."""
from __future__ import annotations

import os
import statistics
import time

import jax
import numpy as np

from harness.flops import prefill_flops
from jserve import LLM, SamplingParams


def _request(eng, prompt: list[int], params: SamplingParams) -> tuple[float, float]:
    """(wall, CPU) seconds of the request."""
    t0, c0 = time.perf_counter(), time.process_time()
    eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0, time.process_time() - c0


def _buffers(eng, prompt: list[int], params: SamplingParams) -> tuple:
    """The (shape, int buffer, float buffer) of the request's prefill step."""
    runner, seen = eng.runner, []
    run = runner.execute_packed

    def keep(shape, ibuf, fbuf, *args, **kw):
        seen.append((shape, np.array(ibuf), np.array(fbuf)))
        return run(shape, ibuf, fbuf, *args, **kw)
    runner.execute_packed = keep
    try:
        _request(eng, prompt, params)
    finally:
        runner.execute_packed = run
    return seen[0]


def _step(runner, shape, ibuf, fbuf) -> tuple[float, float]:
    """(wall, CPU) seconds of the step's executable, to its outputs."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = runner.execute_packed(shape, ibuf, fbuf)
    jax.block_until_ready((out.tokens, runner.last_prompt_logprobs))
    return time.perf_counter() - t0, time.process_time() - c0


def measure(model: str, prompt_len: int = 1536, reps: int = 9,
            tops: tuple[int, ...] = (0, 1, 5)) -> dict:
    """Per mode, the request's and the step's median seconds (wall, CPU) on ``model``."""
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=prompt_len, max_prefill_seqs=1,
              max_model_len=prompt_len + 16, enable_prefix_caching=False,
              async_scheduling=False, warmup=False)
    eng, cfg = llm.engine, llm.engine.model_config
    vocab = eng.tokenizer.vocab_size if eng.tokenizer is not None else cfg.vocab_size
    prompt = np.random.default_rng(0).integers(3, min(vocab, cfg.vocab_size),
                                               prompt_len).tolist()
    greedy = dict(temperature=0.0, max_tokens=1, ignore_eos=True)
    modes = {"plain": SamplingParams(**greedy)} | {
        f"prompt_logprobs={k}": SamplingParams(**greedy, prompt_logprobs=k) for k in tops}
    bufs = {m: _buffers(eng, prompt, p) for m, p in modes.items()}  # compiles, warms up
    for p in modes.values():
        _request(eng, prompt, p)
    times: dict[str, dict[str, list]] = {m: {"request": [], "step": []} for m in modes}
    for _ in range(reps):
        for m, p in modes.items():
            times[m]["request"].append(_request(eng, prompt, p))
            times[m]["step"].append(_step(eng.runner, *bufs[m]))
    stats = {m: {k: tuple(statistics.median(x[i] for x in v) for i in (0, 1))
                 for k, v in t.items()} for m, t in times.items()}
    head = 2.0 * prompt_len * cfg.hidden_size * cfg.vocab_size
    return {"model": model, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "layers": cfg.num_hidden_layers, "prompt_len": prompt_len,
            "step_shape": list(bufs["plain"][0]), "reps": reps, "seconds": stats,
            "times_s": times, "head_share": head / prefill_flops(cfg, prompt_len),
            "loadavg": os.getloadavg()}


def table(results: list[dict]) -> str:
    """A markdown table of ``measure`` results: median ms (wall, CPU) and what each mode
    adds to the plain prefill (by each)."""
    lines = ["| model (vocab) | timed | mode | wall ms | CPU ms | added (wall) "
             "| added (CPU) |", "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        for kind in ("request", "step"):
            base = r["seconds"]["plain"][kind]
            for mode, s in r["seconds"].items():
                wall, cpu = s[kind]
                added = ("" if mode == "plain" else
                         f"{(wall / base[0] - 1) * 100:+.1f}% | {(cpu / base[1] - 1) * 100:+.1f}%")
                lines.append(f"| {os.path.basename(r['model'])} ({r['vocab_size']}) | {kind} "
                             f"| {mode} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | "
                             f"{added or ' | '} |")
        lines.append(f"| {os.path.basename(r['model'])} | LM head / prefill FLOPs | "
                     f"| {r['head_share'] * 100:.1f}% | | | |")
    return "\n".join(lines)
