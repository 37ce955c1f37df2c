"""Multi-process serving: one engine per process over a mesh that spans all of them.

A jitted computation on a multi-process mesh runs only when every process launches it with
the same inputs, but only process 0 (the leader) has requests, a scheduler and a tokenizer.
So the leader plans each step as usual and broadcasts what the device step needs: a small
header (the bucket shape, its ``Launch``, whether it has a structured-output bitmask) and
the step's two packed buffers (one row per pipeline slot under spp, one step's for a pass;
``StepRunner.buffer_shapes``), then the bitmask if it has one. Followers (``follow``) sit
in a loop receiving those and launching the same compiled step, until the
leader broadcasts a stop. Step outputs are replicated; only the leader reads them.

The step itself is the caller's: any ``StepRunner`` (the engine's ``ModelRunner``).
"""
from __future__ import annotations

import enum
from typing import Protocol

import jax
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all
from jax.sharding import Mesh

from jserve.sampling.sampler import SampleResult

_STEP, _STOP = 1, 0


class Launch(enum.Enum):
    """How ``StepRunner.execute_packed`` runs a step's packed buffers and what it hands back:
    one value per way (the header carries it to the followers)."""

    STEP = 0
    """Run and sample. With spp == 1 the step's own executable samples (a row that needs
    more than greedy or temperature: the sampling executable after it); with spp > 1 one
    pipeline tick, buffers [spp, size] (row ``s``: the batch stage ``s`` runs), then the
    sampling executable on the batch that leaves the last stage (the last row)."""

    FORWARD = 1
    """spp == 1, masks not known at launch: the forward alone. The result is its
    ``SampleInputs`` (its logits, the rest made from its buffers), which the caller hands to
    ``sample`` with the masks once it has them."""

    NO_EXIT = 2
    """A pipeline tick no batch leaves (its last slot empty): nothing samples, and the result
    is host zeros, so the caller does not wait for the tick."""

    PASS = 3
    """spp > 1, the pipeline empty: one batch's buffers [size] through every stage in one
    executable (``pipeline.lone_pass``), then sampled; the carry is left as it is."""


class StepRunner(Protocol):
    """What multi-process serving needs of the compiled model step."""
    mesh: Mesh

    def buffer_shapes(self, shape: tuple[int, int], launch: Launch = Launch.STEP
                      ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The shapes of the int32 and float32 buffers and the bitmask a ``launch`` of
        ``shape`` takes."""

    def execute_packed(self, shape: tuple[int, int], ibuf: np.ndarray, fbuf: np.ndarray,
                       masks: np.ndarray | None = None, launch: Launch = Launch.STEP
                       ) -> SampleResult:
        """Runs the step for ``shape`` on packed host buffers and bitmask (None: no row
        has one) as ``launch`` says, the same on every process."""


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


def _header(kind: int, shape: tuple[int, int] = (0, 0), launch: Launch = Launch.STEP,
            masked: bool = False) -> np.ndarray:
    return np.array([kind, *shape, launch.value, masked], np.int32)


def _run(runner: StepRunner, shape: tuple[int, int], ibuf: np.ndarray, fbuf: np.ndarray,
         masks: np.ndarray | None, launch: Launch) -> SampleResult:
    """Every process calls this with the same host buffers (the runner makes the global
    arrays its programs take); the result is this process's copy of the replicated
    outputs."""
    out = runner.execute_packed(shape, ibuf, fbuf, masks, launch)
    return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x,
                        out)


def leader_execute(runner: StepRunner, shape: tuple[int, int], ibuf: np.ndarray,
                   fbuf: np.ndarray, masks: np.ndarray | None = None,
                   launch: Launch = Launch.STEP) -> SampleResult:
    """The leader's ``runner.execute_packed``: broadcast the step, then run it like the
    followers."""
    broadcast_one_to_all(_header(_STEP, shape, launch, masks is not None))
    ibuf, fbuf = broadcast_one_to_all((ibuf, fbuf))
    if masks is not None:
        masks = broadcast_one_to_all(masks)
    return _run(runner, shape, ibuf, fbuf, masks, launch)


def stop_followers() -> None:
    """Ends every follower's ``follow`` loop; the leader calls it once, when done serving."""
    broadcast_one_to_all(_header(_STOP))


def follow(runner: StepRunner) -> int:
    """A follower's main loop: run each step the leader broadcasts until it says stop.
    Returns the number of steps run."""
    steps = 0
    while True:
        kind, bd, tp, launch, masked = broadcast_one_to_all(_header(_STOP)).tolist()
        if kind == _STOP:
            return steps
        shape, launch = (bd, tp), Launch(launch)
        ishape, fshape, mshape = runner.buffer_shapes(shape, launch)
        ibuf, fbuf = broadcast_one_to_all((np.zeros(ishape, np.int32),
                                           np.zeros(fshape, np.float32)))
        masks = broadcast_one_to_all(np.zeros(mshape, np.int32)) if masked else None
        _run(runner, shape, ibuf, fbuf, masks, launch)
        steps += 1
