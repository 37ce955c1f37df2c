"""LoRA adapters on this CPU: jserve's decode step with a batch over many adapters against
the same batch on the base model alone, jserve against transformers + peft serving the
same adapters one at a time, and the delta's forms on their own: masked over every slot
(as the step computes it), gathered per token (punica's BGMV) and segmented by adapter with
``jax.lax.ragged_dot`` (punica's SGMV).

    python scripts/bench_lora.py                      # 32 requests over 8 adapters, rank 16
    python scripts/bench_lora.py --reps 5 --out lora.json
    python scripts/bench_lora.py --delta-only           # the delta's forms alone

A seeded random Llama (hidden 1024, 4 layers, 16 query / 4 KV heads of 64, MLP 2816,
vocab 8192, float32) and ``--adapters`` PEFT adapters of ``--rank`` on all seven
projections, seeded random, written by transformers and peft. Each repetition, alternated:

- ``lora``: one jserve engine (``enable_lora``, ``max_loras`` = the adapters) runs the
  batch of ``--requests`` prompts, request i under adapter i % adapters; ``base``: an
  engine without LoRA runs the same prompts; ``lora-engine base``: the LoRA engine runs
  them all on the base model. Decode step: the median of the all-decode steps' times in
  ``step_log`` (bursts off, so one step a call; every program compiled first).
- ``hf+peft``: ``PeftModel`` (unmerged), each adapter in turn set active and its requests
  generated as one batch (``generate``, greedy, EOS ignored); tokens/s against jserve's
  whole mixed batch.

Recorded in docs/lora.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

MODEL = dict(num_hidden_layers=4, hidden_size=1024, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, intermediate_size=2816, vocab_size=8192,
             max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             tie_word_embeddings=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_model(root: Path, adapters: int, rank: int):
    """The base checkpoint and ``adapters`` PEFT adapters under ``root``; returns (base
    dir, adapter dirs, the HF model with every adapter loaded, unmerged)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).eval()
    base.save_pretrained(root / "base")
    dirs = []
    for i in range(adapters):
        model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(
            root / "base"), peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                            target_modules=TARGETS, lora_dropout=0.0))
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, w in sorted(model.named_parameters()):
                if "lora_" in name:
                    w.copy_(torch.randn(w.shape, generator=g) * 0.05)
        model.save_pretrained(root / f"adapter{i}")
        dirs.append(root / f"adapter{i}")
    hf = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(root / "base"), dirs[0],
        adapter_name="adapter0")
    for i, d in enumerate(dirs[1:], 1):
        hf.load_adapter(d, adapter_name=f"adapter{i}")
    hf.eval()
    hf.generation_config.eos_token_id = None
    return root / "base", dirs, hf


def decode_step_s(llm, prompts, params, loras=None) -> tuple[float, float, list]:
    """(median all-decode step seconds, wall seconds, token ids) of one batch."""
    eng = llm.engine
    eng.step_log = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    wall = time.perf_counter() - t0
    steps = [s for plan, s in eng.step_log if plan.decodes and not plan.prefills]
    return statistics.median(steps), wall, [o.outputs[0].token_ids for o in outs]


def hf_one_at_a_time(hf, prompts, adapters: int, new_tokens: int) -> float:
    """Seconds for transformers + peft to serve every adapter's requests, one adapter's
    batch at a time."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(adapters):
            hf.set_adapter(f"adapter{i}")
            mine = [p for j, p in enumerate(prompts) if j % adapters == i]
            hf.generate(torch.tensor(mine), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def delta_forms(tokens: int, slots: int, rank: int, d: int, reps: int) -> dict:
    """Seconds of the delta of one [d, d] projection for ``tokens`` tokens over ``slots``
    adapters: masked (``jserve.model.lora``) and gathered per token (BGMV)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jserve.model import lora

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(d, slots * rank)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(slots, rank, d)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    s = jnp.asarray(np.arange(tokens) % slots, jnp.int32)
    @jax.jit
    def masked(a, b, h, s):
        layer = {"wo": None, lora.a_name("wo"): a, lora.b_name("wo"): b, lora.SLOTS: s}
        return lora.added(layer, "wo", h, jnp.zeros((h.shape[0], b.shape[-1]), h.dtype))


    @jax.jit
    def gathered(a, b, h, s):
        ga = jnp.moveaxis(a.reshape(d, slots, rank), 1, 0)[s]  # [T, d, r]
        return jnp.einsum("tr,tro->to", jnp.einsum("ti,tir->tr", h, ga), b[s])

    @jax.jit
    def ragged(a, b, h, s):  # punica's SGMV: tokens sorted by adapter, one group each
        order = jnp.argsort(s)
        sizes = jnp.bincount(s, length=slots).astype(jnp.int32)
        a3 = jnp.moveaxis(a.reshape(d, slots, rank), 1, 0)  # [slots, d, r]
        xa = jax.lax.ragged_dot(h[order], a3, sizes)
        out = jax.lax.ragged_dot(xa, b, sizes)
        return jnp.zeros_like(out).at[order].set(out)

    @jax.jit
    def base(w, h):
        return h @ w

    w = jnp.asarray(rng.normal(size=(d, d)), jnp.float32)
    out = {}
    forms = (("masked", masked, (a, b, h, s)), ("gathered", gathered, (a, b, h, s)),
             ("ragged_dot", ragged, (a, b, h, s)), ("base_matmul", base, (w, h)))
    want = np.asarray(masked(a, b, h, s))
    for name, fn, args in forms:
        if name != "base_matmul":  # the same deltas, whichever form
            np.testing.assert_allclose(np.asarray(fn(*args)), want, rtol=2e-3, atol=2e-3)
        fn(*args).block_until_ready()
        times = []
        for _ in range(max(reps, 5) * 20):
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--delta-only", action="store_true",
                   help="only the delta's forms on one projection (no engines, no HF)")
    a = p.parse_args()
    if a.delta_only:
        print(json.dumps({t: delta_forms(t, a.adapters, a.rank, MODEL["hidden_size"], a.reps)
                          for t in (a.requests, 256)}, indent=1))
        return 0

    import numpy as np

    from jserve import LLM, LoRARequest, SamplingParams

    rng = np.random.default_rng(1)
    prompts = [[1] + rng.integers(3, MODEL["vocab_size"], a.prompt_len - 1).tolist()
               for _ in range(a.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    engine = dict(max_num_seqs=a.requests, max_num_batched_tokens=256, max_model_len=512,
                  decode_burst=1, enable_prefix_caching=False)
    results: dict = {"settings": vars(a) | {"out": str(a.out)}, "model": MODEL}
    with tempfile.TemporaryDirectory(prefix="jserve-lora-") as tmp:
        base_dir, dirs, hf = write_model(Path(tmp), a.adapters, a.rank)
        loras = [LoRARequest(f"adapter{j % a.adapters}", j % a.adapters + 1,
                             str(dirs[j % a.adapters])) for j in range(a.requests)]
        with_lora = LLM(str(base_dir), enable_lora=True, max_loras=a.adapters,
                        max_lora_rank=a.rank, **engine)
        plain = LLM(str(base_dir), **engine)
        decode_step_s(with_lora, prompts, params, loras)  # loads the adapters (untimed)
        rows = []
        for rep in range(a.reps):
            lo, lo_wall, lo_ids = decode_step_s(with_lora, prompts, params, loras)
            ba, ba_wall, _ = decode_step_s(plain, prompts, params)
            lb, _, _ = decode_step_s(with_lora, prompts, params)
            hf_s = hf_one_at_a_time(hf, prompts, a.adapters, a.new_tokens)
            rows.append(dict(lora_step_s=lo, base_step_s=ba, lora_engine_base_step_s=lb,
                             lora_wall_s=lo_wall, base_wall_s=ba_wall, hf_peft_s=hf_s))
            print(f"rep {rep}: decode step lora {lo * 1e3:.2f} ms, base {ba * 1e3:.2f} ms "
                  f"(x{lo / ba:.2f}), lora engine on base {lb * 1e3:.2f} ms; batch wall "
                  f"jserve {lo_wall:.2f} s, hf+peft one adapter at a time {hf_s:.2f} s",
                  flush=True)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        tokens = a.requests * a.new_tokens
        results.update(reps=rows, median=med,
                       decode_step_ratio=med["lora_step_s"] / med["base_step_s"],
                       jserve_tokens_per_s=tokens / med["lora_wall_s"],
                       hf_peft_tokens_per_s=tokens / med["hf_peft_s"],
                       delta_forms={t: delta_forms(t, a.adapters, a.rank,
                                                   MODEL["hidden_size"], a.reps)
                                    for t in (a.requests, 256)})
        results["vs_hf_peft"] = results["jserve_tokens_per_s"] / results["hf_peft_tokens_per_s"]
        _ = lo_ids
    print(json.dumps({k: results[k] for k in ("decode_step_ratio", "jserve_tokens_per_s",
                                              "hf_peft_tokens_per_s", "vs_hf_peft",
                                              "delta_forms")}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
