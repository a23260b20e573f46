"""OpGraph: the first IR below the FX graph.

An :class:`OpGraph` is a list of :class:`Op` in topological order over named
:class:`Buffer` storages. Every operand is a :class:`View` of a buffer: a strided
layout (shape, strides, offset in elements) plus ``pos_stride``, the number of
elements the view moves per decode position ``p`` (non-zero only for rows of
position tables and for the in-place KV-cache write slot).

All classes are frozen dataclasses; the def-use graph is derived on demand as a
``networkx.DiGraph`` (:meth:`OpGraph.def_use`).
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field

import networkx as nx
import torch


class BufferKind(str, enum.Enum):
    """Where a buffer's storage comes from and who owns it."""

    INPUT = "input"  # bound per call (token ids, ...)
    PARAM = "param"  # model weights, bound once, read-only
    CONST = "const"  # folded constants owned by the compiled program
    TABLE = "table"  # position tables [max_positions, ...] (RoPE cos/sin, ...)
    STATE = "state"  # caller-owned state updated in place (KV caches)
    TEMP = "temp"  # intermediates owned by the compiled program
    OUTPUT = "output"  # program outputs (owned by the program, returned to the caller)


DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int64: 3,
    torch.int32: 4,
    torch.bool: 5,
    torch.float8_e4m3fn: 6,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def is_integer(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers (not floating point, complex or bool): a position's dtype."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's torch name without ``torch.`` (``torch.bfloat16`` -> ``"bfloat16"``), as IR text
    and JSON write it; :func:`dtype_from_name` inverts it."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` (``"bfloat16"`` -> ``torch.bfloat16``); ``ValueError`` if unknown."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _attr_to_json(v):
    """An op attribute as JSON: tuples, dtypes and non-finite floats are tagged so they round-trip."""
    if isinstance(v, tuple):
        return {"tuple": [_attr_to_json(x) for x in v]}
    if isinstance(v, list):
        return [_attr_to_json(x) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"op attribute value {v!r} of type {type(v).__name__} is not serializable")


def _attr_from_json(v):
    if isinstance(v, list):
        return [_attr_from_json(x) for x in v]
    if isinstance(v, dict):
        if "tuple" in v:
            return tuple(_attr_from_json(x) for x in v["tuple"])
        if "dtype" in v:
            return dtype_from_name(v["dtype"])
        if "float" in v:
            return float(v["float"])
        raise ValueError(f"unknown tagged attribute value {v!r}")
    return v


@dataclass(frozen=True)
class Buffer:
    """A storage: ``shape`` is its canonical contiguous shape, ``dtype`` its element type."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: BufferKind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major (C-order) strides of ``shape``, in elements; a dim of size 0 counts as 1 for the
    dims before it, as torch does."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class View:
    """A strided window on a buffer (sizes and strides in elements).

    Element ``idx`` of the view lives at buffer element
    ``offset + p * pos_stride + sum(idx[i] * strides[i])`` for decode position ``p``.
    """

    buffer: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    pos_stride: int = 0

    @staticmethod
    def whole(buf: Buffer) -> "View":
        return View(buf.name, buf.shape, contiguous_strides(buf.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        return all(
            size == 1 or stride == want
            for size, stride, want in zip(self.shape, self.strides, contiguous_strides(self.shape))
        )

    def to_dict(self) -> dict:
        return {"buffer": self.buffer, "shape": list(self.shape), "strides": list(self.strides),
                "offset": self.offset, "pos_stride": self.pos_stride}

    @staticmethod
    def from_dict(d: dict) -> "View":
        return View(d["buffer"], tuple(d["shape"]), tuple(d["strides"]), d["offset"], d["pos_stride"])

    def render(self) -> str:
        s = f"{self.buffer}[{'x'.join(map(str, self.shape)) or 'scalar'}]"
        if not self.is_contiguous() or self.offset:
            s += f"@{self.offset}/{','.join(map(str, self.strides))}"
        if self.pos_stride:
            s += f"+p*{self.pos_stride}"
        return s


@dataclass(frozen=True)
class Provenance:
    """The FX node an op came from: its name, aten target and the user's source line."""

    node: str
    target: str
    source: str = ""

    def render(self) -> str:
        return f"{self.node} ({self.target})" + (f" at {self.source}" if self.source else "")


@dataclass(frozen=True)
class Op:
    """One op of the tilec op set.

    ``kind`` names the registry entry (``tilec.ops``); ``inputs``/``outputs`` are views;
    ``attrs`` a sorted tuple of ``(name, value)`` pairs with plain Python values.
    """

    name: str
    kind: str
    inputs: tuple[View, ...]
    outputs: tuple[View, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    provenance: Provenance | None = None

    def attr(self, key: str, default=None):
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def reads_text(self, labels: dict[str, str], graph: "OpGraph | None" = None) -> str:
        """``; it reads argument 0 (input_ids)``: the buffers this op reads that ``labels`` names (buffer
        name -> a program argument's label), in input order, each once, for a run-time error; "" when
        it reads none of them. With ``graph``, a buffer a ``copy`` op of ``graph`` wrote from a labelled
        one (a cast: ``ids.long()``) is named through it: ``a copy of argument 0 (ids)``."""
        copies = {}
        if graph is not None:
            copies = {o.outputs[0].buffer: labels[o.inputs[0].buffer] for o in graph.ops
                      if o.kind == "copy" and o.inputs and o.outputs and o.inputs[0].buffer in labels}
        names = list(dict.fromkeys(labels[v.buffer] if v.buffer in labels else f"a copy of {copies[v.buffer]}"
                                   for v in self.inputs if v.buffer in labels or v.buffer in copies))
        return f"; it reads {', '.join(names)}" if names else ""

    def to_dict(self) -> dict:
        prov = self.provenance
        return {"name": self.name, "kind": self.kind, "inputs": [v.to_dict() for v in self.inputs],
                "outputs": [v.to_dict() for v in self.outputs],
                "attrs": [[k, _attr_to_json(v)] for k, v in self.attrs],
                "provenance": None if prov is None else {"node": prov.node, "target": prov.target,
                                                         "source": prov.source}}

    @staticmethod
    def from_dict(d: dict) -> "Op":
        prov = d.get("provenance")
        return Op(d["name"], d["kind"], tuple(View.from_dict(v) for v in d["inputs"]),
                  tuple(View.from_dict(v) for v in d["outputs"]),
                  tuple((k, _attr_from_json(v)) for k, v in d["attrs"]),
                  None if prov is None else Provenance(prov["node"], prov["target"], prov.get("source", "")))

    def render(self) -> str:
        ins = ", ".join(v.render() for v in self.inputs)
        outs = ", ".join(v.render() for v in self.outputs)
        attrs = "".join(f" {k}={v!r}" for k, v in self.attrs)
        return f"{self.name} = {self.kind}({ins}) -> {outs}{attrs}"


@dataclass(frozen=True)
class ScalarOperand:
    """A per-call integer operand: ``base + p * pos_scale`` (e.g. the attention length ``p + 1``)."""

    base: int
    pos_scale: int


@dataclass(frozen=True)
class OpGraph:
    """Ops in topological order plus the buffers they touch.

    ``inputs`` lists the call signature: for each user argument, either a buffer name,
    ``"<position>"`` (the decode position, an int64 scalar tensor), or ``"<ignored>"``.
    ``outputs`` are the views returned to the caller.
    """

    ops: tuple[Op, ...]
    buffers: dict[str, Buffer] = field(hash=False)
    inputs: tuple[str, ...]
    outputs: tuple[View, ...]
    max_positions: int = 1
    constants: dict[str, torch.Tensor] = field(default_factory=dict, hash=False, compare=False)
    # (user argument index, table [max_positions, ...]): position inputs the step updates in
    # place, e.g. HF's cache counter; the program writes ``table[p]`` into them after a step
    position_updates: tuple = field(default=(), hash=False, compare=False)
    # (aten mask node name, (batch, heads, query rows, cache length)): run-time attention masks
    # planned as causal, which the program checks on every call (tilec.guards.MaskGuard)
    mask_guards: tuple = ()

    @functools.cached_property
    def written(self) -> frozenset[str]:
        """Names of the buffers some op writes."""
        return frozenset(v.buffer for op in self.ops for v in op.outputs)

    def read_only(self, name: str) -> bool:
        """True when buffer ``name`` holds its values before the step starts and no op writes it:
        weights (PARAM), folded constants (CONST), and call inputs no op writes - the
        ``torch.compile`` backend passes module parameters as such inputs, bound per call. A GEMV's
        loader streams (and prefetches) only such weights, without waiting on events. Call arguments
        must not share memory with a buffer the step writes (``CompiledProgram`` raises when they do;
        the ``torch.compile`` backend runs a graph whose inputs alias a tensor written in place eagerly)."""
        kind = self.buffers[name].kind
        return kind in (BufferKind.PARAM, BufferKind.CONST) or kind is BufferKind.INPUT and name not in self.written

    def def_use(self) -> nx.DiGraph:
        """Bipartite def-use graph: op nodes ``("op", name)`` and buffer nodes ``("buf", name)``."""
        g = nx.DiGraph()
        for op in self.ops:
            g.add_node(("op", op.name), op=op)
            for v in op.inputs:
                g.add_edge(("buf", v.buffer), ("op", op.name))
            for v in op.outputs:
                g.add_edge(("op", op.name), ("buf", v.buffer))
        return g

    def producers(self) -> dict[str, list[Op]]:
        out: dict[str, list[Op]] = {}
        for op in self.ops:
            for v in op.outputs:
                out.setdefault(v.buffer, []).append(op)
        return out

    def to_dict(self) -> dict:
        """A JSON-able dict of the graph; its tensors (``constants`` and the ``position_updates``
        tables) come from :meth:`tensors` and are stored separately (e.g. as safetensors).

        ``OpGraph.from_dict(g.to_dict(), g.tensors()) == g``, renders identically, and has equal
        constants and position updates.
        """
        return {
            "buffers": [{"name": b.name, "shape": list(b.shape), "dtype": dtype_name(b.dtype), "kind": b.kind.value}
                        for b in self.buffers.values()],
            "ops": [op.to_dict() for op in self.ops],
            "inputs": list(self.inputs),
            "outputs": [v.to_dict() for v in self.outputs],
            "max_positions": self.max_positions,
            "constants": sorted(self.constants),
            "position_updates": [idx for idx, _ in self.position_updates],
            "mask_guards": [[name, list(shape)] for name, shape in self.mask_guards],
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """``constants`` by buffer name plus each position-update table as ``position_update.<arg index>``."""
        return {**self.constants, **{f"position_update.{idx}": table for idx, table in self.position_updates}}

    @staticmethod
    def from_dict(d: dict, tensors: dict[str, torch.Tensor] | None = None) -> "OpGraph":
        """Inverse of :meth:`to_dict` and :meth:`tensors`.

        Raises:
            ValueError: an unknown dtype or buffer kind, or a tensor named in ``d`` is missing.
        """
        tensors = dict(tensors or {})
        names = [*d.get("constants", []), *(f"position_update.{i}" for i in d.get("position_updates", []))]
        missing = [k for k in names if k not in tensors]
        if missing:
            raise ValueError(f"opgraph tensors missing: {missing}")
        buffers = {b["name"]: Buffer(b["name"], tuple(b["shape"]), dtype_from_name(b["dtype"]), BufferKind(b["kind"]))
                   for b in d["buffers"]}
        return OpGraph(tuple(Op.from_dict(o) for o in d["ops"]), buffers, tuple(d["inputs"]),
                       tuple(View.from_dict(v) for v in d["outputs"]), d["max_positions"],
                       {k: tensors[k] for k in d.get("constants", [])},
                       tuple((i, tensors[f"position_update.{i}"]) for i in d.get("position_updates", [])),
                       tuple((name, tuple(shape)) for name, shape in d.get("mask_guards", [])))

    def render(self) -> str:
        lines = ["opgraph {"]
        for b in self.buffers.values():
            lines.append(f"  buffer {b.name}: {dtype_name(b.dtype)}[{'x'.join(map(str, b.shape))}] {b.kind.value}")
        lines.append(f"  inputs ({', '.join(self.inputs)})")
        for name, shape in self.mask_guards:
            lines.append(f"  guard causal_mask({name}) [{'x'.join(map(str, shape))}]")
        for op in self.ops:
            lines.append(f"  {op.render()}")
        lines.append(f"  return ({', '.join(v.render() for v in self.outputs)})")
        lines.append("}")
        return "\n".join(lines)
