"""A prompt's KV pages out of one engine and into another (prefill/decode disaggregation,
docs/scale_out.md): what runs on each engine's thread, between steps.

The pages travel by the prefix cache's own identity: a page is named by its content key
(``jserve.cache.prefix``: the digest of every token up to its end), so nothing else needs to
agree between the engines.

- **Export** (``export_pages``, on the prefill engine): the cached pages of a prompt's
  leading full pages, read as stored (quantized pages with their scales,
  ``page_io.read_pages``). The request that computed them has finished; its pages are idle
  in the prefix cache until evicted. So a page evicted before the decode engine asks is not
  sent, and the decode engine computes it.
- **Import** (``import_pages``, on the decode engine): fresh pages are allocated, written and
  registered under the same keys, then released. They sit idle in the prefix cache, and the
  request that follows finds them by its own prompt's keys, as it would a prefix it computed
  itself. Pages already cached are skipped. A pool with no room imports what fits, and the
  rest is computed. Pages are conserved: every page ends free, idle cached, or held as
  before.

The wire format is ``jserve.kv_wire``'s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import jax
import numpy as np

from jserve import kv_wire
from jserve.cache.pool import kv_bytes_per_page
from jserve.cache.prefix import extend_page_keys
from jserve.engine.device import page_io
from sharding.mesh import MeshConfig
from sharding.specs import kv_head_map

if TYPE_CHECKING:
    from jserve.engine.engine import LLMEngine


def unsupported(engine: LLMEngine) -> str | None:
    """Why ``engine`` cannot export or import pages (None: it can): the host tier's limits
    (``page_io.unmovable``), and one KV group."""
    alloc = engine.allocator
    why = page_io.unmovable(alloc, MeshConfig.parse(engine.config.mesh).spp,
                            engine.multi_process)
    return why or ("not with KV-cache parallelism (kvp > 1) yet" if alloc.groups > 1 else None)


def bytes_per_token(engine: LLMEngine) -> int:
    """Bytes of one token's KV as the pages store and send it: every layer, K and V, values
    and scales, every stored KV head (the pages are read whole, copies under tp included)."""
    cfg, config = engine.model_config, engine.config
    heads = len(kv_head_map(cfg, MeshConfig.parse(config.mesh).tp))
    return kv_bytes_per_page(cfg, 1, heads, kv_cache_dtype=config.kv_cache_dtype)


def page_keys(engine: LLMEngine, token_ids: Sequence[int], salt: str | None) -> list:
    """The keys of the prompt's pages an admission would take from the cache: its full
    pages, less the one holding its last token (always computed, for its logits)."""
    size = engine.allocator.page_size
    return extend_page_keys([], list(token_ids), size, (len(token_ids) - 1) // size, salt)


def export_pages(engine: LLMEngine, token_ids: Sequence[int], salt: str | None = None
                 ) -> bytes:
    """The wire form of the cached leading pages of ``token_ids`` (LoRA adapter ``salt``):
    as many leading pages as the prefix cache still holds, maybe none."""
    alloc = engine.allocator
    pages = alloc.lookup(page_keys(engine, token_ids, salt))
    if not pages:
        return encode(alloc.page_size, _empty(engine))
    alloc.acquire(pages)  # held while read: nothing evicts them under the copy
    try:
        data = page_io.read_pages(engine.runner.kv_cache, pages, engine.runner.programs.movers)
    finally:
        alloc.free(pages)
    return encode(alloc.page_size, data)


def import_pages(engine: LLMEngine, token_ids: Sequence[int], wire: bytes,
                 salt: str | None = None) -> tuple[int, int]:
    """Writes the pages of ``wire`` (``export_pages`` of the same prompt) into this engine's
    prefix cache, as idle cached pages under the prompt's keys; returns (pages new here,
    leading pages sent that the cache now holds: fewer than sent when the pool had no room
    for the rest). ``PageFormatError`` when they are not this engine's pages (nothing
    changed; ``kv_wire.PageFormatError``)."""
    alloc = engine.allocator
    data = decode(wire, engine.runner.kv_cache, alloc.page_size)
    sent = jax.tree.leaves(data)[0].shape[2]
    keys = page_keys(engine, token_ids, salt)[:sent]
    have, new = alloc.lookup(keys), []
    alloc.acquire(have)  # so the allocation below evicts none of them
    try:
        room = alloc.num_free  # free pages and idle cached ones (the LRU ones evicted)
        new = alloc.allocate(min(len(keys) - len(have), room)) if room else []
        if new:
            lo = len(have)
            part = jax.tree.map(lambda x: x[:, :, lo:lo + len(new)], data)
            runner = engine.runner
            runner.kv_cache = page_io.write_pages(runner.kv_cache, new, part,
                                                  runner.programs.movers)
            for page, key in zip(new, keys[lo:]):
                alloc.register(page, key)
    finally:
        alloc.free(have + new)
    return len(new), len(have) + len(new)


def _empty(engine: LLMEngine):
    return jax.tree.map(lambda x: np.zeros(x.shape[:2] + (0,) + x.shape[3:], x.dtype),
                        engine.runner.kv_cache)


def encode(page_size: int, data) -> bytes:
    """``data`` (``page_io.read_pages``'s host pages) in ``kv_wire``'s format."""
    return kv_wire.encode(page_size, jax.tree.leaves(data))


def decode(wire: bytes, like, page_size: int):
    """The host pages of ``wire`` in ``like``'s tree (the KV cache); ``PageFormatError``
    unless they fit it (``kv_wire.decode``)."""
    leaves = kv_wire.decode(wire, jax.tree.leaves(like), page_size)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
