"""The model step under ``jax.shard_map``: each ``tp`` shard runs the unsharded ``forward``
on its heads and MLP slice (shapes say how many) and psums the partial outputs of wo and
w_down over ``tp`` (Megatron); with ``kvp`` > 1 each KV-cache-parallel group holds its pool
and its columns of the page table and attention merges over ``kvp``
(``jserve.kernels.kv_parallel``). Logits come out replicated, KV pages stay split."""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jserve.cache.pool import KVCache
from jserve.config import ModelConfig
from jserve.model.decoder import Params, StepInput, final_logits, forward_stream
from sharding.kv_parallel import PAGE_TABLE_SPEC
from sharding.specs import kv_cache_specs, param_specs


def batch_specs(batch: StepInput) -> StepInput:
    """shard_map in_specs for a step's batch: replicated, the page table split on kvp."""
    specs = jax.tree.map(lambda _: P(), batch)
    return dataclasses.replace(specs, attn=dataclasses.replace(specs.attn,
                                                               page_table=PAGE_TABLE_SPEC))


def tp_forward(params: Params, kv_cache: KVCache, batch: StepInput, *, mesh: Mesh,
               cfg: ModelConfig, attention_impl: str = "reference", stream: bool = False,
               vocab_major: bool = False) -> tuple[jax.Array, ...]:
    """``forward`` over params from ``shard_params`` and pages from
    ``allocate_sharded_kv_cache``; the batch is replicated but for the page table's
    columns, split over ``kvp``. Returns (logits, KV cache), and with ``stream`` the
    residual stream after the last layer too (replicated: prompt logprobs). ``vocab_major``:
    the logits [vocab, S] (``decoder.head_logits``)."""
    kv_specs = kv_cache_specs()
    kvp_axis = "kvp" if mesh.shape["kvp"] > 1 else None
    def local(params, kv_cache, batch):
        x, kv_cache, _ = forward_stream(params, kv_cache, batch, cfg=cfg,
                                        attention_impl=attention_impl, tp_axis="tp",
                                        kvp_axis=kvp_axis)
        logits = final_logits(params, x, batch.logits_rows, cfg, vocab_major)
        return (logits, kv_cache, x) if stream else (logits, kv_cache)
    # check_vma off: the attention kernels' loop carries start as invariant constants and
    # turn varying over tp; the outputs' replication is by construction (psum, then replicated
    # norm and head), and tests hold it by comparing tokens with the unsharded engine.
    out_specs = (P(), kv_specs, P()) if stream else (P(), kv_specs)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(param_specs(params), kv_specs, batch_specs(batch)),
                         out_specs=out_specs, check_vma=False)(params, kv_cache, batch)
