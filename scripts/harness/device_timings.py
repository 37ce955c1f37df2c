"""The device check's engine timings on random weights (not judged): decode step time at each
batch with and without decode bursts (MBU), a prompt prefilled in one chunk (MFU), and a long
prompt prefilled in small against large chunks."""
from __future__ import annotations

import statistics
import traceback

import numpy as np

from harness.device_profiles import Profile, llama_cfg, ratio
from harness.device_report import error_text, fmt_pct, say
from harness.flops import kv_bytes_per_token, prefill_flops, weight_bytes_read
from harness.random_engine import free_memory, make_engine, random_params, twice
from jserve.sampling.params import SamplingParams


def decode_timing(p: Profile, name: str, cfg, engine, impl: str, peaks, b: int,
                  rng: np.random.Generator, burst: int = 1) -> dict:
    """Batch b of ``decode_prompt``-token prompts, ``decode_tokens`` greedy tokens each: the
    step times of the steps where all b sequences decode and nothing prefills. ``burst`` > 1:
    with decode bursts of that many steps (``EngineConfig.decode_burst``), the times of the
    bursts over their steps."""
    prompts = rng.integers(3, cfg.vocab_size, (b, p.decode_prompt)).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=p.decode_tokens, ignore_eos=True)
    engine.bursts.steps = burst
    try:
        _, log, compiles = twice(engine, prompts, greedy,
                                 f"{name} decode b={b}" + (f" bursts of {burst}" if burst > 1
                                                           else ""))
    finally:
        engine.bursts.steps = 1
    steps = [(plan, s / plan.burst) for plan, s in log
             if not plan.prefills and len(plan.decodes) == b and plan.burst == burst]
    if not steps:
        raise RuntimeError(f"no step had all {b} sequences decoding")
    # Context a decode attends to: its position + 1 (ScheduledChunk.start; if the plan
    # stops saying, the mean over the decode phase).
    approx = b * (p.decode_prompt + p.decode_tokens / 2)
    ctx = statistics.mean(
        sum(c.start + 1 for c in plan.decodes)
        if all(hasattr(c, "start") for c in plan.decodes) else approx for plan, _ in steps)
    step = statistics.median(s for _, s in steps)
    w_bytes = weight_bytes_read(cfg)
    kv = ctx * kv_bytes_per_token(cfg)
    row = dict(model=name, impl=impl, batch=b, burst=burst, prompt=p.decode_prompt,
               new_tokens=p.decode_tokens, max_model_len=engine.max_model_len,
               steps_timed=len(steps), mean_context=ctx / b, step_ms=step * 1e3,
               tok_s=b / step, weight_gb=w_bytes / 1e9, kv_gb=kv / 1e9,
               tbps=(w_bytes + kv) / step / 1e12, mbu=ratio((w_bytes + kv) / step, peaks[1]),
               compiles_while_timed=compiles, **_prediction(engine, cfg, b, kv, peaks))
    predicted = row.get("predicted_ms")
    say(f"  decode {name} b={b} burst {burst}: {row['step_ms']:.2f} ms/step "
        f"(predicted {'-' if predicted is None else f'{predicted:.2f}'}: "
        f"{row.get('launches')} launches, {row.get('host_syncs')} host syncs), "
        f"{row['tok_s']:.1f} tok/s, "
        f"{row['tbps']:.3g} TB/s, MBU {fmt_pct(row['mbu'])}")
    return row


def _prediction(engine, cfg, b: int, kv_read: float, peaks) -> dict:
    """The decode step's roofline from its compiled program (``jserve.targets``), before
    the timing confirms or refutes it; {} when the step was not compiled up front."""
    from jserve.targets.programs import predict

    programs = engine.runner.programs
    entry = programs.steps.get(engine.buckets.shape_for(b, 0))
    if entry is None:
        return {}
    return predict(entry[0], cfg, engine.runner.kv_cache, peaks[1], peaks[0], kv_read,
                   engine.runner.params)


def prefill_timing(p: Profile, name: str, cfg, engine, impl: str, peaks, prompt_len: int,
                   chunk: int, rng: np.random.Generator) -> dict:
    """One prompt of ``prompt_len`` tokens, one new token, chunks of ``chunk`` tokens (the
    engine's token budget): the summed step times of its prefill."""
    prompt = rng.integers(3, cfg.vocab_size, prompt_len).tolist()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    _, log, compiles = twice(engine, [prompt], one, f"{name} prefill {prompt_len}/{chunk}")
    secs = sum(s for _, s in log)
    flops = prefill_flops(cfg, prompt_len)
    row = dict(model=name, impl=impl, prompt=prompt_len, chunk=chunk, steps=len(log),
               seconds=secs, tok_s=prompt_len / secs, tflops=flops / secs / 1e12,
               mfu=ratio(flops / secs, peaks[0]), compiles_while_timed=compiles)
    say(f"  prefill {name} {prompt_len} tokens in chunks of {chunk}: {secs * 1e3:.1f} ms, "
        f"{row['tok_s']:.0f} tok/s, {row['tflops']:.3g} TFLOP/s, MFU {fmt_pct(row['mfu'])}")
    return row


class ModelTimings:
    """One timing model's measurements as separate steps (the budgeted run's items): its
    random weights and engine are made on first use and kept for the next measurement until
    ``close``; each measurement appends its row to ``out`` and, failing, its error to
    ``out["errors"]`` before raising. The engine compiles its whole program set at start
    (``warmup``, on a thread pool) unless ``warmup`` is "none"."""

    def __init__(self, p: Profile, name: str, impl: str, peaks, seed: int, out: dict,
                 warmup: str = "all", layer_loop: str = "auto"):
        self.p, self.name, self.impl, self.peaks, self.seed, self.out = (p, name, impl, peaks,
                                                                         seed, out)
        self.cfg = llama_cfg(**p.timing_models[name])
        self.warmup, self.layer_loop = warmup, layer_loop
        self.rng = np.random.default_rng(seed)
        self.params = self.engine = None

    def _pages(self, n: int) -> int:
        return -(-n // self.p.page)

    def _attempt(self, what: str, fn):
        try:
            return fn()
        except Exception as e:
            self.out["errors"].append(f"{self.name} {what}: {error_text(e)}")
            say(f"  {self.name} {what} failed: {error_text(e)}")
            raise

    def _weights(self):
        if self.params is None:
            cfg = self.cfg
            say(f"timings: {self.name} ({cfg.num_hidden_layers} layers, hidden "
                f"{cfg.hidden_size}, {cfg.num_attention_heads}/{cfg.num_key_value_heads} "
                f"heads, head_dim {cfg.head_dim}, {cfg.dtype}, attention {self.impl})")
            self.params = self._attempt("weights", lambda: random_params(cfg, self.seed))
        return self.params

    def _engine(self):
        """The decode engine (token budget ``prefill_len``: it serves the one-chunk prefill
        too), built on first use."""
        if self.engine is None:
            p = self.p
            need = max(max(p.decode_batches) * self._pages(p.decode_prompt + p.decode_tokens),
                       self._pages(p.prefill_len) + 1)
            params = self._weights()
            self.engine = self._attempt("engine", lambda: make_engine(
                self.cfg, params, self.impl, max_num_seqs=max(p.decode_batches),
                max_num_batched_tokens=p.prefill_len, max_prefill_seqs=4,
                max_model_len=p.decode_max_model_len, page_size=p.page,
                num_kv_pages=need + 2, warmup=self.warmup, decode_burst=p.decode_burst,
                layer_loop=self.layer_loop))
            say(f"  {self.name} engine: {self.engine.startup.line()}")
        return self.engine

    def decode(self, b: int, burst: int = 1) -> None:
        row = self._attempt(f"decode b={b} burst {burst}", lambda: decode_timing(
            self.p, self.name, self.cfg, self._engine(), self.impl, self.peaks, b, self.rng,
            burst))
        if self.layer_loop != "auto":
            row["layer_loop"] = self.layer_loop
        self.out["decode"].append(row)

    def prefill(self) -> None:
        n = self.p.prefill_len
        self.out["prefill"].append(self._attempt(f"prefill {n}", lambda: prefill_timing(
            self.p, self.name, self.cfg, self._engine(), self.impl, self.peaks, n, n,
            self.rng)))

    def close(self) -> None:
        """Drops the engine and weights (their device memory goes before the next model)."""
        self.engine = self.params = None
        free_memory()

    def chunked(self) -> None:
        """The long prompt prefilled in each chunk size, one engine each (the decode engine
        is dropped first), and the small-against-large row."""
        p, chunks = self.p, {}
        self.engine = None
        long_len = p.chunk_context + p.page
        for chunk in p.chunk_sizes:
            def run(chunk=chunk):
                eng = make_engine(self.cfg, self._weights(), self.impl, max_num_seqs=1,
                                  max_num_batched_tokens=chunk, max_prefill_seqs=1,
                                  max_model_len=long_len, page_size=p.page,
                                  num_kv_pages=self._pages(long_len) + 3)
                return prefill_timing(p, self.name, self.cfg, eng, self.impl, self.peaks,
                                      p.chunk_context, chunk, self.rng)
            chunks[chunk] = self._attempt(f"prefill {p.chunk_context} in chunks of {chunk}",
                                          run)
            self.out["prefill"].append(chunks[chunk])
            free_memory()
        lo, hi = min(chunks), max(chunks)
        self.out["chunked"].append(dict(
            model=self.name, context=p.chunk_context, small_chunk=lo, big_chunk=hi,
            small_s=chunks[lo]["seconds"], big_s=chunks[hi]["seconds"],
            slowdown=chunks[lo]["seconds"] / chunks[hi]["seconds"]))


def model_timings(p: Profile, name: str, impl: str, peaks, seed: int, out: dict) -> None:
    """Every figure of one model into ``out`` (decode at each batch with and without
    bursts, the one-chunk prefill, the chunked long prefill); a failed measurement is in
    ``out["errors"]`` and the others still run."""
    m = ModelTimings(p, name, impl, peaks, seed, out)
    steps = [lambda b=b, burst=burst: m.decode(b, burst) for b in p.decode_batches
             for burst in (1, p.decode_burst)] + [m.prefill, m.chunked]
    for step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - recorded in out["errors"]; the others still run
            traceback.print_exc()
    m.close()


def timings(p: Profile, impl: str, peaks, seed: int, models: list[str]) -> dict:
    out = dict(impl=impl, decode=[], prefill=[], chunked=[], errors=[])
    for name in models:
        model_timings(p, name, impl, peaks, seed, out)
        free_memory()
    return out
