"""The engine's command-line flags in one place. ``jserve generate / serve / profile`` and the
scripts that build an engine add them with ``add_engine_args`` and turn the parsed flags into
``EngineConfig`` fields with ``engine_kwargs``, or into an ``LLM`` with ``llm_from_args``.

No JAX here: the CLI's parser and the benchmarks import this before anything starts JAX."""
from __future__ import annotations

import argparse
import json

from jserve.config import DTYPE_CHOICES, KV_CACHE_DTYPES, QUANTIZATIONS
from jserve.engine.config import LAYER_LOOPS, RUNNERS, WARMUP_MODES, EngineConfig
from jserve.flags.vllm_names import (
    BLOCK_SIZES,
    GIB,
    KV_CACHE_DTYPE_ALIASES,
    mesh_with_tp,
    swap_space_bytes,
)
from jserve.lora.config import lora_config, parse_lora_modules
from jserve.speculative.config import SpeculativeConfig


def add_engine_args(p: argparse.ArgumentParser, warmup: str = "none", **defaults) -> None:
    """The engine's flags (``jserve generate / serve / profile`` and the scripts that build an
    engine); ``warmup``: this command's default; ``defaults``: other flags' defaults for this
    command, by destination (``max_num_seqs=8``), shown by ``--help``."""
    d = EngineConfig
    p.add_argument("--model", default="default",
                   help='"default" (built-in random model), "tiny-tasks" (built-in trained '
                        'model), an HF directory or an orbax directory')
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights and activations: auto is the checkpoint's dtype, but float32 "
                        "on a CPU backend (XLA:CPU runs bf16 about 100x slower); `jserve "
                        "serve`'s first line says which runs and why")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length, prompt and output (None: the model's, at most 8192)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="sequences decoding at once (decode rows of a step)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step at most (the prefill chunk size limit)")
    _add_memory_args(p)
    _add_step_args(p, warmup)
    if defaults:
        p.set_defaults(**defaults)


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    """The KV pool, its storage and the weights' (part of ``add_engine_args``)."""
    d = EngineConfig
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV cache budget per device in bytes (None: --memory-fraction of the "
                        "free memory; on CPU at most 4 GiB)")
    p.add_argument("--num-kv-pages", "--num-gpu-blocks-override", dest="num_kv_pages",
                   type=int, default=None,
                   help="exact KV pool per device in pages (instead of a byte budget; "
                        "--num-gpu-blocks-override: vLLM's name)")
    p.add_argument("--memory-fraction", "--gpu-memory-utilization", dest="memory_fraction",
                   type=fraction, default=d.memory_fraction,
                   help="share of the device memory still free once the weights are loaded "
                        "that the KV cache takes, when --kv-cache-bytes is not given (on CPU "
                        "at most 4 GiB). --gpu-memory-utilization F sets this to F; vLLM's F "
                        "is of the whole device for weights, activations and KV, so at the "
                        "same F jserve's pool is larger by (1 - F) x weights plus vLLM's "
                        "activation reserve (docs/compatibility.md)")
    p.add_argument("--kv-cache-dtype", type=kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   default=d.kv_cache_dtype,
                   help="how KV pages are stored: auto (the model's dtype), int8 (per token "
                        "and KV head scales) or fp8_e4m3 / fp8_e5m2 (fp8: vLLM's name of "
                        "fp8_e4m3; docs/quantization.md)")
    p.add_argument("--page-size", "--block-size", dest="page_size", type=int,
                   choices=BLOCK_SIZES, default=None,
                   help=f"tokens a KV page (--block-size: vLLM's name); None: "
                        f"{d.page_size}")
    p.add_argument("--swap-space", type=swap_gib, default=None, metavar="GIB",
                   help=f"host memory in GiB that preempted sequences' KV pages are swapped "
                        f"to (EngineConfig.swap_space_bytes); None: "
                        f"{d.swap_space_bytes / GIB:g}")
    p.add_argument("--kv-offload-bytes", type=int, default=d.kv_offload_bytes,
                   help="host-memory tier of the prefix cache in bytes: cached KV pages the "
                        "device evicts are copied to host RAM and restored by copy when a "
                        "prompt asks for them again (0: off; docs/prefix_cache.md)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="weight-only quantization on load (docs/quantization.md); None: as "
                        "the checkpoint stores the weights")



def _add_step_args(p: argparse.ArgumentParser, warmup: str) -> None:
    """The mesh, the step programs and how steps run (part of ``add_engine_args``)."""
    d = EngineConfig
    p.add_argument("--mesh", default=d.mesh,
                   help='device mesh, e.g. "tp=2,kvp=2,spp=2" (tensor, KV-cache and stream '
                        'pipeline parallel axes; dp is not supported yet)')
    p.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size",
                   type=positive_int, default=None,
                   help="vLLM's flag: the mesh's tp axis (--mesh's other axes kept; a --mesh "
                        "with another tp is an error); None: --mesh's tp")
    p.add_argument("--warmup", nargs="?", const="all", choices=WARMUP_MODES, default=warmup,
                   help="step programs compiled before the engine is ready: all (the "
                        "whole fixed set, on a thread pool: nothing compiles while serving; "
                        "--warmup alone), core (the largest step and the one-row decode; "
                        "other shapes compile in the background on first use, their steps "
                        "padded up meanwhile), background (core, then all others in the "
                        "background at once), none (each on first use, waiting)")
    p.add_argument("--no-warmup", dest="warmup", action="store_const", const="none",
                   help="the same as --warmup none")
    p.add_argument("--prefix-caching", "--enable-prefix-caching", dest="prefix_caching",
                   action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="share the KV pages of identical leading tokens between requests "
                        "(docs/prefix_cache.md; --[no-]enable-prefix-caching: vLLM's name)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d.async_scheduling,
                   help="plan and launch step N+1 while step N runs on the device (tokens "
                        "read one step late); off: every step waits for its tokens")
    p.add_argument("--decode-burst", type=_burst_steps, default=d.decode_burst,
                   help="at most this many decode steps run in one device call while "
                        "nothing waits and no running request needs the host between tokens "
                        "(1: off; auto: 4); a request arriving meanwhile waits for the "
                        "burst to end")
    p.add_argument("--layer-loop", choices=LAYER_LOOPS, default=d.layer_loop,
                   help="how the decoder layers run: loop (over stacked weights), unrolled "
                        "(per-layer arrays), sliced (unrolled over static slices), indexed "
                        "(the loop, matmuls reading each layer in place: Pallas) or auto "
                        "(docs/engine.md)")
    add_lora_args(p)
    p.add_argument("--speculative-config", type=speculative_config, default=None,
                   help='speculative decoding as JSON, vLLM\'s dict: e.g. \'{"method": '
                        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
                        "(docs/speculative.md)")
    p.add_argument("--runner", choices=RUNNERS, default=None,
                   help="generate (default), or pooling: an embedding model, each request "
                        "one prompt's embedding (/v1/embeddings; docs/server.md)")
    p.add_argument("--task", choices=["generate", "embed"], default=None,
                   help="vLLM's older spelling: embed is --runner pooling")
    p.add_argument("--pooler-config", type=json_object, default=None, metavar="JSON",
                   help='with --runner pooling, how a prompt is pooled, over what the '
                        'checkpoint says: \'{"mode": "last" | "mean", "normalize": true}\'')
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="the sampling defaults of requests that leave the fields unset: auto "
                        "reads the model directory's generation_config.json (temperature, "
                        "top_p, top_k, min_p, repetition_penalty; max_new_tokens also caps "
                        "every served request's max_tokens), vllm uses none, DIR reads DIR's")
    p.add_argument("--override-generation-config", type=json_object, default=None,
                   metavar="JSON", help='generation_config keys over those it read, e.g. '
                                        '\'{"temperature": 0.5}\'')


def json_object(text: str) -> dict:
    """A flag's JSON object, or an argparse error."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def swap_gib(text: str) -> int:
    """``--swap-space``'s type: GiB (vLLM's unit) >= 0, as bytes."""
    try:
        return swap_space_bytes(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fraction(text: str) -> float:
    """``--memory-fraction``'s type: a number in (0, 1]."""
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < f <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return f


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _burst_steps(text: str) -> int | str:
    """``--decode-burst``'s type: "auto" or an integer >= 1."""
    return text if text == "auto" else positive_int(text)


def kv_cache_dtype(text: str) -> str:
    """``--kv-cache-dtype``'s type: vLLM's names mapped to jserve's (fp8 is fp8_e4m3)."""
    return KV_CACHE_DTYPE_ALIASES.get(text, text)


def speculative_config(text: str):
    """``--speculative-config``'s type: the JSON parsed, or an argparse error."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags (docs/lora.md)."""
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters on the base model (requests pick one by the "
                        "OpenAI model field)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters to load at start: name=path (a PEFT directory), or the "
                        'JSON form \'{"name": ..., "path": ...}\'')
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapters resident on the device at once (and in one step); "
                        "default 1")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="the largest adapter rank served (the device pool's); default 16")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory (default --max-loras)")
    p.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter while "
                        "serving")


def lora_from_args(a: argparse.Namespace):
    """``--enable-lora`` and its flags as a ``LoRAConfig`` (None: off)."""
    try:
        return lora_config(getattr(a, "enable_lora", False), getattr(a, "max_loras", None),
                           getattr(a, "max_lora_rank", None),
                           getattr(a, "max_cpu_loras", None),
                           parse_lora_modules(getattr(a, "lora_modules", None)),
                           getattr(a, "enable_runtime_lora_updating", False))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def engine_kwargs(a: argparse.Namespace) -> dict:
    """``EngineConfig`` fields from ``add_engine_args``'s flags. A flag left unset (None) is
    left out, so the caller's own default for it holds (``EngineConfig``'s, or a benchmark's
    such as a trace's ``max_model_len``)."""
    kw = dict(max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_bytes=a.kv_cache_bytes,
              num_kv_pages=a.num_kv_pages, memory_fraction=a.memory_fraction,
              warmup=a.warmup, enable_prefix_caching=a.prefix_caching,
              mesh=mesh_with_tp(a.mesh, getattr(a, "tensor_parallel_size", None)),
              async_scheduling=a.async_scheduling, kv_cache_dtype=a.kv_cache_dtype,
              speculative_config=a.speculative_config, decode_burst=a.decode_burst,
              layer_loop=a.layer_loop,
              kv_offload_bytes=a.kv_offload_bytes, page_size=a.page_size,
              swap_space_bytes=a.swap_space, runner=runner(a),
              pooler_config=getattr(a, "pooler_config", None), lora=lora_from_args(a))
    return {k: v for k, v in kw.items() if v is not None}


def runner(a: argparse.Namespace) -> str | None:
    """``--runner``, or vLLM's older ``--task`` (embed: pooling); both given must agree."""
    task = {"embed": "pooling", "generate": "generate", None: None}[getattr(a, "task", None)]
    given = getattr(a, "runner", None)
    if task is not None and given is not None and task != given:
        raise SystemExit(f"--task {a.task} means --runner {task}, not --runner {given}")
    return given or task


def llm_kwargs(a: argparse.Namespace) -> dict:
    """``LLM``'s keyword arguments from the flags: ``engine_kwargs`` plus the load-time
    ``dtype`` and ``quantization`` (left out when unset)."""
    load = {k: v for k, v in (("dtype", a.dtype), ("quantization", a.quantization),
                              ("generation_config", a.generation_config),
                              ("override_generation_config", a.override_generation_config))
            if v is not None}
    return {**load, **engine_kwargs(a)}


def llm_from_args(a: argparse.Namespace, **overrides):
    """``LLM(--model, ...)`` built from ``add_engine_args``'s flags; ``overrides``: further
    ``LLM`` keyword arguments (``scheduler=...``), which win over the flags."""
    from jserve.llm import LLM  # loads JAX and the engine: only once an engine is built

    return LLM(a.model, **{**llm_kwargs(a), **overrides})
