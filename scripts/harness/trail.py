"""TRAIL evaluated on a model with a trained length probe (``scripts/eval_length_probe.py``,
docs/trail.md): the probe's error live in the engine (prompt-only, per-step and refined
predictions), and mean latency and TTFT of sprpt against fcfs and sarathi on a burst and on
Poisson arrivals, wall clock on this machine."""
from __future__ import annotations

import gc
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from jserve import LLM
from jserve.probe import RemainingFilter, default_probe_path
from jserve.sampling.params import SamplingParams

# (scheduler, sprpt's c); c "capture" runs the policy with the probe's layer capture and
# tracker on but unused, so its row isolates what capturing costs from what sprpt's order buys.
POLICIES = (("fcfs", None), ("fcfs", "capture"), ("sarathi", None), ("sprpt", 0.5),
            ("sprpt", 0.8), ("sprpt", 1.0))


def task_prompts(n: int, seed: int) -> list[str]:
    from jserve.train.length_task import format_prompt, sample_tasks

    return [format_prompt(t.prompt) for t in sample_tasks(n, seed)]


def live_mae(model: str, probe_path: str, prompts, max_tokens: int, engine: dict):
    """Runs the engine with the probe on (its own capture and tracker) and scores every
    prediction it made against the tokens each request actually had left."""
    llm = LLM(model, length_probe=probe_path, **engine)
    eng = llm.engine
    eng.length_tracker.log = []
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    total = {o.request_id: len(o.token_ids) for o in outs}
    probe = eng.length_tracker.probe
    errs = {"prompt_only": [], "per_step": [], "refined": []}
    filters: dict[str, RemainingFilter] = {}
    first: dict[str, float] = {}
    for rid, k, kind, emb in eng.length_tracker.log:
        p = probe.probs(emb[None])[0]
        truth = total[rid] - k
        if kind == "prompt":
            f = filters[rid] = RemainingFilter(probe.bins)
            first[rid] = refined = f.start(p)
        else:
            refined = filters[rid].update(p)
        errs["prompt_only"].append(abs(max(first[rid] - k, 0.0) - truth))
        errs["per_step"].append(abs(float(probe.bins.expected(p)) - truth))
        errs["refined"].append(abs(refined - truth))
    lengths = list(total.values())
    return {k: float(np.mean(v)) for k, v in errs.items()}, lengths


def run_workload(llm: LLM, prompts, arrivals, max_tokens: int) -> dict:
    """Arrivals admitted between steps at their wall-clock times; latency and TTFT from
    arrival (queueing included)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    order = np.argsort(arrivals, kind="stable")
    outs = {}
    i = 0
    t0 = time.monotonic()
    while i < len(order) or eng.has_unfinished():
        now = time.monotonic()
        while i < len(order) and t0 + arrivals[order[i]] <= now:
            j = int(order[i])
            eng.add_request(prompts[j], params, request_id=str(j),
                            arrival_time=t0 + arrivals[j])
            i += 1
        if eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[int(o.request_id)] = o
        elif i < len(order):
            time.sleep(max(0.0, t0 + arrivals[order[i]] - time.monotonic()))
    m = [outs[j].metrics for j in range(len(prompts))]
    lat = [x.finished_time - x.arrival_time for x in m]
    ttft = [x.first_token_time - x.arrival_time for x in m]
    return {"mean_latency_s": float(np.mean(lat)), "mean_ttft_s": float(np.mean(ttft)),
            "p90_latency_s": float(np.percentile(lat, 90)),
            "makespan_s": float(max(x.finished_time for x in m) - t0),
            "preemptions": eng.scheduler.num_preemptions,
            "tokens": [outs[j].token_ids for j in range(len(prompts))]}


def _drop_executables() -> None:
    """Each engine compiles its buckets; without dropping them the process runs out of memory
    maps (see tests/conftest.py). The persistent compilation cache still has them."""
    gc.collect()
    jax.clear_caches()


def latency_table(model, probe_path, prompts, arrivals, max_tokens, engine) -> dict:
    res = {}
    for policy, c in POLICIES:
        name = (policy if c is None else f"{policy} + capture" if c == "capture"
                else f"sprpt c={c}")
        kw = dict(engine, scheduler=policy)
        if c is not None:
            kw.update(length_probe=probe_path)
        if policy == "sprpt":
            kw.update(sprpt_c=c)
        llm = LLM(model, **kw)
        res[name] = run_workload(llm, prompts, arrivals, max_tokens)
        del llm
        _drop_executables()
        r = res[name]
        print(f"  {name:12s} mean latency {r['mean_latency_s']:.2f}s  mean TTFT "
              f"{r['mean_ttft_s']:.2f}s  makespan {r['makespan_s']:.1f}s  "
              f"preemptions {r['preemptions']}", flush=True)
    return res


HOW_IT_WORKS = """- **Capture** (`EngineConfig(length_probe=..., probe_layer=...)`, off by default: the
  step compiles exactly as without it). The fused step also returns the chosen layer's float32
  residual stream at each sampled row and, per row, its sum over the step's prompt tokens
  (`decoder.forward(capture_layer=, prompt_mask=)`, a segment sum over `token_seq`); the host
  (`jserve.probe.tracker.LengthTracker`) adds the sums up across prefill chunks.
- **Probe** (`jserve.probe.length_probe`): MLP hidden -> 512 -> bins (ReLU) on standardised
  embeddings, cross-entropy on the bin of the tokens still to generate, AdamW (optax). Bins
  (`jserve.probe.bins`): 10 equal bins over 0-512 plus an overflow bin by default, or log-spaced.
- **Filter** (`jserve.probe.smoothing`): prior = previous posterior x T, where a request in bin
  b stays with probability 1 - 1/w_b and moves one bin down with 1/w_b (bin 0 stays; the
  overflow bin borrows the last width); posterior = prior x probe softmax, normalised;
  prediction = expected remaining length over the bin centres. The first prediction is the
  probe on the mean prompt embedding, made when the prompt's last chunk has run.
- **sprpt** (`jserve.scheduler.sprpt`): waiting and running requests ordered by predicted
  remaining tokens; before its prompt is prefilled a request counts as the mean output length
  of the probe's training requests. A running request is preemptable only while generated <= c x its first
  prediction; when the shortest waiting request finds the batch full (max_num_seqs or KV), the
  preemptable running request with the largest prediction is preempted if that is longer.
  Prefill chunks under the token budget as in Sarathi.
"""  # noqa: E501  (markdown written as it reads)


def write_doc(path: Path, args, sidecar, live, lengths, workloads, command) -> None:
    """docs/trail.md: the run, how TRAIL works, the probe's accuracy, the latency tables."""
    L = _head(args, sidecar, command)
    L.append("## How it works\n")
    L.append(HOW_IT_WORKS)
    L += _accuracy(args, sidecar, live, lengths) + _latency(args, workloads)
    path.write_text("\n".join(L))


def _head(args, sidecar, command) -> list[str]:
    L = []
    L.append("# TRAIL: output-length probe and SPRPT with limited preemption\n")
    L.append("Generated by `scripts/eval_length_probe.py` (issue 8). Command:\n")
    L.append(f"    {command}\n")
    L.append(f"Model `{args.model}`, probe `{args.probe}` (layer {sidecar.get('best_layer')}, "
             f"bins {[round(e, 1) for e in sidecar.get('bins', [])]} + overflow). Machine: "
             f"{platform.machine()} CPU ({platform.processor() or 'unknown'}), shared with "
             "other jobs, so absolute times are noisy; every policy ran the same requests.\n")
    return L


def _accuracy(args, sidecar, live, lengths) -> list[str]:
    L = []
    L.append("## Probe accuracy\n")
    L.append("Mean absolute error (tokens) of the predicted remaining length over every step "
             "of every request. *prompt-only*: the first prediction (probe on the mean prompt "
             "embedding) minus the tokens generated since; *per-step*: the probe on that "
             "step's embedding alone; *refined*: the Bayesian filter over steps (what the "
             "engine uses).\n")
    L.append(f"Per layer, on {sidecar.get('held_out_requests')} held-out requests of the "
             f"training run ({sidecar.get('requests')} requests, trained on the rest, "
             f"{sidecar.get('steps')} optax steps per layer):\n")
    L.append("| layer | prompt-only MAE | per-step MAE | refined MAE |")
    L.append("|---|---|---|---|")
    for layer, m in sorted(sidecar.get("mae", {}).items(), key=lambda kv: int(kv[0])):
        L.append(f"| {layer} | {m['prompt_only']:.1f} | {m['per_step']:.1f} | "
                 f"{m['refined']:.1f} |")
    L.append("")
    L.append(f"The shipped probe live in the engine (its own capture and tracker), on "
             f"{args.test_requests} fresh test requests (task seed {args.test_seed}; output "
             f"length mean {np.mean(lengths):.1f}, max {max(lengths)} tokens):\n")
    L.append("| prompt-only MAE | per-step MAE | refined MAE |")
    L.append("|---|---|---|")
    L.append(f"| {live['prompt_only']:.1f} | {live['per_step']:.1f} | {live['refined']:.1f} |")
    L.append("")
    verdict = "below" if live["refined"] < live["prompt_only"] else "NOT below"
    L.append(f"Refined MAE is **{verdict}** prompt-only MAE "
             f"({live['refined']:.1f} vs {live['prompt_only']:.1f}).\n")
    return L


def _latency(args, workloads) -> list[str]:
    L = []
    L.append("## Latency: sprpt vs fcfs\n")
    eng = ", ".join(f"{k}={v}" for k, v in args.engine.items())
    L.append(f"Engine: {eng}. Greedy decoding to EOS (max_tokens {args.max_tokens}); latency "
             "and TTFT count from arrival, queueing included.\n")
    for title, (desc, res) in workloads.items():
        L.append(f"### {title}\n")
        L.append(desc + "\n")
        L.append("| policy | mean latency (s) | mean TTFT (s) | P90 latency (s) | makespan (s) "
                 "| preemptions | vs fcfs mean latency |")
        L.append("|---|---|---|---|---|---|---|")
        base = res["fcfs"]["mean_latency_s"]
        for name, r in res.items():
            L.append(f"| {name} | {r['mean_latency_s']:.2f} | {r['mean_ttft_s']:.2f} | "
                     f"{r['p90_latency_s']:.2f} | {r['makespan_s']:.1f} | {r['preemptions']} | "
                     f"{r['mean_latency_s'] / base:.2f}x |")
        same = all(r["tokens"] == res["fcfs"]["tokens"] for r in res.values())
        L.append("")
        L.append(f"Every policy generated {'the same' if same else 'DIFFERENT'} tokens for "
                 "every request.\n")
    return L


def run(args, command: str) -> None:
    """The whole evaluation: the probe live in the engine, the latency workloads (a burst,
    then Poisson arrivals above sarathi's burst throughput), docs/trail.md (``args.out``).
    ``args``: ``scripts/eval_length_probe.py``'s flags; SystemExit without a probe."""
    args.probe = args.probe or str(default_probe_path(args.model) or "")
    if not args.probe:
        raise SystemExit(f"no probe for {args.model}: run scripts/train_length_probe.py")
    sidecar_path = Path(args.probe.removesuffix(".npz") + ".json")
    sidecar = json.loads(sidecar_path.read_text()) if sidecar_path.exists() else {}
    args.engine = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=128,
                       max_prefill_seqs=4, max_model_len=args.max_model_len, warmup=True)

    print("probe accuracy, live:", flush=True)
    live, lengths = live_mae(args.model, args.probe,
                             task_prompts(args.test_requests, args.test_seed), args.max_tokens,
                             dict(args.engine, max_num_seqs=32, max_num_batched_tokens=256,
                                  warmup=False))
    print("  ", live, flush=True)
    _drop_executables()

    prompts = task_prompts(args.requests, args.test_seed + 1)
    workloads = {}
    print("burst:", flush=True)
    burst = latency_table(args.model, args.probe, prompts, np.zeros(len(prompts)),
                          args.max_tokens, args.engine)
    workloads["Burst"] = (f"{len(prompts)} task requests (seed {args.test_seed + 1}), all at "
                          "t = 0.", burst)
    capacity = len(prompts) / burst["sarathi"]["makespan_s"]
    rate = args.qps or args.load * capacity
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1 / rate, len(prompts)))
    arrivals -= arrivals[0]
    print(f"poisson at {rate:.2f} req/s:", flush=True)
    poisson = latency_table(args.model, args.probe, prompts, arrivals, args.max_tokens,
                            args.engine)
    workloads["Poisson"] = (f"The same {len(prompts)} requests arriving as a Poisson process "
                            f"at {rate:.2f} req/s (sarathi's burst throughput, the capacity "
                            f"without reordering, was {capacity:.2f} req/s); whether a queue "
                            "persists shows in fcfs's mean TTFT.", poisson)
    write_doc(Path(args.out), args, sidecar, live, lengths, workloads, command)
    print(f"wrote {args.out}")
