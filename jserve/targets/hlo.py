"""What an optimized HLO module (``compiled.as_text()``) does when it runs once: the kernels
it launches, the ``while`` loops and conditionals (on XLA:GPU each conditional, and each
iteration of a ``while`` whose trip count is not known when compiling, copies a predicate to
the host and waits for the device outside a CUDA graph; XLA's default command buffers take
neither), the copies of weights or KV pages it makes, and the bytes it moves.

How it counts: the computations reached from the entry through ``while``, ``conditional``
and ``call`` are walked (fusion bodies and reducers are inside their kernel); every
instruction there that is not bookkeeping (parameter, constant, tuple, get-tuple-element,
bitcast, ...) is one kernel: a fusion, a custom call (Triton GEMM fusions, Pallas kernels,
cuBLAS), a copy or another op XLA left unfused. A ``while`` body counts times its known trip
count, or once when it has none (a decode burst's loop: then the figures are one decode step
of the burst); a conditional counts its largest branch (the ``least_`` figures: its
cheapest by bytes, the branch a plain greedy step takes).
Bytes: each kernel's output plus its
operands, where a fusion that only slices an operand reads the slices (and so does an unfused
gather or slice: an MoE decode step's gather of its chosen experts), an in-place update
(a dynamic-update-slice or scatter root, a custom call aliasing its operand) moves only the
update, a custom call's KV pages operand counts nothing (paged attention reads the pages its
sequences own, which the program does not say) and its stacked weight operand one layer (the
indexed layer kernels read theirs in place).
XLA's own ``cost_analysis`` counts custom calls as nothing and a ``while`` body once."""
from __future__ import annotations

import collections
import dataclasses
import math
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
          "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8, "c64": 8, "s4": 0.5, "u4": 0.5}
# libtpu's asynchronous slices and copies (v6e splits a large slice into several): the
# start's shape echoes its operand beside the result.
_ASYNC_STARTS, _ASYNC_DONES = {"slice-start", "copy-start"}, {"slice-done", "copy-done"}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_BOOKKEEPING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
                "domain", "iota"}
_MATERIALISING = {"copy", "copy-start", "dynamic-slice", "slice", "gather", "fusion",
                  "transpose", "concatenate", "pad"}
_SLICING = {"dynamic-slice", "slice", "gather", "bitcast"}
_IN_PLACE_ROOTS = {"dynamic-update-slice", "scatter"}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    root: bool
    args: str = ""  # the text between the parentheses (a parameter's index)

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, dims) of each array in the shape (one, or a tuple's)."""
        return [(d, tuple(int(x) for x in dims.split(",") if x))
                for d, dims in _ARRAY.findall(self.shape)]

    @property
    def bytes(self) -> float:
        return sum(_BYTES.get(d, 0) * math.prod(dims) for d, dims in self.arrays)

    def attr(self, key: str) -> list[str]:
        """The computations named by ``key=%a`` or ``key={%a, %b}``."""
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", self.attrs)
        return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _instruction(line: str) -> Instruction | None:
    m = re.match(r"\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*", line)
    if m is None:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    close = _balanced(rest, op.end() - 1)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[op.end():close - 1]))
    return Instruction(m.group(2), shape, op.group(1), operands, rest[close:], bool(m.group(1)),
                       rest[op.end():close - 1])


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The module's computations (name -> instructions) and its entry's name."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = re.match(r"\s*(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$", line)
        if head and " = " not in line.split("(")[0]:
            current = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None and (ins := _instruction(line)) is not None:
            current.append(ins)
    return comps, entry


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The shapes that say an array is a layer's weight matrix or the KV pages, with 1s
    dropped (a reshape keeps them): each layer matrix [in, out], the stacked [L, in, out],
    the pool [L, Hkv, P, S, D], one layer's [Hkv, P, S, D] and their flat-slot forms."""

    weights: frozenset
    kv: frozenset
    layers: int = 0  # the stacked weights' leading dimension (0: none stacked)

    @classmethod
    def of(cls, cfg, kv_cache, params=None) -> "Geometry":
        """From the model's shapes, the pool's and (``params``: the step's, maybe split on
        a mesh) each layer leaf's one-device shard: a mesh program's HLO holds its
        device's shapes."""
        import jax

        from jserve.model.params import layer_matrix_shapes
        from jserve.model.tp_layout import ADAPTERS

        n = cfg.num_hidden_layers
        mats = set(layer_matrix_shapes(cfg))
        mats |= {(n, *m) for m in mats}
        layers = params["layers"] if params is not None else {}
        stacked = not isinstance(layers, (list, tuple))  # else per-layer arrays (unrolled)
        for leaf in jax.tree.leaves(layers):
            shard = _shard_shape(leaf)  # matrices only: [L, H] norms look like activations
            if stacked and len(shard) == 3:
                mats |= {shard, shard[1:]}
            elif not stacked and len(shard) == 2:
                mats.add(shard)
        for name, leaf in (layers.items() if stacked else ()):  # LoRA's B, as the layer
            if name in ADAPTERS and name.endswith("_b"):  # kernel reads it (lora.added)
                ln, slots, rank, out = _shard_shape(leaf)
                mats |= {(ln, slots * rank, out), (slots * rank, out)}
        kv = set()
        for leaf in jax.tree.leaves(kv_cache):
            shape = _shard_shape(leaf)
            if len(shape) == 5:
                ln, hkv, p, s, dd = shape
                kv |= {shape, (hkv, p, s, dd), (ln, hkv, p * s, dd), (hkv, p * s, dd)}
        return cls(frozenset(_squeeze(m) for m in mats), frozenset(_squeeze(s) for s in kv),
                   n)

    def kind(self, dims: tuple[int, ...]) -> str | None:
        s = _squeeze(dims)
        return "kv" if s in self.kv else "weight" if s in self.weights else None


def _shard_shape(leaf) -> tuple[int, ...]:
    """One device's part of ``leaf`` (an array or a spec; its whole shape without one)."""
    sharding = getattr(leaf, "sharding", None)
    shape = tuple(leaf.shape)
    return tuple(sharding.shard_shape(shape)) if sharding is not None else shape


def _squeeze(dims) -> tuple[int, ...]:
    return tuple(x for x in dims if x != 1)


@dataclasses.dataclass(frozen=True)
class Copy:
    """A kernel that materialises a weight matrix or KV pages: its name, op, kind and the
    bytes it writes each time the program runs (times its loop's trips)."""

    name: str
    opcode: str
    kind: str
    bytes: float


@dataclasses.dataclass(frozen=True)
class Analysis:
    """One program's run, counted as the module docstring says."""

    kernels: collections.Counter  # kind ("fusion", "gemm", "custom-call", "copy", ...) -> n
    whiles: int  # while ops executed
    unknown_trip_whiles: int  # of which without a known trip count (host sync per trip)
    conditionals: int  # conditionals executed (each a host sync outside command buffers)
    copies: tuple[Copy, ...]
    bytes: float  # with each conditional's largest branch (the one counted)
    flops: float
    least_bytes: float = 0.0  # with each conditional's cheapest branch (a plain greedy step)
    least_host_syncs: int = 0  # host syncs along those branches
    least_launches: int = 0  # kernels launched along them

    @property
    def launches(self) -> int:
        return sum(self.kernels.values())

    @property
    def host_syncs(self) -> int:
        """Predicate reads that wait for the device on XLA:GPU outside CUDA graphs."""
        return self.conditionals + self.unknown_trip_whiles

    @property
    def launches_outside_graphs(self) -> int:
        """Launches XLA:GPU's default command buffers leave out on a greedy step (the
        cheapest branches): every kernel between two host syncs runs as one graph, so a
        sync costs about one launch more."""
        return self.least_host_syncs

    def copy_bytes(self, kind: str) -> float:
        return sum(c.bytes for c in self.copies if c.kind == kind)


class _Walk:
    def __init__(self, comps: dict[str, list[Instruction]], geometry: Geometry):
        self.comps, self.geometry = comps, geometry
        self.by_name = {i.name: i for instrs in comps.values() for i in instrs}
        self.kernels: collections.Counter = collections.Counter()
        self.whiles = self.unknown = self.conditionals = 0
        self.copies: list[Copy] = []
        self.bytes = self.flops = 0.0
        self.least = 0.0  # bytes with each conditional's cheapest branch
        self.least_syncs = 0.0  # host syncs along those branches
        self.least_launches = 0.0  # kernels along them

    def run(self, comp: str, trips: float = 1) -> None:
        for ins in self.comps.get(comp, []):
            self.instruction(ins, trips)

    def instruction(self, ins: Instruction, trips: float) -> None:
        op = ins.opcode
        if op in _BOOKKEEPING:
            return
        if op == "while":
            n = self._trip_count(ins)
            self.whiles += trips
            if n is None:
                self.unknown += trips
                self.least_syncs += trips
            inner = trips * (1 if n is None else n)
            for comp in ins.attr("condition") + ins.attr("body"):
                self.run(comp, inner)
            return
        if op == "conditional":
            self.conditionals += trips
            branches = ins.attr("branch_computations") or (
                ins.attr("true_computation") + ins.attr("false_computation"))
            walks = [self._alone(b) for b in branches]
            self.least_syncs += trips
            if walks:
                best = max(walks, key=lambda w: w.launches())
                cheapest = min(walks, key=lambda w: w.least)
                self._add(best, trips)
                self.least += trips * (cheapest.least - best.least)
                self.least_syncs += trips * (cheapest.least_syncs - best.least_syncs)
                self.least_launches += trips * (cheapest.least_launches - best.least_launches)
            return
        if op == "call":
            for comp in ins.attr("to_apply"):
                self.run(comp, trips)
            return
        self.kernels[self._kind(ins)] += trips
        self.least_launches += trips
        moved = trips * self._moved(ins)
        self.bytes += moved
        self.least += moved
        self.flops += trips * self._flops(ins)
        self._copy(ins, trips)

    def _trip_count(self, ins: Instruction) -> int | None:
        """XLA:GPU's ``known_trip_count``, or (libtpu does not write it) a counted loop's:
        its condition compares a tuple element with a constant N, ``LT``, and the loop
        starts that element at a constant (a ``fori_loop``: it steps by one)."""
        n = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
        if n is not None:
            return int(n.group(1))
        cond = self.comps.get(next(iter(ins.attr("condition")), ""), [])
        local = {i.name: i for i in cond}
        root = next((i for i in cond if i.root), None)
        if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs \
                or len(root.operands) != 2:
            return None
        index, bound = (local.get(o) for o in root.operands)
        if index is None or bound is None or index.opcode != "get-tuple-element" \
                or bound.opcode != "constant":
            return None
        k = re.search(r"index=(\d+)", index.attrs)
        init = self.by_name.get(ins.operands[0]) if ins.operands else None
        if k is None or init is None or init.opcode != "tuple":
            return None
        start = self.by_name.get(init.operands[int(k.group(1))])
        while start is not None and start.opcode == "copy" and start.operands:
            start = self.by_name.get(start.operands[0])  # libtpu copies the constant in
        if start is None or start.opcode != "constant":
            return None
        try:
            return max(int(bound.args) - int(start.args), 0)
        except ValueError:
            return None

    def _alone(self, comp: str) -> "_Walk":
        w = _Walk(self.comps, self.geometry)
        w.by_name = self.by_name
        w.run(comp)
        return w

    def launches(self) -> float:
        return sum(self.kernels.values())

    def _add(self, w: "_Walk", trips: float) -> None:
        for k, v in w.kernels.items():
            self.kernels[k] += trips * v
        self.whiles += trips * w.whiles
        self.unknown += trips * w.unknown
        self.conditionals += trips * w.conditionals
        self.copies += [dataclasses.replace(c, bytes=c.bytes * trips) for c in w.copies]
        self.bytes += trips * w.bytes
        self.least += trips * w.least
        self.least_syncs += trips * w.least_syncs
        self.least_launches += trips * w.least_launches
        self.flops += trips * w.flops

    @staticmethod
    def _kind(ins: Instruction) -> str:
        if ins.opcode == "fusion":
            return "gemm" if ("gemm" in ins.attrs or "kind=kOutput" in ins.attrs
                              and "dot" in ins.name) else "fusion"
        if ins.opcode == "custom-call":
            return "pallas" if "pallas" in ins.name or "tpu_custom_call" in ins.attrs \
                or "triton" in ins.attrs else "custom-call"
        return ins.opcode if ins.opcode in ("copy", "copy-start") else "other"

    def _fused(self, ins: Instruction) -> list[Instruction]:
        return self.comps.get(next(iter(ins.attr("calls")), ""), [])

    def _moved(self, ins: Instruction) -> float:
        operands = [self.by_name[o] for o in ins.operands if o in self.by_name]
        if ins.opcode == "custom-call":
            aliased = "output_to_operand_aliasing" in ins.attrs
            return sum(self._custom_read(o) for o in operands) + sum(
                _BYTES.get(d, 0) * math.prod(dims) for d, dims in ins.arrays
                if not (aliased and self.geometry.kind(dims) == "kv"))
        if ins.opcode in _ASYNC_STARTS:  # shape (operand, result, context): the result
            d, dims = ins.arrays[1]           # read and written once
            return 2 * _BYTES.get(d, 0) * math.prod(dims)
        if ins.opcode in _ASYNC_DONES:  # counted at the start
            return 0.0
        if ins.opcode in ("gather", "dynamic-slice", "slice"):  # reads what it takes
            return 2 * ins.bytes + sum(o.bytes for o in operands[1:])  # (and the indices)
        if ins.opcode != "fusion":
            return ins.bytes + sum(o.bytes for o in operands)
        body = self._fused(ins)
        root = next((i for i in body if i.root), None)
        if root is not None and root.opcode in _IN_PLACE_ROOTS:
            big = max(operands, key=lambda o: o.bytes, default=None)
            return 2 * sum(o.bytes for o in operands if o is not big)
        return ins.bytes + sum(self._read(body, i, o) for i, o in enumerate(operands))

    def _read(self, body: list[Instruction], index: int, operand: Instruction) -> float:
        """Bytes a fusion reads of its ``index``-th operand: the slices it takes of it when
        it only slices it, else all of it."""
        param = next((i for i in body if i.opcode == "parameter" and i.args == str(index)),
                     None)
        if param is None:
            return operand.bytes
        taken = self._taken(body, param.name)
        return operand.bytes if taken is None else taken

    def _taken(self, body: list[Instruction], name: str) -> float | None:
        """The bytes the slices of value ``name`` take within a fusion ``body``, through any
        bitcasts of it (a reshaped stack's gather), or None when anything else reads it."""
        users = [i for i in body if name in i.operands]
        if not users or any(u.opcode not in _SLICING or u.operands[0] != name for u in users):
            return None
        total = 0.0
        for u in users:
            part = self._taken(body, u.name) if u.opcode == "bitcast" else u.bytes
            if part is None:
                return None
            total += part
        return total

    def _custom_read(self, operand: Instruction) -> float:
        """Bytes a custom call reads of ``operand``: none of the KV pages (paged: the
        sequences' own, priced apart), one layer of a stacked weight (the indexed layer
        kernels address their layer), else all of it."""
        arrays = operand.arrays
        if len(arrays) != 1:
            return operand.bytes
        dims = arrays[0][1]
        kind = self.geometry.kind(dims)
        if kind == "kv":
            return 0.0
        if kind == "weight" and len(dims) == 3 and dims[0] == self.geometry.layers > 1:
            return operand.bytes / dims[0]
        return operand.bytes

    def _flops(self, ins: Instruction) -> float:
        body = self._fused(ins) if ins.opcode == "fusion" else [ins]
        total = 0.0
        for i in body:
            if i.opcode != "dot" or not i.operands:
                continue
            lhs = next((x for x in body if x.name == i.operands[0]),
                       self.by_name.get(i.operands[0]))
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs)
            if lhs is None or dims is None or not lhs.arrays:
                continue
            k = math.prod(lhs.arrays[0][1][int(x)] for x in dims.group(1).split(",") if x)
            total += 2 * k * sum(math.prod(d) for _, d in i.arrays)
        return total

    def _copy(self, ins: Instruction, trips: float) -> None:
        if ins.opcode not in _MATERIALISING:
            return
        if ins.opcode == "fusion":
            body = self._fused(ins)
            root = next((i for i in body if i.root), None)
            if root is not None and root.opcode in _IN_PLACE_ROOTS | {"dot"}:
                return
        if ins.opcode == "copy-start" and "S(1)" in ins.shape:
            return  # a TPU prefetch into VMEM: a read, not a copy in HBM
        for dtype, dims in ins.arrays:
            kind = self.geometry.kind(dims)
            if kind is not None:
                self.copies.append(Copy(ins.name, ins.opcode, kind,
                                        trips * _BYTES.get(dtype, 0) * math.prod(dims)))


def analyse(text: str, geometry: Geometry) -> Analysis:
    """The run of the module ``text`` (``compiled.as_text()``), read as the module says."""
    comps, entry = parse(text)
    w = _Walk(comps, geometry)
    w.run(entry)
    return Analysis(w.kernels, int(w.whiles), int(w.unknown), int(w.conditionals),
                    tuple(w.copies), w.bytes, w.flops, w.least, int(w.least_syncs),
                    int(w.least_launches))
