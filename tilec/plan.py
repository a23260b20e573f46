"""KernelPlan: the encoded program a persistent kernel (or the CPU reference) executes.

* ``queues``: int32 ``[W, L, 32]``, one 32-int descriptor per instruction
  (:data:`DESCRIPTOR` defines the layout once; the C++ header is generated from it),
  padded with NoOps;
* ``events``: int32 ``[E, 4]`` = (trigger count per step, first task, last task, unused);
  a wait in step ``epoch`` (1, 2, ...) is satisfied when the monotonic counter reaches
  ``epoch * count``, so consecutive steps need no reset;
* ``arrivals``: how many arrival counters follow the E event counters in the executors' counter
  array (``OpDef.arrivals``: a tile adds one and learns whether it arrived last in the step,
  ``epoch * count`` again; the split-KV combine folded into its partials uses them);
* an operand table: int64 ``[R, MAX_OPERANDS, OPERAND_FIELDS]``, one row per op: for each
  operand its address (bytes; or the value of a scalar), dtype code, rank, sizes and
  strides (elements), and how far it moves per decode position (``pos_step``). Addresses
  come from the bound tensors (:meth:`KernelPlan.bind_base`); the
  executors add ``p * pos_step`` for the call's position ``p`` - tables never change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import ops as opreg
from . import smem
from .errors import TilecError
from .ir import DTYPE_CODES, OpGraph, ScalarOperand, View
from .ops import EMPTY, NOOP
from .passes.schedule import Schedule
from .taskgraph import TaskGraph

# ---- the single definition of the descriptor layout ------------------------------------
DESCRIPTOR_WORDS = 32
MAX_COORDS = 5
MAX_PARAMS = 9
PREFETCH_MAX_BYTES = 128 * 1024  # per instruction: 132 workers x 128 KiB stays well inside L2
# Version of the descriptor encoding (the dispatch signature's packing above all): part of the
# keys of the on-disk plan cache (tilec.backend), so a plan stored by another encoding is not reused.
# 3: linear_fused's staged-x flag (param 4). 4: 12 operands a row (tilec.passes.fold_kv_append).
# 5: 13 operands a row and arrival counters (tilec.passes.fold_combine).
PLAN_FORMAT = 5
DESCRIPTOR: tuple[tuple[str, int, int], ...] = (
    # (field, first word, number of words)
    ("opcode", 0, 1),
    ("variant", 1, 1),
    ("wait_event", 2, 1),  # -1: no wait
    ("wait_count", 3, 1),  # triggers per step; the wait target is epoch * wait_count
    ("signal_event", 4, 1),  # -1: no signal
    ("operand_row", 5, 1),
    ("task", 6, 1),  # linearized task index
    ("op", 7, 1),  # op index in the OpGraph (-1 for empty tasks)
    ("coords", 8, 2 * MAX_COORDS),  # (lo, hi) pairs of the tile in the op's iteration space
    ("ncoords", 18, 1),  # number of coordinate ranges in use
    ("dtype_sig", 19, 1),  # operand dtype codes + 1, 4 bits each, and a shape class (variant_signature; selects the device variant)
    ("params", 20, MAX_PARAMS),  # op parameters (int32; floats as float32 bits)
    # GEMV weights the worker's loader warp streams through the shared-memory ring (0: none):
    # operand + 1 | n-range coordinate index << 4 | k-range coordinate index << 8, | 1 << 12 when the
    # items go K block outer, | 1 << 13 for 1-byte (FP8) weights, | 1 << 14 when an item holds two
    # column groups (OpDef.stream, tilec.ops.gemv_stream_word, tilec.ops.fp8_linear)
    ("stream", 29, 1),
    # L2 prefetch hint issued before the wait (0: none): word 0 = operand << 28 | bytes / 16,
    # word 1 = byte offset / 16 from the operand's address (OpDef.prefetch)
    ("prefetch", 30, 2),
)
F = {name: (start, n) for name, start, n in DESCRIPTOR}
assert sum(n for _, _, n in DESCRIPTOR) == DESCRIPTOR_WORDS

MAX_OPERANDS = 13  # attention_partial with its folds: q, K, V, o, ml, valid, cos, sin, k and v rows, K and V slots, out
MAX_DIMS = 4
OPERAND: tuple[tuple[str, int, int], ...] = (
    ("addr", 0, 1),  # byte address (or the scalar's value)
    ("dtype", 1, 1),  # tilec.ir.DTYPE_CODES; -1 for a scalar
    ("ndim", 2, 1),
    ("sizes", 3, MAX_DIMS),
    ("strides", 3 + MAX_DIMS, MAX_DIMS),  # in elements
    ("pos_step", 3 + 2 * MAX_DIMS, 1),  # addr (or scalar) change per decode position, applied on device
)
OPERAND_FIELDS = 12
UNUSED_OPERAND, SCALAR_OPERAND = -2, -1  # dtype codes of an empty slot and of a scalar
OF = {name: (start, n) for name, start, n in OPERAND}


def apply_position(table: torch.Tensor, position: int) -> torch.Tensor:
    """A copy of an operand table (int64 [R, MAX_OPERANDS, OPERAND_FIELDS]) with every entry's
    address (or scalar) moved by ``position * pos_step`` and ``pos_step`` zeroed - what the
    CUDA executor does on the device for the position it is launched with."""
    out = table.clone()
    a, ps = OF["addr"][0], OF["pos_step"][0]
    out[..., a] += position * out[..., ps]
    out[..., ps] = 0
    return out


@dataclass(frozen=True)
class OperandBinding:
    """How one operand-table entry is computed per call."""

    view: View | None
    scalar: ScalarOperand | None
    elem_size: int = 0


@dataclass
class KernelPlan:
    """The encoded program. See the module docstring for the table layouts."""

    graph: OpGraph
    queues: torch.Tensor  # int32 [W, L, 32]
    events: torch.Tensor  # int32 [E, 4]
    operands: list[list[OperandBinding]]  # per operand row
    op_names: list[str]
    static_operands: torch.Tensor  # int64 [R, MAX_OPERANDS, OPERAND_FIELDS] (addr = 0)
    stats: dict = field(default_factory=dict)
    ring_stages: int = 0  # GEMV weight-ring stages per worker (tilec.smem); 0: nothing streamed
    arrivals: int = 0  # arrival counters after the events (module docstring)

    @property
    def workers(self) -> int:
        return self.queues.shape[0]

    def bind(self, tensors: dict[str, torch.Tensor], position: int) -> torch.Tensor:
        """The operand table for one call at decode position ``position``, with every
        position-dependent entry already moved (``pos_step`` zeroed): see :meth:`bind_base`.

        Raises:
            TilecError: a buffer is missing, or p is outside [0, max_positions).
        """
        if not 0 <= position < self.graph.max_positions:
            raise TilecError(f"decode position {position} outside the planned range [0, {self.graph.max_positions})")
        return apply_position(self.bind_base(tensors), position)

    def bind_base(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The position-independent operand table for a set of bound tensors: addresses for
        p = 0 plus each entry's ``pos_step`` (bytes, or scalar units, per position), which the
        executors apply for the call's position. Not cached: :class:`tilec.program.CompiledProgram`
        keeps one table per set of argument tensors.

        Args:
            tensors: buffer name -> tensor holding it (contiguous, matching dtype/shape).
        Raises:
            TilecError: a buffer is missing.
        """
        missing = sorted({b.view.buffer for row in self.operands for b in row
                          if b.view is not None and b.view.buffer not in tensors})
        if missing:
            raise TilecError(f"no tensor bound for buffer(s) {missing}")
        table = self.static_operands.clone()
        a, ps = OF["addr"][0], OF["pos_step"][0]
        ptr = {name: t.data_ptr() for name, t in tensors.items()}
        rows, slots, addrs, steps = [], [], [], []
        for r, row in enumerate(self.operands):
            for i, b in enumerate(row):
                rows.append(r)
                slots.append(i)
                if b.scalar is not None:
                    addrs.append(b.scalar.base)
                    steps.append(b.scalar.pos_scale)
                else:
                    addrs.append(ptr[b.view.buffer] + b.view.offset * b.elem_size)
                    steps.append(b.view.pos_stride * b.elem_size)
        if rows:  # written at once: element by element, a 1B step's 7k writes took 0.35 s (cProfile, in torch.compile)
            at = torch.tensor(rows), torch.tensor(slots)
            table[at + (a,)] = torch.tensor(addrs, dtype=table.dtype)
            table[at + (ps,)] = torch.tensor(steps, dtype=table.dtype)
        return table

    def to_tables(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The plan as ``(tensors, meta)``: ``queues``/``events``/``static_operands`` tensors and a
        JSON-able dict of the operand bindings (per row: a view, or a scalar ``[base, pos_scale]``,
        and the element size in bytes) and op names. The graph is stored separately
        (:meth:`OpGraph.to_dict`); :meth:`from_tables` rebuilds the plan without re-tracing."""
        rows = [[{"view": None if b.view is None else b.view.to_dict(),
                  "scalar": None if b.scalar is None else [b.scalar.base, b.scalar.pos_scale],
                  "elem_size": b.elem_size} for b in row] for row in self.operands]
        tensors = {"queues": self.queues, "events": self.events, "static_operands": self.static_operands}
        return tensors, {"operands": rows, "op_names": list(self.op_names), "ring_stages": self.ring_stages,
                         "arrivals": self.arrivals}

    @classmethod
    def from_tables(cls, graph: OpGraph, tensors: dict[str, torch.Tensor], meta: dict,
                    stats: dict | None = None) -> "KernelPlan":
        """Inverse of :meth:`to_tables`.

        Raises:
            TilecError: a table has the wrong dtype or shape for this layout.
        """
        want = {"queues": (torch.int32, 3), "events": (torch.int32, 2), "static_operands": (torch.int64, 3)}
        for name, (dtype, ndim) in want.items():
            t = tensors.get(name)
            if t is None or t.dtype != dtype or t.dim() != ndim:
                raise TilecError(f"plan table {name}: expected {ndim}-d {dtype}, got "
                                 f"{'nothing' if t is None else f'{t.dim()}-d {t.dtype}'}")
        if tensors["queues"].shape[2] != DESCRIPTOR_WORDS or tuple(tensors["static_operands"].shape[1:]) != (
                MAX_OPERANDS, OPERAND_FIELDS):
            raise TilecError("plan tables do not match this tilec's descriptor/operand layout")
        rows = [[OperandBinding(None if b["view"] is None else View.from_dict(b["view"]),
                                None if b["scalar"] is None else ScalarOperand(*b["scalar"]), b["elem_size"])
                 for b in row] for row in meta["operands"]]
        return cls(graph, tensors["queues"], tensors["events"], rows, list(meta["op_names"]),
                   tensors["static_operands"], dict(stats or {}), int(meta.get("ring_stages", 0)),
                   int(meta.get("arrivals", 0)))

    def render(self) -> str:
        lines = [f"kernelplan workers={self.queues.shape[0]} length={self.queues.shape[1]} "
                 f"events={self.events.shape[0]} operand_rows={len(self.operands)}"
                 + (f" arrivals={self.arrivals}" if self.arrivals else "") + " {"]
        op_lo, op_n = F["opcode"]
        for w in range(self.queues.shape[0]):
            instrs = []
            for d in self.queues[w].tolist():
                if d[0] == NOOP:
                    continue
                name = "empty" if d[0] == EMPTY else self.op_names[d[F["op"][0]]]
                wait = f" wait e{d[2]}>={d[3]}" if d[2] >= 0 else ""
                sig = f" signal e{d[4]}" if d[4] >= 0 else ""
                instrs.append(f"#{d[6]} {name}{wait}{sig}")
            lines.append(f"  w{w}: " + "; ".join(instrs))
        for e, (count, first, last, _) in enumerate(self.events.tolist()):
            lines.append(f"  e{e}: count={count} tasks=[{first},{last}]")
        lines.append("}")
        return "\n".join(lines)


def encode(tg: TaskGraph, sched: Schedule) -> KernelPlan:
    """Encodes a scheduled, linearized TaskGraph into a :class:`KernelPlan`.

    Raises:
        TilecError: an op has more operands, dims, coords or params than the layout holds.
    """
    graph = tg.graph
    try:  # the weight ring takes what the ops' scratch leaves (a plan too big for a CTA streams nothing)
        scratch = smem.scratch_bytes(graph)
        stages = smem.ring_stages(scratch)
    except TilecError:
        scratch, stages = 0, 0
    op_index = {op.name: i for i, op in enumerate(graph.ops)}
    index_of = {tid: i for i, tid in enumerate(tg.order)}
    wait_of, signal_of = {}, {}
    for e in tg.events:
        for s in e.succs:
            wait_of[s] = e
        for p in e.preds:
            signal_of[p] = e
    # operand rows: one per op
    rows: list[list[OperandBinding]] = []
    static = torch.zeros(len(graph.ops), MAX_OPERANDS, OPERAND_FIELDS, dtype=torch.int64)
    static[:, :, OF["dtype"][0]] = UNUSED_OPERAND
    for r, op in enumerate(graph.ops):
        operands = opreg.opdef(op.kind).operands(op)
        if len(operands) > MAX_OPERANDS:
            raise TilecError(f"op {op.name} has {len(operands)} operands (max {MAX_OPERANDS})")
        row = []
        for i, v in enumerate(operands):
            if isinstance(v, ScalarOperand):
                row.append(OperandBinding(None, v))
                static[r, i, OF["dtype"][0]] = SCALAR_OPERAND
                continue
            buf = graph.buffers[v.buffer]
            if len(v.shape) > MAX_DIMS:
                raise TilecError(f"op {op.name}: operand {v.render()} has more than {MAX_DIMS} dims")
            es = torch.empty((), dtype=buf.dtype).element_size()
            row.append(OperandBinding(v, None, es))
            static[r, i, OF["dtype"][0]] = DTYPE_CODES[buf.dtype]
            static[r, i, OF["ndim"][0]] = len(v.shape)
            s0, t0 = OF["sizes"][0], OF["strides"][0]
            for d, (size, stride) in enumerate(zip(v.shape, v.strides)):
                static[r, i, s0 + d] = size
                static[r, i, t0 + d] = stride
        rows.append(row)
    arrival_base, arrivals = {}, 0  # op index -> its first arrival counter (after the events)
    for r, op in enumerate(graph.ops):
        n = opreg.opdef(op.kind).arrivals(op)
        if n:
            arrival_base[r] = len(tg.events) + arrivals
            arrivals += n

    length = max((len(q) for q in sched.queues), default=0) or 1
    queues = torch.zeros(len(sched.queues), length, DESCRIPTOR_WORDS, dtype=torch.int32)
    queues[:, :, F["wait_event"][0]] = -1
    queues[:, :, F["signal_event"][0]] = -1
    queues[:, :, F["op"][0]] = -1
    by_id = {t.id: t for t in tg.tasks}
    for w, q in enumerate(sched.queues):
        staged = None  # what the previous instruction left staged in shared memory (OpDef.staged_x)
        for j, tid in enumerate(q):
            t = by_id[tid]
            d = queues[w, j]
            d[F["task"][0]] = index_of[tid]
            if tid in wait_of:
                d[F["wait_event"][0]] = wait_of[tid].id
                d[F["wait_count"][0]] = len(wait_of[tid].preds)
            if tid in signal_of:
                d[F["signal_event"][0]] = signal_of[tid].id
            if t.op is None:
                d[F["opcode"][0]] = EMPTY
                staged = None
                continue
            op = graph.ops[op_index[t.op]]
            od = opreg.opdef(op.kind)
            d[F["opcode"][0]] = od.opcode
            d[F["dtype_sig"][0]] = variant_signature(graph, op)
            d[F["variant"][0]] = t.tile.variant
            d[F["operand_row"][0]] = op_index[t.op]
            d[F["op"][0]] = op_index[t.op]
            if len(t.tile.coords) > MAX_COORDS:
                raise TilecError(f"op {op.name}: tile has {len(t.tile.coords)} coordinate ranges (max {MAX_COORDS})")
            c0 = F["coords"][0]
            d[F["ncoords"][0]] = len(t.tile.coords)
            for k, (lo, hi) in enumerate(t.tile.coords):
                d[c0 + 2 * k] = lo
                d[c0 + 2 * k + 1] = hi
            params = od.params(op)
            if len(params) > MAX_PARAMS:
                raise TilecError(f"op {op.name}: {len(params)} params (max {MAX_PARAMS})")
            p0 = F["params"][0]
            for k, v in enumerate(params):
                d[p0 + k] = v
            if op_index[t.op] in arrival_base:
                d[p0 + od.arrival_param] = arrival_base[op_index[t.op]]
            stream = od.stream(op, t.tile, graph, scratch) if stages else 0
            d[F["stream"][0]] = stream
            x = od.staged_x(op, t.tile) if stream and not stream & opreg.STREAM_KOUTER else None
            key = (od.kind, x) if x is not None else None
            if key is not None and key == staged:
                d[p0 + od.staged_x_param] = 1
            staged = key
            pf = None if stream else od.prefetch(op, t.tile, graph)
            if pf is not None:
                operand, offset, nbytes = pf
                nbytes = min(nbytes, PREFETCH_MAX_BYTES)
                if nbytes >= 16 and 0 <= operand < 8 and 0 <= offset // 16 < 2 ** 31:
                    d[F["prefetch"][0]] = (operand << 28) | (nbytes // 16)  # never past the range's end
                    d[F["prefetch"][0] + 1] = offset // 16
    events = torch.zeros(len(tg.events), 4, dtype=torch.int32)
    for e in tg.events:
        events[e.id] = torch.tensor([len(e.preds), e.first, e.last, 0], dtype=torch.int32)
    # no ring when nothing streams: the shared memory it would take is the SM's L1 cache instead
    return KernelPlan(graph, queues, events, rows, [op.name for op in graph.ops], static,
                      ring_stages=stages if bool((queues[..., F["stream"][0]] != 0).any()) else 0, arrivals=arrivals)


def variant_signature(graph: OpGraph, op) -> int:
    """The dispatch signature of ``op``'s device instance: its operands' dtype signature, and its
    OpDef's shape class (``OpDef.shape_class``, 0..127) in bits 24..30.

    Raises:
        TilecError: the op has more than 6 operands and a shape class (their bits would overlap).
    """
    od = opreg.opdef(op.kind)
    operands = od.operands(op)
    sig = dtype_signature(graph, operands)
    cls = od.shape_class(op)
    if cls:
        if len(operands) > 6 or not 0 < cls < 128:
            raise TilecError(f"op {op.name}: shape class {cls} with {len(operands)} operands does not fit the signature")
        sig |= cls << 24
    return sig


assert max(DTYPE_CODES.values()) + 1 < 0xF, "dtype codes + 1 must stay below the scalar nibble 0xF"


def dtype_signature(graph: OpGraph, operands) -> int:
    """Operand dtype codes + 1 packed 4 bits each (scalars as 0xF), operand 0 in the low bits: no
    operand packs as 0, so ops of the same dtypes but different operand counts (a linear with and
    without bias, all float32) get different signatures. Only the first 8 operands fit: an op with
    more (attention_partial with its folds) has the others' dtypes tied to those (its ``device_dtypes``
    checks them)."""
    sig = 0
    for i, v in enumerate(operands[:8]):
        code = 0xF if isinstance(v, ScalarOperand) else DTYPE_CODES[graph.buffers[v.buffer].dtype] + 1
        sig |= code << (4 * i)
    return sig if sig < 2 ** 31 else sig - 2 ** 32


def decode_coords(d: list[int]) -> tuple[tuple[int, int], ...]:
    """The tile's coordinate ranges from one descriptor (a list of 32 ints)."""
    c0 = F["coords"][0]
    return tuple((d[c0 + 2 * k], d[c0 + 2 * k + 1]) for k in range(d[F["ncoords"][0]]))


def decode_params(d: list[int]) -> tuple[int, ...]:
    """The op params of one descriptor (a list of 32 ints): all :data:`MAX_PARAMS` words of the
    ``params`` field, as the op's ``params`` encoded them (floats as float32 bits), the words past
    them 0, and the plan's per-tile words (staged x, first arrival counter) filled in."""
    p0, n = F["params"]
    return tuple(d[p0:p0 + n])
