"""Multi-process serving: one engine per process over a mesh that spans all of them.

A jitted computation on a multi-process mesh runs only when every process launches it with
the same inputs, but only process 0 (the leader) has requests, a scheduler and a tokenizer.
So the leader plans each step as usual and broadcasts what the device step needs: a small
header (the bucket shape, whether it samples, whether it is a lone pass through every
pipeline stage, whether it has a structured-output bitmask) and the step's two packed
buffers (one row per pipeline slot under spp, one step's for a pass;
``StepRunner.buffer_shapes``), then the bitmask if it has one. Followers
(``follow``) sit in a loop receiving those and launching the same compiled step, until the
leader broadcasts a stop. Step outputs are replicated; only the leader reads them.

The step itself is the caller's: any ``StepRunner`` (the engine's ``ModelRunner``).
"""
from __future__ import annotations

from typing import Protocol

import jax
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all
from jax.sharding import Mesh

from jserve.sampling.sampler import SampleResult

_STEP, _STOP = 1, 0


class StepRunner(Protocol):
    """What multi-process serving needs of the compiled model step."""
    mesh: Mesh

    def buffer_shapes(self, shape: tuple[int, int], lone: bool = False
                      ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The shapes of the int32 and float32 buffers and the bitmask a step (``lone``: a
        pass) of ``shape`` takes."""

    def execute_packed(self, shape: tuple[int, int], ibuf: np.ndarray, fbuf: np.ndarray,
                       masks: np.ndarray | None = None, sample: bool = True,
                       lone: bool = False) -> SampleResult:
        """Runs the step for ``shape`` on packed host buffers and bitmask (None: no row
        has one; ``sample`` False: no sampling, host zeros back; ``lone``: a pass through
        every pipeline stage), the same on every process."""


def initialize(coordinator: str, num_processes: int, process_id: int,
               local_device_count: int | None = None) -> None:
    """``jax.distributed.initialize`` with CPU collectives over gloo (without them a CPU
    psum across processes has no transport). ``local_device_count`` sets this process's CPU
    devices, like ``--xla_force_host_platform_device_count``; call before any JAX work."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.distributed.initialize(coordinator, num_processes, process_id)


def is_leader() -> bool:
    return jax.process_index() == 0


def _header(kind: int, shape: tuple[int, int] = (0, 0), sample: bool = True,
            lone: bool = False, masked: bool = False) -> np.ndarray:
    return np.array([kind, *shape, sample, lone, masked], np.int32)


def _run(runner: StepRunner, shape: tuple[int, int], ibuf: np.ndarray, fbuf: np.ndarray,
         masks: np.ndarray | None, sample: bool, lone: bool) -> SampleResult:
    """Every process calls this with the same host buffers (the runner makes the global
    arrays its programs take); the result is this process's copy of the replicated
    outputs."""
    out = runner.execute_packed(shape, ibuf, fbuf, masks, sample, lone)
    return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x,
                        out)


def leader_execute(runner: StepRunner, shape: tuple[int, int], ibuf: np.ndarray,
                   fbuf: np.ndarray, masks: np.ndarray | None = None, sample: bool = True,
                   lone: bool = False) -> SampleResult:
    """The leader's ``runner.execute_packed``: broadcast the step, then run it like the
    followers."""
    broadcast_one_to_all(_header(_STEP, shape, sample, lone, masks is not None))
    ibuf, fbuf = broadcast_one_to_all((ibuf, fbuf))
    if masks is not None:
        masks = broadcast_one_to_all(masks)
    return _run(runner, shape, ibuf, fbuf, masks, sample, lone)


def stop_followers() -> None:
    """Ends every follower's ``follow`` loop; the leader calls it once, when done serving."""
    broadcast_one_to_all(_header(_STOP))


def follow(runner: StepRunner) -> int:
    """A follower's main loop: run each step the leader broadcasts until it says stop.
    Returns the number of steps run."""
    steps = 0
    while True:
        kind, bd, tp, sample, lone, masked = broadcast_one_to_all(_header(_STOP)).tolist()
        if kind == _STOP:
            return steps
        shape = (bd, tp)
        ishape, fshape, mshape = runner.buffer_shapes(shape, bool(lone))
        ibuf, fbuf = broadcast_one_to_all((np.zeros(ishape, np.int32),
                                           np.zeros(fshape, np.float32)))
        masks = broadcast_one_to_all(np.zeros(mshape, np.int32)) if masked else None
        _run(runner, shape, ibuf, fbuf, masks, bool(sample), bool(lone))
        steps += 1
