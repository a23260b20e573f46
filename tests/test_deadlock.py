"""Corrupted plans must raise :class:`DeadlockError` naming (worker, instruction, event), never hang.

The plans are compiled for real, then one descriptor of ``plan.queues`` (int32 [W, L, 32],
field offsets in :data:`tilec.plan.F`) is edited:

* a wait on an event that only a LATER instruction of the same queue signals: a wait cycle;
* a wait count higher than the number of signalling instructions: an unsatisfiable wait.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from _helpers import time_limit
from tilec.api import compile_module
from tilec.errors import DeadlockError, TilecError, VerificationError
from tilec.ops import NOOP
from tilec.plan import F
from tilec.refexec import ReferenceExecutor
from tilec.verify import simulate, verify_plan

OPC, WAIT, CNT, SIG = (F[n][0] for n in ("opcode", "wait_event", "wait_count", "signal_event"))


class Block(torch.nn.Module):
    """residual add -> RMSNorm -> gate/up -> SiLU-mul -> down + residual (HF MLP half of a layer)."""

    def __init__(self, d=32, h=48):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(d))
        self.gate_proj = torch.nn.Linear(d, h, bias=False)
        self.up_proj = torch.nn.Linear(d, h, bias=False)
        self.down_proj = torch.nn.Linear(h, d, bias=False)

    def forward(self, x, residual):
        h = residual + x
        var = h.pow(2).mean(-1, keepdim=True)
        n = self.weight * (h * torch.rsqrt(var + 1e-6))
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(n)) * self.up_proj(n))


def compiled(workers: int):
    torch.manual_seed(0)
    m = Block().eval()
    args = (torch.randn(2, 32), torch.randn(2, 32))
    prog = compile_module(m, args, options=dict(workers=workers, tile_n=16, tile_rows=1, fuse_gemv=False))
    return m, args, prog


def instructions(queues: torch.Tensor):
    """(worker, index, descriptor list) of every non-NoOp instruction."""
    for w, qw in enumerate(queues.tolist()):
        for i, d in enumerate(qw):
            if d[OPC] != NOOP:
                yield w, i, d


def later_only_event(queues: torch.Tensor):
    """(worker, instruction, event): ``event`` is signalled only by instructions of the same
    worker after ``instruction`` (and ``instruction`` is not that worker's last one)."""
    signallers: dict[int, list[tuple[int, int]]] = {}
    for w, i, d in instructions(queues):
        if d[SIG] >= 0:
            signallers.setdefault(d[SIG], []).append((w, i))
    best = None
    for e, sites in sorted(signallers.items()):
        ws = {w for w, _ in sites}
        first = min(i for _, i in sites)
        if len(ws) == 1 and first > 0:
            w = ws.pop()
            cand = (w, 0, e)  # make the worker's first instruction wait on it
            if best is None or w > best[0]:  # prefer a worker > 0: other workers end up blocked too
                best = cand
    assert best is not None, "no event signalled only by a later instruction of one queue"
    return best


def corrupt_wait(plan, worker: int, instr: int, event: int, count: int | None = None) -> torch.Tensor:
    q = plan.queues.clone()
    q[worker, instr, WAIT] = event
    q[worker, instr, CNT] = int(plan.events[event, 0]) if count is None else count
    return q


def test_plan_runs_uncorrupted():
    m, args, prog = compiled(4)
    with time_limit(60):
        out = prog(*args)
    torch.testing.assert_close(out, m(*args).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("workers", [1, 4])
def test_wait_on_later_signal_of_same_queue_is_a_deadlock(workers):
    m, args, prog = compiled(workers)
    plan = prog.plan
    w, i, e = later_only_event(plan.queues)
    bad = corrupt_wait(plan, w, i, e)
    tensors, _ = prog.bind_args(args)
    table = plan.bind(tensors, 0)
    with time_limit(60):
        with pytest.raises(DeadlockError) as info:
            ReferenceExecutor(plan).run(tensors, table, queues=bad)
    err = info.value
    assert err.cycle, "DeadlockError.cycle is empty"
    assert (w, i, e) in err.cycle, f"cycle {err.cycle} does not name the corrupted wait {(w, i, e)}"
    assert f"(worker {w}, instruction {i}, event {e})" in str(err)
    assert "cycle" in str(err)
    for cw, ci, ce in err.cycle:  # every entry is a real blocked instruction and its wait
        assert int(bad[cw, ci, WAIT]) == ce

    with time_limit(60):
        with pytest.raises(DeadlockError) as info2:
            simulate(plan, bad)
    assert (w, i, e) in info2.value.cycle
    assert f"(worker {w}, instruction {i}, event {e})" in str(info2.value)


def test_cross_worker_wait_cycle_names_every_worker():
    """Two workers each wait for a signal the other sends later: a 2-cycle."""
    m, args, prog = compiled(2)
    plan = prog.plan
    q = plan.queues
    by_worker = {w: [(i, d) for ww, i, d in instructions(q) if ww == w] for w in (0, 1)}
    # an event signalled only by worker 1 (its last signalling instruction) and one only by worker 0
    sig = {}
    for w, i, d in instructions(q):
        if d[SIG] >= 0:
            sig.setdefault(d[SIG], set()).add(w)
    e1 = next(e for e, ws in sig.items() if ws == {1})
    e0 = next(e for e, ws in sig.items() if ws == {0})
    bad = corrupt_wait(plan, 0, 0, e1)
    bad[1, 0, WAIT] = e0
    bad[1, 0, CNT] = int(plan.events[e0, 0])
    assert by_worker[0] and by_worker[1]
    with time_limit(60):
        with pytest.raises(DeadlockError) as info:
            simulate(plan, bad)
    cycle = info.value.cycle
    assert {(0, 0, e1), (1, 0, e0)} == set(cycle), cycle
    msg = str(info.value)
    assert f"(worker 0, instruction 0, event {e1})" in msg and f"(worker 1, instruction 0, event {e0})" in msg


@pytest.mark.parametrize("workers", [1, 3])
def test_unsatisfiable_wait_count_raises(workers):
    m, args, prog = compiled(workers)
    plan = prog.plan
    # the last instruction that waits: raise its target above the number of signallers
    w, i, d = max(((w, i, d) for w, i, d in instructions(plan.queues) if d[WAIT] >= 0), key=lambda x: x[2][6])
    e = d[WAIT]
    need = int(plan.events[e, 0]) + 1
    bad = corrupt_wait(plan, w, i, e, need)
    tensors, _ = prog.bind_args(args)
    with time_limit(60):
        with pytest.raises(DeadlockError) as info:
            ReferenceExecutor(plan).run(tensors, plan.bind(tensors, 0), queues=bad)
    err = info.value
    assert err.cycle == [(w, i, e)], err.cycle
    assert f"(worker {w}, instruction {i}, event {e})" in str(err)
    assert re.search(rf"waits for {need} signals but only {need - 1} can ever arrive", str(err)), str(err)


def test_unsatisfiable_wait_names_the_root_not_a_victim():
    """Workers blocked behind the stuck one are victims: the error names the stuck wait itself."""
    m, args, prog = compiled(4)
    plan = prog.plan
    # corrupt an early wait of the highest worker that waits at all, so lower workers block behind it
    cands = [(w, i, d) for w, i, d in instructions(plan.queues) if d[WAIT] >= 0 and d[SIG] >= 0]
    w, i, d = max(cands, key=lambda x: (x[0], -x[1]))
    e = d[WAIT]
    bad = corrupt_wait(plan, w, i, e, int(plan.events[e, 0]) + 5)
    with time_limit(60):
        with pytest.raises(DeadlockError) as info:
            simulate(plan, bad)
    assert info.value.cycle == [(w, i, e)], (info.value.cycle, str(info.value))


def test_verify_plan_reports_corrupted_queues():
    m, args, prog = compiled(4)
    plan = prog.plan
    w, i, e = later_only_event(plan.queues)
    broken = dataclasses.replace(plan, queues=corrupt_wait(plan, w, i, e))
    with time_limit(60):
        with pytest.raises(VerificationError, match="deadlock"):
            verify_plan(broken, prog.compiled.stages["linearized"])


def test_counters_persist_across_steps():
    """Event counters are monotonic across calls (epoch k waits for k * count)."""
    m, args, prog = compiled(3)
    for k in range(1, 4):
        prog(*args)
        assert prog.executor.epoch == k
        counts = prog.plan.events[:, 0].to(torch.int64)
        assert torch.equal(prog.executor.counters, k * counts), (k, prog.executor.counters, counts)


def test_event_id_outside_the_table_is_a_clear_error():
    m, args, prog = compiled(2)
    plan = prog.plan
    bad = plan.queues.clone()
    w, i, _ = next(instructions(bad))
    bad[w, i, WAIT] = plan.events.shape[0] + 7
    bad[w, i, CNT] = 1
    tensors, _ = prog.bind_args(args)
    with pytest.raises(TilecError, match=rf"\(worker {w}, instruction {i}\): wait_event {plan.events.shape[0] + 7} "
                                         r"is outside the event table"):
        ReferenceExecutor(plan).run(tensors, plan.bind(tensors, 0), queues=bad)


def test_executor_is_usable_after_a_failed_step():
    """Regression: a deadlocked step used to leave partial signals and an advanced epoch behind,
    so every later step of the same executor deadlocked too."""
    m, args, prog = compiled(4)
    plan = prog.plan
    w, i, e = later_only_event(plan.queues)
    tensors, _ = prog.bind_args(args)
    with pytest.raises(DeadlockError):
        prog.executor.run(tensors, plan.bind(tensors, 0), queues=corrupt_wait(plan, w, i, e))
    assert prog.executor.epoch == 0 and int(prog.executor.counters.abs().sum()) == 0
    with time_limit(60):
        for _ in range(2):
            torch.testing.assert_close(prog(*args), m(*args).detach(), rtol=1e-5, atol=1e-6)
