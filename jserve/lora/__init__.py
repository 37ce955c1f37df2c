"""LoRA adapters served on one base model (vLLM's ``--enable-lora``): what a user names and
configures (``LoRARequest``, ``LoRAConfig``), how PEFT's checkpoints read (``peft``) and
which adapters hold the device's slots (``slots``). The pool's device side is
``jserve.model.lora``; ``config`` imports no JAX (the serving front ends read it)."""
from jserve.lora.config import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
