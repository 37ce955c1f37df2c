"""Attention on XLA:CPU with native kernels (``attention_impl="cpu"``).

XLA:CPU runs the jnp reference's attention as page gathers (a copy of every KV page read)
and many small batched dots inside loops: about a fifth of a batch-32 decode step of the
bench model on a 2-core VM, and a long prompt's prefill attention at about a quarter of the
matmul rate with one core idle (docs/kernels.md). The decode rows and the prefill chunks go
instead to C++ kernels (``native/cpu_decode_attention.cc``, ``native/cpu_prefill_attention.cc``)
called through the XLA FFI: they read the pages in place with an online softmax, on XLA's
own intra-op threads. What a kernel does not take (``decode_supported``,
``prefill_supported``: fp8 pages, odd head sizes) stays on the reference, so every batch the
reference serves is served.

The kernels (and the MoE experts' kernel of ``cpu_moe``) are compiled on first use, into one
library, with the system's C++ compiler
against the FFI headers jaxlib ships, for this CPU (``-march=native``), into a cache keyed by
the sources, the flags, jaxlib's version and the CPU (``$JSERVE_KERNEL_CACHE``, default
``~/.cache/jserve/kernels``). Without a compiler, or if the build fails, ``available()`` is
False (logged once) and ``attention_impl="auto"`` means the reference on CPU, as before.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jserve.kernels import blocks, kv_quant, reference
from jserve.kernels.blocks import window_start
from jserve.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

_NATIVE = Path(__file__).with_name("native")
_SOURCES = (_NATIVE / "cpu_decode_attention.cc", _NATIVE / "cpu_prefill_attention.cc",
            _NATIVE / "cpu_moe.cc")
_HEADERS = (_NATIVE / "elements.h", _NATIVE / "pool.h")
# FFI target names and the library's handler symbols
_TARGETS = {"jserve_cpu_decode_attention": "JserveCpuDecodeAttention",
            "jserve_cpu_prefill_attention": "JserveCpuPrefillAttention",
            "jserve_cpu_moe_experts": "JserveCpuMoeExperts"}
_DECODE, _PREFILL, MOE_EXPERTS = _TARGETS
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
_MAX_GROUP, _MAX_DIM, _MAX_PAGE = 16, 256, 256  # the kernel's limits
_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "error": why not


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(next((ln for ln in lines if ln.startswith(k)), "")
                       for k in ("model name", "flags"))
    except OSError:
        return platform.processor()


def _library_path() -> Path:
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in _SOURCES + _HEADERS), " ".join(_FLAGS).encode(),
                 jax.lib.__version__.encode(), platform.machine().encode(),
                 _cpu_identity().encode()):
        key.update(part)
    root = Path(os.environ.get("JSERVE_KERNEL_CACHE",
                               Path.home() / ".cache" / "jserve" / "kernels"))
    return root / key.hexdigest()[:16] / "libjserve_cpu_kernels.so"


def _build(path: Path) -> None:
    """Compiles the kernel to ``path`` (atomically: parallel processes may race here)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) found")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        proc = subprocess.run([compiler, *_FLAGS, "-I", jax.ffi.include_dir(),
                               *map(str, _SOURCES),
                               "-o", str(out)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, path)


def available() -> bool:
    """Whether the native kernels are built, loaded and registered with XLA (tried once per
    process; the first call may compile them, a few seconds)."""
    with _lock:
        if "ok" not in _state:
            try:
                path = _library_path()
                if not path.exists():
                    _build(path)
                lib = ctypes.cdll.LoadLibrary(str(path))
                for target, symbol in _TARGETS.items():
                    jax.ffi.register_ffi_target(
                        target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state["ok"] = True
            except Exception as e:  # noqa: BLE001 - the reference serves instead
                _state.update(ok=False, error=str(e))
                log.warning("native CPU kernels unavailable, using the XLA ways: %s",
                            e)
        return _state["ok"]


def unavailable() -> str | None:
    """Why the native kernels are not available (None when they are, or not tried yet)."""
    return _state.get("error")


def decode_supported(q: jax.Array, k_pages) -> bool:
    """Whether the kernel takes these shapes and dtypes (else the reference runs)."""
    _, scales = kv_quant.split(k_pages)
    hkv, _, g, d = q.shape
    return (scales is None and k_pages.dtype in (jnp.float32, jnp.bfloat16)
            and g <= _MAX_GROUP and d <= _MAX_DIM and k_pages.shape[-2] <= _MAX_PAGE
            and available())


def _decode_attention(q, k_pages, v_pages, kv_lens, page_table, pages_per_block, scale,
                      layer=None, kv_starts=None):
    """The reference's ``_decode_attention`` contract (q [Hkv, B, G, D]; pages one layer's or
    stacked with ``layer``; ``kv_starts`` each row's sliding-window start) on the native
    kernel where it applies."""
    if not decode_supported(q, k_pages):
        return reference._decode_attention(q, k_pages, v_pages, kv_lens, page_table,
                                           pages_per_block, scale, layer, kv_starts)
    if kv_starts is None:
        kv_starts = jnp.zeros_like(kv_lens)
    (k_pages, at), (v_pages, _) = blocks.stacked(k_pages, layer), blocks.stacked(v_pages, layer)
    hkv, b, g, d = q.shape
    return jax.ffi.ffi_call(
        _DECODE, (jax.ShapeDtypeStruct((hkv, b, g, d), jnp.float32),
                  jax.ShapeDtypeStruct((hkv, b, g), jnp.float32)))(
        q.astype(jnp.float32), k_pages, v_pages, at, kv_lens.astype(jnp.int32),
        kv_starts.astype(jnp.int32), page_table.astype(jnp.int32), scale=np.float32(scale))


def prefill_supported(q: jax.Array, k_pages) -> bool:
    """Whether the prefill kernel takes these shapes and dtypes: float32, bfloat16 or int8
    pages (fp8 stays on the reference), head_dim a multiple of 16 up to 256."""
    values, _ = kv_quant.split(k_pages)
    d = q.shape[-1]
    return (values.dtype in (jnp.float32, jnp.bfloat16, jnp.int8)
            and d % 16 == 0 and d <= _MAX_DIM and available())


def _prefill_attention(q, q_seq, q_pos, k_pages, v_pages, kv_lens, page_table, num_seqs,
                       pages_per_block, scale, rows_per_tile, layer=None, window=None):
    """The reference's ``_prefill_attention`` contract (q [Hkv, T, G, D] of several
    sequences' contiguous chunks) on the native kernel where it applies."""
    if not prefill_supported(q, k_pages):
        return reference._prefill_attention(q, q_seq, q_pos, k_pages, v_pages, kv_lens,
                                            page_table, num_seqs, pages_per_block, scale,
                                            rows_per_tile, layer, window)
    (k_pages, at), (v_pages, _) = blocks.stacked(k_pages, layer), blocks.stacked(v_pages, layer)
    (k_values, k_scales), (v_values, v_scales) = kv_quant.split(k_pages), kv_quant.split(v_pages)
    none = jnp.zeros((1,), jnp.float32)
    q_lo = jnp.zeros_like(q_pos) if window is None else window_start(q_pos, window)
    hkv, t, g, d = q.shape
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return jax.ffi.ffi_call(
        _PREFILL, (jax.ShapeDtypeStruct((hkv, t, g, d), jnp.float32),
                   jax.ShapeDtypeStruct((hkv, t, g), jnp.float32)))(
        q.astype(jnp.float32) * scale, k_values, v_values,
        none if k_scales is None else k_scales, none if v_scales is None else v_scales,
        at, i32(q_seq), i32(q_pos), i32(q_lo), i32(kv_lens), i32(page_table),
        i32(num_seqs).reshape(1))


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           meta: AttentionMetadata, *, layer=None, window=None
                           ) -> tuple[jax.Array, jax.Array]:
    """``reference.ragged_paged_attention`` with its decode rows and prefill chunks on the
    native kernels (which start each row at its sliding ``window``'s first key)."""
    return reference.ragged_paged_attention(q, k_pages, v_pages, meta, layer=layer,
                                            decode=_decode_attention,
                                            prefill=_prefill_attention, window=window)
