"""Training a small Llama on :mod:`jserve.train.length_task` on CPU.

Training runs a plain dense causal forward over the same HF-shaped param tree the serving
engine loads (``jserve.model.weights.param_shapes``), so the saved checkpoint serves as is.
Batches are packed: several examples share a row, attention stays inside each example
(segment ids) and positions restart at 0 per example, so little compute goes to padding.
The loss covers answer tokens and the EOS only: the model is taught to answer and to stop,
not to generate prompts.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jserve.config import ModelConfig
from jserve.model.decoder import decoder_layer, embed, head_logits, layer_loop
from jserve.model.layers import layer_rope, rope_tables
from jserve.model.params import Params
from jserve.model.weights import init_params
from jserve.tokenizer import ByteTokenizer
from jserve.train.length_task import Task, format_prompt, sample_task

# Small enough to train on two CPU cores in minutes; 4 query / 2 KV heads and 4 layers so
# tensor parallelism (up to 4) and stage pipelines (up to 4) can split it.
TINY_TASKS_CONFIG = ModelConfig(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=ByteTokenizer.BOS,
    eos_token_ids=(ByteTokenizer.EOS,),
    dtype="float32",
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_rows: int = 16
    row_len: int = 512
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    log_every: int = 10


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """Packed rows [B, L]: input ids, targets (next ids), loss weights, positions, segments."""

    tokens: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    positions: np.ndarray
    segments: np.ndarray


def encode_example(task: Task, tok: ByteTokenizer = ByteTokenizer()) -> tuple[list[int], int]:
    """(ids = BOS + prompt + answer + EOS, number of prompt ids incl. BOS)."""
    prompt = tok.encode(format_prompt(task.prompt), add_special_tokens=True)
    answer = tok.encode(task.answer, add_special_tokens=False)
    return prompt + answer + [tok.EOS], len(prompt)


def pack(rows: Sequence[Sequence[tuple[list[int], int]]], row_len: int) -> Batch:
    """Lays each row's examples side by side. Padding has segment 0, loss weight 0, token PAD.

    Raises ValueError if a row's examples are longer than ``row_len``."""
    shape = (len(rows), row_len)
    tokens = np.full(shape, ByteTokenizer.PAD, np.int32)
    targets = np.zeros(shape, np.int32)
    weights = np.zeros(shape, np.float32)
    positions = np.zeros(shape, np.int32)
    segments = np.zeros(shape, np.int32)
    seg = 0
    for r, examples in enumerate(rows):
        if (total := sum(len(ids) for ids, _ in examples)) > row_len:
            raise ValueError(f"row {r} holds {total} tokens, more than row_len={row_len}")
        col = 0
        for ids, n_prompt in examples:
            seg += 1
            n = len(ids)
            tokens[r, col:col + n] = ids
            targets[r, col:col + n - 1] = ids[1:]
            # Predicting ids[n_prompt:] (answer + EOS) from positions n_prompt-1 .. n-2.
            weights[r, col + n_prompt - 1:col + n - 1] = 1.0
            positions[r, col:col + n] = np.arange(n)
            segments[r, col:col + n] = seg
            col += n
    return Batch(tokens, targets, weights, positions, segments)


def batches(tc: TrainConfig) -> Iterator[Batch]:
    """An endless seeded stream of packed batches of fresh "train"-split tasks.

    First-fit-decreasing over a pool of pending examples; what does not fit waits for the next
    batch (longest first), so the stream keeps the task distribution and rows stay full."""
    rng = np.random.default_rng(tc.seed)
    capacity = tc.batch_rows * tc.row_len
    pool: list[tuple[list[int], int]] = []
    while True:
        while sum(len(ids) for ids, _ in pool) < 1.25 * capacity:
            ids, n_prompt = encode_example(sample_task(rng, "train"))
            if len(ids) > tc.row_len:
                raise ValueError(f"an example of {len(ids)} tokens exceeds row_len={tc.row_len}")
            pool.append((ids, n_prompt))
        pool.sort(key=lambda e: -len(e[0]))
        rows: list[list[tuple[list[int], int]]] = [[] for _ in range(tc.batch_rows)]
        free = [tc.row_len] * tc.batch_rows
        left = []
        for ex in pool:
            r = next((r for r in range(tc.batch_rows) if free[r] >= len(ex[0])), None)
            if r is None:
                left.append(ex)
            else:
                rows[r].append(ex)
                free[r] -= len(ex[0])
        pool = left
        yield pack(rows, tc.row_len)


def dense_forward(params: Params, tokens: jax.Array, positions: jax.Array, segments: jax.Array,
                  cfg: ModelConfig) -> jax.Array:
    """float32 logits [B, L, vocab] of a causal forward where a token attends only to earlier
    tokens of its own segment: the model's layer loop and blocks (``jserve.model.decoder``) on
    [B, L] rows with dense masked attention in place of the paged cache. ``params`` in the
    HF-shaped checkpoint layout. A windowed layer (``cfg.layer_windows``) also masks the keys
    at or before query position - window."""
    t, hd = tokens.shape[1], cfg.head_dim
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = causal[None] & (segments[:, :, None] == segments[:, None, :])  # [B, Lq, Lk]

    def attend(q, k, v, window=0, sinks=None):  # q [B, L, Hq, D], k/v [B, L, Hkv, D]
        b, _, hq, _ = q.shape
        keep = mask if not window else (
            mask & (positions[:, None, :] > positions[:, :, None] - window))
        hkv = k.shape[2]
        q = q.reshape(b, t, hkv, hq // hkv, hd)
        s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
        s = s / np.sqrt(hd)
        s = jnp.where(keep[:, None, None], s, -1e30)
        if sinks is not None:  # one more logit a head on a zero value (gpt-oss)
            sink = jnp.broadcast_to(sinks.reshape(hkv, hq // hkv, 1, 1).astype(s.dtype),
                                    (*s.shape[:-1], 1))
            s = jnp.concatenate([s, sink], axis=-1)
        p = jax.nn.softmax(s, axis=-1)[..., :t].astype(v.dtype)
        return jnp.einsum("bkgqs,bskd->bqkgd", p, v).reshape(b, t, hq, hd), None

    cos, sin = rope_tables(cfg, positions)                                # [B, L, D]
    layers = params["layers"]
    window_of = lambda i: cfg.layer_windows[i] if cfg.layer_windows else 0  # noqa: E731
    x, _, _ = layer_loop(layers, embed(params, tokens, cfg), None,
                         lambda layer, i, x, _: decoder_layer(
                             layer, x, *layer_rope(cos, sin, cfg, i),
                             functools.partial(attend, window=window_of(i)), cfg=cfg),
                         0, len(layers))
    return head_logits(params, x, cfg)


def loss_fn(params: Params, batch: Batch, cfg: ModelConfig) -> jax.Array:
    """Mean cross-entropy over the weighted (answer + EOS) targets."""
    logits = dense_forward(params, batch.tokens, batch.positions, batch.segments, cfg)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets)
    return jnp.sum(nll * batch.weights) / jnp.maximum(jnp.sum(batch.weights), 1.0)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps,
                                                  max(tc.steps, tc.warmup_steps + 1),
                                                  end_value=tc.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=tc.weight_decay))


def make_train_step(cfg: ModelConfig, opt: optax.GradientTransformation):
    @jax.jit
    def step(params, opt_state, batch: Batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def _as_jax(batch: Batch) -> Batch:
    return Batch(*(jnp.asarray(a) for a in dataclasses.astuple(batch)))


def train(tc: TrainConfig, cfg: ModelConfig = TINY_TASKS_CONFIG, params: Params | None = None,
          log=print, on_checkpoint=None, checkpoint_every: int = 0) -> tuple[Params, list[float]]:
    """Runs ``tc.steps`` AdamW steps from ``params`` (default: ``init_params(cfg, tc.seed)``);
    returns the final params and the loss of every step. ``on_checkpoint(step, params)`` is
    called every ``checkpoint_every`` steps (0: never)."""
    if tc.steps < 1:
        raise ValueError(f"steps must be >= 1, got {tc.steps}")
    params = init_params(cfg, tc.seed) if params is None else params
    opt = make_optimizer(tc)
    opt_state = opt.init(params)
    step_fn = make_train_step(cfg, opt)
    losses: list[float] = []
    data = batches(tc)
    start = time.perf_counter()
    for i in range(1, tc.steps + 1):
        params, opt_state, loss = step_fn(params, opt_state, _as_jax(next(data)))
        losses.append(float(loss))
        if i % tc.log_every == 0 or i == tc.steps:
            log(f"step {i:5d}  loss {np.mean(losses[-tc.log_every:]):.4f}  "
                f"{time.perf_counter() - start:7.1f}s")
        if on_checkpoint and checkpoint_every and i % checkpoint_every == 0:
            on_checkpoint(i, params)
    return params, losses
