"""Golden printed-IR tests (FileCheck style) for every pipeline stage of a small MLP block.

The module is the second half of an HF decoder layer, written with plain torch ops:
residual add -> RMSNorm -> gate/up linears -> SiLU-mul -> down linear + residual.
Each stage's ``render()`` is checked on the lines that matter, in order, with names that
come from torch.export captured once and re-used (``[[name]]``), as FileCheck variables do.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from _helpers import StageRecorder, assert_close
from tilec.api import compile_module
from tilec.options import Options

STAGES = ["opgraph", "split_kv", "fuse_gemv", "fold_cache", "gemv_groups", "tasks", "fused", "normalized", "linearized", "schedule", "plan"]
# the task-graph goldens below pin the unfused op graph (GEMV fusion has its own golden) and
# MPK's normalization of fan-outs through empty tasks (fork coarsening has its own golden)
OPTS = Options(workers=4, tile_n=32, tile_rows=1, scheduler="list", fuse_gemv=False, coarsen_forks=False)


class MLPBlock(torch.nn.Module):
    def __init__(self, hidden=64, inter=96, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.eps = eps

    def forward(self, x, residual):
        hidden = residual + x
        variance = hidden.to(torch.float32).pow(2).mean(-1, keepdim=True)
        normed = self.weight * (hidden * torch.rsqrt(variance + self.eps))
        act = torch.nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed)
        return hidden + self.down_proj(act)


def compile_block(opts=OPTS):
    torch.manual_seed(0)
    m = MLPBlock().eval()
    args = (torch.randn(2, 64), torch.randn(2, 64))
    rec = StageRecorder()
    prog = compile_module(m, args, options=opts, hook=rec)
    return m, args, prog, rec


@pytest.fixture(scope="module")
def block():
    return compile_block()


def filecheck(text: str, patterns: list[str], env: dict | None = None) -> dict:
    """Each regex must match (``re.search``) a line after the previous match, in order.

    ``[[name]]`` in a pattern is replaced by the escaped value captured earlier by a named
    group ``(?P<name>...)``; the captures are returned (and accumulate in ``env``).
    """
    env = {} if env is None else env
    lines = text.splitlines()
    at = 0
    for pat in patterns:
        rx = re.compile(re.sub(r"\[\[(\w+)\]\]", lambda m: re.escape(env[m.group(1)]), pat))
        for j in range(at, len(lines)):
            m = rx.search(lines[j])
            if m:
                env.update(m.groupdict())
                at = j + 1
                break
        else:
            raise AssertionError(f"CHECK not found after line {at}: {rx.pattern!r}\n--- in ---\n{text}")
    return env


def parse_events(text: str):
    """``e<id> <strategy>: {t..} -> {t..}[ range=[a,b]]`` lines of a taskgraph render."""
    out = []
    for m in re.finditer(r"^  e(\d+) ([\w+]+): \{([t\d,]*)\} -> \{([t\d,]*)\}(?: range=\[(-?\d+),(-?\d+)\])?$",
                         text, re.M):
        ids = lambda s: [int(x[1:]) for x in s.split(",") if x]  # noqa: E731
        rng = (int(m.group(5)), int(m.group(6))) if m.group(5) is not None else None
        out.append((int(m.group(1)), m.group(2), ids(m.group(3)), ids(m.group(4)), rng))
    return out


def parse_tasks(text: str):
    """``<index>: t<id> <label>`` lines -> [(index, task id, label)]."""
    return [(int(a), int(b), c) for a, b, c in re.findall(r"^  (\d+): t(\d+) (.*)$", text, re.M)]


def test_hook_sees_every_stage_in_order(block):
    _, _, prog, rec = block
    assert list(rec.stages) == STAGES
    assert all(s >= 0 for s in rec.seconds.values())
    for name in STAGES:
        if name != "schedule":
            assert isinstance(rec.render(name), str) and rec.render(name)
    assert rec.stages["plan"] is prog.plan
    assert prog.compiled.stages.keys() == rec.stages.keys()


def test_opgraph_lists_the_fused_ops_in_order(block):
    _, _, prog, rec = block
    text = rec.render("opgraph")
    assert [op.kind for op in rec.stages["opgraph"].ops] == \
        ["binary", "rmsnorm", "linear", "linear", "silu_mul", "linear", "binary"]
    env = filecheck(text, [
        r"^opgraph \{$",
        r"^  buffer x: float32\[2x64\] input$",
        r"^  buffer p_weight: float32\[64\] param$",
        r"^  buffer p_gate_proj_weight: float32\[96x64\] param$",
        r"^  buffer (?P<out>\w+): float32\[2x64\] output$",
        r"^  inputs \(x, residual\)$",
        r"^  \w+ = binary\(residual\[2x64\], x\[2x64\]\) -> (?P<h>\w+)\[2x64\] fn='add'$",
        r"^  \w+ = rmsnorm\([[h]]\[2x64\], p_weight\[64\]\) -> (?P<n>\w+)\[2x64\] eps=1e-06$",
        r"^  \w+ = linear\([[n]]\[2x64\], p_gate_proj_weight\[96x64\]\) -> (?P<g>\w+)\[2x96\]$",
        r"^  \w+ = linear\([[n]]\[2x64\], p_up_proj_weight\[96x64\]\) -> (?P<u>\w+)\[2x96\]$",
        r"^  \w+ = silu_mul\([[g]]\[2x96\], [[u]]\[2x96\]\) -> (?P<a>\w+)\[2x96\]$",
        r"^  \w+ = linear\([[a]]\[2x96\], p_down_proj_weight\[64x96\]\) -> (?P<d>\w+)\[2x64\]$",
        r"^  \w+ = binary\([[h]]\[2x64\], [[d]]\[2x64\]\) -> [[out]]\[2x64\] fn='add'$",
        r"^  return \([[out]]\[2x64\]\)$",
        r"^\}$",
    ])
    # the absorbed RMSNorm pieces (pow/mean/rsqrt) and the SiLU are not ops of their own
    assert not re.search(r"fn='(pow_scalar|rsqrt|silu)'", text)
    assert len(re.findall(r"^  \w+ = ", text, re.M)) == 7
    assert env["out"] in {v.buffer for v in prog.graph.outputs}


def test_events_before_fusion(block):
    _, _, prog, rec = block
    text = rec.render("tasks")
    tasks = parse_tasks(text)
    assert len(tasks) == 16  # 2 + 2 row tiles, 3 + 3 + 2 column tiles, 2 + 2 row tiles
    filecheck(text, [
        r"^taskgraph \{$",
        r"^  0: t0 \w+\[0:1,0:64\]$",                # residual add, row 0
        r"^  2: t2 \w+\[0:1,0:64\]$",                # rmsnorm, row 0
        r"^  4: t4 \w+\[0:2,0:32,0:64\]$",           # gate: all rows x 32 columns x all of K
        r"^  12: t12 \w+\[0:2,0:32,0:96\]$",         # down, K = 96
        r"^  15: t15 \w+\[1:2,0:64\]$",
        r"^  e0 tile: \{t0\} -> \{t2\}$",                  # add row -> norm row, one to one
        r"^  e2 tile_cover: \{t2,t3\} -> \{t4\}$",         # a GEMV tile needs every norm row
        r"^  e8 tile_cover: \{t4,t5,t6\} -> \{t10\}$",     # a SiLU-mul row needs every gate tile
        r"^  e9 tile_cover: \{t7,t8,t9\} -> \{t10\}$",     # ... and every up tile
        r"^  e14 tile: \{t0\} -> \{t14\}$",                # the residual re-read by the last add
        r"^  e17 tile_cover: \{t12,t13\} -> \{t15\}$",
        r"^\}$",
    ])
    events = parse_events(text)
    assert len(events) == 18
    strategies = [e[1] for e in events]
    assert strategies.count("tile") == 4 and strategies.count("tile_cover") == 14
    assert all(len(e[3]) == 1 for e in events), "before fusion: one event per (consumer task, producer op)"
    assert all(e[4] is None for e in events), "no ranges before linearization"


def test_events_after_fusion(block):
    _, _, prog, rec = block
    text = rec.render("fused")
    filecheck(text, [
        r"^  e0 tile: \{t0\} -> \{t2\}$",
        r"^  e1 tile: \{t1\} -> \{t3\}$",
        r"^  e2 tile_cover: \{t2,t3\} -> \{t4,t5,t6,t7,t8,t9\}$",        # same preds: 6 events -> 1
        r"^  e3 tile_cover: \{t4,t5,t6,t7,t8,t9\} -> \{t10,t11\}$",      # same succs, then same preds
        r"^  e4 tile_cover: \{t10,t11\} -> \{t12,t13\}$",
        r"^  e5 tile\+tile_cover: \{t0,t12,t13\} -> \{t14\}$",          # mixed strategies are kept visible
        r"^  e6 tile\+tile_cover: \{t1,t12,t13\} -> \{t15\}$",
    ])
    assert len(parse_events(text)) == 7
    s = prog.stats
    assert (s["events_before_fusion"], s["events_after_fusion"]) == (18, 7)
    assert (s["deps_before_fusion"], s["deps_after_fusion"]) == (54, 32)
    assert s["deps_after_fusion"] < s["deps_before_fusion"]
    # fusion does not change the tasks
    assert parse_tasks(text) == parse_tasks(rec.render("tasks"))


def test_events_after_fusion_with_coarsened_forks():
    """coarsen_forks: the down tiles t12 / t13 fed both residual-add tiles' events (e5, e6 above),
    whose waiters are tiles of one op: the two events become one, and normalization relays only the
    fan-outs into different ops (t0, t1 -> RMSNorm and residual add). The merged event is labelled
    ``coarse`` in the printed stages."""
    m, args, prog, rec = compile_block(dataclasses.replace(OPTS, coarsen_forks=True))
    filecheck(rec.render("fused"), [
        r"^  e4 tile_cover: \{t10,t11\} -> \{t12,t13\}$",
        r"^  e5 coarse\+tile\+tile_cover: \{t0,t1,t12,t13\} -> \{t14,t15\}$",
    ])
    s = prog.stats
    assert (s["forks_coarsened"], s["events_after_fusion"], s["empty_tasks_added"], s["events"]) == (1, 6, 4, 8)
    filecheck(rec.render("normalized"), [
        r"^  e5 coarse\+tile\+tile_cover: \{t12,t13,t17,t19\} -> \{t14,t15\}$",
        r"^  e6 fork: \{t0\} -> \{t16,t17\}$",
        r"^  e7 fork: \{t1\} -> \{t18,t19\}$",
    ])
    assert_close(prog(*args), m(*args), 1e-5)


def test_normalized_one_wait_one_trigger_and_empty_tasks(block):
    _, _, prog, rec = block
    text = rec.render("normalized")
    tasks = parse_tasks(text)
    empties = [tid for _, tid, label in tasks if label == "empty"]
    assert empties == [16, 17, 18, 19, 20, 21]
    assert prog.stats["empty_tasks_added"] == 6
    events = parse_events(text)
    waits, trigs = {}, {}
    for eid, _, preds, succs, _ in events:
        for t in preds:
            trigs[t] = trigs.get(t, 0) + 1
        for t in succs:
            waits[t] = waits.get(t, 0) + 1
    assert max(waits.values()) <= 1 and max(trigs.values()) <= 1
    filecheck(text, [
        r"^  16: t16 empty$",
        r"^  21: t21 empty$",
        r"^  e0 tile: \{t16\} -> \{t2\}$",                 # t0 fed two events: now through empty tasks
        r"^  e5 tile\+tile_cover: \{t17,t20\} -> \{t14\}$",
        r"^  e7 fork: \{t0\} -> \{t16,t17\}$",
        r"^  e9 fork: \{t12,t13\} -> \{t20,t21\}$",         # t12/t13 triggered e5 and e6: one shared fork
    ])
    assert sum(e[1] == "fork" for e in events) == 3
    assert prog.stats["events"] == len(events) == 10


def test_linearized_order_and_event_ranges(block):
    _, _, prog, rec = block
    text = rec.render("linearized")
    filecheck(text, [
        r"^  0: t0 ",
        r"^  1: t1 ",
        r"^  2: t16 empty$",                          # the forks' successors follow their triggers
        r"^  5: t19 empty$",
        r"^  6: t2 ",
        r"^  13: t9 ",
        r"^  18: t20 empty$",
        r"^  21: t15 ",
        r"^  e2 tile_cover: \{t2,t3\} -> \{t4,t5,t6,t7,t8,t9\} range=\[8,13\]$",
        r"^  e3 tile_cover: \{t4,t5,t6,t7,t8,t9\} -> \{t10,t11\} range=\[14,15\]$",
        r"^  e7 fork: \{t0\} -> \{t16,t17\} range=\[2,3\]$",
        r"^  e9 fork: \{t12,t13\} -> \{t20,t21\} range=\[18,19\]$",
    ])
    # every event's successors are exactly the contiguous range [first, last] of the order,
    # and the order is topological
    pos = {tid: idx for idx, tid, _ in parse_tasks(text)}
    assert sorted(pos.values()) == list(range(22))
    for eid, _, preds, succs, rng in parse_events(text):
        assert rng is not None, f"e{eid} has no range"
        assert sorted(pos[s] for s in succs) == list(range(rng[0], rng[1] + 1)), f"e{eid}"
        assert max(pos[p] for p in preds) < rng[0], f"e{eid} launches before a trigger"


def test_schedule_and_plan(block):
    m, args, prog, rec = block
    sched = rec.stages["schedule"]
    assert not hasattr(sched, "render")
    assert sched.policy == "list" and len(sched.queues) == 4
    order = rec.stages["linearized"].order
    index = {tid: i for i, tid in enumerate(order)}
    assert sorted(t for q in sched.queues for t in q) == sorted(order)
    for q in sched.queues:  # each queue follows the global linearized order
        assert [index[t] for t in q] == sorted(index[t] for t in q)
    text = rec.render("plan")
    filecheck(text, [
        r"^kernelplan workers=4 length=\d+ events=10 operand_rows=7 \{$",
        r"^  w0: #0 \w+ signal e7; ",
        r"^  w3: ",
        r"^  e2: count=2 tasks=\[8,13\]$",
        r"^  e3: count=6 tasks=\[14,15\]$",
        r"^  e7: count=1 tasks=\[2,3\]$",
        r"^\}$",
    ])
    assert re.search(r"#20 \w+ wait e5>=2(;|$)", text, re.M)
    assert_close(prog(*args), m(*args).detach(), 1e-5)


def test_render_is_stable_across_compiles():
    texts = []
    for _ in range(2):
        _, _, prog, rec = compile_block()
        texts.append({name: rec.render(name) for name in STAGES if name != "schedule"})
        texts[-1]["schedule"] = repr(rec.stages["schedule"].queues)
        texts[-1]["stats"] = repr(sorted(prog.stats.items()))
    for name in texts[0]:
        assert texts[0][name] == texts[1][name], f"stage {name} renders differently on a second compile"


def test_round_robin_plan_render():
    _, _, prog, rec = compile_block(Options(workers=3, tile_n=32, tile_rows=1, scheduler="round_robin", fuse_gemv=False,
                                                 coarsen_forks=False))
    sched = rec.stages["schedule"]
    order = rec.stages["linearized"].order
    assert sched.queues == tuple(tuple(order[i] for i in range(w, len(order), 3)) for w in range(3))
    filecheck(rec.render("plan"), [
        r"^kernelplan workers=3 length=8 events=10 ",
        r"^  w0: #0 \w+ signal e7; #3 empty wait e7>=1 signal e5; #6 ",
        r"^  w1: #1 ",
        r"^  w2: #2 empty wait e7>=1 signal e0; ",
    ])


def test_fuse_gemv_golden():
    """RMSNorm -> gate/up becomes two prologue-fused GEMVs, SiLU-mul -> down -> + residual one
    fused GEMV with both; the norm and SiLU-mul ops and the add disappear. The SiLU then moves
    into the gate GEMV's epilogue and the down projection's prologue keeps the product."""
    m, args, prog, rec = compile_block(Options(workers=4, tile_n=32, tile_rows=1))
    text = rec.render("fuse_gemv")
    filecheck(text, [
        r"^opgraph \{$",
        r"^  \w+ = binary\(residual\[2x64\], x\[2x64\]\) -> (?P<h>\w+)\[2x64\] fn='add'$",
        r"^  \w+ = linear_fused\([[h]]\[2x64\], p_weight\[64\], p_gate_proj_weight\[96x64\]\) -> (?P<g>\w+)\[2x96\] "
        r"epilogue='silu' eps=1e-06 prologue='rmsnorm'$",
        r"^  \w+ = linear_fused\([[h]]\[2x64\], p_weight\[64\], p_up_proj_weight\[96x64\]\) -> (?P<u>\w+)\[2x96\]",
        r"^  \w+ = linear_fused\([[g]]\[2x96\], [[u]]\[2x96\], p_down_proj_weight\[64x96\], [[h]]\[2x64\]\) -> "
        r"\w+\[2x64\] epilogue='add' prologue='mul'$",
        r"^\}$",
    ])
    assert "= rmsnorm(" not in text and "= silu_mul(" not in text and text.count("binary(") == 1
    assert_close(prog(*args), m(*args), 1e-5)
