"""The length probe: an MLP (hidden -> 512 -> bins, ReLU) from one layer's embedding to a
distribution over remaining-length bins, trained with optax, stored as a small .npz.

Inference runs in numpy on the host (a few rows per step; no device round trip); inputs are
standardised with the training set's mean and std, which the file keeps.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jserve.probe.bins import LengthBins

_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "probes"


def default_probe_path(model: str) -> Path | None:
    """The probe shipped for a built-in model name (``tiny-tasks`` ->
    ``jserve/assets/probes/tiny_tasks_probe.npz``), or None."""
    path = _ASSETS / f"{model.replace('-', '_')}_probe.npz"
    return path if path.exists() else None


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


@dataclasses.dataclass(frozen=True, eq=False)
class LengthProbe:
    w1: np.ndarray  # [H, hidden]
    b1: np.ndarray
    w2: np.ndarray  # [hidden, bins]
    b2: np.ndarray
    mean: np.ndarray  # input standardisation [H]
    std: np.ndarray
    bins: LengthBins
    layer: int          # which decoder layer's output (0-based) it reads
    prior_mean: float   # the remaining length assumed before a first prediction

    @property
    def input_dim(self) -> int:
        return self.w1.shape[0]

    def logits(self, x: np.ndarray) -> np.ndarray:
        x = (np.asarray(x, np.float32) - self.mean) / self.std
        return np.maximum(x @ self.w1 + self.b1, 0.0) @ self.w2 + self.b2

    def probs(self, x: np.ndarray) -> np.ndarray:
        """Bin probabilities [N, bins] of embeddings [N, H]."""
        return _softmax(self.logits(x).astype(np.float64))

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Expected remaining length of each embedding alone (no smoothing)."""
        return self.bins.expected(self.probs(x))

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, w1=self.w1, b1=self.b1, w2=self.w2, b2=self.b2,
                            mean=self.mean, std=self.std, edges=np.asarray(self.bins.edges),
                            layer=np.asarray(self.layer), prior_mean=np.asarray(self.prior_mean))

    @classmethod
    def load(cls, path: str | Path) -> "LengthProbe":
        path = Path(path)
        if not path.exists():
            raise ValueError(f"length probe file {path} does not exist")
        with np.load(path) as z:
            return cls(z["w1"], z["b1"], z["w2"], z["b2"], z["mean"], z["std"],
                       LengthBins(tuple(z["edges"].tolist())), int(z["layer"]),
                       float(z["prior_mean"]))


def train_probe(x: np.ndarray, remaining: np.ndarray, bins: LengthBins, layer: int, *,
                hidden: int = 512, steps: int = 2000, batch_size: int = 256,
                learning_rate: float = 1e-3, weight_decay: float = 1e-4, seed: int = 0,
                log_every: int = 0, prior_mean: float | None = None
                ) -> tuple[LengthProbe, list[float]]:
    """Cross-entropy on the bin of each pair's remaining length, AdamW, minibatches drawn
    with replacement. Returns the probe and the loss at every step. ``prior_mean``: what a
    request counts as before its first prediction (default: the mean of ``remaining``; the
    training script gives the mean output length)."""
    import jax
    import jax.numpy as jnp
    import optax

    x = np.asarray(x, np.float32)
    remaining = np.asarray(remaining, float)
    if x.ndim != 2 or len(x) != len(remaining) or len(x) == 0:
        raise ValueError(f"need embeddings [N, H] and N remaining lengths, got {x.shape}, "
                         f"{remaining.shape}")
    labels = bins.bin_of(remaining).astype(np.int32)
    mean, std = x.mean(0), x.std(0) + 1e-6
    xs = (x - mean) / std
    k1, k2, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    h_in = x.shape[1]
    params = {"w1": jax.random.normal(k1, (h_in, hidden)) * np.sqrt(2.0 / h_in),
              "b1": jnp.zeros(hidden),
              "w2": jax.random.normal(k2, (hidden, bins.num_bins)) * np.sqrt(1.0 / hidden),
              "b2": jnp.zeros(bins.num_bins)}
    opt = optax.adamw(learning_rate, weight_decay=weight_decay)
    state = opt.init(params)
    xs_d, labels_d = jnp.asarray(xs), jnp.asarray(labels)

    def loss_fn(p, xb, yb):
        z = jax.nn.relu(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(z, yb).mean()

    @jax.jit
    def update(p, s, key):
        idx = jax.random.randint(key, (min(batch_size, len(xs)),), 0, len(xs))
        loss, g = jax.value_and_grad(loss_fn)(p, xs_d[idx], labels_d[idx])
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss

    losses = []
    for i, key in enumerate(jax.random.split(kb, steps)):
        params, state, loss = update(params, state, key)
        losses.append(float(loss))
        if log_every and i % log_every == 0:
            print(f"step {i} loss {losses[-1]:.4f}")
    p = jax.device_get(params)
    probe = LengthProbe(np.asarray(p["w1"], np.float32), np.asarray(p["b1"], np.float32),
                        np.asarray(p["w2"], np.float32), np.asarray(p["b2"], np.float32),
                        mean.astype(np.float32), std.astype(np.float32), bins, int(layer),
                        float(remaining.mean() if prior_mean is None else prior_mean))
    return probe, losses
