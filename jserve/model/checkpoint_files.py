"""A HF safetensors checkpoint's tensors as the loaders read them (``jserve.model.weights``):
which names live in which file, and views.

A family may name a leaf's checkpoint tensor as a view of a stored one, a numpy-style index
after the stored name (``base.Tensor``): ``mlp.experts.gate_up_proj[3, :, 0::2]`` is expert
3's gate columns of gpt-oss's interleaved gate/up stack, ``...bias[3, None, 0::2]`` the same
columns of the biases as a one-row matrix. Entries are ints, ``None`` (a new axis of one),
``:`` and ``start::step``. A view reads as a tensor of its own: the file layout lists it in
place of the stored tensor it reads (:func:`view_layout`), and every read of a name goes
through :func:`read`/:func:`shape` here, which read only the experts a view picks.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from safetensors import safe_open

_VIEW = re.compile(r"^(?P<stored>[^\[\]]+)\[(?P<index>[^\[\]]*)\]$")


def _entry(text: str) -> int | slice | None:
    text = text.strip()
    if text == "None":
        return None
    if ":" in text:
        return slice(*(int(x) if x.strip() else None for x in text.split(":")))
    return int(text)


def view_of(name: str) -> tuple[str, tuple] | None:
    """(stored tensor name, index) of a view name, None for a stored tensor's own name."""
    m = _VIEW.match(name)
    if m is None:
        return None
    return m["stored"], tuple(_entry(t) for t in m["index"].split(","))


def safetensors_layout(model_dir: Path) -> dict[Path, list[str]]:
    """Which tensor names live in which file, for a single or an index-sharded checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name, file in json.loads(index.read_text())["weight_map"].items():
            by_file[model_dir / file].append(name)
        return dict(by_file)
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor "
                                "model.safetensors.index.json")
    with safe_open(single, framework="numpy") as f:
        return {single: list(f.keys())}


def view_layout(layout: dict[Path, list[str]], wanted: Iterable[str]
                ) -> dict[Path, list[str]]:
    """``layout`` with each stored tensor that ``wanted`` names views of listed as those
    views instead (and as itself too where ``wanted`` names it; the rest as it is)."""
    wanted = set(wanted)
    views: dict[str, list[str]] = defaultdict(list)
    for name in wanted:
        if (v := view_of(name)) is not None:
            views[v[0]].append(name)
    as_is = lambda n: [n] if n in wanted or n not in views else []  # noqa: E731
    return {file: [n for stored in names for n in views.get(stored, []) + as_is(stored)]
            for file, names in layout.items()}


def _padded(view: tuple, ndim: int) -> tuple:
    return view + (slice(None),) * (ndim - sum(v is not None for v in view))


def shape(f, name: str) -> tuple[int, ...]:
    """The shape of tensor (or view) ``name`` in the open file ``f``, from its header."""
    v = view_of(name)
    if v is None:
        return tuple(f.get_slice(name).get_shape())
    stored = f.get_slice(v[0]).get_shape()
    dims, out = iter(stored), []
    for entry in _padded(v[1], len(stored)):
        if entry is None:
            out.append(1)
        elif isinstance(entry, slice):
            out.append(len(range(*entry.indices(next(dims)))))
        else:
            next(dims)
    return tuple(out)


def read(f, name: str, index: tuple[slice, ...] | None = None) -> Any:
    """Tensor (or view) ``name`` of the open file ``f``, or its part ``index`` (contiguous
    slices, one an axis): a stored tensor's slice is read without the rest; a view reads
    the whole of what its int entries pick (one expert's stack) and indexes it in memory."""
    v = view_of(name)
    if v is None:
        return f.get_slice(name)[index] if index is not None else f.get_tensor(name)
    stored, view = v
    view = _padded(view, len(f.get_slice(stored).get_shape()))
    picked = tuple(slice(e, e + 1) if isinstance(e, int) else slice(None)
                   for e in view if e is not None)
    block = f.get_slice(stored)[picked]
    out = block[tuple(0 if isinstance(e, int) else e for e in view)]
    return out if index is None else out[index]
