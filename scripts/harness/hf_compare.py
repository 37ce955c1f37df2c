"""jserve against Hugging Face transformers ``generate`` on this CPU (``scripts/bench_engine.py``):
the same seeded random Llama and prompts on both sides; decode and prefill rates, an offline
batch of trace-length requests (jserve's continuous batching against HF's static batches),
and jserve's batch-32 decode step against a compute ceiling.

Import this after setting ``OMP_WAIT_POLICY`` (the script does: torch starts OpenMP here)."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import transformers

from harness import flops as model_flops
from harness.decode_step import MatmulCeiling, step_weights
from jserve.llm import LLM
from jserve.sampling.params import SamplingParams
from jserve.sim.trace import read_lengths

PAD_ID = 0


MODEL_KWARGS = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, intermediate_size=1536,
                    vocab_size=8192, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    bos_token_id=1, eos_token_id=2, pad_token_id=PAD_ID)


@dataclasses.dataclass(frozen=True)
class Settings:
    reps: int
    decode_batches: tuple[int, ...]
    decode_prompt_len: int
    decode_new_tokens: int
    correctness_batch: int
    prefill_batch: int
    prefill_len: int
    offline_requests: int
    length_scale: float
    prompt_clip: tuple[int, int]
    output_clip: tuple[int, int]
    hf_batch: int
    engine: dict
    trace: str = "sharegpt4"  # the offline requests' lengths: a packaged trace or a file
    seed: int = 0
    vocab_size: int = 8192  # the model's (``--vocab``)
    decode_only: bool = False  # decode rates and the ceiling only (``--decode-only``)


def build_model(model_dir: Path, seed: int) -> transformers.LlamaForCausalLM:
    """Seeded random HF Llama, saved for jserve; returned in eval mode for the HF side."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL_KWARGS))
    model = model.to(torch.float32).eval()
    model.save_pretrained(model_dir)
    gc = model.generation_config
    gc.eos_token_id = None  # decode exactly max_new_tokens, like jserve's ignore_eos
    gc.pad_token_id = PAD_ID
    gc.do_sample = False
    return model


def matmul_params_per_token(c: dict) -> int:
    """Matmul parameters one token touches, the lm_head included (the embedding is a
    lookup): ``harness.flops.matmul_params_per_token`` plus the head."""
    head = c["hidden_size"] * c["vocab_size"]
    return model_flops.matmul_params_per_token(SimpleNamespace(**c)) + head


def attention_flops_per_context_token(c: dict) -> int:
    """QK^T and PV for one query token against one cached token, all layers."""
    return int(model_flops.attention_flops(SimpleNamespace(**c), 1, 1))


def describe_model() -> tuple[int, int]:
    c = MODEL_KWARGS
    p = matmul_params_per_token(c)
    a = attention_flops_per_context_token(c)
    print(f"model: LlamaForCausalLM, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
          f"{c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads x "
          f"head_dim {c['head_dim']}, intermediate {c['intermediate_size']}, "
          f"vocab {c['vocab_size']}, float32")
    print(f"  matmul params per token {p / 1e6:.2f}M (lm_head included) -> "
          f"{2 * p / 1e6:.1f} MFLOP per decoded token, + attention {a} FLOP per context token")
    return p, a


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def random_prompts(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    return rng.integers(3, MODEL_KWARGS["vocab_size"], size=(n, length)).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class Jserve:
    """One LLM for the whole run (warm-up compiles every bucket once); counts recompiles.
    Prefix caching is off: the repetitions re-send the same prompts, and HF has no cache."""

    def __init__(self, model_dir: Path, engine_kwargs: dict):
        t0 = time.perf_counter()
        self.llm = LLM(str(model_dir), warmup=True, enable_prefix_caching=False,
                       **engine_kwargs)
        self.start_seconds = time.perf_counter() - t0
        self.compiles_after_warmup = self.llm.engine.compile_count

    def generate(self, prompts, params):
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        return outs, time.perf_counter() - t0

    @property
    def recompiles(self) -> int:
        return self.llm.engine.compile_count - self.compiles_after_warmup


def hf_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy generate; returns (generated ids only, seconds)."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=new_tokens, do_sample=False)
        dt = time.perf_counter() - t0
    gen = out[:, input_ids.shape[1]:]
    assert gen.shape[1] == new_tokens, (gen.shape, new_tokens)
    return gen, dt


def unpadded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(prompts, dtype=torch.long)
    return ids, torch.ones_like(ids)


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def jserve_decode_stats(outs) -> dict:
    """Decode rate as HF's is measured: tokens generated after every request has its first
    token (HF: after generate(1) would return), over the time from then to the last token.
    Also the steady step time while every sequence of the batch is decoding (after the last
    first token, before the first request's last token)."""
    first_all = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.token_times[-1] for o in outs)
    later = sum(t > first_all for o in outs for t in o.metrics.token_times)
    rate = later / (end - first_all)
    t_start = max(o.metrics.token_times[0] for o in outs)
    t_end = min(o.metrics.token_times[-1] for o in outs)
    last = max(outs, key=lambda o: o.metrics.token_times[0]).metrics.token_times
    window = [t for t in last if t_start <= t <= t_end]
    if len(window) >= 2:
        step = (window[-1] - window[0]) / (len(window) - 1)
    else:  # no step with the whole batch decoding: every interval of the last request
        step = median(np.diff(last).tolist())
    return {"rate": rate, "steady_step_s": step}


def measure_decode(js: Jserve, model, s: Settings, batch: int, rng: np.random.Generator,
                   check_tokens: bool) -> dict:
    n = s.decode_new_tokens
    prompts = random_prompts(rng, batch, s.decode_prompt_len)
    ids, mask = unpadded(prompts)
    js_rates, js_steps, hf_t_n, hf_t_1 = [], [], [], []
    for rep in range(s.reps + 1):  # rep 0 is the untimed first run
        outs, _ = js.generate(prompts, greedy(n))
        assert all(len(o.token_ids) == n for o in outs)
        stats = jserve_decode_stats(outs)
        gen_n, t_n = hf_generate(model, ids, mask, n)
        _, t_1 = hf_generate(model, ids, mask, 1)
        if rep == 0:
            if check_tokens:
                check_identical(outs, gen_n, batch)
            continue
        js_rates.append(stats["rate"])
        js_steps.append(stats["steady_step_s"])
        hf_t_n.append(t_n)
        hf_t_1.append(t_1)
    # HF: difference of the medians (one rep's t_N - t_1 is noisy when N is small).
    return {"batch": batch, "prompt_len": s.decode_prompt_len, "new_tokens": n,
            "jserve_tok_s": median(js_rates),
            "hf_tok_s": batch * (n - 1) / (median(hf_t_n) - median(hf_t_1)),
            "jserve_steady_step_s": median(js_steps),
            "jserve_tok_s_reps": js_rates, "hf_generate_n_s_reps": hf_t_n,
            "hf_generate_1_s_reps": hf_t_1}


def check_identical(outs, hf_gen: torch.Tensor, batch: int) -> None:
    hf_tokens = hf_gen.tolist()
    for i, o in enumerate(outs):
        if list(o.token_ids) != hf_tokens[i]:
            k = next(j for j, (a, b) in enumerate(zip(o.token_ids, hf_tokens[i])) if a != b)
            raise AssertionError(f"batch-{batch} decode: request {i} differs from HF at output "
                                 f"token {k}: jserve {list(o.token_ids)[k:k + 5]} vs HF "
                                 f"{hf_tokens[i][k:k + 5]}")
    print(f"batch-{batch} greedy decode, {len(hf_tokens[0])} tokens x {batch}: "
          f"tokens identical: yes")


def measure_prefill(js: Jserve, model, s: Settings, rng: np.random.Generator) -> dict:
    prompts = random_prompts(rng, s.prefill_batch, s.prefill_len)
    ids, mask = unpadded(prompts)
    tokens = s.prefill_batch * s.prefill_len
    js_rates, hf_rates = [], []
    for rep in range(s.reps + 1):
        _, t_js = js.generate(prompts, greedy(1))
        _, t_hf = hf_generate(model, ids, mask, 1)
        if rep:
            js_rates.append(tokens / t_js)
            hf_rates.append(tokens / t_hf)
    return {"batch": s.prefill_batch, "prompt_len": s.prefill_len,
            "jserve_tok_s": median(js_rates), "hf_tok_s": median(hf_rates),
            "jserve_tok_s_reps": js_rates, "hf_tok_s_reps": hf_rates}


def trace_requests(s: Settings, rng: np.random.Generator) -> tuple[list, list[int]]:
    rows = read_lengths(s.trace)
    pick = rng.choice(len(rows), size=s.offline_requests, replace=False)
    lens = np.array([rows[i] for i in pick], dtype=np.float64)
    p_len = np.clip(np.round(lens[:, 0] / s.length_scale), *s.prompt_clip).astype(int)
    o_len = np.clip(np.round(lens[:, 1] / s.length_scale), *s.output_clip).astype(int)
    prompts = [random_prompts(rng, 1, int(n))[0] for n in p_len]
    print(f"offline workload: {s.offline_requests} requests with the lengths of {s.trace}, "
          f"lengths / {s.length_scale:g}, prompt clipped to {list(s.prompt_clip)}, "
          f"output to {list(s.output_clip)}")
    for name, x in (("prompt", p_len), ("output", o_len)):
        print(f"  {name:6s} tokens: mean {x.mean():.1f}  p50 {np.median(x):.0f}  "
              f"p90 {np.percentile(x, 90):.0f}  max {x.max()}  total {x.sum()}")
    return prompts, o_len.tolist()


def run_hf_static_batches(model, prompts, out_lens, batch: int) -> tuple[list[list[int]], float]:
    """Arrival order, batches of ``batch``, left-padded, each run to its longest output."""
    tokens: list[list[int]] = []
    total = 0.0
    for i in range(0, len(prompts), batch):
        ids, mask = left_padded(prompts[i:i + batch])
        lens = out_lens[i:i + batch]
        gen, dt = hf_generate(model, ids, mask, max(lens))
        total += dt
        tokens.extend(g[:n] for g, n in zip(gen.tolist(), lens))
    return tokens, total


def measure_offline(js: Jserve, model, s: Settings, rng: np.random.Generator) -> dict:
    """No extra untimed run here: jserve's buckets are compiled and both sides are warm."""
    prompts, out_lens = trace_requests(s, rng)
    params = [greedy(n) for n in out_lens]
    useful = sum(out_lens)
    n = len(prompts)
    js_times, hf_times = [], []
    for _ in range(s.reps):
        outs, t_js = js.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == out_lens
        hf_tokens, t_hf = run_hf_static_batches(model, prompts, out_lens, s.hf_batch)
        js_times.append(t_js)
        hf_times.append(t_hf)
        print(f"  offline rep {len(js_times)}: jserve {t_js:.1f}s, HF {t_hf:.1f}s", flush=True)
    same = sum(list(o.token_ids) == h for o, h in zip(outs, hf_tokens))
    print(f"offline greedy agreement with HF (left-padded batches): {same}/{n} requests "
          f"identical")
    t_js, t_hf = median(js_times), median(hf_times)
    return {"requests": n, "useful_output_tokens": useful, "hf_batch": s.hf_batch,
            "jserve_s": t_js, "hf_s": t_hf,
            "jserve_tok_s": useful / t_js, "hf_tok_s": useful / t_hf,
            "jserve_req_s": n / t_js, "hf_req_s": n / t_hf,
            "identical_requests": same, "jserve_s_reps": js_times, "hf_s_reps": hf_times}


def ceiling(decode: dict, params: int, attn: int, js: Jserve, reps: int) -> dict:
    """Compute ceiling of a decode step at ``decode['batch']`` vs jserve's steady step time:
    the f32 matmul rate of this machine, measured now (``MatmulCeiling``: the step's weight
    matrices at that batch, one after another; median of ``reps``), not a rate assumed."""
    b = decode["batch"]
    mean_ctx = decode["prompt_len"] + decode["new_tokens"] / 2
    flops = b * (2 * params + attn * mean_ctx)
    step = decode["jserve_steady_step_s"]
    achieved = flops / step / 1e9
    matmuls = MatmulCeiling(step_weights(js.llm.engine.runner.params), b)
    rate = matmuls.flops / median([matmuls.time()[0] for _ in range(reps)]) / 1e9
    return {"batch": b, "flops_per_step": flops, "matmul_gflops": rate,
            "ceiling_step_s": flops / (rate * 1e9),
            "jserve_steady_step_s": step, "achieved_gflops": achieved,
            "fraction_of_ceiling": achieved / rate}


def print_table(results: dict) -> None:
    rows = []
    for d in results["decode"]:
        rows.append((f"decode tok/s, batch {d['batch']} ({d['prompt_len']}+{d['new_tokens']})",
                     d["jserve_tok_s"], d["hf_tok_s"]))
    p = results["prefill"]
    if p is not None:
        rows.append((f"prefill tok/s, {p['batch']} x {p['prompt_len']}", p["jserve_tok_s"],
                     p["hf_tok_s"]))
    o = results["offline"]
    if o is not None:
        rows.append((f"offline useful output tok/s ({o['requests']} req)", o["jserve_tok_s"],
                     o["hf_tok_s"]))
        rows.append((f"offline requests/s ({o['requests']} req)", o["jserve_req_s"],
                     o["hf_req_s"]))
        rows.append(("offline wall time s (lower is better)", o["jserve_s"], o["hf_s"]))
    w = max(len(r[0]) for r in rows)
    print(f"\n{'metric':{w}s}  {'jserve':>10s}  {'HF':>10s}  {'jserve/HF':>9s}")
    for name, a, b in rows:
        print(f"{name:{w}s}  {a:10.2f}  {b:10.2f}  {a / b:9.2f}")
    c = results["ceiling"]
    print(f"\nbatch-{c['batch']} decode vs ceiling ({c['matmul_gflops']:.1f} GFLOP/s f32, the "
          "step's matmuls alone, measured in this run): "
          f"{c['flops_per_step'] / 1e9:.3f} GFLOP/step -> ceiling step "
          f"{c['ceiling_step_s'] * 1e3:.2f} ms; jserve steady step "
          f"{c['jserve_steady_step_s'] * 1e3:.2f} ms = {c['achieved_gflops']:.1f} GFLOP/s = "
          f"{c['fraction_of_ceiling']:.1%} of ceiling")


def run(s: Settings, threads: int | None, quick: bool, out: Path | None) -> int:
    """The whole comparison: every measurement, the table, and the results JSON at ``out``.
    ``threads``: torch's (None: every core this process may run on)."""
    transformers.utils.logging.disable_progress_bar()
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(f"jserve vs HF transformers {transformers.__version__} generate, torch "
          f"{torch.__version__} ({threads} threads), float32 on CPU; median of {s.reps} reps"
          f"{' (quick)' if quick else ''}; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    print(f"load average at start: {load_average()} (other work on the machine skews timings)")
    MODEL_KWARGS["vocab_size"] = s.vocab_size  # the model every function here builds and draws for
    params, attn = describe_model()
    rng = np.random.default_rng(s.seed)
    results: dict = {"settings": dataclasses.asdict(s), "threads": threads,
                     "load_average_start": load_average(),
                     "flops_per_decoded_token": 2 * params,
                     "attention_flops_per_context_token": attn}
    with tempfile.TemporaryDirectory(prefix="jserve-bench-") as tmp:
        model = build_model(Path(tmp), s.seed)
        js = Jserve(Path(tmp), s.engine)
        print(f"jserve: {s.engine}, warm-up compiled {js.compiles_after_warmup} step shapes in "
              f"{js.start_seconds:.1f}s (load + compile, not timed)")
        results["jserve_start_s"] = js.start_seconds
        decodes = []
        for b in s.decode_batches:
            decodes.append(measure_decode(js, model, s, b, rng,
                                          check_tokens=b == s.correctness_batch))
            print(f"decode batch {b}: jserve {decodes[-1]['jserve_tok_s']:.1f} tok/s, "
                  f"HF {decodes[-1]['hf_tok_s']:.1f} tok/s")
        results["decode"] = decodes
        results["prefill"] = results["offline"] = None
        if not s.decode_only:
            results["prefill"] = p = measure_prefill(js, model, s, rng)
            print(f"prefill {p['batch']} x {p['prompt_len']}: jserve {p['jserve_tok_s']:.1f} "
                  f"tok/s, HF {p['hf_tok_s']:.1f} tok/s")
            results["offline"] = measure_offline(js, model, s, rng)
        results["ceiling"] = ceiling(decodes[-1], params, attn, js, s.reps)
        results["jserve_recompiles_during_timing"] = js.recompiles
    results["load_average_end"] = load_average()
    print_table(results)
    print(f"load average at end: {results['load_average_end']}")
    if js.recompiles:
        print(f"WARNING: jserve compiled {js.recompiles} step shapes after warm-up")
    if out:
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")
    return 0
