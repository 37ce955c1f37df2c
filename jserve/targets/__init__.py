"""Compiling jserve's programs for an accelerator this host does not have: the targets by
name (``TARGETS``), their compile-only devices (``devices``), the engine's program set built
and compiled for them through the engine's own lowering (``programs``), and what the
optimized programs do (``hlo``). ``jserve compile --target`` is the command; the suite's
accelerator tests call the same code. (No JAX at import: the CLI lists the targets.)"""
