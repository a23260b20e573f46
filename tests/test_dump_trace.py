"""IR dumps (``tilec.dump``) and schedule traces (``tilec.trace``).

The module is RMSNorm -> gate/up linears -> SiLU-mul -> down linear, compiled through
``tilec.api.compile_module``. The dump directory must hold exactly the stable file names,
whether enabled by the option or by ``TILEC_DUMP_DIR``; the trace must parse as Chrome
trace format with one track per busy worker and one slice per instruction, consistent with
the plan's events and the cost model.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from _helpers import StageRecorder
from tilec.api import compile_module
from tilec.cost import HOP_US
from tilec.dump import ENV_VAR, render_schedule
from tilec.errors import TilecError
from tilec.ops import NOOP
from tilec.options import Options
from tilec.plan import F
from tilec.stats import render_stats
from tilec.trace import hop_table, measured_trace, op_table, predicted_trace, wait_table, write_trace

FILES = ["01-opgraph.txt", "02-split_kv.txt", "03-fuse_gemv.txt", "04-fold_cache.txt", "05-gemv_groups.txt",
         "06-tasks.txt", "07-fused.txt", "08-normalized.txt", "09-linearized.txt", "10-schedule.txt", "11-plan.txt", "stats.txt", "trace.json"]
STAGES = ["opgraph", "split_kv", "fuse_gemv", "fold_cache", "gemv_groups", "tasks", "fused", "normalized", "linearized", "schedule", "plan"]
BASE = dict(workers=4, tile_n=32, tile_rows=1)


class NormMLP(torch.nn.Module):
    def __init__(self, hidden=64, inter=96, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        normed = self.weight * (x * torch.rsqrt(variance + self.eps))
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))


def compile_mlp(options):
    torch.manual_seed(0)
    rec = StageRecorder()
    prog = compile_module(NormMLP().eval(), (torch.randn(2, 64),), options=options, hook=rec)
    return prog, rec


def only_subdir(root: Path) -> Path:
    subdirs = list(root.iterdir())
    assert len(subdirs) == 1 and subdirs[0].is_dir(), f"expected one compile directory in {root}: {subdirs}"
    return subdirs[0]


# ---- dumps -------------------------------------------------------------------------------

def test_dump_dir_option_writes_the_stable_files(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    prog, rec = compile_mlp(Options(**BASE, dump_dir=str(tmp_path)))  # the user hook still runs
    d = only_subdir(tmp_path)
    assert sorted(p.name for p in d.iterdir()) == FILES  # and no leftover temporary files
    for i, stage in enumerate(STAGES):
        text = (d / FILES[i]).read_text()
        if stage == "schedule":
            assert text == render_schedule(rec.stages["schedule"], rec.stages["linearized"]) + "\n"
        else:
            assert text == rec.render(stage) + "\n"
    assert (d / "stats.txt").read_text() == render_stats(prog.stats) + "\n"
    json.loads((d / "trace.json").read_text())

    # recompiling the same graph with the same options rewrites the same files, identically
    before = {name: (d / name).read_text() for name in FILES}
    compile_mlp(Options(**BASE, dump_dir=str(tmp_path)))
    assert only_subdir(tmp_path) == d
    assert {name: (d / name).read_text() for name in FILES} == before

    # other options: another directory
    compile_mlp(Options(**{**BASE, "workers": 3}, dump_dir=str(tmp_path)))
    assert len(list(tmp_path.iterdir())) == 2


def test_dump_env_var_and_option_precedence(tmp_path, monkeypatch):
    env_dir, opt_dir = tmp_path / "env", tmp_path / "opt"
    monkeypatch.setenv(ENV_VAR, str(env_dir))
    compile_mlp(dict(BASE))
    assert sorted(p.name for p in only_subdir(env_dir).iterdir()) == FILES

    # the option wins over the environment variable, and names the same subdirectory
    compile_mlp({**BASE, "dump_dir": str(opt_dir)})
    assert only_subdir(opt_dir).name == only_subdir(env_dir).name
    assert len(list(env_dir.iterdir())) == 1

    # an empty variable means off
    monkeypatch.setenv(ENV_VAR, "")
    monkeypatch.chdir(tmp_path)
    compile_mlp(dict(BASE))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env", "opt"]


def test_dump_dir_option_validation():
    assert Options(dump_dir=Path("/tmp/x")).dump_dir == "/tmp/x"
    Options(dump_dir=Path("/tmp/x")).digest()  # hashable as JSON
    with pytest.raises(ValueError, match="dump_dir"):
        Options(dump_dir="")
    with pytest.raises(ValueError, match="dump_dir"):
        Options.from_dict({"dump_dir": 3})


def test_schedule_render_lists_every_task_once(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    _, rec = compile_mlp(Options(**BASE))
    sched, tg = rec.stages["schedule"], rec.stages["linearized"]
    text = render_schedule(sched, tg)
    lines = text.splitlines()
    assert lines[0] == f"schedule policy=list workers=4 makespan_us={sched.makespan_us:.3f} {{"
    assert lines[-1] == "}"
    ids = [int(item.split()[1][1:]) for line in lines[1:-1] for item in line.split(": ", 1)[1].split("; ")]
    assert sorted(ids) == sorted(t.id for t in tg.tasks)


# ---- predicted trace ---------------------------------------------------------------------

def instructions(plan):
    """(worker, instruction index, descriptor) of every non-NoOp instruction."""
    return [(w, j, d) for w, q in enumerate(plan.queues.tolist()) for j, d in enumerate(q) if d[0] != NOOP]


def check_chrome_trace(trace: dict, plan, tg=None):
    """Checks the Chrome trace format and the slices against the plan; returns the slices."""
    trace = json.loads(json.dumps(trace))
    assert trace["displayTimeUnit"] == "ns" and isinstance(trace["traceEvents"], list)
    events = trace["traceEvents"]
    assert all(e["ph"] in ("M", "X") and isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in events)
    meta = [e for e in events if e["ph"] == "M"]
    assert [e["args"]["name"] for e in meta if e["name"] == "process_name"] == ["tilec plan"]
    instrs = instructions(plan)
    busy = sorted({w for w, _, _ in instrs})
    threads = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {w: f"worker {w}" for w in busy}

    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(instrs)
    ops = plan.graph.ops
    for s, (w, j, d) in zip(slices, instrs):
        assert (s["tid"], s["args"]["worker"], s["args"]["instruction"]) == (w, w, j)
        assert s["args"]["task"] == d[F["task"][0]]
        assert s["args"]["wait_event"] == d[F["wait_event"][0]]
        assert s["args"]["signal_event"] == d[F["signal_event"][0]]
        if d[F["op"][0]] < 0:
            assert s["name"] == "empty" and s["args"]["op"] is None
        else:
            op = ops[d[F["op"][0]]]
            assert op.kind in s["name"] and op.provenance.node in s["name"], s["name"]
            assert s["args"]["op"] == op.name
            assert s["args"]["coords"] and all(0 <= lo <= hi for lo, hi in s["args"]["coords"])
        if tg is not None:
            assert s["args"]["bytes"] >= 0 and s["args"]["flops"] >= 0
        assert s["ts"] >= 0 and s["dur"] >= 0

    for w in busy:  # slices on a track are in queue order and do not overlap
        track = [s for s in slices if s["tid"] == w]
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)
    return slices


@pytest.mark.parametrize("opts", [
    dict(BASE),
    dict(BASE, scheduler="round_robin", workers=3),
    dict(BASE, workers=64, split_k=2),  # idle workers; split-K partials (tile_reduce)
])
def test_predicted_trace_is_a_chrome_trace_consistent_with_the_plan(tmp_path, monkeypatch, opts):
    monkeypatch.delenv(ENV_VAR, raising=False)
    prog, rec = compile_mlp(Options(**opts))
    plan, tg, sched = rec.stages["plan"], rec.stages["linearized"], rec.stages["schedule"]
    trace = predicted_trace(plan, tg)
    write_trace(tmp_path / "t.json", trace)
    parsed = json.loads((tmp_path / "t.json").read_text())
    assert parsed == json.loads(json.dumps(trace))
    slices = check_chrome_trace(parsed, plan, tg)

    end = {}
    for s in slices:
        end.setdefault(s["args"]["signal_event"], []).append(s["ts"] + s["dur"])
    waited = 0
    for s in slices:  # a slice never starts before its wait event's predecessors end (+ one hop)
        e = s["args"]["wait_event"]
        if e >= 0:
            assert len(end[e]) == plan.events[e, 0]
            assert s["ts"] >= max(end[e]) + HOP_US - 1e-3, (s, max(end[e]))
            waited += 1
    assert waited > 0
    makespan = max(s["ts"] + s["dur"] for s in slices)
    assert parsed["otherData"]["makespan_us"] == pytest.approx(makespan, abs=1e-3)
    assert makespan == pytest.approx(sched.makespan_us, abs=1e-3)  # the scheduler's own model


def test_predicted_trace_needs_the_linearized_taskgraph(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    _, rec = compile_mlp(Options(**BASE))
    with pytest.raises(TilecError, match="not linearized"):
        predicted_trace(rec.stages["plan"], rec.stages["tasks"])


# ---- measured trace ----------------------------------------------------------------------

def test_measured_trace_from_synthetic_stamps(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    _, rec = compile_mlp(Options(**{**BASE, "workers": 5, "scheduler": "round_robin"}))
    plan, tg = rec.stages["plan"], rec.stages["linearized"]
    w_n, l_n = plan.queues.shape[:2]
    instrs = instructions(plan)
    assert len(instrs) < w_n * l_n, "the test wants NoOp padding"
    t0 = 1_700_000_000_000_000_000  # %globaltimer-like absolute ns
    stamps = torch.full((w_n, l_n, 2), -1, dtype=torch.int64)  # NoOps' stamps are garbage
    expect = {}
    for w, j, _ in instrs:
        start = t0 + 5_000 + 1_000 * j + 100 * w
        stamps[w, j] = torch.tensor([start, start + 250 + 10 * w])
        expect[(w, j)] = ((start - t0 - 5_000) / 1000, (250 + 10 * w) / 1000)

    trace = measured_trace(plan, stamps)
    slices = check_chrome_trace(trace, plan)
    assert {(s["tid"], s["args"]["instruction"]): (s["ts"], s["dur"]) for s in slices} == expect
    assert all("bytes" not in s["args"] for s in slices)
    assert trace["otherData"]["clock"] == "measured"
    # the same names as the predicted trace; with the task graph, bytes and flops too
    assert [s["name"] for s in slices] == [e["name"] for e in predicted_trace(plan, tg)["traceEvents"]
                                           if e["ph"] == "X"]
    check_chrome_trace(measured_trace(plan, stamps.numpy(), tg), plan, tg)

    with pytest.raises(TilecError, match="shape"):
        measured_trace(plan, stamps[:, :-1])
    w, j, _ = instrs[0]
    stamps[w, j, 1] = stamps[w, j, 0] - 1
    with pytest.raises(TilecError, match="end before they start"):
        measured_trace(plan, stamps)


def test_op_and_wait_tables_of_a_measured_trace(monkeypatch):
    """Per-op rows (tiles, starts, ends, tile time) in order of median start within a window,
    and per-kind waits (the gaps between a worker's consecutive instructions)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    _, rec = compile_mlp(Options(**{**BASE, "workers": 5, "scheduler": "round_robin"}))
    plan = rec.stages["plan"]
    w_n, l_n = plan.queues.shape[:2]
    stamps = torch.zeros(w_n, l_n, 2, dtype=torch.int64)
    for w, j, _ in instructions(plan):  # instruction j of every worker: starts at 10 j us, runs 2 us
        stamps[w, j] = torch.tensor([10_000 * j, 10_000 * j + 2_000])
    trace = measured_trace(plan, stamps)
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["args"]["op"]]
    ops = {e["args"]["op"] for e in slices}
    rows = op_table(trace).splitlines()
    assert rows[0].split()[:3] == ["op", "tiles", "start"] and len(rows) == 1 + len(ops)
    starts = [float(r.split()[3]) for r in rows[1:]]
    assert starts == sorted(starts)  # ordered by median start
    for r in rows[1:]:
        op, tiles, tile_us = r.split()[0], int(r.split()[1]), float(r.split()[7])
        assert tiles == sum(e["args"]["op"] == op for e in slices) and tile_us == 2.0
    in_window = [op for op in ops if 5.0 <= statistics.median(e["ts"] for e in slices if e["args"]["op"] == op) <= 15.0]
    assert in_window and len(op_table(trace, 5.0, 15.0).splitlines()) == 1 + len(in_window)
    waits = {r.split()[0]: r.split()[1:] for r in wait_table(trace).splitlines()[1:]}
    assert all(float(v[1]) == 8.0 and float(v[2]) == 8.0 for v in waits.values())  # every gap is 10 - 2 us
    assert sum(int(v[0]) for v in waits.values()) == sum(
        max(0, sum(1 for ww, _, _ in instructions(plan) if ww == w) - 1) for w in range(w_n))


def test_hop_table_of_a_measured_trace():
    """Hops: start minus the later of the worker's previous end and its event's last signaler's
    end, split by which came last (hand-made trace: two producers signal event 0 at 5 and 7 us;
    a consumer on a free worker starts at 8 (event-bound, 1 us), one behind a busy worker at 10.5
    (worker-bound: free at 10, 0.5 us); an instruction without a wait is not a hop)."""
    def sl(w, j, ts, dur, cat, wait=-1, sig=-1):
        return {"ph": "X", "ts": ts, "dur": dur, "cat": cat,
                "args": {"worker": w, "instruction": j, "wait_event": wait, "signal_event": sig}}
    trace = {"traceEvents": [sl(0, 0, 0.0, 5.0, "linear", sig=0), sl(1, 0, 0.0, 7.0, "linear", sig=0),
                             sl(0, 1, 8.0, 1.0, "rope", wait=0), sl(2, 0, 0.0, 10.0, "linear"),
                             sl(2, 1, 10.5, 1.0, "rope", wait=0), sl(1, 1, 9.0, 1.0, "linear")]}
    rows = [r.split() for r in hop_table(trace).splitlines()]
    assert rows[0][:2] == ["waiting", "kind"]
    assert rows[1:] == [["rope", "event-bound", "1", "1.00", "1.00"], ["rope", "worker-bound", "1", "0.50", "0.50"]]
    assert hop_table({"traceEvents": [sl(0, 0, 0.0, 1.0, "linear")]}).startswith("no hops")


def test_unwritable_dump_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(TilecError, match=r"^option dump_dir=.*/file/d: cannot create the dump directory \(Not a directory\)"):
        compile_module(torch.nn.Linear(4, 4), (torch.randn(2, 4),), options=dict(BASE, dump_dir=str(blocker / "d")))


def test_measured_overrides_restore_the_cost_figures():
    """``tilec.cost.measured_overrides`` (the lab scripts' cost A/Bs) plans with other figures
    inside, the roofline for a kind mapped to None, and restores every figure on exit - also
    after an error; a malformed figure is refused."""
    from tilec import cost

    before = dict(cost.MEASURED)
    with pytest.raises(RuntimeError):
        with cost.measured_overrides({"rope": [1.0, 0.0], "bmm": None}):
            assert cost.MEASURED["rope"] == (1.0, 0.0) and "bmm" not in cost.MEASURED
            assert cost.task_time_us(0, 0, "rope") == 1.0
            raise RuntimeError("compile failed")
    assert cost.MEASURED == before
    with pytest.raises(ValueError, match="rope"):
        with cost.measured_overrides({"rope": [1.0]}):
            pass
    assert cost.MEASURED == before


def test_read_trace_reads_what_write_trace_writes_plain_or_gzip(tmp_path):
    """read_trace round-trips write_trace's file and its gzip (told apart by its bytes, not its name);
    it refuses a predicted trace unless asked, an empty file, truncated or corrupt gzip, JSON nested
    too deeply, JSON that is no trace object and a missing file - ValueError or OSError only."""
    import gzip

    from tilec.tracefile import read_trace

    trace = {"otherData": {"clock": "measured", "makespan_us": 12.5},
             "traceEvents": [{"ph": "X", "ts": 1.0, "dur": 2.5, "name": "linear", "args": {"worker": 3}}]}
    plain = tmp_path / "t.json"
    write_trace(plain, trace)
    assert read_trace(plain) == trace
    packed = tmp_path / "t.trace"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_trace(packed) == trace
    predicted = tmp_path / "p.json"
    write_trace(predicted, dict(trace, otherData={"clock": "predicted by tilec.cost"}))
    with pytest.raises(ValueError, match="not a measured trace"):
        read_trace(predicted)
    assert read_trace(predicted, measured=False)["otherData"]["clock"] == "predicted by tilec.cost"
    packed_bytes = gzip.compress(plain.read_bytes())
    flipped = bytearray(packed_bytes)
    flipped[-6] ^= 0xFF  # the CRC
    for name, data in (("truncated", packed_bytes[:30]), ("appended", packed_bytes + b"garbage"),
                       ("crc", bytes(flipped)), ("deep", b"[" * 5000 + b"]" * 5000)):
        bad = tmp_path / f"{name}.json.gz"
        bad.write_bytes(data)
        with pytest.raises(ValueError, match="not JSON or gzip-compressed JSON"):
            read_trace(bad)
    empty = tmp_path / "e.json"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty file"):
        read_trace(empty)
    listed = tmp_path / "l.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="otherData"):
        read_trace(listed)
    with pytest.raises(OSError):
        read_trace(tmp_path / "missing.json")


def test_measured_trace_leaves_out_unstamped_instructions_and_refuses_invalid_stamps(monkeypatch):
    """One unstamped (zero) instruction among %globaltimer stamps gave a makespan of ~1.765e15 us and a nonsense op
    table; negative or float stamps were taken as they came (a fresh user's finding). Unstamped instructions now
    have no slice and are counted; negative and non-integer stamps are a TilecError."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    _, rec = compile_mlp(Options(**{**BASE, "workers": 5, "scheduler": "round_robin"}))
    plan = rec.stages["plan"]
    w_n, l_n = plan.queues.shape[:2]
    instrs = instructions(plan)
    t0 = 1_765_000_000_000_000_000
    stamps = torch.zeros(w_n, l_n, 2, dtype=torch.int64)
    for w, j, _ in instrs:
        stamps[w, j] = torch.tensor([t0 + 1_000 * j, t0 + 1_000 * j + 500])
    full = measured_trace(plan, stamps)
    w, j, _ = instrs[-1]
    stamps[w, j] = 0  # not stamped
    trace = measured_trace(plan, stamps)
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(slices) == len(instrs) - 1 and (w, j) not in {(s["tid"], s["args"]["instruction"]) for s in slices}
    assert trace["otherData"]["unstamped"] == 1 and trace["otherData"]["unstamped_at"] == [[w, j]]
    assert trace["otherData"]["makespan_us"] <= full["otherData"]["makespan_us"] < 1e6
    assert max(float(r.split()[3]) for r in op_table(trace).splitlines()[1:]) < 1e6
    assert "unstamped" not in full["otherData"]
    stamps[w, j] = torch.tensor([t0 + 1_000 * j, 0])  # started, never finished (trapped in it): counted, no slice
    trace = measured_trace(plan, stamps)
    assert trace["otherData"]["unfinished"] == 1 and trace["otherData"]["unfinished_at"] == [[w, j]]
    assert len([e for e in trace["traceEvents"] if e.get("ph") == "X"]) == len(instrs) - 1
    stamps[w, j] = 0

    negative = stamps.clone()
    negative[instrs[0][0], instrs[0][1]] = torch.tensor([-5, 10])
    with pytest.raises(TilecError, match=r"measured stamps are negative at \(worker, instruction\)"):
        measured_trace(plan, negative)
    with pytest.raises(TilecError, match="stamps must be integer nanoseconds .* got float64"):
        measured_trace(plan, stamps.double() + 0.5)
