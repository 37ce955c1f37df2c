"""``CopyRate``: what moving bytes over one link takes, learned from timed copies. Shared by
the engine (its host tier's copies) and the server (KV pages pulled from a prefill engine);
no JAX, no engine."""
from __future__ import annotations


class CopyRate:
    """A link's copy time, learned online (the prefix cache's host tier, KV pages between
    engines):
    ``seconds(n) = latency_s + n / bytes_per_s``, with ``observe(n, seconds)`` moving the
    bandwidth toward each measured copy's (an exponential average with weight ``alpha``),
    so the deadline policies price a restore by what copies really take on this link."""

    def __init__(self, bytes_per_s: float, latency_s: float = 0.0, alpha: float = 0.2):
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.bytes_per_s, self.latency_s, self.alpha = float(bytes_per_s), latency_s, alpha
        self.samples = 0

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s if num_bytes else 0.0

    def observe(self, num_bytes: int, seconds: float) -> None:
        moving = seconds - self.latency_s
        if num_bytes <= 0 or moving <= 0:
            return
        rate = num_bytes / moving
        self.bytes_per_s = rate if self.samples == 0 else (
            (1 - self.alpha) * self.bytes_per_s + self.alpha * rate)
        self.samples += 1
