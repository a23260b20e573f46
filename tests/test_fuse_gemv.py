"""Op-level GEMV fusion (``tilec.passes.fuse_gemv``): RMSNorm / SiLU-mul prologues and
residual-add epilogues keep every rounding point, so fused plans give bitwise the results
of unfused plans (reference executor), and the pass refuses what it must not fuse."""
from __future__ import annotations

import collections

import pytest
import torch

from _helpers import LlamaRMSNorm, assert_close, assert_steps_bitwise_equal, step_pair
from tilec.api import compile_module


def kinds(prog) -> dict[str, int]:
    return dict(collections.Counter(op.kind for op in prog.plan.graph.ops))


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_fused_equals_unfused(name, dtype):
    model, tok, fused, unfused = step_pair(name, dtype, dict(fuse_gemv=False))
    k = kinds(fused[0].program)
    layers = model.config.num_hidden_layers
    # q, k, v, o, gate, up, down per layer and the LM head: every GEMV absorbed a neighbour
    assert k["linear_fused"] == 7 * layers + 1 and "linear" not in k and "silu_mul" not in k
    assert "binary" not in k  # both residual adds became epilogues
    assert k.get("rmsnorm", 0) == (2 * layers if name.startswith("qwen3") else 0)  # q/k norms stay
    assert_steps_bitwise_equal(fused, unfused, tok, "fused and unfused")


class NormShared(torch.nn.Module):
    """The RMSNorm output is also returned: the norm must stay, the GEMV still fuses it."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(64, eps=1e-5)
        self.lin = torch.nn.Linear(64, 48, bias=False)
        self.out = torch.nn.Linear(48, 64, bias=False)

    def forward(self, x):
        h = self.norm(x)
        y = self.lin(h)
        return x + self.out(y), h, y


def test_shared_producers_stay():
    torch.manual_seed(0)
    m = NormShared().eval()
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 64)
    prog = compile_module(m, (x,), options=dict(workers=4))
    k = kinds(prog)
    # the norm output is returned -> kept; y is returned -> lin has no epilogue, out has one
    assert k == {"rmsnorm": 1, "linear_fused": 2}, k
    got, want = prog(x), m(x)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5)


def test_bias_and_large_rows_not_fused():
    torch.manual_seed(0)
    norm, lin = torch.nn.RMSNorm(64), torch.nn.Linear(64, 32)  # a bias: not fused

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = norm, lin

        def forward(self, x):
            return self.lin(self.norm(x))

    x = torch.randn(2, 64)
    prog = compile_module(Biased().eval(), (x,), options=dict(workers=3))
    assert kinds(prog) == {"rmsnorm": 1, "linear": 1}
    assert_close(prog(x), Biased().eval()(x), 1e-5)

    class Wide(torch.nn.Module):  # 64 rows x 1024 floats = 256 KiB staged: over the limit
        def __init__(self):
            super().__init__()
            self.norm, self.lin = torch.nn.RMSNorm(1024), torch.nn.Linear(1024, 16, bias=False)

        def forward(self, x):
            return self.lin(self.norm(x))

    w = Wide().eval()
    xw = torch.randn(64, 1024)
    prog = compile_module(w, (xw,), options=dict(workers=3))
    assert kinds(prog) == {"rmsnorm": 1, "linear": 1}
    assert_close(prog(xw), w(xw), 1e-5)


class SwiGLU(torch.nn.Module):
    """``down(silu(gate(x)) * up(x))``; with ``up=False`` ``down(silu(h) * h)``, whose product reads
    the gate output twice."""

    def __init__(self, up=True):
        super().__init__()
        self.gate = torch.nn.Linear(64, 96, bias=False)
        self.up = torch.nn.Linear(64, 96, bias=False) if up else None
        self.down = torch.nn.Linear(96, 64, bias=False)

    def forward(self, x):
        h = self.gate(x)
        return self.down(torch.nn.functional.silu(h) * (self.up(x) if self.up is not None else h))


def gemv_forms(prog) -> set[tuple]:
    """(kind, prologue, epilogue) of the plan's ops."""
    return {(op.kind, op.attr("prologue"), op.attr("epilogue")) for op in prog.plan.graph.ops}


def test_swiglu_split_needs_the_gate_output_read_once():
    """Where the product's other factor is the gate output itself, the SiLU cannot move into the
    gate's epilogue (the product would square it): the down projection keeps silu_mul."""
    torch.manual_seed(0)
    m = SwiGLU(up=False).eval()
    x = torch.randn(2, 64)
    prog = compile_module(m, (x,), options=dict(workers=4))
    fused = gemv_forms(prog)
    assert ("linear_fused", "silu_mul", "none") in fused and all(e != "silu" for _, _, e in fused), fused
    assert_close(prog(x), m(x), 1e-5)


@pytest.mark.parametrize("split", [True, False])
def test_swiglu_split_moves_the_silu_into_the_gate(split):
    """With ``swiglu_split`` the gate GEMV applies the SiLU and the down projection multiplies;
    bitwise the same outputs either way (reference executor), and within float32 rounding of eager."""
    torch.manual_seed(0)
    m = SwiGLU().eval()
    x = torch.randn(3, 64)
    prog = compile_module(m, (x,), options=dict(workers=4, swiglu_split=split))
    fused = gemv_forms(prog)
    if split:
        assert ("linear_fused", "none", "silu") in fused and ("linear_fused", "mul", "none") in fused, fused
    else:
        assert ("linear_fused", "silu_mul", "none") in fused and all(e != "silu" for _, _, e in fused), fused
    other = compile_module(m, (x,), options=dict(workers=4, swiglu_split=not split))
    assert torch.equal(prog(x), other(x))
    assert_close(prog(x), m(x), 1e-5)


class WideMLP(torch.nn.Module):
    """Llama-3.2-1B's MLP half (hidden 2048, intermediate 8192): RMSNorm, gate / up, SiLU-mul,
    down + residual."""

    def __init__(self, d=2048, f=8192):
        super().__init__()
        self.norm = LlamaRMSNorm(d, dtype=torch.float32)  # (the test moves the module to bf16)
        self.gate = torch.nn.Linear(d, f, bias=False)
        self.up = torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h)) + x


@pytest.mark.parametrize("rows,stages", [(1, 3), (3, 3), (4, 2)])
def test_fused_rows_leave_the_weight_ring(rows, stages):
    """A fused GEMV's x rows must not take the weight ring's room: at 4 rows the down projection's
    float rows plus their bf16 copy (4 x 8192) asked 194.5 KiB of the CTA's 225, the ring got no stage
    and no GEMV of Llama-3.2-1B's batch-4 step streamed its weights (7.31 ms a step on an H200
    against 1.17 at batch 1). Without the copy's room the ring keeps 2 stages and every GEMV
    streams; results as eager's."""
    from tilec.ops import opdef
    from tilec.plan import F

    torch.manual_seed(0)
    mod = WideMLP().to(torch.bfloat16)
    x = torch.randn(rows, 2048, dtype=torch.bfloat16)
    prog = compile_module(mod, (x,), options=dict(executor="reference"))
    assert kinds(prog) == {"linear_fused": 3}, kinds(prog)
    plan = prog.plan
    assert plan.ring_stages == stages
    q = plan.queues
    gemv = q[..., F["opcode"][0]] == opdef("linear_fused").opcode
    assert int(gemv.sum()) > 0 and bool((q[..., F["stream"][0]][gemv] != 0).all()), "a GEMV tile is not streamed"
    with torch.no_grad():
        assert_close(prog(x), mod(x), tol=2e-2)  # bf16 rounding of the intermediates


def test_a_linear_output_added_to_itself_is_not_a_residual_epilogue():
    """``y = lin(x); y + y``: the add was fused as the GEMV's residual epilogue with y itself as the
    residual, a buffer nothing writes then (VerificationError; NaN with verify=False)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            y = self.lin(x)
            return y + y

    m, x = M(), torch.randn(2, 8)
    for opts in ({}, {"verify": False}):
        prog = compile_module(m, (x,), options=dict(workers=4, **opts))
        x2 = torch.randn(2, 8)
        with torch.no_grad():
            assert_close(prog(x2), m(x2), 1e-5)
        assert not any(op.kind == "linear_fused" and op.attr("epilogue") == "add" for op in prog.graph.ops)


class FlatMM(torch.nn.Module):
    """The chain as AOTAutograd hands it over: ``mm`` on a ``[rows, K]`` view of the norm's
    ``[batch, seq, K]`` output, its result read back as ``[batch, seq, N]`` by the residual add,
    and SwiGLU's product flattened for the down projection."""

    def __init__(self, d=64, inter=96):
        super().__init__()
        self.norm = LlamaRMSNorm(d)
        self.gate = torch.nn.Parameter(torch.randn(inter, d) / d ** 0.5)
        self.up = torch.nn.Parameter(torch.randn(inter, d) / d ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(d, inter) / inter ** 0.5)

    def forward(self, x):  # x [B, S, d]
        b, s, d = x.shape
        h = self.norm(x).view(b * s, d)
        g = torch.mm(h, self.gate.t()).view(b, s, -1)
        u = torch.mm(h, self.up.t()).view(b, s, -1)
        a = torch.nn.functional.silu(g) * u
        return x + torch.mm(a.view(b * s, -1), self.down.t()).view(b, s, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_through_flattened_views_fuses(dtype):
    """Under torch.compile HF generate()'s decode step had every RMSNorm, SiLU-mul and residual add
    as an op of its own (29 ops for 2 Llama layers against compile_decode_step's 18; on an H100 its
    step took 2.7 ms against ~1.3), because the views the ops exchange differ in their leading dims."""
    torch.manual_seed(0)
    m = FlatMM().to(dtype).eval()
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 1, 64, dtype=dtype)
    fused = compile_module(m, (x,), options=dict(workers=4))
    unfused = compile_module(m, (x,), options=dict(workers=4, fuse_gemv=False))
    assert kinds(fused) == {"linear_fused": 3}, kinds(fused)
    assert {op.attr("prologue") for op in fused.graph.ops} == {"rmsnorm", "mul"}
    x2 = torch.randn(2, 1, 64, dtype=dtype)
    with torch.no_grad():
        got, want = fused(x2), unfused(x2)
        assert torch.equal(got, want)  # the same rounding points
        assert_close(got, m(x2), 1e-5 if dtype == torch.float32 else 2e-2)


def test_generate_under_torch_compile_fuses_like_compile_decode_step(monkeypatch):
    """HF generate()'s decode call through the torch.compile backend plans the same fused GEMVs as
    compile_decode_step (q, k, v, o, gate, up, down a layer and the LM head) and decodes eager's tokens."""
    import tilec.backend as backend
    from _helpers import greedy_generate
    from tilec.zoo import make_model

    programs = []
    real = backend._compile_region
    monkeypatch.setattr(backend, "_compile_region", lambda *a: programs.append(real(*a)) or programs[-1])
    torch.manual_seed(0)
    model = make_model("llama-tiny", layers=2)
    ids = torch.randint(3, 1000, (1, 5))
    with torch.no_grad():
        want = greedy_generate(model, False, 4, {"workers": 8}, input_ids=ids)
        got = greedy_generate(model, True, 4, {"workers": 8}, input_ids=ids)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    decode, = [p for p, _ in programs if "attention" in kinds(p)]  # (a 5-token prefill compiles in regions)
    k = kinds(decode)
    assert k.get("linear_fused") == 7 * 2 + 1 and not {"linear", "binary", "rmsnorm", "silu_mul"} & set(k), k


def test_generate_under_torch_compile_streams_its_weights(monkeypatch):
    """The backend passes module parameters to the program as call inputs (bound per call), and a
    GEMV's loader streamed only PARAM / CONST weights: HF generate()'s bf16 decode step on an H200
    ran with no weight ring at all (2.5 ms a step against 1.1 for compile_decode_step's plan). Now
    read-only inputs stream too (``OpGraph.read_only``): the same ring and stream words."""
    import tilec.backend as backend
    from _helpers import greedy_generate
    from tilec.hf import compile_decode_step
    from tilec.plan import F
    from tilec.zoo import make_model, prefill

    programs = []
    real = backend._compile_region
    monkeypatch.setattr(backend, "_compile_region", lambda *a: programs.append(real(*a)) or programs[-1])
    torch.manual_seed(0)
    model = make_model("llama-tiny", torch.bfloat16, layers=2)
    ids = torch.randint(3, 1000, (1, 5))
    with torch.no_grad():
        greedy_generate(model, True, 3, {"workers": 8}, input_ids=ids)
    decode, = [p for p, _ in programs if "attention" in kinds(p)]
    cache, _ = prefill(model, 1, 5, 8)
    step = compile_decode_step(model, cache, 1, options={"workers": 8})
    streamed = [int((p.plan.queues[..., F["stream"][0]] != 0).sum()) for p in (decode, step.program)]
    assert decode.plan.ring_stages == step.program.plan.ring_stages > 0
    assert streamed[0] == streamed[1] > 0, streamed
    weights = [n for n, b in decode.graph.buffers.items() if b.kind.value == "input" and len(b.shape) == 2
               and b.dtype == torch.bfloat16 and b.shape[0] > 1]
    assert weights and all(decode.graph.read_only(n) for n in weights)


def test_read_only_buffers():
    """``OpGraph.read_only``: weights, constants and inputs no op writes; not state, temps, or an
    input some op writes."""
    from tilec.ir import Buffer, BufferKind, Op, OpGraph, View

    bufs = {n: Buffer(n, (4,), torch.float32, k) for n, k in (("w", BufferKind.PARAM), ("c", BufferKind.CONST),
                                                             ("x", BufferKind.INPUT), ("y", BufferKind.INPUT),
                                                             ("s", BufferKind.STATE), ("t", BufferKind.TEMP))}
    whole = {n: View.whole(b) for n, b in bufs.items()}
    ops = (Op("a", "binary", (whole["x"], whole["w"]), (whole["t"],), (("fn", "add"),)),
           Op("b", "binary", (whole["t"], whole["c"]), (whole["y"],), (("fn", "add"),)))
    g = OpGraph(ops, bufs, ("x", "y", "s"), (whole["t"],))
    assert {n for n in bufs if g.read_only(n)} == {"w", "c", "x"}
