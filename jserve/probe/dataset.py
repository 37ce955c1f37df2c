"""(embedding, remaining tokens) pairs for every layer at once, from finished sequences.

Capturing one layer in the live engine would need one serving run per candidate layer; one
plain forward pass over each finished sequence (prompt + output) gives every layer's hidden
state at every position, which are the embeddings the engine would have captured: the mean
over the prompt (target: the output length L) and the residual stream at output token k's
position for k = 1 .. L-1, the step that produces token k+1 (target: L - k).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.pool import allocate_kv_cache
from jserve.config import ModelConfig
from jserve.kernels import AttentionMetadata
from jserve.model.decoder import StepInput, embed, layer_loop, stack_layers, step_layer
from jserve.model.layers import rope_tables
from jserve.model.params import Params
from jserve.probe.bins import LengthBins

_PAGE = 16


@functools.partial(jax.jit, static_argnames=("cfg",))
def _all_layers(params: Params, tokens: jax.Array, n: jax.Array, *, cfg: ModelConfig):
    params = stack_layers(params)  # one scan over the layers instead of unrolling them
    t = tokens.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    real = pos < n
    pages = t // _PAGE
    attn = AttentionMetadata(positions=pos, token_seq=jnp.where(real, 0, 1).astype(jnp.int32),
                             kv_lens=n[None].astype(jnp.int32),
                             page_table=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                             num_prefills=jnp.asarray(1, jnp.int32), num_decodes=0)
    batch = StepInput(tokens=tokens, slots=jnp.where(real, _PAGE + pos, 0).astype(jnp.int32),
                      logits_rows=(n - 1)[None].astype(jnp.int32), attn=attn)
    cos, sin = rope_tables(cfg, pos)
    layer_fn = step_layer(batch, cos, sin, cfg=cfg, attention_impl="reference")
    _, _, out = layer_loop(params["layers"], embed(params, tokens, cfg),
                           allocate_kv_cache(cfg, pages + 1, _PAGE), layer_fn, 0,
                           cfg.num_hidden_layers, collect=lambda x: x.astype(jnp.float32))
    return out  # [layers, T, H]


def sequence_pairs(cfg: ModelConfig, params: Params, prompt_ids: list[int],
                   output_ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For one finished request: embeddings [layers, 1 + L-1, H], remaining [L], generated
    count before each embedding's step [L] (row 0 is the mean prompt embedding).
    ``params`` in the runtime layout (``to_runtime_layout``)."""
    p, big_l = len(prompt_ids), len(output_ids)
    seq = list(prompt_ids) + list(output_ids[:-1])
    n = len(seq)
    t = max(_PAGE, 1 << (n - 1).bit_length())
    tokens = np.zeros(t, np.int32)
    tokens[:n] = seq
    hs = np.asarray(_all_layers(params, jnp.asarray(tokens), jnp.asarray(n), cfg=cfg))
    prompt_mean = hs[:, :p].mean(1, keepdims=True)
    token_embs = hs[:, p:n]  # output token k (1-based) sits at position p + k - 1
    k = np.arange(big_l)
    return np.concatenate([prompt_mean, token_embs], 1), (big_l - k).astype(float), k


def predictions(probe, embs: np.ndarray) -> dict[str, np.ndarray]:
    """A request's predictions of its remaining length at each of its steps (k = 0 .. L-1),
    from one layer's embeddings [1 + L-1, H] (row 0 the prompt mean):

    prompt_only: the first prediction minus the tokens generated since (at least 0);
    per_step: the probe on that step's embedding alone (the first prediction at k = 0);
    refined: the Bayesian filter, what the engine's tracker computes."""
    from jserve.probe.smoothing import RemainingFilter

    probs = probe.probs(embs)
    k = np.arange(len(embs))
    first = probe.bins.expected(probs[0])
    f = RemainingFilter(probe.bins)
    refined = [f.start(probs[0])] + [f.update(p) for p in probs[1:]]
    return {"prompt_only": np.maximum(first - k, 0.0),
            "per_step": probe.bins.expected(probs),
            "refined": np.asarray(refined)}


def finished_sequences(llm, prompts, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Greedy generations (prompt ids, output ids) of ``prompts`` on ``llm``, stopping at EOS."""
    from jserve.sampling.params import SamplingParams

    outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [(o.prompt_token_ids, o.token_ids) for o in outs]


def collect(llm, prompts, max_tokens: int):
    """Per request: (embeddings [layers, L, H], remaining [L])."""
    eng = llm.engine
    seqs = finished_sequences(llm, prompts, max_tokens)
    return [sequence_pairs(eng.model_config, eng.runner.params, p, o)[:2] for p, o in seqs]


def stack(data, layer: int, prompt_repeat: int):
    """Training pairs of one layer; each prompt pair repeated ``prompt_repeat`` times so the
    first prediction (one pair per request) is not drowned by the per-token pairs."""
    xs, ys = [], []
    for embs, rem in data:
        xs += [np.repeat(embs[layer, :1], prompt_repeat, 0), embs[layer, 1:]]
        ys += [np.repeat(rem[:1], prompt_repeat), rem[1:]]
    return np.concatenate(xs), np.concatenate(ys)


def held_out_mae(probe, data, layer: int) -> dict[str, float]:
    errs = {"prompt_only": [], "per_step": [], "refined": []}
    for embs, rem in data:
        for name, pred in predictions(probe, embs[layer]).items():
            errs[name].append(np.abs(pred - rem))
    return {name: float(np.concatenate(e).mean()) for name, e in errs.items()}


def make_bins(kind: str, num_bins: int, max_len: float) -> LengthBins:
    return LengthBins.log_spaced(num_bins, max_len) if kind == "log" else \
        LengthBins.equal(num_bins, max_len)
