"""A HF safetensors checkpoint's tensors as the loaders read them (``jserve.model.weights``):
which names live in which file, and views.

A family may name a leaf's checkpoint tensor as a view of a stored one, a numpy-style index
after the stored name (``base.Tensor``): ``mlp.experts.gate_up_proj[3, :, 0::2]`` is expert
3's gate columns of gpt-oss's interleaved gate/up stack, ``...bias[3, None, 0::2]`` the same
columns of the biases as a one-row matrix. Entries are ints, ``None`` (a new axis of one),
``:`` and ``start::step``. A view reads as a tensor of its own: the file layout lists it in
place of the stored tensor it reads (:func:`view_layout`), and every read of a name goes
through :func:`read`/:func:`shape` here, which read only the experts a view picks.

A stored tensor may also be MXFP4 (gpt-oss's released experts): ``X_blocks`` [..., rows,
groups, 16] bytes of two e2m1 values each and ``X_scales`` [..., rows, groups] exponents
(2 ** (s - 127) a group of 32), in place of ``X`` [..., cols, rows] (the decoded last two
axes transposed, as transformers' ``convert_moe_packed_tensors`` gives them). ``X`` then
reads as that float tensor, decoded one expert's slab at a time.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from safetensors import safe_open

_VIEW = re.compile(r"^(?P<stored>[^\[\]]+)\[(?P<index>[^\[\]]*)\]$")
# The e2m1 values of a nibble (OCP microscaling formats: sign, two exponent bits, one
# mantissa bit).
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MXFP4_PARTS = ("_blocks", "_scales")


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
    views instead (and as itself too where ``wanted`` names it; the rest as it is); an
    MXFP4 tensor's two parts listed as the wanted names that read it."""
    wanted, present = set(wanted), {n for names in layout.values() for n in names}
    views: dict[str, list[str]] = defaultdict(list)
    for name in wanted:
        v = view_of(name)
        stored = name if v is None else v[0]
        if v is not None or _is_mxfp4(present, stored):
            views[stored].append(name)
    for stored in [s for s in views if _is_mxfp4(present, s)]:  # listed at its _blocks
        views[stored + "_blocks"], views[stored + "_scales"] = views.pop(stored), []

    def listed(stored: str) -> list[str]:
        if stored not in views:
            return [stored]
        return views[stored] + ([stored] if stored in wanted else [])
    return {file: [n for stored in names for n in listed(stored)]
            for file, names in layout.items()}


def _is_mxfp4(present: set[str], stored: str) -> bool:
    """Whether ``stored`` is stored as MXFP4 parts among the ``present`` names."""
    return stored not in present and all(stored + p in present for p in MXFP4_PARTS)


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., groups * 32, rows] of MXFP4 ``blocks`` [..., rows, groups, 16] (low
    nibble first) and ``scales`` [..., rows, groups] (biased exponents)."""
    blocks = np.asarray(blocks, np.uint8)
    values = np.stack([_E2M1[blocks & 0x0F], _E2M1[blocks >> 4]], axis=-1)
    values = values.reshape(*blocks.shape[:-1], -1)  # [..., rows, groups, 32]
    exponents = np.asarray(scales, np.int32) - 127
    out = np.ldexp(values, exponents[..., None]).reshape(*blocks.shape[:-2], -1)
    return np.swapaxes(out, -1, -2).astype(np.float32)


def _padded(view: tuple, ndim: int) -> tuple:
    return view + (slice(None),) * (ndim - sum(v is not None for v in view))


_KEY_SETS: list[tuple[Any, frozenset[str]]] = []  # the last few open files' names


def _names(f) -> frozenset[str]:
    """The tensor names of the open file ``f``, listed once: ``f.keys()`` builds a new list
    on every call, and a checkpoint of many experts has tens of thousands of names, each
    looked up as it is read."""
    for g, names in _KEY_SETS:
        if g is f:
            return names
    names = frozenset(f.keys())
    _KEY_SETS.insert(0, (f, names))
    del _KEY_SETS[4:]  # (a loader reads few files at once; a miss only lists again)
    return names


def _stored_shape(f, stored: str) -> tuple[int, ...]:
    if stored in _names(f):
        return tuple(f.get_slice(stored).get_shape())
    *lead, rows, groups, pairs = f.get_slice(stored + "_blocks").get_shape()  # MXFP4
    return (*lead, groups * pairs * 2, rows)


def _stored_slab(f, stored: str, picked: tuple[slice, ...]):
    """``stored[picked]`` (slices of its leading axes, the last two whole for MXFP4)."""
    if stored in _names(f):
        return f.get_slice(stored)[picked]
    lead = picked[:-2]
    return decode_mxfp4(f.get_slice(stored + "_blocks")[lead],
                        f.get_slice(stored + "_scales")[lead])[picked[-2:]]


def shape(f, name: str) -> tuple[int, ...]:
    """The shape of tensor (or view) ``name`` in the open file ``f``, from its header."""
    v = view_of(name)
    if v is None:
        return _stored_shape(f, name)
    stored = _stored_shape(f, v[0])
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
    if v is None and name in _names(f):
        return f.get_slice(name)[index] if index is not None else f.get_tensor(name)
    stored, view = v if v is not None else (name, ())
    view = _padded(view, len(_stored_shape(f, stored)))
    picked = tuple(slice(e, e + 1) if isinstance(e, int) else slice(None)
                   for e in view if e is not None)
    if v is None and index is not None:  # a plain MXFP4 tensor: decode only what is asked
        picked, view = index, (slice(None),) * len(index)
        index = None
    block = _stored_slab(f, stored, picked)
    out = block[tuple(0 if isinstance(e, int) else e for e in view)]
    return out if index is None else out[index]
