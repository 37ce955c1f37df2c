"""Simulator: the live scheduler driven by a virtual clock and a hardware time model, so
paper-scale experiments run without GPUs (and without JAX)."""
from jserve.sim.hardware import (HARDWARE_SPECS, MODEL_SHAPES, GpuTimeModel, HardwareSpec,
                                 ModelShape)
from jserve.sim.simulator import TraceRequest, VirtualClock, simulate

__all__ = ["GpuTimeModel", "HARDWARE_SPECS", "HardwareSpec", "MODEL_SHAPES", "ModelShape",
           "TraceRequest", "VirtualClock", "simulate"]
