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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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

    def render(self) -> str:
        lines = ["opgraph {"]
        for b in self.buffers.values():
            lines.append(f"  buffer {b.name}: {dtype_name(b.dtype)}[{'x'.join(map(str, b.shape))}] {b.kind.value}")
        lines.append(f"  inputs ({', '.join(self.inputs)})")
        for op in self.ops:
            lines.append(f"  {op.render()}")
        lines.append(f"  return ({', '.join(v.render() for v in self.outputs)})")
        lines.append("}")
        return "\n".join(lines)
