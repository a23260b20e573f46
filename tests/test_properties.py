"""Property tests: random DAGs of supported ops, random shapes, tile sizes and schedules.

Every example builds a plain ``torch.nn.Module`` from a random program of ops, compiles it
with :func:`tilec.api.compile_module` (the stage verifiers run inside the pipeline: the
default ``Options.verify=True``), runs the encoded plan on the CPU reference executor on
random inputs and compares every output with eager PyTorch (float32, 1e-4 relative L2).

``TILEC_HYPOTHESIS_EXAMPLES`` scales the number of examples (e.g. 500 for a soak run).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from _helpers import assert_close, time_limit
from tilec.api import compile_module
from tilec.ops import NOOP
from tilec.options import Options
from tilec.plan import F as FIELDS
from tilec.verify import simulate


def _examples(n: int) -> int:
    scale = os.environ.get("TILEC_HYPOTHESIS_EXAMPLES")
    return int(scale) if scale else n


# ---- random programs -------------------------------------------------------------------

@dataclass
class Program:
    """A straight-line program over named values.

    ``inputs``: name -> shape of each runtime input (float32 random normal);
    ``steps``: (op, output name, argument names, extra) in order;
    ``params``: name -> shape of each weight the module owns.
    """

    lead: tuple[int, ...]
    inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    steps: list[tuple[str, str, tuple[str, ...], dict]] = field(default_factory=list)
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = [f"lead={self.lead} inputs={self.inputs}"]
        lines += [f"  {out} = {op}({', '.join(args)}) {extra}" for op, out, args, extra in self.steps]
        lines.append(f"  return {self.outputs}")
        return "\n".join(lines)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class ProgramModule(torch.nn.Module):
    """Interprets a :class:`Program` with plain torch ops, HF style."""

    def __init__(self, prog: Program):
        super().__init__()
        self.prog = prog
        self.weights = torch.nn.ParameterDict()
        for name, shape in prog.params.items():
            if name.endswith("_w") and len(shape) == 1:  # norm weights around 1
                t = 1.0 + 0.1 * torch.randn(shape)
            elif len(shape) == 1:  # biases
                t = 0.1 * torch.randn(shape)
            else:
                t = torch.randn(shape) / shape[-1] ** 0.5
            self.weights[name] = torch.nn.Parameter(t)

    def forward(self, *args):
        env = dict(zip(self.prog.inputs, args))
        w = self.weights
        for op, out, a, ex in self.prog.steps:
            x = env[a[0]]
            if op == "linear":
                y = F.linear(x, w[out + "_lin"], w[out + "_b"] if ex["bias"] else None)
            elif op == "rmsnorm":
                xf = x.to(torch.float32)
                var = xf.pow(2).mean(-1, keepdim=True)
                y = w[out + "_w"] * (xf * torch.rsqrt(var + ex["eps"]))
            elif op == "layernorm":
                d = x.shape[-1]
                y = F.layer_norm(x, (d,), w[out + "_w"] if ex["affine"] else None,
                                 w[out + "_b"] if ex["bias"] else None, ex["eps"])
            elif op == "silu_mul":
                y = F.silu(x) * env[a[1]]
            elif op == "add":
                y = x + env[a[1]]
            elif op == "mul":
                y = x * env[a[1]]
            elif op == "scale":
                y = x * ex["s"]
            elif op == "bmul":  # broadcast a [D] weight over the rows
                y = x * w[out + "_s"]
            elif op == "softmax":
                y = torch.softmax(x, dim=-1)
            elif op == "slice":  # a zero-copy column window
                y = x[..., ex["lo"]:ex["hi"]]
            elif op == "stride2":  # every other column (a view no box describes exactly)
                y = x[..., ex["start"]::2]
            elif op == "cat":
                y = torch.cat([x, env[a[1]]], dim=-1)
            elif op == "rope":
                cos, sin = env[a[1]], env[a[2]]
                y = (x * cos) + (rotate_half(x) * sin)
            elif op == "rope_interleave":
                cos, sin = env[a[1]], env[a[2]]
                x1, x2 = x[..., 0::2], x[..., 1::2]
                y = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
            else:  # pragma: no cover
                raise AssertionError(op)
            env[out] = y
        outs = tuple(env[o] for o in self.prog.outputs)
        return outs[0] if len(outs) == 1 else outs


WIDTHS = (8, 16, 24, 32, 48)


@st.composite
def programs(draw, max_ops: int = 6) -> Program:
    lead = draw(st.sampled_from([(1,), (2,), (3,), (5,), (1, 1), (2, 3), (1, 4)]))
    prog = Program(lead)
    shapes: dict[str, int] = {}  # value name -> last dim (all values have shape lead + (d,))
    consumed: set[str] = set()

    def add_input(name, d, shape=None):
        prog.inputs[name] = shape or lead + (d,)
        shapes[name] = d

    add_input("x0", draw(st.sampled_from(WIDTHS)))
    n_ops = draw(st.integers(1, max_ops))
    kinds = ["linear", "rmsnorm", "layernorm", "silu_mul", "add", "mul", "scale", "bmul", "softmax", "rope",
             "rope_interleave", "slice", "stride2", "cat"]
    for i in range(n_ops):
        kind = draw(st.sampled_from(kinds))
        names = sorted(shapes)
        src = draw(st.sampled_from(names))
        d = shapes[src]
        out = f"v{i}"
        if kind == "linear":
            n = draw(st.sampled_from(WIDTHS))
            bias = draw(st.booleans())
            prog.params[out + "_lin"] = (n, d)
            if bias:
                prog.params[out + "_b"] = (n,)
            prog.steps.append(("linear", out, (src,), {"bias": bias}))
            shapes[out] = n
        elif kind in ("rmsnorm", "layernorm"):
            eps = draw(st.sampled_from([1e-5, 1e-6]))
            extra = {"eps": eps}
            if kind == "layernorm":
                extra["affine"] = draw(st.booleans())
                extra["bias"] = draw(st.booleans())
                if extra["affine"]:
                    prog.params[out + "_w"] = (d,)
                if extra["bias"]:
                    prog.params[out + "_b"] = (d,)
            else:
                prog.params[out + "_w"] = (d,)
            prog.steps.append((kind, out, (src,), extra))
            shapes[out] = d
        elif kind in ("silu_mul", "add", "mul"):
            same = [n for n in names if shapes[n] == d]
            other = draw(st.sampled_from(same))
            if other == src and kind == "silu_mul" or len(same) == 1 and draw(st.booleans()):
                other = f"in{i}"
                add_input(other, d)
            prog.steps.append((kind, out, (src, other), {}))
            consumed.add(other)
            shapes[out] = d
        elif kind == "scale":
            prog.steps.append(("scale", out, (src,), {"s": draw(st.sampled_from([0.5, -2.0, 1.25]))}))
            shapes[out] = d
        elif kind == "bmul":
            prog.params[out + "_s"] = (d,)
            prog.steps.append(("bmul", out, (src,), {}))
            shapes[out] = d
        elif kind == "softmax":
            prog.steps.append(("softmax", out, (src,), {}))
            shapes[out] = d
        elif kind == "slice":
            if d < 4:
                continue
            lo = draw(st.integers(0, d // 2))
            hi = draw(st.integers(lo + 2, d))
            prog.steps.append(("slice", out, (src,), {"lo": lo, "hi": hi}))
            shapes[out] = hi - lo
        elif kind == "stride2":
            if d < 4:
                continue
            start = draw(st.integers(0, 1))
            prog.steps.append(("stride2", out, (src,), {"start": start}))
            shapes[out] = len(range(start, d, 2))
        elif kind == "cat":
            other = draw(st.sampled_from(names))
            prog.steps.append(("cat", out, (src, other), {}))
            consumed.add(other)
            shapes[out] = d + shapes[other]
        elif kind in ("rope", "rope_interleave"):
            if d % 2:
                continue
            # cos/sin: the full shape, or broadcast over some leading dims (HF: over the heads)
            dc = d if kind == "rope" else d // 2
            cshape = tuple(1 if draw(st.booleans()) else s for s in lead) + (dc,)
            if draw(st.booleans()):
                cshape = cshape[draw(st.integers(0, len(lead))):]
            prog.inputs[f"cos{i}"] = prog.inputs[f"sin{i}"] = cshape
            prog.steps.append((kind, out, (src, f"cos{i}", f"sin{i}"), {}))
            consumed |= {f"cos{i}", f"sin{i}"}
            shapes[out] = d
        consumed.add(src)
    if not prog.steps:
        prog.steps.append(("scale", "v_last", ("x0",), {"s": 3.0}))
        shapes["v_last"] = shapes["x0"]
        consumed.add("x0")
    produced = [s[1] for s in prog.steps]
    sinks = [n for n in produced if n not in consumed]
    prog.outputs = tuple(sinks) if sinks else (produced[-1],)
    return prog


@st.composite
def options(draw, max_workers: int = 132) -> Options:
    return Options(
        workers=draw(st.integers(1, max_workers)),
        scheduler=draw(st.sampled_from(["list", "round_robin"])),
        tile_n=draw(st.sampled_from([1, 4, 8, 16, 64])),
        split_k=draw(st.sampled_from([1, 1, 2, 3, 4])),
        tile_rows=draw(st.sampled_from([1, 2, 3, 4, 8])),
        tile_cols=draw(st.sampled_from([None, 4, 8, 1024])),
    )


def make_inputs(prog: Program) -> tuple[torch.Tensor, ...]:
    out = []
    for name, shape in prog.inputs.items():
        if name.startswith(("cos", "sin")):  # rotary tables: cos/sin of random angles
            ang = torch.rand(shape) * 6.28
            out.append(torch.cos(ang) if name.startswith("cos") else torch.sin(ang))
        else:
            out.append(torch.randn(shape))
    return tuple(out)


def check_program(prog: Program, opts: Options) -> None:
    module = ProgramModule(prog).eval()
    args = make_inputs(prog)
    with torch.no_grad():
        expected = module(*args)
    compiled = compile_module(module, args, options=opts)
    assert compiled.plan.workers == opts.workers
    for _ in range(2):  # a second call re-uses the plan (monotonic event counters, epoch 2)
        got = compiled(*args)
        exp = expected if isinstance(expected, tuple) else (expected,)
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(exp)
        for i, (g, e) in enumerate(zip(got, exp)):
            assert_close(g, e, 1e-4, f"output {i} ({prog.outputs[i]}) of\n{prog.describe()}\nwith {opts}")
    # fresh inputs, same plan
    args2 = make_inputs(prog)
    with torch.no_grad():
        exp2 = module(*args2)
    got2 = compiled(*args2)
    exp2 = exp2 if isinstance(exp2, tuple) else (exp2,)
    got2 = got2 if isinstance(got2, tuple) else (got2,)
    for g, e in zip(got2, exp2):
        assert_close(g, e, 1e-4, f"second inputs of\n{prog.describe()}\nwith {opts}")
    return compiled


# ---- the properties ----------------------------------------------------------------------

@pytest.mark.slow
@settings(max_examples=_examples(50), deadline=None)
@given(prog=programs(), opts=options())
def test_random_dag_matches_eager(prog, opts):
    with time_limit(120):
        check_program(prog, opts)


@settings(max_examples=_examples(30), deadline=None)
@given(prog=programs(max_ops=4), workers=st.integers(1, 132), scheduler=st.sampled_from(["list", "round_robin"]))
def test_any_worker_count_and_scheduler_is_deadlock_free(prog, workers, scheduler):
    """Any W in 1..132 with either scheduler: the verifier (plan simulation) passes, the run completes."""
    opts = Options(workers=workers, scheduler=scheduler, tile_n=8, tile_rows=1, tile_cols=8, verify=True)
    with time_limit(120):
        compiled = check_program(prog, opts)
        plan = compiled.plan
        q = plan.queues
        assert q.shape[0] == workers and q.shape[2] == 32
        # every task encoded once; each queue in increasing global (linearized) order
        task = FIELDS["task"][0]
        real = q[:, :, FIELDS["opcode"][0]] != NOOP
        seq = [q[w, real[w], task].tolist() for w in range(workers)]
        assert sorted(t for s in seq for t in s) == list(range(len(compiled.compiled.stages["linearized"].tasks)))
        assert all(s == sorted(s) for s in seq)
        if scheduler == "round_robin":
            assert all(s == list(range(w, len(s) * workers, workers))[:len(s)] for w, s in enumerate(seq))
        simulate(plan)  # the verifier's own check, explicitly: two steps of waits/signals, no deadlock


# ---- event derivation: an op's earlier accesses against a tile's box ----------------------

_COORD = st.integers(-3, 6)


@st.composite
def _access_steps(draw):
    """A rank 0..3 and up to 12 (box, exact, queries) adds: half-open ranges that may be empty,
    inverted, touching or nested."""
    rank = draw(st.integers(0, 3))
    box = st.tuples(*[st.tuples(_COORD, _COORD) for _ in range(rank)])
    # column tiles along one dim (what the index serves), besides arbitrary boxes
    tiles = st.tuples(st.integers(0, max(rank - 1, 0)), st.integers(0, 7)).map(
        lambda di: tuple((2 * di[1], 2 * di[1] + 2) if j == di[0] else (0, 1) for j in range(rank)))
    return rank, draw(st.lists(st.tuples(box | tiles, st.booleans(), st.lists(box, max_size=4)), min_size=1,
                               max_size=20))


@settings(max_examples=_examples(500), deadline=None)
@given(_access_steps(), st.sampled_from([2, None]))
def test_accesses_overlapping_matches_the_pairwise_test(steps, index_min):
    """``taskgraph._Accesses.overlapping`` (bounding-box shortcuts, the index along a dim that
    separates the boxes, from ``index_min`` accesses) gives the ids, in order, and the all-exact
    flag of a test of every stored box with ``boxes_overlap``, queried after every add."""
    from tilec.taskgraph import _Accesses, boxes_overlap

    class Accesses(_Accesses):
        __slots__ = ()
        INDEX_MIN = index_min or _Accesses.INDEX_MIN

    rank, adds = steps
    acc, stored = Accesses(rank), []
    for tid, (box, exact, queries) in enumerate(adds):
        acc.add(tid, box, exact)
        stored.append((tid, box, exact))
        for q in [*queries, box]:
            hit = [(t, ex) for t, b, ex in stored if boxes_overlap(q, b)]
            ids, all_exact = acc.overlapping(q)
            assert (list(ids), all_exact) == ([t for t, _ in hit], all(ex for _, ex in hit)), (stored, q)
