"""The mesh config ``dp x spp x kvp x ep x tp`` and the ``jax.sharding.Mesh`` built from it.

One string (``"tp=2,kvp=2"``) names the whole layout so ``LLM(mesh=...)``, the CLI and the
predictor key all agree on it. ``MeshConfig`` is plain Python (the CLI parses and checks a
mesh without loading JAX); only ``make_mesh`` imports JAX."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

from jserve.config import ModelConfig
from jserve.model.tp_layout import check_tp

if TYPE_CHECKING:
    import jax

# Data, stream-pipeline, KV-cache, expert and tensor parallel. ``ep`` splits an MoE model's
# experts (whole experts a shard; everything else is replicated over it, so each ep shard
# runs the same tokens and the experts' outputs are summed over ep: jserve/model/moe.py).
AXES = ("dp", "spp", "kvp", "ep", "tp")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    dp: int = 1
    spp: int = 1
    kvp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh axis {name} must be an integer >= 1, got {value!r}")

    @classmethod
    def parse(cls, text: str | None) -> MeshConfig:
        """``"tp=2,kvp=2"`` (axes left out are 1; ``None`` or ``""`` is one device)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            name, eq, value = part.partition("=")
            name = name.strip()
            if not eq or name not in AXES:
                raise ValueError(f"bad mesh entry {part!r} in {text!r}: expected AXIS=N with "
                                 f"AXIS one of {AXES}")
            if name in sizes:
                raise ValueError(f"mesh axis {name} given twice in {text!r}")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(
                    f"mesh axis {name} needs an integer, got {value.strip()!r}") from None
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in AXES)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def key(self) -> str:
        """Short name for file keys (runtime predictors): ``"1"`` for one device."""
        parts = [f"{name}{getattr(self, name)}" for name in AXES if getattr(self, name) > 1]
        return "x".join(parts) or "1"

    def validate(self, cfg: ModelConfig) -> None:
        """Raises ValueError when the model cannot be split this way."""
        check_tp(cfg, self.tp)
        if self.ep > 1 and not cfg.num_experts:
            raise ValueError(f"ep={self.ep} splits experts, and this model has none (dense "
                             f"{cfg.architecture}); split it with tp")
        if self.ep > 1 and cfg.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide num_experts={cfg.num_experts}")


def make_mesh(mc: MeshConfig, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A mesh with axes ``AXES`` over the first ``mc.size`` of ``devices`` (default: all of
    ``jax.devices()``, every process's, so the same call is right on each host)."""
    import jax  # ``MeshConfig`` is plain Python (the CLI parses a mesh without JAX)

    devices = list(jax.devices() if devices is None else devices)
    if mc.size > len(devices):
        raise ValueError(f"mesh {mc.key()} needs {mc.size} devices, have {len(devices)}")
    return jax.make_mesh(mc.shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES),
                         devices=devices[:mc.size])
