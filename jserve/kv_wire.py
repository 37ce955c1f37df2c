"""The wire format of KV pages moved between engines (prefill/decode disaggregation): a 4-byte
big-endian header length, a JSON header (``version``, ``page_size``, ``pages``, and each
leaf's ``dtype`` and ``shape``, in the KV cache's ``jax.tree.leaves`` order, the page axis
third), then each leaf's bytes in C order. The one authority on it: the engine encodes and
decodes pages with it (``jserve.engine.device.kv_transfer``), the server reads headers with it
(``jserve.serving.kv_connector``). numpy only: no JAX, no engine."""
from __future__ import annotations

import json
import struct
from typing import Sequence

import numpy as np

VERSION = 1
_LEN = struct.Struct(">I")


class PageFormatError(ValueError):
    """The pages sent are not this engine's pages: another page size, dtype or shape."""


def encode(page_size: int, leaves: Sequence[np.ndarray]) -> bytes:
    leaves = [np.ascontiguousarray(x) for x in leaves]
    head = json.dumps({"version": VERSION, "page_size": page_size,
                       "pages": leaves[0].shape[2] if leaves else 0,
                       "leaves": [{"dtype": x.dtype.name, "shape": list(x.shape)}
                                  for x in leaves]}).encode()
    return b"".join([_LEN.pack(len(head)), head, *(x.tobytes() for x in leaves)])


def header(wire: bytes) -> tuple[dict, int]:
    """(the header, the offset of the first leaf's bytes); PageFormatError if unreadable."""
    try:
        (n,) = _LEN.unpack_from(wire)
        head = json.loads(wire[_LEN.size:_LEN.size + n])
        if not isinstance(head, dict):
            raise ValueError("the header is not an object")
        return head, _LEN.size + n
    except (ValueError, struct.error) as e:
        raise PageFormatError(f"not KV pages: {e}") from None


def pages_in(wire: bytes) -> int:
    """The page count a wire form's header gives (0 for anything unreadable)."""
    try:
        return int(header(wire)[0]["pages"])
    except (PageFormatError, KeyError, TypeError, ValueError):
        return 0


def decode(wire: bytes, like: Sequence[np.ndarray], page_size: int) -> list[np.ndarray]:
    """The leaves of ``wire`` (views of its bytes); ``PageFormatError`` unless they are
    pages of ``page_size`` tokens and every leaf matches ``like``'s (the KV cache's leaves,
    anything with ``dtype``, ``ndim`` and ``shape``) in dtype and every axis but the
    pages'."""
    head, offset = header(wire)
    try:
        if head["version"] != VERSION:
            raise PageFormatError(f"page wire version {head['version']}, not {VERSION}")
        if head["page_size"] != page_size:
            raise PageFormatError(f"pages of {head['page_size']} tokens sent to an engine "
                                  f"with pages of {page_size}")
        if len(head["leaves"]) != len(like):
            raise PageFormatError(f"{len(head['leaves'])} KV leaves sent, this engine has "
                                  f"{len(like)}")
        out = []
        for spec, x in zip(head["leaves"], like):
            shape, dtype = tuple(spec["shape"]), np.dtype(x.dtype)
            if spec["dtype"] != dtype.name or len(shape) != x.ndim \
                    or shape[:2] + shape[3:] != tuple(x.shape[:2] + x.shape[3:]):
                raise PageFormatError(
                    f"pages of {spec['dtype']}{list(shape)} sent to an engine storing "
                    f"{dtype.name}{list(x.shape)} (the page axis third)")
            count = int(np.prod(shape))
            if offset + count * dtype.itemsize > len(wire):
                raise PageFormatError("the pages' bytes end early")
            out.append(np.frombuffer(wire, dtype, count, offset).reshape(shape))
            offset += count * dtype.itemsize
        if offset != len(wire):
            raise PageFormatError(f"{len(wire) - offset} bytes after the pages")
        return out
    except PageFormatError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise PageFormatError(f"not KV pages: {e}") from None
