"""Weight copies in a compiled step: the ops of an optimized HLO module that materialise a
whole layer matrix ([in, out] or [1, in, out] of a stacked weight), which a loop over
stacked layers does for each ``w[i]`` (``jserve.model.layer_weights``). Counted in the
program text (a loop body counts once, though it runs every layer); the instructions inside
fusion bodies are not counted, the fusion that outputs the matrix is."""
from __future__ import annotations

import re

from jserve.config import ModelConfig
from jserve.model import params

_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[([\d,]*)\]\S*\s+([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# Ops that produce a new buffer (a bitcast or a parameter is the same memory).
_MATERIALISING = ("copy", "dynamic-slice", "slice", "fusion", "gather")


def layer_matrix_shapes(cfg: ModelConfig) -> set[tuple[int, ...]]:
    """The [in, out] shapes of a layer's matrices on one device (``params``, either layout),
    and their [1, in, out] forms."""
    shapes = params.layer_matrix_shapes(cfg)
    return shapes | {(1, *s) for s in shapes}


def layer_matrix_copies(hlo_text: str, cfg: ModelConfig) -> int:
    """How many instructions outside fusion bodies of ``hlo_text`` (``compiled.as_text()``)
    output a layer matrix of ``cfg`` by materialising it."""
    fused = set(_CALLS.findall(hlo_text))
    shapes = layer_matrix_shapes(cfg)
    count, inside = 0, None
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
            m = _COMPUTATION.match(line)
            inside = m.group(1) if m else None
            continue
        m = _INSTRUCTION.match(line)
        if m is None or inside in fused or m.group(2) not in _MATERIALISING:
            continue
        dims = tuple(int(x) for x in m.group(1).split(",") if x)
        count += dims in shapes
    return count
