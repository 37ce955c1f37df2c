"""vLLM's names of jserve's engine settings, in one place for the command line and the
offline API: the well-known `vllm serve` flags jserve refuses and why (``VLLM_REFUSED``;
``LLM(...)`` refuses the same names as keyword arguments), vLLM's KV cache dtype names, the
tensor-parallel size as the mesh's tp axis, the tokenizer rule, and ``LLM``'s constructor
arguments under vLLM's names (``llm_engine_kwargs``). No JAX: the CLI's parser reads it."""
from __future__ import annotations

import os

from jserve.lora.config import lora_config
from sharding.mesh import AXES, MeshConfig

# Well-known flags of `vllm serve` that jserve refuses, and why (docs/compatibility.md); any
# other unknown flag gets argparse's "unrecognized arguments", which names it too.
_FILES_ONLY = "jserve loads a local checkpoint directory (safetensors or orbax); nothing is " \
              "downloaded"
VLLM_REFUSED = {
    "--pipeline-parallel-size": "jserve's pipeline is stream pipeline parallel: --mesh spp=N "
                                "(docs/mesh.md)",
    "-pp": "jserve's pipeline is stream pipeline parallel: --mesh spp=N (docs/mesh.md)",
    "--enable-expert-parallel": "jserve's expert parallelism is a mesh axis of its own: "
                                "--mesh ep=N splits the experts N ways (attention is "
                                "replicated over ep; add tp=M to split it, "
                                "sharding/README.md)",
    "--distributed-executor-backend": "a multi-host engine is one process per host: "
                                      "--coordinator, --num-processes (docs/multihost.md)",
    "--enforce-eager": "jserve always runs compiled XLA step programs (--warmup none "
                       "compiles each on first use instead of before serving)",
    "--compilation-config": "jserve compiles a fixed set of step programs (--warmup, "
                            "docs/startup.md)",
    "--cuda-graph-sizes": "jserve compiles a fixed set of step programs (--warmup, "
                          "docs/startup.md); no CUDA graphs",
    "--enable-chunked-prefill": "jserve chunks every prefill (its schedulers are built on "
                                "it): leave the flag out; --max-num-batched-tokens bounds a "
                                "chunk",
    "--no-enable-chunked-prefill": "jserve chunks every prefill (its schedulers are built on "
                                   "it); --max-num-batched-tokens bounds a chunk",
    "--cpu-offload-gb": "weights stay on the device",
    "--scheduling-policy": "jserve's policies are --scheduler (docs/scheduler.md); priority "
                           "is a request field",
    "--load-format": _FILES_ONLY, "--download-dir": _FILES_ONLY, "--revision": _FILES_ONLY,
    "--tokenizer-revision": _FILES_ONLY, "--code-revision": _FILES_ONLY,
    "--hf-token": _FILES_ONLY,
    "--tokenizer-mode": "jserve reads a fast tokenizer's tokenizer.json only",
    "--speculative-model": "use --speculative-config (vLLM's dict, docs/speculative.md)",
    "--guided-decoding-backend": "structured output has one backend, jserve's own "
                                 "(docs/structured_output.md)",
    "--structured-outputs-config": "structured output has one backend, jserve's own "
                                   "(docs/structured_output.md)",
    "--limit-mm-per-prompt": "jserve serves text models only",
    "--device": "JAX picks the backend (JAX_PLATFORMS=cpu|cuda|tpu)",
    "--uvicorn-log-level": "--log-level sets jserve's log level",
    "--disable-log-requests": "jserve logs no request (nothing to turn off): leave it out",
    "--enable-log-requests": "jserve does not log requests",
    "--disable-log-stats": "jserve logs no periodic stats (they are on /metrics): leave it out",
}
# vLLM's names of jserve's KV cache storage (``--kv-cache-dtype fp8``: vLLM's fp8 is e4m3).
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
# ``LLM(...)`` keywords under vLLM's names -> the ``EngineConfig`` field each sets (the CLI's
# flags of the same names are aliases of the same fields).
LLM_ALIASES = {"gpu_memory_utilization": "memory_fraction",
               "num_gpu_blocks_override": "num_kv_pages", "block_size": "page_size"}
# vLLM's KV block sizes (tokens a page): the page sizes ``--block-size`` takes.
BLOCK_SIZES = (8, 16, 32, 64, 128)
GIB = 1 << 30  # vLLM's swap_space is in GiB


def mesh_with_tp(mesh: str, tp: int | None,
                 names: tuple[str, str] = ("--tensor-parallel-size", "--mesh")) -> str:
    """``mesh`` with ``tp`` (vLLM's tensor-parallel size) as its tp axis (``mesh`` as given
    when ``tp`` is None); ValueError, naming the two settings as ``names``, when the mesh
    already names another tp."""
    if tp is None:
        return mesh
    m = MeshConfig.parse(mesh)
    if m.tp not in (1, tp):
        raise ValueError(f"{names[0]} {tp} and {names[1]} {mesh!r} (tp={m.tp}) "
                         "disagree: give tp once")
    sizes = {ax: getattr(m, ax) for ax in AXES} | {"tp": tp}
    return ",".join(f"{ax}={n}" for ax, n in sizes.items() if n > 1 or ax == "tp")


def separate_tokenizer(tokenizer: str | None, model: str) -> bool:
    """Whether vLLM's tokenizer setting names a directory other than the model's own."""
    return tokenizer is not None and tokenizer != model \
        and os.path.realpath(tokenizer) != os.path.realpath(model)


def check_tokenizer(tokenizer: str | None, model: str, name: str = "--tokenizer") -> None:
    """vLLM's tokenizer setting, checked before anything loads: None, the model's own
    directory (or name), or another directory with a fast tokenizer's tokenizer.json (its
    tokenizer_config.json and chat template beside it; ``load_model(tokenizer=...)`` reads
    it); ValueError otherwise."""
    if separate_tokenizer(tokenizer, model) \
            and not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
        raise ValueError(f"{name} {tokenizer}: no tokenizer.json there (jserve reads a fast "
                         "tokenizer's tokenizer.json and tokenizer_config.json)")


def swap_space_bytes(gib: object) -> int:
    """vLLM's ``swap_space`` (GiB of host memory for preempted sequences' KV) in bytes."""
    if not isinstance(gib, (int, float)) or isinstance(gib, bool) or not 0 <= gib < 1 << 20:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {gib!r}")
    return int(gib * GIB)


def refused_why(name: str) -> str | None:
    """Why ``LLM(name=...)`` is refused: the reason of the flag ``--name`` (None: not one)."""
    return VLLM_REFUSED.get("--" + name.replace("_", "-"))


def llm_engine_kwargs(model: str, kwargs: dict) -> dict:
    """``LLM``'s keyword arguments with vLLM's names turned into jserve's:
    ``tensor_parallel_size`` -> the mesh's tp, ``gpu_memory_utilization`` ->
    ``memory_fraction`` (in (0, 1]), ``num_gpu_blocks_override`` -> ``num_kv_pages``,
    ``block_size`` -> ``page_size``, ``swap_space`` (GiB) -> ``swap_space_bytes``,
    ``kv_cache_dtype="fp8"`` -> ``fp8_e4m3``, ``tokenizer`` (checked; ``LLM`` loads it) and
    ``trust_remote_code`` (no code runs from a checkpoint) dropped, ``seed=None`` (vLLM's
    "unseeded") as the engine's default. TypeError for a vLLM name jserve refuses (saying
    why), ValueError for a value it cannot honour; other names pass through as given."""
    kw = dict(kwargs)
    refused = [(k, why) for k in kw if (why := refused_why(k)) is not None]
    if refused:
        k, why = refused[0]
        raise TypeError(f"LLM({k}=...): vLLM's argument is not supported by jserve: {why}")
    tp = kw.pop("tensor_parallel_size", None)
    if tp is not None:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        kw["mesh"] = mesh_with_tp(kw.get("mesh", "tp=1"), tp,
                                  ("tensor_parallel_size", "mesh"))
    for vllm_name, field in LLM_ALIASES.items():
        if vllm_name in kw:
            if field in kw:
                raise TypeError(f"LLM: give {vllm_name} or {field}, not both")
            kw[field] = kw.pop(vllm_name)
    if "swap_space" in kw:
        if "swap_space_bytes" in kw:
            raise TypeError("LLM: give swap_space or swap_space_bytes, not both")
        kw["swap_space_bytes"] = swap_space_bytes(kw.pop("swap_space"))
    fraction = kw.get("memory_fraction")
    if fraction is not None and not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"gpu_memory_utilization (memory_fraction) must be in (0, 1], "
                         f"got {fraction!r}")
    if "kv_cache_dtype" in kw:
        kw["kv_cache_dtype"] = KV_CACHE_DTYPE_ALIASES.get(kw["kv_cache_dtype"],
                                                          kw["kv_cache_dtype"])
    check_tokenizer(kw.pop("tokenizer", None), model, "tokenizer")
    kw.pop("trust_remote_code", None)
    if "seed" in kw and kw["seed"] is None:
        del kw["seed"]
    lora = lora_config(*(kw.pop(k, None) for k in _LORA_KWARGS))
    if lora is not None:
        kw["lora"] = lora
    return kw


# ``LLM``'s LoRA keywords, vLLM's, in ``lora_config``'s order.
_LORA_KWARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
