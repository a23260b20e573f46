"""CPU reference executor: runs the *encoded* KernelPlan tile by tile, worker by worker.

It reads only the int32 instruction queues, the event table and the int64 operand table;
operand tensors are rebuilt from the addresses, dtypes, sizes and strides in the table
(resolved against the tensors bound for the call, with bounds checks). Each worker runs
until its next wait is unsatisfied; the sweep repeats until every queue is done. If a whole
sweep makes no progress it raises :class:`DeadlockError` naming the cycle of
``(worker, instruction, event)``. Event counters are monotonic across calls: call ``k``
(epoch ``k``) waits for ``epoch * count``, as the GPU executor does; so are the plan's arrival
counters after them (a tile is the step's last of ``count`` arrivals when its add reaches
``epoch * count``).

This is the validation executor (and the fallback without CUDA); it is not fast.
"""
from __future__ import annotations

import bisect

import networkx as nx
import torch

from . import ops as opreg
from .errors import DeadlockError, TilecError
from .ir import CODE_DTYPES
from .ops import EMPTY, NOOP, TileArgs
from .plan import OF, SCALAR_OPERAND, UNUSED_OPERAND, F, KernelPlan, apply_position, decode_coords, decode_params

_W = {name: F[name][0] for name in ("opcode", "variant", "wait_event", "wait_count", "signal_event", "operand_row",
                                    "task")}


class MemoryMap:
    """Resolves byte addresses from the operand table to views of the bound CPU tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        spans = []
        for name, t in tensors.items():
            if t.numel():
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name, t))
        spans.sort(key=lambda s: s[0])
        self.spans = spans
        self.starts = [s[0] for s in spans]

    def view(self, addr: int, dtype: torch.dtype, sizes: list[int], strides: list[int]) -> torch.Tensor:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.spans[i][1]:
            raise TilecError(f"operand address {addr:#x} is not inside any bound tensor")
        start, end, name, t = self.spans[i]
        if t.dtype != dtype:
            raise TilecError(f"operand at {addr:#x} in buffer {name}: table says {dtype}, tensor is {t.dtype}")
        es = t.element_size()
        off = (addr - start) // es
        last = off + sum((s - 1) * st for s, st in zip(sizes, strides) if s > 0)
        if any(st < 0 for st in strides) or last >= t.numel():
            raise TilecError(f"operand view sizes={sizes} strides={strides} at element {off} overruns buffer {name} "
                             f"({t.numel()} elements)")
        flat = t.reshape(-1)
        return flat.as_strided(sizes, strides, flat.storage_offset() + off)


class ReferenceExecutor:
    """Executes a :class:`KernelPlan` on the CPU; keeps the event counters between calls."""

    def __init__(self, plan: KernelPlan):
        self.plan = plan
        self.input_labels: dict[str, str] = {}  # buffer name -> its argument's label, for errors (CompiledProgram's)
        self.counters = torch.zeros(plan.events.shape[0] + plan.arrivals, dtype=torch.int64)
        self.epoch = 0

    @torch.no_grad()  # its torch ops would record a history from a cache that requires grad (none is wanted)
    def run(self, tensors: dict[str, torch.Tensor], operand_table: torch.Tensor,
            queues: torch.Tensor | None = None, position: int = 0, check=None) -> None:
        """One step at decode position ``position``. ``tensors`` maps buffer names to the tensors
        the operand table points into; entries move by ``position * pos_step`` (``apply_position``).
        ``check`` is the CUDA executor's; this one raises as it runs, whatever it says.

        A step that raises is rolled back (event counters and epoch), so the executor stays
        usable for the next call.

        Raises:
            DeadlockError: no worker can progress (names the wait cycle).
            TilecError: an operand address or view is out of bounds, or an instruction names an
                event outside the event table.
        """
        queues = self.plan.queues if queues is None else queues
        q = queues.tolist()
        events = self.plan.events.tolist()
        ends = [sum(1 for d in qw if d[0] != NOOP) for qw in q]
        n_events = len(events)
        for w, qw in enumerate(q):
            for i in range(ends[w]):
                for name in ("wait_event", "signal_event"):
                    e = qw[i][_W[name]]
                    if not -1 <= e < n_events:
                        raise TilecError(f"(worker {w}, instruction {i}): {name} {e} is outside the event table "
                                         f"[0, {n_events})")
        mem = MemoryMap(tensors)
        table = apply_position(operand_table, position).tolist()
        counters = self.counters
        snapshot = counters.clone()
        self.epoch += 1
        try:
            self._run(q, ends, table, events, mem)
        except BaseException:
            # a failed step leaves no partial signals behind: the next call starts a clean epoch
            counters.copy_(snapshot)
            self.epoch -= 1
            raise

    def _run(self, q, ends, table, events, mem) -> None:
        counters = self.counters
        pcs = [0] * len(q)
        while True:
            progress = False
            for w, qw in enumerate(q):
                while pcs[w] < ends[w]:
                    d = qw[pcs[w]]
                    e = d[_W["wait_event"]]
                    if e >= 0 and counters[e] < self.epoch * d[_W["wait_count"]]:
                        break
                    if d[_W["opcode"]] != EMPTY:
                        self._execute(d, table, mem)
                    s = d[_W["signal_event"]]
                    if s >= 0:
                        counters[s] += 1
                    pcs[w] += 1
                    progress = True
            if all(pc == end for pc, end in zip(pcs, ends)):
                break
            if not progress:
                raise self._deadlock(q, pcs, ends, events)

    def _execute(self, d: list[int], table: list, mem: MemoryMap) -> None:
        od = opreg.BY_OPCODE.get(d[_W["opcode"]])
        if od is None:
            raise TilecError(f"task {d[_W['task']]}: unknown opcode {d[_W['opcode']]}")
        operands = []
        for entry in table[d[_W["operand_row"]]]:
            code = entry[OF["dtype"][0]]
            if code == UNUSED_OPERAND:
                break
            if code == SCALAR_OPERAND:
                operands.append(entry[OF["addr"][0]])
                continue
            n = entry[OF["ndim"][0]]
            sizes = entry[OF["sizes"][0]:OF["sizes"][0] + n]
            strides = entry[OF["strides"][0]:OF["strides"][0] + n]
            operands.append(mem.view(entry[OF["addr"][0]], CODE_DTYPES[code], sizes, strides))
        try:
            od.run_tile(TileArgs(decode_coords(d), decode_params(d), d[_W["variant"]], operands, self._arrive))
        except (IndexError, RuntimeError) as e:
            op = self.plan.graph.ops[d[F["op"][0]]]
            where = f" from {op.provenance.render()}" if op.provenance else ""
            reads = op.reads_text(self.input_labels, self.plan.graph)
            raise TilecError(f"task {d[_W['task']]} (op {op.name}{where}{reads}) failed: {e}") from e

    def _arrive(self, counter: int, count: int) -> bool:
        """An arrival at ``counter`` (an index the plan gave the tile): whether it was the step's last of ``count``.

        Raises:
            TilecError: ``counter`` is not one of the plan's arrival counters.
        """
        n_events = self.plan.events.shape[0]
        if not n_events <= counter < self.counters.shape[0]:
            raise TilecError(f"arrival counter {counter} outside [{n_events}, {self.counters.shape[0]})")
        self.counters[counter] += 1
        return int(self.counters[counter]) == self.epoch * count

    def _deadlock(self, q, pcs, ends, events) -> DeadlockError:
        """Explains why no worker can progress.

        A cycle of workers each waiting for a signal that only another blocked worker of the
        cycle would still send is reported as that cycle. Otherwise some blocked wait can never
        be satisfied (its target exceeds the signals received plus those still pending): that
        root cause is reported, not the workers blocked behind it.
        """
        waits_for = nx.DiGraph()
        blocked = {}
        for w, qw in enumerate(q):
            if pcs[w] == ends[w]:
                continue
            d = qw[pcs[w]]
            e = d[_W["wait_event"]]
            pending = 0
            waits_for.add_node(w)
            for w2, qw2 in enumerate(q):
                for i in range(pcs[w2], ends[w2]):
                    if qw2[i][_W["signal_event"]] == e:
                        waits_for.add_edge(w, w2)
                        pending += 1
            blocked[w] = (pcs[w], e, self.epoch * d[_W["wait_count"]], int(self.counters[e]), pending)
        try:
            cycle_edges = nx.find_cycle(waits_for)
            cycle = [(w, blocked[w][0], blocked[w][1]) for w, _ in cycle_edges]
            steps = " -> ".join(f"(worker {w}, instruction {i}, event {e})" for w, i, e in cycle)
            msg = f"deadlock in step {self.epoch}: wait cycle {steps}"
        except nx.NetworkXNoCycle:
            stuck = [w for w, (_, _, target, have, pending) in blocked.items() if have + pending < target]
            w = min(stuck or blocked, key=lambda w: (waits_for.out_degree(w), w))
            i, e, target, have, pending = blocked[w]
            cycle = [(w, i, e)]
            msg = (f"deadlock in step {self.epoch}: (worker {w}, instruction {i}, event {e}) waits for "
                   f"{target} signals but only {have + pending} can ever arrive")
            others = len(blocked) - 1
            if others:
                msg += f" ({others} other worker(s) also blocked)"
        return DeadlockError(msg, cycle)
