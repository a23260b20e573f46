"""TaskGraph: tiles of every op, the tensor regions they touch, and events between them.

Events are derived from region overlap (read-after-write, write-after-read, write-after-write,
in program order) and labelled with the pairing strategy of the seed (MegaRTP):

* ``tile``        one producer tile feeds the consumer tile;
* ``tile_cover``  the consumer region is covered by several disjoint producer tiles
                  (an RMSNorm row after the N-tiles of a GEMV);
* ``tile_reduce`` the producer tiles accumulate into the region (split-K partials);
* ``whole``       the region analysis was not exact (a view it could not map), so the
                  consumer waits for every producer tile that may overlap (conservative).

Tiles of one op never wait for one another over their accumulations (split-K partials add in
any order) or a :data:`~tilec.ops.DYNAMIC` write (a region whose writer among the op's tiles is
chosen at run time).

Before fusion there is one event per (consumer task, producer op); the passes in
``tilec.passes`` fuse, normalize and linearize them.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field

import torch

from . import ops as opreg
from .ir import Buffer, OpGraph, View, contiguous_strides
from .ops import ACCUMULATE, DYNAMIC, Box, Tile

_ENUM_LIMIT = 1 << 16


@dataclass(frozen=True)
class Task:
    """One tile of one op (``op`` is None for normalization's empty tasks).

    reads / writes are boxes in *buffer* coordinates: ``(buffer, box)`` and
    ``(buffer, box, access)``; ``nbytes``/``flops`` come from the op's cost rule.
    """

    id: int
    op: str | None
    kind: str
    tile: Tile | None
    reads: tuple = ()
    writes: tuple = ()
    exact: bool = True
    nbytes: int = 0
    flops: int = 0

    def label(self) -> str:
        if self.op is None:
            return f"t{self.id} empty"
        coords = ",".join(f"{lo}:{hi}" for lo, hi in self.tile.coords)
        v = f" v{self.tile.variant}" if self.tile.variant else ""
        return f"t{self.id} {self.op}[{coords}]{v}"


@dataclass(frozen=True)
class Event:
    """A counter: triggered once by each task in ``preds``; ``succs`` wait for all of them.

    After linearization ``first``/``last`` give the contiguous index range of ``succs``.
    """

    id: int
    preds: frozenset[int]
    succs: frozenset[int]
    strategy: str = "tile"
    first: int = -1
    last: int = -1


@dataclass(frozen=True)
class TaskGraph:
    """The task-level IR of ``graph``: every tile of every op as a :class:`Task` (ids 0..T-1 in op
    order, then tile order; normalization appends empty tasks) and the :class:`Event` counters
    between them. Built by :func:`build_taskgraph`; ``tilec.passes`` (``fuse_events``,
    ``normalize``, ``linearize``) return new ones.

    ``order``: the linearized task order (empty before linearization; events' ``first`` / ``last``
    index it). ``stats``: counts the passes record (events and dependencies before and after
    fusion, empty tasks added, ...), read by ``tilec.stats.compile_stats``.
    """

    graph: OpGraph
    tasks: tuple[Task, ...]
    events: tuple[Event, ...]
    order: tuple[int, ...] = ()  # linearized task order (empty until linearization)
    stats: dict = field(default_factory=dict, hash=False, compare=False)

    def waits(self) -> dict[int, list[int]]:
        """task id -> events it waits on."""
        out: dict[int, list[int]] = {t.id: [] for t in self.tasks}
        for e in self.events:
            for s in e.succs:
                out[s].append(e.id)
        return out

    def triggers(self) -> dict[int, list[int]]:
        """task id -> events it triggers."""
        out: dict[int, list[int]] = {t.id: [] for t in self.tasks}
        for e in self.events:
            for p in e.preds:
                out[p].append(e.id)
        return out

    def dependency_count(self) -> int:
        """Encoded dependencies: one per (event, predecessor) and per (event, successor)."""
        return sum(len(e.preds) + len(e.succs) for e in self.events)

    def render(self) -> str:
        lines = ["taskgraph {"]
        by_id = {t.id: t for t in self.tasks}
        order = self.order or tuple(sorted(by_id))
        for i, tid in enumerate(order):
            lines.append(f"  {i if self.order else tid}: {by_id[tid].label()}")
        for e in sorted(self.events, key=lambda e: e.id):
            rng = f" range=[{e.first},{e.last}]" if e.first >= 0 else ""
            lines.append(f"  e{e.id} {e.strategy}: {_ids(e.preds)} -> {_ids(e.succs)}{rng}")
        lines.append("}")
        return "\n".join(lines)


def _ids(s) -> str:
    return "{" + ",".join(f"t{i}" for i in sorted(s)) + "}"


# ---- view box -> buffer box --------------------------------------------------------------

def _unravel(flat: int, shape) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(flat % s if s else 0)
        flat = flat // s if s else 0
    return list(reversed(out))


def map_box(view: View, box: Box, buf: Buffer, p: int | None = None) -> tuple[Box, bool]:
    """The buffer-coordinate box covered by ``box`` of ``view``, and whether it is exact.

    ``p`` is the decode position; ``None`` means any position: a dim that moves with p is
    then covered whole (the conservative choice for dependencies).
    """
    return _map_box(view, tuple(map(tuple, box)), tuple(buf.shape), p)


@functools.lru_cache(maxsize=1 << 16)  # a step maps each (view, box) about twice: its reads, the verifier's
def _map_box(view: View, box: Box, shape: tuple[int, ...], p: int | None) -> tuple[Box, bool]:
    cs = contiguous_strides(shape)
    if any(hi <= lo for lo, hi in box):
        return tuple((0, 0) for _ in shape), True
    offset = view.offset + (p or 0) * view.pos_stride
    base = _unravel(offset, shape)
    ranges: dict[int, tuple[int, int]] = {}
    ok = True
    for (lo, hi), size, stride in zip(box, view.shape, view.strides):
        if stride == 0 or size == 1:
            if stride and lo:
                ok = False
            continue
        j = next((j for j in range(len(shape)) if cs[j] == stride and shape[j] > 1), None)
        if j is None or j in ranges or base[j] + hi > shape[j]:
            ok = False
            break
        ranges[j] = (base[j] + lo, base[j] + hi)
    if ok:
        out = []
        for j, s in enumerate(shape):
            out.append(ranges.get(j, (base[j], base[j] + 1)))
        if view.pos_stride and p is None:
            jd = next((j for j in range(len(shape)) if cs[j] == view.pos_stride), None)
            if jd is None:
                return tuple((0, s) for s in shape), False
            out[jd] = (0, shape[jd])
        return tuple(out), True
    numel = math.prod(hi - lo for lo, hi in box)
    if numel <= _ENUM_LIMIT and not (view.pos_stride and p is None):
        addr = torch.tensor(offset)
        for (lo, hi), stride in zip(box, view.strides):
            addr = (addr.unsqueeze(-1) + torch.arange(lo, hi) * stride)
        addr = addr.flatten().unique()
        coords = [(addr // cs[j]) % max(shape[j], 1) for j in range(len(shape))]
        bbox = tuple((int(c.min()), int(c.max()) + 1) for c in coords)
        return bbox, math.prod(hi - lo for lo, hi in bbox) == addr.numel()
    return tuple((0, s) for s in shape), False


def boxes_overlap(a: Box, b: Box) -> bool:
    """Whether boxes ``a`` and ``b`` of one buffer (half-open ranges per dim, same rank) share an
    element: their ranges intersect in every dim. A box with an empty range overlaps nothing."""
    return all(alo < bhi and blo < ahi for (alo, ahi), (blo, bhi) in zip(a, b))


class _Accesses:
    """The earlier accesses of one op in one mode to one buffer: task ids and boxes, with their
    bounding box kept as they are added, so that :meth:`overlapping` answers a box that contains
    them all (or misses them all) without a test per access; otherwise the boxes are found through
    a dim along which they are disjoint (a GEMV's column tiles), sorted once, by bisection."""

    __slots__ = ("ids", "boxes", "exacts", "exact", "lo", "hi", "empty", "_index")
    INDEX_MIN = 16  # fewer accesses are tested one by one

    def __init__(self, rank: int):
        self.ids: list[int] = []
        self.boxes: list[Box] = []
        self.exacts: list[bool] = []
        self.exact = True  # every access's task mapped its regions exactly
        self.lo = [math.inf] * rank
        self.hi = [-math.inf] * rank
        self.empty = False  # some box has an empty range
        self._index = None  # (accesses indexed, dim or None, order, los, his)

    def add(self, tid: int, box: Box, exact: bool) -> None:
        self.ids.append(tid)
        self.boxes.append(box)
        self.exacts.append(exact)
        self.exact &= exact
        for d, (lo, hi) in enumerate(box):
            self.empty |= lo >= hi
            self.lo[d] = min(self.lo[d], lo)
            self.hi[d] = max(self.hi[d], hi)

    def overlapping(self, box: Box) -> tuple[list[int], bool]:
        """The ids of the accesses whose boxes overlap ``box`` (:func:`boxes_overlap`), in the order
        they were added, and whether all of those tasks were exact."""
        if not all(lo < self.hi[d] and self.lo[d] < hi for d, (lo, hi) in enumerate(box)):
            return [], True
        if not self.empty and all(lo <= self.lo[d] and self.hi[d] <= hi for d, (lo, hi) in enumerate(box)):
            return self.ids, self.exact
        n, d, order, los, his = self._indexed()
        if d is None:
            cand = range(len(self.boxes))
        else:  # the indexed accesses that overlap box along d, then those added since
            cand = sorted(order[bisect.bisect_right(his, box[d][0]):bisect.bisect_left(los, box[d][1])])
            cand += range(n, len(self.boxes))
        hit = [i for i in cand if boxes_overlap(box, self.boxes[i])]
        return [self.ids[i] for i in hit], all(self.exacts[i] for i in hit)

    def _indexed(self) -> tuple:
        """(accesses indexed, dim, their order along it, its los and his in that order); dim None
        when no dim separates them or there are too few. Rebuilt when the accesses added since
        outnumber those indexed (an op's own accesses grow while it queries them)."""
        n = len(self.boxes)
        if self._index is None or n > 2 * self._index[0]:
            self._index = (n, None, None, None, None)
            if n >= self.INDEX_MIN and not self.empty:
                for d in range(len(self.lo)):
                    order = sorted(range(n), key=lambda i: self.boxes[i][d])
                    los = [self.boxes[i][d][0] for i in order]
                    his = [self.boxes[i][d][1] for i in order]
                    if all(his[k] <= los[k + 1] for k in range(n - 1)):  # disjoint: his sorted too
                        self._index = (n, d, order, los, his)
                        break
        return self._index


# ---- building ----------------------------------------------------------------------------

def build_taskgraph(graph: OpGraph, opts) -> TaskGraph:
    """Splits every op into tiles and derives one event per (consumer task, producer op).

    Raises:
        VerificationError: if a tile writes through a view that cannot be mapped exactly.
    """
    from .errors import VerificationError

    opreg.set_element_sizes({b.name: torch.empty((), dtype=b.dtype).element_size() for b in graph.buffers.values()})
    tasks: list[Task] = []
    task_op: list[int] = []
    for oi, op in enumerate(graph.ops):
        d = opreg.opdef(op.kind)
        operands = d.operands(op)
        for tile in d.tiles(op, opts):
            reads, writes, exact = [], [], True
            for idx, box in tile.reads:
                v = operands[idx]
                bbox, ex = map_box(v, box, graph.buffers[v.buffer])
                exact &= ex
                reads.append((v.buffer, bbox))
            for idx, box, access in tile.writes:
                v = operands[idx]
                bbox, ex = map_box(v, box, graph.buffers[v.buffer])
                if not ex:
                    raise VerificationError(f"op {op.name}: tile {tile.coords} writes {v.render()} through a view "
                                            f"that is not a box of the buffer")
                writes.append((v.buffer, bbox, access))
            nbytes, flops = d.cost(op, tile)
            tasks.append(Task(len(tasks), op.name, op.kind, tile, tuple(reads), tuple(writes), exact, nbytes, flops))
            task_op.append(oi)

    # earlier accesses per buffer, grouped by (op, mode) into an _Accesses; reads and writes kept
    # apart, since a read conflicts only with earlier writes. Whether two accesses conflict depends
    # on their ops and modes alone, so a group that cannot conflict is skipped whole (an op's own
    # tiles: a batch-16 Llama step's 640 split-KV partial tiles a layer read and dynamically write
    # one KV cache; checking them pairwise made the build quadratic). A group outside the box is
    # skipped and one inside it taken whole from its bounding box (a GEMV tile reading all of x
    # after the previous GEMV's tiles wrote it, the all-to-all case), without a test per access.
    writes_of: dict[str, dict[tuple[int, str], _Accesses]] = {}
    reads_of: dict[str, dict[tuple[int, str], _Accesses]] = {}
    deps: dict[tuple[int, int], set[int]] = {}  # (consumer task, producer op) -> producer tasks
    reduced: set[tuple[int, int]] = set()  # (consumer task, producer op) edges that see accumulations
    inexact: set[tuple[int, int]] = set()
    for t in tasks:
        oi = task_op[t.id]
        accesses = [(b, box, "read") for b, box in t.reads] + [(b, box, mode) for b, box, mode in t.writes]
        for buf, box, mode in accesses:
            groups = [writes_of.get(buf, {})] if mode == "read" else [writes_of.get(buf, {}), reads_of.get(buf, {})]
            for group in groups:
                for (pop, pmode), earlier in group.items():
                    if pop == oi and (pmode == mode == ACCUMULATE or DYNAMIC in (pmode, mode)):
                        continue  # an op's own accumulations / dynamic writes never order its tiles
                    hit, exact = earlier.overlapping(box)
                    if not hit:
                        continue
                    key = (t.id, pop)
                    deps.setdefault(key, set()).update(hit)
                    if pmode == ACCUMULATE:
                        reduced.add(key)
                    if not (exact and t.exact):
                        inexact.add(key)
        for buf, box, mode in accesses:
            (reads_of if mode == "read" else writes_of).setdefault(buf, {}).setdefault(
                (oi, mode), _Accesses(len(box))).add(t.id, box, t.exact)

    events = []
    for (consumer, pop), preds in sorted(deps.items()):
        if (consumer, pop) in inexact:
            strategy = "whole"
        elif (consumer, pop) in reduced:  # not an op's own partials waiting for its init tile
            strategy = "tile_reduce"
        elif len(preds) == 1:
            strategy = "tile"
        else:
            strategy = "tile_cover"
        events.append(Event(len(events), frozenset(preds), frozenset({consumer}), strategy))
    return TaskGraph(graph, tuple(tasks), tuple(events))
