"""The one answer to "which platform are these programs for": JAX's default backend, or,
while ``jserve compile`` builds a target's programs on compile-only devices
(``jserve.targets``), that target's platform. Everything that picks a program's kernels or
shape by platform (the attention kernels' interpret flag, the layer mode, the argmax, the
compute dtype) asks here, so a GPU or TPU program compiled on a CPU host is the one that
host would run. Process-wide on purpose: the engine's compile threads must see it too."""
from __future__ import annotations

import contextlib
import threading

_lock = threading.Lock()
_target: str | None = None


def current() -> str:
    """"cpu", "gpu" or "tpu": the platform programs are built for now."""
    if _target is not None:
        return _target
    import jax  # plain-Python callers (the CLI's parsers) import this module without JAX

    return jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str):
    """Programs traced inside are for ``platform`` (one target at a time per process)."""
    global _target
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be cpu, gpu or tpu, got {platform!r}")
    with _lock:
        if _target not in (None, platform):
            raise RuntimeError(f"already compiling for {_target}")
        before, _target = _target, platform
    try:
        yield
    finally:
        _target = before


def branches_cheap() -> bool:
    """Whether a run-time branch (``lax.cond``) is cheap on the platform. XLA:CPU runs a
    conditional in line and aliases what a branch passes on unchanged; a TPU branches on
    the device (and its scatters, which an unconditional update would need, are loops).
    XLA:GPU reads the predicate on the host, waiting for the device (outside CUDA graphs),
    and copies each buffer a branch passes on (the 1B shape's decode step copied its 24 MB
    penalty state and 37 MB of handed-on logits so every step). Where branches are not
    cheap a program does cheap work unconditionally (writes dropped or in place, no-ops
    bit for bit) and keeps branches for work worth a sync."""
    return current() != "gpu"
