"""Decode at batch 1 under other XLA flags, for the device check (``scripts/device_check.py``):
XLA reads its flags once per process, so each set runs in a child process
(``python -m harness.device_flags``) that builds the timing model's engine anew and
times its plain steps and its bursts, as the parent does without the flags.

The one set measured: command buffers (CUDA graphs) that also take ``while`` loops and
conditionals. Outside a command buffer, XLA:GPU's conditional copies its predicate to the
host and waits for the device (openxla/xla ``ConditionalThunk::ExecuteOnStream``), and so
does a ``while`` without a trip count known when compiling; a decode step program has a burst
loop and a few run-time switches, so without them the step executable call waits for the
device several times a step (docs/device.md)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from harness.child_rows import child_rows

CONTROL_FLOW_GRAPHS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
                       "CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL")


def measure(profile: dict, model: str, impl: str, peaks: list, seed: int, flags: str
            ) -> None:
    """Prints one decode row per burst length (1, the profile's), batch 1, tagged with
    ``flags``."""
    from harness.device_profiles import Profile
    from harness.device_timings import ModelTimings
    p = Profile(**profile)
    out = dict(decode=[], errors=[])
    m = ModelTimings(p, model, impl, tuple(peaks), seed, out)
    for burst in (1, p.decode_burst):
        m.decode(1, burst)
        print(json.dumps(dict(out["decode"][-1], xla_flags=flags)), flush=True)


def measure_in_child(profile, model: str, impl: str, peaks, seed: int, flags: str,
                     timeout: float) -> list[dict]:
    """``measure`` in a fresh process with ``flags`` added to ``XLA_FLAGS``, killed after
    ``timeout`` seconds (the rows printed by then are kept)."""
    env = {"XLA_FLAGS": " ".join(filter(None, (os.environ.get("XLA_FLAGS"), flags)))}
    return child_rows("harness.device_flags", dict(
        profile=dataclasses.asdict(profile), model=model, impl=impl, peaks=list(peaks),
        seed=seed, flags=flags), timeout, f"decode under {flags}", env)


if __name__ == "__main__":
    measure(**json.loads(sys.argv[1]))
