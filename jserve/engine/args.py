"""The engine's command-line flags in one place. ``jserve generate / serve / profile`` and the
scripts that build an engine add them with ``add_engine_args`` and turn the parsed flags into
``EngineConfig`` fields with ``engine_kwargs``, or into an ``LLM`` with ``llm_from_args``.

No JAX here: the CLI's parser and the benchmarks import this before anything starts JAX."""
from __future__ import annotations

import argparse

from jserve.config import KV_CACHE_DTYPES, QUANTIZATIONS
from jserve.engine.config import WARMUP_MODES, EngineConfig
from jserve.speculative.config import SpeculativeConfig


def add_engine_args(p: argparse.ArgumentParser, warmup: str = "none", **defaults) -> None:
    """The engine's flags (``jserve generate / serve / profile`` and the scripts that build an
    engine); ``warmup``: this command's default; ``defaults``: other flags' defaults for this
    command, by destination (``max_num_seqs=8``), shown by ``--help``."""
    d = EngineConfig
    p.add_argument("--model", default="default",
                   help='"default" (built-in random model), "tiny-tasks" (built-in trained '
                        'model), an HF directory or an orbax directory')
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights and activations (None: the checkpoint's own dtype)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length, prompt and output (None: the model's, at most 8192)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences decoding at once (decode rows of a step)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step at most (the prefill chunk size limit)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV cache budget per device in bytes (None: --memory-fraction of the "
                        "free memory; on CPU at most 4 GiB)")
    p.add_argument("--num-kv-pages", type=int, default=None,
                   help="exact KV pool per device in pages (instead of a byte budget)")
    p.add_argument("--memory-fraction", type=float, default=d.memory_fraction,
                   help="share of the device's free memory (after the weights) the KV cache "
                        "takes when --kv-cache-bytes is not given")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="how KV pages are stored: auto (the model's dtype), int8 (per token "
                        "and KV head scales) or fp8 (docs/quantization.md)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="weight-only quantization on load (docs/quantization.md); None: as "
                        "the checkpoint stores the weights")
    p.add_argument("--mesh", default=d.mesh,
                   help='device mesh, e.g. "tp=2,kvp=2,spp=2" (tensor, KV-cache and stream '
                        'pipeline parallel axes; dp is not supported yet)')
    p.add_argument("--warmup", nargs="?", const="all", choices=WARMUP_MODES, default=warmup,
                   help="step programs compiled before the engine is ready: core (the "
                        "largest step and the one-row decode; other shapes compile in the "
                        "background on first use, their steps padded up meanwhile), "
                        "background (core, then all others in the background at once), all "
                        "(every shape; --warmup alone), none (each on first use, waiting)")
    p.add_argument("--no-warmup", dest="warmup", action="store_const", const="none",
                   help="the same as --warmup none")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching,
                   help="share the KV pages of identical leading tokens between requests "
                        "(docs/prefix_cache.md)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d.async_scheduling,
                   help="plan and launch step N+1 while step N runs on the device (tokens "
                        "read one step late); off: every step waits for its tokens")
    p.add_argument("--decode-burst", type=int, default=d.decode_burst,
                   help="decode steps run in one device call while nothing waits and no "
                        "running request needs the host between tokens (1: off); a request "
                        "arriving meanwhile waits for the burst to end")
    p.add_argument("--speculative-config", type=speculative_config, default=None,
                   help='speculative decoding as JSON, vLLM\'s dict: e.g. \'{"method": '
                        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
                        "(docs/speculative.md)")
    if defaults:
        p.set_defaults(**defaults)


def speculative_config(text: str):
    """``--speculative-config``'s type: the JSON parsed, or an argparse error."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_kwargs(a: argparse.Namespace) -> dict:
    """``EngineConfig`` fields from ``add_engine_args``'s flags. A flag left unset (None) is
    left out, so the caller's own default for it holds (``EngineConfig``'s, or a benchmark's
    such as a trace's ``max_model_len``)."""
    kw = dict(max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_bytes=a.kv_cache_bytes,
              num_kv_pages=a.num_kv_pages, memory_fraction=a.memory_fraction,
              warmup=a.warmup, mesh=a.mesh, enable_prefix_caching=a.prefix_caching,
              async_scheduling=a.async_scheduling, kv_cache_dtype=a.kv_cache_dtype,
              speculative_config=a.speculative_config, decode_burst=a.decode_burst)
    return {k: v for k, v in kw.items() if v is not None}


def llm_kwargs(a: argparse.Namespace) -> dict:
    """``LLM``'s keyword arguments from the flags: ``engine_kwargs`` plus the load-time
    ``dtype`` and ``quantization`` (left out when unset)."""
    load = {k: v for k, v in (("dtype", a.dtype), ("quantization", a.quantization))
            if v is not None}
    return {**load, **engine_kwargs(a)}


def llm_from_args(a: argparse.Namespace, **overrides):
    """``LLM(--model, ...)`` built from ``add_engine_args``'s flags; ``overrides``: further
    ``LLM`` keyword arguments (``scheduler=...``), which win over the flags."""
    from jserve.llm import LLM  # loads JAX and the engine: only once an engine is built

    return LLM(a.model, **{**llm_kwargs(a), **overrides})
