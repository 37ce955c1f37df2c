"""One side of ``scripts/bench_vs_vllm.py`` in a process of its own: jserve's ``LLM`` from
jserve's venv or vLLM's from vLLM's venv (the two never share a process, a torch or an
OpenMP runtime). It loads the model once, then runs the jobs the parent writes on stdin, one
JSON object a line, and answers each with one line ``@@vs_vllm {json}`` on stdout (vLLM logs
to stdout too, so the parent keeps only marked lines). Loading once lets the parent alternate
the sides repetition by repetition without timing a load or a compile.

    python vs_vllm_child.py '{"side": "vllm", "model": DIR, "dtype": "float32", ...}'

Stdlib besides the side's own library: the vLLM side has no jserve to import."""
from __future__ import annotations

import json
import sys
import time

import vllm_shim  # noqa: F401  (importlib.metadata answers for "vllm"; harmless for jserve)

MARK = "@@vs_vllm "


def _answer(row: dict) -> None:
    sys.stdout.write(MARK + json.dumps(row) + "\n")
    sys.stdout.flush()


def build(cfg: dict):
    """The side's LLM and a ``generate(prompts, max_tokens) -> [(prompt_ids, output_ids)]``
    that runs greedy with EOS ignored; prompts are token-id lists or strings."""
    common = dict(dtype=cfg["dtype"], seed=0, max_model_len=cfg["max_model_len"],
                  max_num_seqs=cfg["max_num_seqs"])
    if cfg.get("max_num_batched_tokens"):
        common["max_num_batched_tokens"] = cfg["max_num_batched_tokens"]
    kv = int(cfg["kv_gib"] * (1 << 30))
    if cfg["side"] == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=cfg["model"], kv_cache_memory_bytes=kv, **common)
    else:
        from jserve.llm import LLM
        from jserve.sampling.params import SamplingParams

        llm = LLM(cfg["model"], kv_cache_bytes=kv, **common)

    def generate(prompts: list, max_tokens: int) -> list[tuple[list[int], list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        given = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(given, params, use_tqdm=False)
        return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]

    return generate


def run_job(generate, job: dict) -> dict:
    """One measurement: ``offline`` (a batch's output tok/s), ``batch1`` (TTFT as the time of
    a one-token generate, TPOT as (t[N] - t[1]) / (N - 1) on a second prompt of the same
    length, as docs/bench.md measures HF), ``tokens`` (the ids, for the parent to compare)
    or ``warmup`` (untimed)."""
    kind = job["job"]
    if kind == "offline":
        t0 = time.perf_counter()
        outs = generate(job["prompts"], job["max_tokens"])
        seconds = time.perf_counter() - t0
        tokens = sum(len(o) for _, o in outs)
        return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
    if kind == "batch1":
        n = job["max_tokens"]
        t0 = time.perf_counter()
        generate([job["prompts"][0]], 1)
        t1 = time.perf_counter()
        (_, out), = generate([job["prompts"][1]], n)
        tn = time.perf_counter() - t1
        ttft = t1 - t0
        return {"ttft_s": ttft, "tpot_s": (tn - ttft) / max(1, n - 1), "tokens": len(out)}
    if kind == "tokens":
        outs = generate(job["prompts"], job["max_tokens"])
        return {"prompt_ids": [p for p, _ in outs], "output_ids": [o for _, o in outs]}
    if kind == "warmup":
        for prompts, n in job["batches"]:
            generate(prompts, n)
        return {}
    raise ValueError(f"unknown job {kind!r}")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    generate = build(cfg)
    _answer({"ready": True, "load_s": time.perf_counter() - t0})
    for line in sys.stdin:
        job = json.loads(line)
        if job["job"] == "quit":
            break
        try:
            _answer(run_job(generate, job))
        except Exception as e:  # the parent reports it and goes on with the other parts
            import traceback

            _answer({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


if __name__ == "__main__":
    main()
