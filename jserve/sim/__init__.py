"""Simulator: the live scheduler driven by a virtual clock and a hardware time model, so
paper-scale experiments run without GPUs (and without JAX)."""
from jserve.sim.hardware import HARDWARE_SPECS, MODEL_SHAPES, GpuTimeModel, HardwareSpec, ModelShape
from jserve.sim.simulator import VirtualClock, simulate
from jserve.sim.tokens import LengthOnlyTokens
from jserve.sim.trace import TraceRequest, read_records, read_trace, write_records

__all__ = ["GpuTimeModel", "HARDWARE_SPECS", "HardwareSpec", "LengthOnlyTokens", "MODEL_SHAPES",
           "ModelShape", "TraceRequest", "VirtualClock", "read_records", "read_trace",
           "simulate", "write_records"]
