"""The engine's real step programs compiled for an H100 and a v5e (``jserve.targets``), with
the structure each target's defaults must give them: the Llama-3.2-1B shape's decode and
mixed steps, and the memory plan against XLA's own analysis at the 8B shape's widths."""
from __future__ import annotations

import pytest


def _llama_1b():
    from harness.device_profiles import LLAMA_1B, llama_cfg

    return llama_cfg(**LLAMA_1B)


def _decode_steps(target: str, steps, **engine):
    """The 1B-shaped model's step programs of ``steps`` compiled for ``target`` with the
    engine's defaults there (a 1.14 GB KV pool, 8K context)."""
    from jserve.engine.config import EngineConfig
    from jserve.targets.programs import compile_for

    config = EngineConfig(num_kv_pages=2176, max_model_len=8192, **engine)
    return compile_for(target, _llama_1b(), config, steps=steps)


@pytest.mark.slow
# v5e's batch-1 decode step is left out (35 s of the suite's compile time, the same
# structure as batch 32's, whose KV reads make the 1.2x bound the harder one); the device
# check compiles and runs it where a TPU is lent.
@pytest.mark.parametrize("target, steps", [("v5e", [(32, 0), (32, 256)]),
                                           ("v6e", [(32, 256)])])
def test_tpu_steps_compile_with_the_pallas_kernels_and_copy_nothing(target, steps):
    """The 1B-shaped decode step (batch 32) and a mixed step, compiled for a v5e (and
    a v6e, whose Mosaic refused the KV write as v5e's did) with TPU's defaults (Pallas
    attention and KV writes, the indexed layer loop, the pool pinned row-major): Mosaic
    compiles them, no program copies a layer's weights or the KV pool (the reference
    attention relaid 20.5 GB of pages a step, the loop copied 0.4 GB of weights at batch
    32), and a greedy decode step moves within 1.2x of the weights' bytes (12.6 GB by XLA's
    count for 2.47 GB before). (v6e's batch-32 decode step: XLA counts 2.56 GB, jserve's
    module walk 18.4 GB, an overcount of libtpu's v6e ops not yet found; not asserted.)"""
    r = _decode_steps(target, steps)
    assert (r.attention, r.layer_mode) == ("pallas_tpu", "indexed")
    assert [p.name for p in r.programs] == [f"step {d}x{t}" for d, t in steps]
    for p in r.programs:
        a = p.analysis
        assert a.kernels["pallas"] == 16 * (4 + 1 + 2), p.name  # matmuls, attention, writes
        assert (a.copy_bytes("weight"), a.copy_bytes("kv")) == (0, 0), (p.name, a.copies)
    for (_, prefill), p in zip(steps, r.programs):
        if prefill == 0:
            assert p.analysis.least_bytes <= 1.2 * r.weight_bytes, (p.name,
                                                                    p.analysis.least_bytes)


@pytest.mark.slow
def test_gpu_decode_step_reads_its_weights_once():
    """The 1B-shaped batch-1 decode step compiled for an H100 with GPU's defaults (Triton
    kernels, decode steps indexed): no weight or KV copy (the sliced layers in the burst loop
    copied 1.41 GB a step), a greedy step within 1.2x of the weights' bytes (1.24x while
    XLA copied the penalty state and the handed-on logits in the branches that passed them
    on), a layer's K and V written in one launch, and a greedy step's host syncs two: the
    burst loop's trip and the sampling's one branch (11 when each switch of the chain was
    a branch of its own; the whole chain's branches, for its filters' sort, stay in the
    largest). Kept exactly, not yet met: the host syncs (outside CUDA graphs; goal none)
    and the launches (a greedy step 345, 21.6 a layer, 18 of them in the layer loop's
    body; 24.6 before q, k and v were one matrix (``wqkv``), 28 before the sampling took
    one branch, 36 before the query blocking and the write slots were made once a step
    and the split-K merge reduced once; goal 12), so a change to either shows here."""
    r = _decode_steps("h100", [(1, 0)])
    (p,) = r.programs
    a = p.analysis
    assert (r.attention, r.layer_mode) == ("pallas_gpu", "sliced-indexed")
    assert (a.copy_bytes("weight"), a.copy_bytes("kv")) == (0, 0), a.copies
    assert a.least_bytes <= 1.2 * r.weight_bytes
    assert a.kernels["pallas"] == 16 * (4 + 1 + 1)  # matmuls, attention, the K/V write
    assert (a.least_host_syncs, a.least_launches) == (2, 345)
    assert (a.host_syncs, a.launches) == (5, 389)


@pytest.mark.slow
@pytest.mark.parametrize("target, mesh", [("h100", "tp=1"), ("v5e", "tp=4")])
def test_the_plan_is_what_xla_allocates(target, mesh):
    """``jserve plan``'s bytes a device (weights, the pool it sizes for the target's memory,
    the penalty state, the largest step's temporaries) within 5% of what XLA's memory
    analysis says that step needs, compiled for the target with that pool. The 8B shape's
    widths at 2 of its 32 layers, Llama 2's vocabulary of 32,000 and a small step (the
    compile time is the suite's: 8 layers and the default step took 4 minutes on a v5e;
    the 128K vocabulary's sampler half of this test's 93 s on a v5e, where the plan was
    within 0.05% of XLA's count, 1.2% at 32K); on a v5e over four chips, as an 8B model
    needs (16 GB of weights for 16 GB of HBM)."""
    from harness.device_profiles import LLAMA_8B, llama_cfg
    from jserve.engine.config import EngineConfig
    from jserve.targets.programs import compile_for

    cfg = llama_cfg(**{**LLAMA_8B, "num_hidden_layers": 2, "vocab_size": 32000})
    config = EngineConfig(mesh=mesh, max_model_len=8192, max_num_seqs=8,
                          max_num_batched_tokens=64)
    largest = (config.max_num_seqs, config.max_num_batched_tokens)
    r = compile_for(target, cfg, config, steps=[largest])
    assert r.plan.fits and r.fits
    planned, compiled = r.plan.total_bytes, r.largest_memory
    assert abs(planned - compiled) <= 0.05 * compiled, (planned, compiled)


@pytest.mark.slow
def test_gpu_mixed_step_copies_nothing_and_syncs_as_counted():
    """The 1B-shaped mixed step (32 decodes beside 256 prompt tokens) compiled for an H100:
    its layers sliced (XLA's GEMMs for the prompt's matmuls), the Pallas attention and one
    K/V write a layer, no copy of the KV pages or of a layer's weights (XLA materialised
    0.20 GB of slices of the separate q, k and v matrices before they were one, ``wqkv``),
    no loop around the layers (so no slice of a layer is copied per trip). Kept exactly,
    not yet met: a greedy step's host syncs (goal none): two, the prompt logprobs' branch
    and the sampling's (11 before the penalty state and the handed-on logits were written
    unconditionally and the sampling took one branch), so a change shows here."""
    r = _decode_steps("h100", [(32, 256)])
    (p,) = r.programs
    a = p.analysis
    assert r.layer_mode == "sliced-indexed"
    assert a.kernels["pallas"] == 16 * (2 + 1)  # attention's decode and prompt launches, the write
    assert (a.copy_bytes("kv"), a.copy_bytes("weight")) == (0, 0), a.copies
    assert (a.whiles, a.least_host_syncs, a.host_syncs) == (1, 2, 8)


@pytest.mark.slow
def test_gpu_moe_decode_step_reads_only_its_chosen_experts():
    """A Qwen3-30B-A3B-shaped batch-1 decode step (128 experts 768 wide, top 8; 4 layers,
    a 32K vocabulary) compiled for an H100 with GPU's defaults: the experts read in place
    by the indexed layer loop (one gather of the chosen experts' columns, one dynamic slice
    of each chosen down matrix, the router by the layer matmul kernel), no weight or KV
    copy, and the bytes a greedy step moves within 1.3x of what one token must read
    (attention, router, its 8 experts, the LM head): 0.66 GB for 0.59 GB, of 5.2 GB of
    weights (13.8 GB by the HLO walk, which read a gather as its whole operand, and a 4 MB
    router product materialised a layer before the router was read in place)."""
    from jserve.config import ModelConfig
    from jserve.engine.config import EngineConfig
    from jserve.model.params import active_params
    from jserve.targets.programs import compile_for

    cfg = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, dtype="bfloat16", architecture="Qwen3MoeForCausalLM",
                      model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=True)
    r = compile_for("h100", cfg, EngineConfig(num_kv_pages=512, max_model_len=4096),
                    steps=[(1, 0)])
    (p,) = r.programs
    a = p.analysis
    assert (r.attention, r.layer_mode) == ("pallas_gpu", "sliced-indexed")
    assert (a.copy_bytes("weight"), a.copy_bytes("kv")) == (0, 0), a.copies
    one_token = (active_params(cfg) - cfg.vocab_size * cfg.hidden_size) * 2  # one embed row
    assert r.weight_bytes > 8 * one_token
    assert a.least_bytes <= 1.3 * one_token, (a.least_bytes, one_token)


@pytest.mark.slow
@pytest.mark.parametrize("target, step, syncs", [("h100", (1, 0), 2), ("v5e", (32, 0), 4)])
def test_lora_decode_step_reads_the_pool_in_place(target, step, syncs):
    """The 1B-shaped decode step with a pool of 8 LoRA adapters of rank 16 on every
    projection (180 MB beside 2.47 GB of weights), compiled with each target's defaults:
    each A and B product runs on the layer matmul kernel reading its layer of the pool in
    place (11 a layer beside the base's 4: one A for q/k/v, one for gate/up, o's and down's,
    and the 7 B's), no weight or KV copy (slicing each layer's pool out copied 1.34 GB a step
    on a v5e, where merging a [in, slots, rank] pool's minor axes was a relayout), no more
    copies than the step without adapters (masking xa by reshaping it to [slots, rank] added
    128 on a v5e), its host syncs, and the bytes a greedy step moves within 1.25x of the
    weights with the pool (h100 batch 1: 3.21 GB, the base step 2.90 GB: the deltas' f32
    products written and read again beside the pool; v5e batch 32: 3.04 GB for 2.75 GB)."""
    from jserve.lora import LoRAConfig

    r = _decode_steps(target, [step], lora=LoRAConfig(max_loras=8, max_lora_rank=16))
    (p,) = r.programs
    a = p.analysis
    attention_and_writes = 1 + (2 if target == "v5e" else 1)
    assert a.kernels["pallas"] == 16 * (4 + 11 + attention_and_writes)
    assert (a.copy_bytes("weight"), a.copy_bytes("kv")) == (0, 0), a.copies
    assert a.least_host_syncs == syncs
    assert a.kernels["copy"] == {"h100": 6, "v5e": 122}[target]  # (h100 base: 7, v5e: 122)
    # layers x slots x rank x bf16 x (in + out) of q, k, v, o, gate, up, down
    pool = 16 * 8 * 16 * 2 * sum(i + o for i, o in ((2048, 2048), (2048, 512), (2048, 512),
                                                    (2048, 2048), (2048, 8192),
                                                    (2048, 8192), (8192, 2048)))
    assert r.weight_bytes == 2471628800 + pool
    assert a.least_bytes <= 1.25 * r.weight_bytes, a.least_bytes
