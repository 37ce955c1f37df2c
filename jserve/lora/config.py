"""What a user names and sets: an adapter (``LoRARequest``, vLLM's) and the engine's LoRA
settings (``LoRAConfig``, from ``--enable-lora`` and its flags)."""
from __future__ import annotations

import dataclasses
import json

from jserve.fields import FieldError


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, as vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``:
    the name requests select it by (the OpenAI ``model`` field), a positive id, and the
    directory PEFT saved it in."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise FieldError("lora_name", "an adapter needs a non-empty name")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``max_loras``: adapters resident on the device at once (the slot pool, and the most
    distinct adapters one step holds); ``max_lora_rank``: the pool's rank (an adapter of
    higher rank is refused); ``max_cpu_loras``: adapters kept read on the host (default
    ``max_loras``); ``modules``: (name, path) adapters known at start; ``runtime_updating``:
    adapters may be loaded and unloaded while serving (vLLM's
    ``--enable-runtime-lora-updating``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()
    runtime_updating: bool = False

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora modules name an adapter twice: {names}")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


def pool_size(config: LoRAConfig | None) -> tuple[int, int] | None:
    """(slots, rank) of the device pool (``jserve.model.lora``); None without LoRA."""
    return None if config is None else (config.max_loras, config.max_lora_rank)


def lora_module_bases(values: list[str] | None) -> dict[str, str]:
    """The ``base_model_name`` each JSON ``--lora-modules`` entry gives (name -> base): the
    server refuses one that is not a name of the model it serves."""
    bases = {}
    for v in values or ():
        if v.strip().startswith("{"):
            d = json.loads(v)
            if d.get("base_model_name"):
                bases[str(d["name"])] = str(d["base_model_name"])
    return bases


def parse_lora_modules(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """``--lora-modules`` entries as vLLM takes them: ``name=path``, or the JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (the base checked by the server:
    ``lora_module_bases``)."""
    out = []
    for v in values or ():
        v = v.strip()
        if v.startswith("{"):
            try:
                d = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {v!r} is not JSON: {e}") from None
            if not isinstance(d, dict) or not d.get("name") or not d.get("path"):
                raise ValueError(f"--lora-modules: {v!r} needs \"name\" and \"path\"")
            out.append((str(d["name"]), str(d["path"])))
            continue
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {v!r} is not name=path")
        out.append((name, path))
    return tuple(out)


def lora_config(enable_lora: bool = False, max_loras: int | None = None,
                max_lora_rank: int | None = None, max_cpu_loras: int | None = None,
                modules: tuple[tuple[str, str], ...] = (), runtime_updating: bool = False
                ) -> LoRAConfig | None:
    """vLLM's LoRA settings (``LLM(enable_lora=True, max_loras=...)``, ``--enable-lora``
    and its flags) as a ``LoRAConfig``; None when LoRA is off (ValueError if a LoRA setting
    is given without ``enable_lora``)."""
    given = {k: v for k, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank),
                               ("max_cpu_loras", max_cpu_loras), ("lora_modules", modules),
                               ("enable_runtime_lora_updating", runtime_updating)) if v}
    if not enable_lora:
        if given:
            raise ValueError(f"{sorted(given)} need enable_lora (--enable-lora)")
        return None
    d = LoRAConfig()
    return LoRAConfig(max_loras=max_loras or d.max_loras,
                      max_lora_rank=max_lora_rank or d.max_lora_rank,
                      max_cpu_loras=max_cpu_loras, modules=tuple(modules),
                      runtime_updating=runtime_updating)
