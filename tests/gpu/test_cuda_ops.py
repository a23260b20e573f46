"""One test per tile op on the CUDA executor against eager torch, on random inputs at
several shapes (including sizes that are not multiples of the tile sizes)."""
import pytest
import torch
import torch.nn.functional as F

from _helpers import APPEND_CASES, LlamaRMSNorm, append_fold_results, run_plan
from tilec.api import compile_module
from tilec.errors import TilecError

DEV = "cuda"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def tol(dtype):
    return 1e-4 if dtype == torch.float32 else 2e-2


def check(mod, args, dtype, **opts):
    mod = mod.to(DEV)
    args = tuple(a.to(DEV) for a in args)
    prog = compile_module(mod, args, options=dict(executor="cuda", **opts))
    with torch.no_grad():
        want = mod(*args)
    got = prog(*args)
    assert prog.executor_kind == "cuda"
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.isfinite(g.float()).all()
        assert rel(g, w) < tol(dtype), rel(g, w)
    return prog


class Lin(torch.nn.Module):
    def __init__(self, k, n, bias, dtype):
        super().__init__()
        self.l = torch.nn.Linear(k, n, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.l(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,bias,tile_n", [(1, 256, 100, False, 64), (3, 72, 130, True, 32), (16, 512, 64, False, 16),
                                              (100, 256, 72, True, 32)])
def test_linear(dtype, m, k, n, bias, tile_n):
    """100 rows: a tile's rows in two chunks of at most 64."""
    check(Lin(k, n, bias, dtype), (torch.randn(m, k, dtype=dtype),), dtype, tile_n=tile_n)


@pytest.mark.parametrize("m,k,n,bias", [(9, 512, 100, True), (16, 2048, 72, False), (40, 2048, 130, True),
                                         (16, 6144, 24, False), (12, 5000, 40, True), (5, 512, 100, True),
                                         (8, 2048, 72, False), (5, 8192, 24, True), (8, 5000, 40, False),
                                         (4, 14336, 40, True), (3, 8192, 24, False), (2, 14336, 24, False)])
def test_linear_tensor_core_rows(m, k, n, bias):
    """5..64 rows: the mma.sync path - streamed weights for 5..16 rows (x staged whole up to K 4096,
    longer K block outer, x staged one K block at a time), from staged rows (small K) or straight
    from x (large) for more. 2..4 rows whose float rows exceed 96 KiB (a Llama-3.1-8B batch-4 down
    projection, 4 x 14336) stream K block outer too: they streamed nothing and ran at ~0.05 TB/s."""
    check(Lin(k, n, bias, torch.bfloat16), (torch.randn(m, k, dtype=torch.bfloat16),), torch.bfloat16)


class LinOfLin(torch.nn.Module):
    """Two linears in a row: the second's tiles wait on the first's event (a GEMV waits inside
    its op, after its setup - runtime/tilec/executor.cuh)."""

    def __init__(self, k, n, dtype):
        super().__init__()
        self.a = torch.nn.Linear(k, k, bias=False, dtype=dtype)
        self.b = torch.nn.Linear(k, n, bias=True, dtype=dtype)

    def forward(self, x):
        return self.b(self.a(x) * 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 100])
def test_linear_after_linear(dtype, m):
    """The second GEMV's wait is a real event; at 100 rows its rows come in two chunks and it
    waits once, in the first."""
    check(LinOfLin(256, 72, dtype), (torch.randn(m, 256, dtype=dtype),), dtype, workers=8, tile_n=32)


class SwiGLU(torch.nn.Module):
    def __init__(self, d, f, dtype):
        super().__init__()
        self.gate = torch.nn.Linear(d, f, bias=False, dtype=dtype)
        self.up = torch.nn.Linear(d, f, bias=False, dtype=dtype)
        self.down = torch.nn.Linear(f, d, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)) + x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 12, 32])
def test_swiglu_split_is_bitwise_the_silu_mul_prologue(dtype, m):
    """SwiGLU's SiLU as the gate GEMV's epilogue and a multiply-only down prologue (the default)
    gives bitwise what the down projection's silu_mul prologue gives (bf16: 12 rows take the
    tensor-core ring consumer, 32 the tensor-core GEMV without the ring; float32: the float
    staging path)."""
    mod, x = SwiGLU(256, 512, dtype), torch.randn(m, 256, dtype=dtype)
    split = check(mod, (x,), dtype, workers=16)
    fused = {(op.kind, op.attr("prologue"), op.attr("epilogue")) for op in split.plan.graph.ops}
    assert ("linear_fused", "none", "silu") in fused and ("linear_fused", "mul", "add") in fused, fused
    whole = check(mod, (x,), dtype, workers=16, swiglu_split=False)
    assert "silu" not in {op.attr("epilogue") for op in whole.plan.graph.ops}
    xd = x.to(DEV)
    assert torch.equal(split(xd), whole(xd))


@pytest.mark.parametrize("m,stages", [(3, 3), (4, 2), (5, 3), (8, 3)])
def test_wide_rows_keep_the_weight_ring(m, stages):
    """Llama-3.2-1B's MLP at 3..8 rows, every GEMV streaming its weights. At 3 / 4 rows the down
    projection's scratch is its float rows alone (no room for their bf16 copy), in which the ring
    consumer stages the bf16 x and side rows - at 4 x 8192 exactly filling it - so the weight ring
    keeps 3 / 2 stages. At 5 / 8 rows the down projection (too wide to fuse) goes to the tensor-core
    consumer, x staged one K block at a time (at 8 rows it streamed nothing before)."""
    from tilec.ops import opdef
    from tilec.plan import F

    prog = check(SwiGLU(2048, 8192, torch.bfloat16), (torch.randn(m, 2048, dtype=torch.bfloat16),), torch.bfloat16)
    assert prog.plan.ring_stages == stages and prog.executor.ring_stages == stages
    q = prog.plan.queues
    op = q[..., F["opcode"][0]]
    gemv = (op == opdef("linear_fused").opcode) | (op == opdef("linear").opcode)
    assert int(gemv.sum()) > 0 and bool((q[..., F["stream"][0]][gemv] != 0).all())


class NormLinOfView(torch.nn.Module):
    """RMSNorm then a linear of a view of the input offset by one element: its bf16 rows are not
    16-byte aligned, so the ring consumer cannot stage them as bf16."""

    def __init__(self, k, n):
        super().__init__()
        self.norm = LlamaRMSNorm(k)  # (torch.nn.RMSNorm of bf16 rows is planned as an upcast and a float32 norm)
        self.l = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)

    def forward(self, y):
        return self.l(self.norm(y[:, 1:]))


def test_wide_misaligned_rows_read_the_float_rows():
    """4 x 8192 fused rows whose scratch is their float rows alone (the ring keeps 2 stages) and
    that cannot be staged as bf16: the ring consumer reads the float rows."""
    k = 8192
    prog = check(NormLinOfView(k, 64), (torch.randn(4, k + 1, dtype=torch.bfloat16),), torch.bfloat16)
    assert [op.kind for op in prog.plan.graph.ops] == ["linear_fused"] and prog.plan.ring_stages == 2


class NormLin(torch.nn.Module):
    """Llama's RMSNorm, then a linear: the norm becomes the GEMV's prologue."""

    def __init__(self, k, n):
        super().__init__()
        self.norm = LlamaRMSNorm(k)
        self.l = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)

    def forward(self, y):
        return self.l(self.norm(y))


@pytest.mark.parametrize("k", [2048, 3072, 4096, 4104, 8192])
def test_rmsnorm_prologue_of_one_row(k):
    """One bf16 row's RMSNorm prologue: from registers with one 16-byte vector a thread up to K = 2048, through
    shared memory past that (benchmarks/lab/patches/s60-rms2.patch takes the register path to 4096, Llama-3.1-8B's
    hidden size: these K are its test)."""
    torch.manual_seed(0)
    prog = check(NormLin(k, 96), (torch.randn(1, k, dtype=torch.bfloat16),), torch.bfloat16, workers=8)
    assert [op.kind for op in prog.plan.graph.ops] == ["linear_fused"]


class LinOfView(Lin):
    """The linear of a view of the input: transposed (K stride 16) or offset by one element
    (rows 2 bytes past 16-byte alignment) - the K-outer stream stages such rows one element at a
    time."""

    def __init__(self, k, n, how):
        super().__init__(k, n, False, torch.bfloat16)
        self.how = how

    def forward(self, y):
        return self.l(y.transpose(0, 1) if self.how == "transposed" else y[:, 1:])


@pytest.mark.parametrize("how", ["transposed", "offset"])
def test_linear_long_k_of_strided_or_misaligned_rows(how):
    y = torch.randn(6144, 16, dtype=torch.bfloat16) if how == "transposed" else torch.randn(16, 6145, dtype=torch.bfloat16)
    check(LinOfView(6144, 24, how), (y,), torch.bfloat16)


class LinScaled(Lin):
    def forward(self, x):
        return self.l(x) * 2.0


def test_linear_split_k_fp32():
    prog = check(LinScaled(1000, 96, True, torch.float32), (torch.randn(2, 1000),), torch.float32, tile_n=32,
                 split_k=4)
    assert any("tile_reduce" in e.strategy for e in prog.compiled.stages["tasks"].events)


class Norms(torch.nn.Module):
    def __init__(self, d, dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, dtype=dtype))
        self.ln = torch.nn.LayerNorm(d, dtype=dtype)
        torch.nn.init.normal_(self.ln.weight)
        torch.nn.init.normal_(self.ln.bias)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        r = self.w * h.to(x.dtype)
        return r, self.ln(x), torch.softmax(x, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (2, 3, 100)])
def test_rmsnorm_layernorm_softmax(dtype, shape):
    prog = check(Norms(shape[-1], dtype), (torch.randn(*shape, dtype=dtype),), dtype, tile_rows=2)
    kinds = {op.kind for op in prog.graph.ops}
    assert {"rmsnorm", "layernorm", "softmax"} <= kinds


class Rope(torch.nn.Module):
    def forward(self, x, cos, sin, c2, s2):
        h = x.shape[-1] // 2
        a = x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin
        x1, x2 = x[..., 0::2], x[..., 1::2]
        b = torch.cat([x1 * c2 - x2 * s2, x2 * c2 + x1 * s2], -1)
        c = x * cos + torch.stack((-x2, x1), -1).flatten(-2) * sin  # GPT-J / GLM-4: pairs rotated in place
        return a, b, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope(dtype):
    x = torch.randn(2, 4, 1, 64, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
    cos, sin = torch.randn(2, 1, 1, 64, dtype=dtype), torch.randn(2, 1, 1, 64, dtype=dtype)
    c2, s2 = torch.randn(2, 1, 1, 32, dtype=dtype), torch.randn(2, 1, 1, 32, dtype=dtype)
    prog = check(Rope(), (x, cos, sin, c2, s2), dtype)
    assert sorted(op.attr("style") for op in prog.graph.ops if op.kind == "rope") == [0, 1, 2]


class Ewise(torch.nn.Module):
    def forward(self, g, u, b):
        return F.silu(g) * u, (g + b) * 0.5 - u, torch.exp(b) / 3.0, torch.relu(-g), F.gelu(u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,tile_cols", [(1000, 333), (4096, 333), (4096, 256), (1000, None)])
def test_elementwise(dtype, n, tile_cols):
    """tile_cols 256 (and 1000 whole) tiles move 8 elements per 16-byte access; 333 one at a time."""
    g, u = torch.randn(2, n, dtype=dtype), torch.randn(2, n, dtype=dtype)
    b = torch.randn(1, n, dtype=dtype)
    check(Ewise(), (g, u, b), dtype, tile_cols=tile_cols)


class Divide(torch.nn.Module):
    """``x / 448.``, ``x / 3.7``, ``x / torch.tensor(448.)`` (CPU scalars: CUDA eager multiplies by the float
    reciprocal) and ``x / s`` of a
    0-dim float32 buffer on x's device (eager divides exactly, by s in x's dtype), ``x * s`` and ``s - x``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.tensor(3.7))

    def forward(self, x):
        return x / 448., x / 3.7, x / torch.tensor(448.), x / self.s, x * self.s, self.s - x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_division_by_a_scalar_rounds_as_cuda_eager(dtype):
    """CUDA eager divides by a Python number as a product with its float reciprocal (ATen's div_true_kernel_cuda:
    x / 448. differed from the correctly rounded quotient in 558 938 of 2**20 random floats on an H100, sixtieth
    session) and by a device tensor exactly; the executor did the exact division for both. A 0-dim float32 tensor on
    the device is converted to bf16 first in bf16 arithmetic (3.7 -> 3.703125), which the executor did not do (bf16
    x / s failed bitwise in the sixtieth session's first run of this test). Bitwise eager now, and the two
    roundings do differ on these inputs."""
    torch.manual_seed(0)
    x = (torch.rand(4, 4096) * 10).to(dtype).to(DEV)
    mod = Divide().to(DEV)
    prog = compile_module(mod, (x,), options=dict(executor="cuda"))
    with torch.no_grad():
        want = mod(x)
    got = prog(x)
    assert [op.attr("fn") for op in prog.graph.ops if op.kind == "unary"] == [
        "div_scalar", "div_scalar", "div_scalar", "div_exact_scalar", "mul_scalar", "rsub_scalar"]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    if dtype == torch.float32:
        assert not torch.equal(want[1], want[2])


class ScalarArgument(torch.nn.Module):
    def forward(self, x, s):
        return x * s, x / s, s - x, x + s, torch.maximum(x, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_0dim_argument_is_rounded_as_cuda_eager(dtype):
    """A 0-dim float32 argument ``s`` (a run-time value, not a constant) in bf16 / fp16 arithmetic: CUDA eager converts
    it to x's dtype first (3.7 -> 3.703125 in bf16), and the executor read it unrounded as float32; a copy to x's
    dtype now rounds it before each op, as for the constant case above."""
    torch.manual_seed(0)
    x = (torch.rand(4, 4096) * 10 + 0.1).to(dtype).to(DEV)
    s = torch.tensor(3.7, device=DEV)
    prog = compile_module(ScalarArgument(), (x, s), options=dict(executor="cuda"))
    assert sum(op.kind == "copy" for op in prog.graph.ops) == 5
    want = ScalarArgument()(x, s)
    for g, w in zip(prog(x, s), want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    # and a new value of s at the next call, as eager reads it
    s2 = torch.tensor(-1.3, device=DEV)
    for g, w in zip(prog(x, s2), ScalarArgument()(x, s2)):
        assert torch.equal(g, w)


class Reciprocal(torch.nn.Module):
    def forward(self, x):
        return 3.7 / x, torch.reciprocal(x) + 1, 1 / (x * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reciprocal_is_cuda_eagers_bitwise(dtype):
    """``3.7 / x`` (export: reciprocal(x) * 3.7), ``torch.reciprocal`` and ``1 / (x * 2)`` bitwise CUDA eager's: the
    runtime's reciprocal is 1.f / x in float32 (ATen's reciprocal kernel), then rounded to the output dtype. Random
    values of both signs, and +-0, +-inf and values whose reciprocal is subnormal (flushed to zero it would differ)."""
    torch.manual_seed(0)
    x = torch.randn(4, 4096) * 10
    big = torch.finfo(dtype).max / 4
    x[0, :6] = torch.tensor([0., -0., float("inf"), -float("inf"), big, -big])
    x = x.to(dtype).to(DEV)
    prog = compile_module(Reciprocal(), (x,), options=dict(executor="cuda"))
    with torch.no_grad():
        want = Reciprocal()(x)
    for g, w in zip(prog(x), want):
        assert g.dtype == w.dtype and torch.equal(g.isnan(), w.isnan())
        assert torch.equal(g.nan_to_num(), w.nan_to_num())


class Clamps(torch.nn.Module):
    def forward(self, x, y):
        return (x.clamp(min=0.3), x.clamp(-1, 2), F.relu6(x * 4), F.hardtanh(x), torch.clamp(x, y), torch.rsub(x, y),
                torch.maximum(x, y), torch.minimum(x, y), F.relu(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamps_maximum_and_relu_keep_nans_as_cuda_eager(dtype):
    """clamp forms (maximum with the lower bound, minimum with the upper), torch.maximum / minimum and ReLU bitwise
    CUDA eager's with NaNs in x and in y: the runtime took fmaxf / fminf, which return the other operand, so a NaN
    came out as the bound (or 0 from ReLU) where eager's is NaN."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 4096), torch.randn(4, 4096)
    x[0, :3] = float("nan")
    y[1, :3] = float("nan")
    x, y = x.to(dtype).to(DEV), y.to(dtype).to(DEV)
    prog = compile_module(Clamps(), (x, y), options=dict(executor="cuda"))
    with torch.no_grad():
        want = Clamps()(x, y)
    for g, w in zip(prog(x, y), want):
        assert g.dtype == w.dtype and torch.equal(g.isnan(), w.isnan())
        assert torch.equal(g.nan_to_num(), w.nan_to_num())


class CatMixed(torch.nn.Module):
    def forward(self, a, b, c):
        return torch.cat([a, b * 2, c.float().to(a.dtype)], -1), torch.cat([a, b], 1).to(torch.float32) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concat_vectors(dtype):
    """Concat along the last dim in 8-element slabs (16-byte moves), along a middle dim, and with dtype casts."""
    a, b = torch.randn(3, 4, 64, dtype=dtype), torch.randn(3, 4, 64, dtype=dtype)
    c = torch.randn(3, 4, 24, dtype=torch.bfloat16)
    check(CatMixed(), (a, b, c), dtype, tile_cols=32)


class Emb(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.e = torch.nn.Embedding(1000, 96, dtype=dtype)

    def forward(self, ids, y):
        return self.e(ids), torch.cat([y, y * 2], dim=1), y.transpose(0, 1).contiguous().view(-1) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_concat_copy(dtype):
    check(Emb(dtype), (torch.randint(0, 1000, (3, 1)), torch.randn(5, 7, dtype=dtype)), dtype, tile_cols=40)


class Gather(torch.nn.Module):
    def __init__(self, rows, dim, dtype):
        super().__init__()
        self.e = torch.nn.Embedding(rows, dim, dtype=dtype)

    def forward(self, ids):
        return self.e(ids)


@pytest.mark.parametrize("dtype,dim,tile_cols,tile_rows", [
    (torch.bfloat16, 2048, 1024, 1), (torch.bfloat16, 96, 40, 1), (torch.float16, 64, None, 1),
    (torch.float32, 96, 40, 1), (torch.bfloat16, 12, None, 1), (torch.bfloat16, 96, 36, 1), (torch.float32, 12, None, 1),
    (torch.bfloat16, 2048, 2048, 4), (torch.bfloat16, 1100, 2048, 4)])
def test_embedding_rows(dtype, dim, tile_cols, tile_rows):
    """The gather's 16-byte path (rows a multiple of 8 wide, tiles starting on a 16-byte boundary)
    and its element-by-element fallback (rows of 12 or 1100; tiles of 36 columns), each also over
    a box of more than 4096 elements (tiles of 4 rows of 2048 / 1100: the batched loops), copy
    eager's rows exactly, and an id outside the table gives a NaN row (no out-of-bounds read) that
    the host reports, naming the op, as the CPU reference does; a step without checks goes on and
    later steps are right (written without a GPU)."""
    torch.manual_seed(0)
    m = Gather(1000, dim, dtype).to(DEV)
    ids = torch.tensor([[3], [999], [0], [517]], device=DEV)
    prog = compile_module(m, (ids,), options=dict(executor="cuda", workers=7, tile_cols=tile_cols,
                                                         tile_rows=tile_rows))
    with torch.no_grad():
        want = m(ids)
    assert torch.equal(prog(ids), want)
    bad = torch.tensor([[5], [1000], [-1], [2]], device=DEV)
    with pytest.raises(TilecError, match=r"op embedding.* failed: index (1000|-1) read at run time is outside \[0, 1000\)"):
        prog(bad)
    unchecked = compile_module(m, (ids,), options=dict(executor="cuda", workers=7, tile_cols=tile_cols,
                                                       tile_rows=tile_rows, check=False))
    got = unchecked(bad)
    assert torch.isnan(got[1:3].float()).all()
    assert torch.equal(got[0], m.e.weight[5:6]) and torch.equal(got[3], m.e.weight[2:3])
    assert torch.equal(unchecked(ids), want)  # the next step runs (the error stays recorded)
    with pytest.raises(TilecError, match=r"op embedding.* failed: index (1000|-1) read at run time"):
        unchecked.executor.check()
    unchecked.executor.check()  # reported once
    assert torch.equal(prog(ids), want)
    # check="deferred" is for decode steps: a program without a decode position is checked as it returns
    deferred = compile_module(m, (ids,), options=dict(executor="cuda", workers=7, tile_cols=tile_cols,
                                                      tile_rows=tile_rows, check="deferred"))
    with pytest.raises(TilecError, match=r"^task .*op embedding.* failed: index (1000|-1) read at run time"):
        deferred(bad)
    assert torch.equal(deferred(ids), want)


class VIntoCache(torch.nn.Module):
    """v = 2 x as heads (exact in any dtype, so eager and tilec agree bitwise), written into
    ``cache`` at ``pos`` (a ``cache_write`` op)."""

    def __init__(self, heads, dim):
        super().__init__()
        self.heads, self.dim = heads, dim

    def forward(self, x, pos, cache):
        v = (x * 2).view(x.shape[0], 1, self.heads, self.dim).transpose(1, 2)
        cache.index_copy_(2, pos, v)
        return x + 1


class GatherIntoCache(VIntoCache):
    """Token rows gathered and written into ``cache`` at ``pos``: a program that takes a decode position."""

    def __init__(self):
        super().__init__(1, 64)
        self.e = torch.nn.Embedding(1000, 64, dtype=torch.bfloat16)

    def forward(self, ids, pos, cache):
        return super().forward(self.e(ids), pos, cache)


def test_a_deferred_check_raises_a_decode_steps_error_at_the_next_call():
    """check="deferred" (torch.compile's default): a decode step's bad token id is not waited for; the
    next call raises it, naming the op and that it was an earlier step's, once; later steps are right."""
    torch.manual_seed(0)
    m = GatherIntoCache().to(DEV)
    ids, cache = torch.tensor([[3], [517]], device=DEV), torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16, device=DEV)
    prog = compile_module(m, (ids, torch.tensor([0], device=DEV), cache.clone()), positions=[1], max_positions=8,
                          options=dict(executor="cuda", workers=4, check="deferred"))
    ref = cache.clone()
    with torch.no_grad():
        want = m(ids, torch.tensor([2], device=DEV), ref)  # x + 1 (bf16): within one bf16 step of eager's
        torch.testing.assert_close(prog(ids, torch.tensor([2], device=DEV), cache), want, rtol=1e-2, atol=1e-2)
        got = prog(torch.tensor([[5], [1000]], device=DEV), torch.tensor([3], device=DEV), cache)  # no raise here
        assert torch.isnan(got[1].float()).all()
        torch.cuda.synchronize()
        with pytest.raises(TilecError, match=r"^a step before this call \(check=\"deferred\"\): task .*op "
                                             r"embedding.* failed: index 1000 read at run time"):
            prog(ids, torch.tensor([4], device=DEV), cache)
        torch.testing.assert_close(prog(ids, torch.tensor([4], device=DEV), cache), want, rtol=1e-2, atol=1e-2)
        m(ids, torch.tensor([4], device=DEV), ref)
        assert torch.equal(cache[:, :, 4], ref[:, :, 4]) and torch.equal(cache[:, :, 2], ref[:, :, 2])
        prog.check_errors()  # reported once: nothing queued now


@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 64), (torch.bfloat16, 12), (torch.float32, 64)])
def test_cache_write(dtype, dim):
    """The cache write's 16-byte row copy (bf16, rows of 64) and its elementwise fallback (rows of
    12: not a multiple of 8; float32) put exactly eager's values into the slot and touch nothing else."""
    torch.manual_seed(0)
    m = VIntoCache(3, dim)
    x = torch.randn(2, 1, 3 * dim, dtype=dtype, device=DEV)
    cache = torch.randn(2, 3, 8, dim, dtype=dtype, device=DEV)
    prog = compile_module(m, (x, torch.tensor([0], device=DEV), cache.clone()), positions=[1], max_positions=8,
                          options=dict(executor="cuda", workers=5))
    assert any(op.kind == "cache_write" for op in prog.plan.graph.ops)
    for p in (0, 5, 7):
        mine, ref = cache.clone(), cache.clone()
        with torch.no_grad():
            m(x, torch.tensor([p], device=DEV), ref)
        prog(x, torch.tensor([p], device=DEV), mine)
        assert torch.equal(mine, ref), f"position {p}: cache differs from eager"


# ---- split-KV decode attention (attention_partial + attention_combine) --------------------------

def _attention_plan(b, hq, hkv, sq, s, d, dv, dtype, kv_layout, **opts):
    """A hand-built OpGraph with one causal decode ``attention`` op, compiled with ``opts``.
    ``kv_layout="bshd"`` stores the caches as [B, S, Hkv, D] and reads them through strided views."""
    from tilec.ir import Buffer, BufferKind, Op, OpGraph, View
    from tilec.options import Options
    from tilec.pipeline import compile_opgraph

    def cache(name, dim):
        if kv_layout == "bshd":
            buf = Buffer(name, (b, s, hkv, dim), dtype, BufferKind.STATE)
            return buf, View(name, (b, hkv, s, dim), (s * hkv * dim, dim, hkv * dim, 1))
        buf = Buffer(name, (b, hkv, s, dim), dtype, BufferKind.STATE)
        return buf, View.whole(buf)

    (kb, kv_), (vb, vv) = cache("k", d), cache("v", dv)
    qb = Buffer("q", (b, hq, sq, d), dtype, BufferKind.INPUT)
    ob = Buffer("out", (b, hq, sq, dv), dtype, BufferKind.OUTPUT)
    op = Op("attn", "attention", (View.whole(qb), kv_, vv), (View.whole(ob),),
            (("causal", True), ("scale", d ** -0.5)))
    graph = OpGraph((op,), {x.name: x for x in (qb, kb, vb, ob)}, ("q", "k", "v", "<position>"),
                    (View.whole(ob),), max_positions=s - sq + 1)
    return compile_opgraph(graph, Options(executor="cuda", **opts)).plan


def _run_plan(plan, executor, q, k, v, p):
    return run_plan(plan, executor, {"q": q, "k": k, "v": v}, p, q.device)["out"]


# (batch, Hq, Hkv, Sq, S, position p, D, Dv, dtype, cache layout, attn_kv_chunk: None = auto)
SPLIT_KV_CASES = [
    pytest.param(1, 32, 8, 1, 1032, 1024, 64, 64, torch.bfloat16, "bhsd", None, id="llama-3.2-1b"),
    pytest.param(1, 16, 8, 1, 1032, 1024, 128, 128, torch.bfloat16, "bhsd", None, id="qwen3-0.6b"),
    pytest.param(2, 8, 2, 2, 300, 150, 64, 32, torch.bfloat16, "bhsd", 32, id="b2-sq2-dv32-empty-splits"),
    pytest.param(1, 64, 8, 1, 5000, 4990, 128, 128, torch.bfloat16, "bhsd", 3000, id="g8-two-segments"),
    pytest.param(1, 8, 2, 1, 500, 400, 64, 64, torch.bfloat16, "bshd", 64, id="strided-bshd"),
    pytest.param(1, 8, 2, 1, 5000, 4990, 64, 64, torch.bfloat16, "bhsd", 128, id="40-splits"),  # combine's loop path
    pytest.param(1, 8, 4, 1, 200, 199, 36, 20, torch.bfloat16, "bhsd", 32, id="generic-d36"),
    pytest.param(2, 8, 2, 1, 300, 250, 64, 64, torch.float32, "bhsd", 48, id="fp32"),
    # the tensor-core partial (bf16, staged K/V): a short last pass of queries (G x Sq = 6), causal Sq = 2
    pytest.param(1, 6, 2, 2, 300, 280, 64, 64, torch.bfloat16, "bhsd", 64, id="g3-sq2-short-pass"),
    # D % 16 != 0 (lane-group scores, tensor-core P.V), Dv = 80 (10 column tiles over 8 warps), segments
    pytest.param(1, 8, 2, 1, 3000, 2990, 72, 80, torch.bfloat16, "bhsd", 2048, id="d72-dv80-segments"),
    # Dv = 256: 4 column tiles per warp
    pytest.param(1, 8, 8, 1, 600, 590, 256, 256, torch.bfloat16, "bhsd", None, id="dv256"),
]


@pytest.mark.parametrize("b,hq,hkv,sq,s,p,d,dv,dtype,layout,chunk", SPLIT_KV_CASES)
def test_split_kv_attention(b, hq, hkv, sq, s, p, d, dv, dtype, layout, chunk):
    """partial + combine on the device vs torch SDPA (float64 math on the same inputs; relative
    L2 <= 1e-2 for bf16, 1e-4 for float32) and vs the CPU reference executor of the same plan
    (<= 5e-3 for bf16: the same p rounding, __expf vs exp); the combine folded into the partials
    (``fold_combine``: the last tile of each head group combines it) bitwise the same on the device,
    over two steps of one executor (its arrival counters carry over)."""
    from tilec.cuda import CudaExecutor
    from tilec.options import Options
    from tilec.refexec import ReferenceExecutor

    plan = _attention_plan(b, hq, hkv, sq, s, d, dv, dtype, layout, workers=132, attn_kv_chunk=chunk,
                           fold_combine=False)
    assert [op.kind for op in plan.graph.ops] == ["attention_partial", "attention_combine"]
    folded = _attention_plan(b, hq, hkv, sq, s, d, dv, dtype, layout, workers=132, attn_kv_chunk=chunk)
    assert [op.kind for op in folded.graph.ops] == ["attention_partial"]
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=DEV)
    shape = (lambda dim: (b, s, hkv, dim)) if layout == "bshd" else (lambda dim: (b, hkv, s, dim))
    k, v = torch.randn(*shape(d), dtype=dtype, device=DEV), torch.randn(*shape(dv), dtype=dtype, device=DEV)
    got = _run_plan(plan, CudaExecutor(plan, Options(executor="cuda"), torch.device(DEV)), q, k, v, p)
    assert torch.isfinite(got.float()).all()

    kh, vh = (k.transpose(1, 2), v.transpose(1, 2)) if layout == "bshd" else (k, v)
    g = hq // hkv
    mask = torch.arange(s, device=DEV).view(1, s) < (p + 1 + torch.arange(sq, device=DEV)).view(sq, 1)
    want = F.scaled_dot_product_attention(q.double(), kh.repeat_interleave(g, 1).double(),
                                          vh.repeat_interleave(g, 1).double(), attn_mask=mask, scale=d ** -0.5)
    assert rel(got, want) < (1e-4 if dtype == torch.float32 else 1e-2), rel(got, want)
    ref = _run_plan(plan, ReferenceExecutor(plan), q.cpu(), k.cpu(), v.cpu(), p)
    assert rel(got.cpu(), ref) < (1e-5 if dtype == torch.float32 else 5e-3), rel(got.cpu(), ref)
    ex = CudaExecutor(folded, Options(executor="cuda"), torch.device(DEV))
    for _ in range(2):
        assert torch.equal(_run_plan(folded, ex, q, k, v, p), got)


@pytest.mark.parametrize("case", APPEND_CASES, ids=lambda c: f"sq{c[3]}-d{c[5]}-dv{c[6]}-{str(c[7])[6:]}-chunk{c[8]}")
def test_appended_rows_bitwise(case):
    """The split-KV tiles that write the step's new K / V rows into their staged rows (and the
    cache) as they stage them: several rows a step (Sq 2-3) straddling two splits, D != Dv (96 /
    32, whose 12 16-byte chunks a row take the staging's general loop), fp16 (the lane-group
    P.V), 12 queries a head group (three passes): output and caches bitwise those of the plan with
    a rope and a cache_write op, over positions on both sides of split boundaries."""
    for p, res in append_fold_results(case, "cuda", DEV):
        for n in ("out", "k", "v"):
            assert torch.equal(res[True][n], res[False][n]), f"position {p}: {n} differs"
        assert res[True]["out"].float().isfinite().all()


class Chain(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = torch.nn.Linear(d, 4 * d, bias=False, dtype=torch.bfloat16)
        self.b = torch.nn.Linear(4 * d, d, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.b(F.silu(self.a(x))) + x


def test_cuda_graph_replays_advance_the_epoch():
    """A launch replayed from a CUDA graph must wait on its producers like a direct call: the
    device advances the epoch itself (a host-side epoch frozen into the graph made every
    replay after the first skip its waits)."""
    from tilec.timing import cuda_graph

    mod = Chain(512).to(DEV)
    x = torch.randn(1, 512, dtype=torch.bfloat16, device=DEV)
    prog = compile_module(mod, (x,), options=dict(executor="cuda"))
    tensors, p = prog.bind_args((x,))
    table = prog.plan.bind_base(tensors)
    graph = cuda_graph(lambda: prog.executor.run(tensors, table, position=p, check=False))
    xin = tensors[prog.graph.inputs[0]]  # the buffer the captured launch reads
    ov = prog.graph.outputs[0]
    for _ in range(5):
        xin.copy_(torch.randn_like(xin))
        graph.replay()
        torch.cuda.synchronize()
        got = tensors[ov.buffer].reshape(-1)[ov.offset:ov.offset + 512].view(1, 512)
        with torch.no_grad():
            want = mod(xin.view(1, 512))
        assert rel(got, want) < 2e-2
    prog.executor.check()


class Einsum(torch.nn.Module):
    """out = einsum(eq, a, W): one bmm op (tilec/ops/bmm.py) with W a parameter."""

    def __init__(self, eq, w):
        super().__init__()
        self.eq = eq
        self.w = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, a):
        return torch.einsum(self.eq, a, self.w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eq,b,m,k,n,tile_n", [
    ("bmk,bkn->bmn", 4, 16, 192, 512, 128),  # GLM-5 absorption shape: 16-byte weight loads
    ("bmk,bkn->bmn", 3, 20, 300, 128, 128),  # two row blocks, K not a multiple of anything
    ("bmk,bnk->bmn", 2, 5, 72, 40, 16),      # weight n stride != 1: scalar weight loads
    ("thd,hdc->htc", 3, 7, 24, 36, 8),       # a with strided batch and rows (MLA's q_nope[t, h])
])
def test_bmm(dtype, eq, b, m, k, n, tile_n):
    lhs = eq.split("->")[0].split(",")
    size = dict(b=b, h=b, m=m, t=m, k=k, d=k, n=n, c=n)
    a = torch.randn(*(size[ch] for ch in lhs[0]), dtype=dtype)
    w = torch.randn(*(size[ch] for ch in lhs[1]), dtype=dtype) / k ** 0.5
    prog = check(Einsum(eq, w), (a,), dtype, tile_n=tile_n)
    assert [op.kind for op in prog.graph.ops] == ["bmm"]


def test_refused_launch_leaves_the_program_usable():
    """A launch refused by the co-residency check (far more workers than the GPU holds) after the
    kernel was set up for another shared-memory size must not leave a later launch of the plan
    failing: the launcher caches its set-up only once the checks pass (a reviewer's reproducer)."""
    torch.manual_seed(0)
    m = Lin(2048, 2048, False, torch.bfloat16).to(DEV)
    x = torch.randn(1, 2048, dtype=torch.bfloat16, device=DEV)
    prog = compile_module(m, (x,), options=dict(executor="cuda"))
    want = prog(x)
    ex = prog.executor
    if not ex.plan.ring_stages:
        pytest.skip("the plan streams no weights (no ring depth to change)")
    depth = ex.ring_stages
    ex.use_ring_stages(3 if depth == 2 else 2)
    with pytest.raises(TilecError, match="cannot be co-resident"):
        ex.run({}, ex._last_table, queues=ex.queues.repeat(200, 1, 1))
    ex.use_ring_stages(depth)
    assert torch.equal(prog(x), want)
    assert torch.equal(prog(x), want)


class _IntCopies(torch.nn.Module):
    def forward(self, ids32, ids64, one, pos, hist):
        hist.index_copy_(1, pos, ids64[:, :1])
        return (ids32.long(), ids64.t().contiguous(), ids32.t().contiguous().to(torch.int64),
                torch.cat([ids64, ids32.long()], 1), one.long())


def test_integer_copies_are_exact():
    """Copies, integer casts, concats and cache writes went through float32 (map1, for_out_box):
    values past 2**24 came out rounded. Integers now move as integers (move_integers), a 0-d one
    too (written without a GPU)."""
    big = torch.tensor([16777217, 33554433, 1000000001, -7, 2**40 + 3, -(2**35) - 1])
    ids64 = big.view(2, 3).to(DEV)
    ids32 = torch.tensor([16777217, 33554433, 1000000001, -7, 5, 2**31 - 1], dtype=torch.int32).view(2, 3).to(DEV)
    one = torch.tensor(2**31 - 2, dtype=torch.int32, device=DEV)
    hist = torch.zeros(2, 8, dtype=torch.int64, device=DEV)
    m = _IntCopies()
    prog = compile_module(m, (ids32, ids64, one, torch.tensor([3], device=DEV), hist.clone()), positions=[3],
                          max_positions=8, options=dict(executor="cuda", workers=4))
    assert {"copy", "concat", "cache_write"} <= {op.kind for op in prog.graph.ops}
    mine, want_hist = hist.clone(), hist.clone()
    got = prog(ids32, ids64, one, torch.tensor([5], device=DEV), mine)
    want = m(ids32, ids64, one, torch.tensor([5], device=DEV), want_hist)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert torch.equal(mine, want_hist)
