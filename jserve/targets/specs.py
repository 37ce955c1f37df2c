"""The accelerators jserve compiles for on a host without them, and their compile-only
devices. A GPU is an XLA ``GpuTargetConfigProto`` written from the facts below (the
hardware figures of openxla/xla's ``xla/backends/gpu/target_config/specs/*.txtpb``, kept to
the fields jax 0.10.2's proto knows); a TPU is a libtpu topology by name. Peak rates are
the vendors' dense bf16 figures, for the roofline."""
from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Target:
    """One accelerator kind: what the roofline and the plan need, and how to get its
    compile-only devices (``topology``: libtpu's name for TPUs; GPUs: one host's)."""

    name: str
    platform: str  # "gpu" | "tpu"
    device_kind: str
    memory_bytes: int  # one device's
    bandwidth: float  # bytes/s, one device's HBM
    peak_flops: float  # bf16 dense, one device
    topology: str
    max_devices: int  # devices the topology holds
    gpu: dict | None = None  # gpu_device_info facts (GPUs)
    launch_seconds: float = 0.0  # a kernel launch outside a CUDA graph, for the roofline

    def target_config(self) -> str | None:
        """The ``GpuTargetConfigProto`` text of a GPU (None for a TPU)."""
        if self.gpu is None:
            return None
        g = dict(self.gpu)
        major, minor = g.pop("compute_capability")
        fields = "".join(f"  {k}: {v}\n" for k, v in g.items())
        return (f"gpu_device_info {{\n{fields}"
                f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
                f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 10 }}\n'
                f'device_description_str: "{self.device_kind}"\n')


def _hopper_or_later(cores: int, bandwidth: int, l2: int, clock: float, memory: int,
                     major: int) -> dict:
    return dict(threads_per_block_limit=1024, threads_per_warp=32,
                shared_memory_per_block=49152, shared_memory_per_core=233472,
                threads_per_core_limit=2048, core_count=cores, fpus_per_core=128,
                block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
                memory_bandwidth=bandwidth, l2_cache_size=l2, clock_rate_ghz=clock,
                device_memory_size=memory, shared_memory_per_block_optin=232448,
                registers_per_core_limit=65536, registers_per_block_limit=65536,
                compute_capability=(major, 0))


def _gpu(name: str, kind: str, memory: int, bandwidth: int, flops: float, cores: int,
         l2: int, clock: float, major: int) -> Target:
    return Target(name, "gpu", kind, memory, float(bandwidth), flops, "1x1x{n}", 8,
                  _hopper_or_later(cores, bandwidth, l2, clock, memory, major),
                  launch_seconds=4e-6)


def _tpu(name: str, kind: str, memory: int, bandwidth: float, flops: float,
         topology: str, max_devices: int) -> Target:
    return Target(name, "tpu", kind, memory, bandwidth, flops, topology, max_devices,
                  launch_seconds=0.0)


_GiB = 1 << 30
TARGETS: dict[str, Target] = {t.name: t for t in (
    _gpu("h100", "NVIDIA H100 80GB HBM3", 84942979072, 3352320000000, 989e12, 132,
         52428800, 1.98, 9),
    _gpu("h200", "NVIDIA H200 141GB HBM3e", 151397597184, 4800000000000, 989e12, 132,
         52428800, 1.98, 9),
    _gpu("b200", "NVIDIA B200", 191514411008, 7672320000000, 2250e12, 148, 132644864,
         1.965, 10),
    # libtpu's host bounds are 2x2: a one-chip program uses the first of four devices.
    _tpu("v5e", "TPU v5 lite", 16 * _GiB, 819e9, 197e12, "v5e:2x2", 4),
    _tpu("v6e", "TPU v6 lite", 32 * _GiB, 1640e9, 918e12, "v6e:2x2", 4),
    _tpu("v5p", "TPU v5", 95 * _GiB, 2765e9, 459e12, "v5p:2x2x1", 4),
)}


def target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; choose from {sorted(TARGETS)}") from None


@functools.cache
def devices(name: str, count: int = 1) -> tuple:
    """``count`` compile-only devices of target ``name`` (its plugin must be installed:
    ``jax[cuda13]`` for GPUs, ``jax[tpu]`` for TPUs). Programs compiled on them are XLA's
    real ones for that target; none can run here."""
    import os

    from jax.experimental import topologies

    # No TPU is opened: let several processes (the suite's workers) load libtpu at once,
    # and tell it it is not on a TPU VM (it asks the metadata server otherwise).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    t = target(name)
    if not 1 <= count <= t.max_devices:
        raise ValueError(f"{name}: 1 to {t.max_devices} devices, not {count}")
    try:
        if t.platform == "gpu":
            topo = topologies.get_topology_desc(
                name, "cuda", target_config=t.target_config(),
                topology=t.topology.format(n=count))
        else:
            topo = topologies.get_topology_desc(topology_name=t.topology, platform="tpu")
    except Exception as e:  # noqa: BLE001 - the plugin's own error, with what to install
        extra = "cuda" if t.platform == "gpu" else "tpu"
        raise RuntimeError(f"cannot make compile-only {name} devices ({e}); install "
                           f"jserve[{extra}]") from e
    found = tuple(topo.devices)[:count]
    if len(found) < count:
        raise ValueError(f"{name}: the topology has {len(found)} devices, not {count}")
    return found
