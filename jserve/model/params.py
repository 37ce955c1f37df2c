"""The params pytree's type and shapes (the layout :mod:`jserve.model` describes), from the
model's family (``jserve.model.families``): the checkpoint layout (``param_shapes``:
HF-shaped, one dict per layer) and the runtime layout the step takes
(``runtime_param_shapes``: the layers stacked, some matrices fused). The loaders
(``weights``), the model and the memory planner read them."""
from __future__ import annotations

import math
from typing import Any

from jserve.config import ModelConfig
from jserve.model.families import family_of
from jserve.model.tp_layout import EXPERTS, fused_in

Params = dict[str, Any]


def param_shapes(cfg: ModelConfig) -> Params:
    """The params pytree with shape tuples as leaves: the single source of the layout."""
    family = family_of(cfg)
    layer = {name: t.shape for name, t in family.layer_tensors(cfg).items()}
    shapes: Params = {name: t.shape for name, t in family.top_tensors(cfg).items()}
    shapes["layers"] = [dict(layer) for _ in range(cfg.num_hidden_layers)]
    return shapes


def runtime_param_shapes(cfg: ModelConfig) -> dict:
    """Shape tuples of the runtime layout (what ``decoder.to_runtime_layout`` returns): the
    checkpoint layout's per-layer shapes stacked, the ``tp_layout.FUSED`` matrices fused
    (an expert stack's [in, experts * widths], ``tp_layout.LeafKind``)."""
    shapes = param_shapes(cfg)
    layer = dict(shapes["layers"][0])
    for name, parts in fused_in(layer).items():
        shapes_in = [layer.pop(p) for p in parts]
        width = sum(s[-1] for s in shapes_in)
        layer[name] = ((shapes_in[0][1], shapes_in[0][0] * width) if name in EXPERTS
                       else (*shapes_in[0][:-1], width))
    n = cfg.num_hidden_layers
    return {**shapes, "layers": {name: (n, *shape) for name, shape in layer.items()}}


def layer_matrix_shapes(cfg: ModelConfig) -> set[tuple[int, int]]:
    """The [in, out] shape of each layer matrix of either layout (the checkpoint's and the
    runtime's, fused), one device's at tp=1: what a compiled program's weights look like
    (an expert stack's matrices are one expert's)."""
    checkpoint = param_shapes(cfg)["layers"][0].values()
    runtime = runtime_param_shapes(cfg)["layers"].values()
    return ({s[-2:] for s in checkpoint if len(s) >= 2}
            | {s[-2:] for s in runtime if len(s) >= 3})


def num_params(cfg: ModelConfig) -> int:
    """The model's parameter count (biases and norms included)."""
    shapes = param_shapes(cfg)
    top = sum(math.prod(s) for name, s in shapes.items() if name != "layers")
    return top + sum(math.prod(s) for layer in shapes["layers"] for s in layer.values())


def active_params(cfg: ModelConfig) -> int:
    """The parameters one token's forward reads: ``num_params`` less the routed experts it
    does not pick (each expert stack counts k of its E experts); what a token's FLOPs
    follow. ``num_params`` for a dense model."""
    if not cfg.num_experts:
        return num_params(cfg)
    stacks = [t for name, t in family_of(cfg).layer_tensors(cfg).items() if name in EXPERTS]
    unpicked = sum(math.prod(t.shape) for t in stacks) * (
        cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
    return num_params(cfg) - cfg.num_hidden_layers * unpicked
