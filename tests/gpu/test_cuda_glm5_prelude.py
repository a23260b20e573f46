"""The GLM-5 DSA prelude (examples/glm5_dsa_prelude.py) on the CUDA executor against the
example's oracle (computed on the CPU): the device tile ops of runtime/tilec/ops_glm.cuh
(fp8_quant, fp8_linear, bmm, paged_cache_write, index_score).

Tolerances: 1e-4 relative L2 in float32 (bf16 structure), 2e-2 in bf16 and FP8 (issue 5's
acceptance); the FP8 scores' top-2048 positions (top-KV/8 on the reduced configuration)
overlap the FP8 oracle's by >= 99 %. The full-size cases are the acceptance runs (slow).
"""
import copy
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tilec.api import compile_module
from tilec.errors import TilecError

DEV = "cuda"
_PATH = Path(__file__).resolve().parents[2] / "examples" / "glm5_dsa_prelude.py"
_spec = importlib.util.spec_from_file_location("glm5_dsa_prelude", _PATH)
glm = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("glm5_dsa_prelude", glm)
_spec.loader.exec_module(glm)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)), "-inf entries differ"
    return float((a[fin] - b[fin]).norm() / b[fin].norm())


def overlap(a, b, k):
    ia, ib = a.float().cpu().topk(k, -1).indices, b.float().cpu().topk(k, -1).indices
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(ia, ib)) / (k * a.shape[0])


CASES = [
    ("reduced", False, torch.float32, 1e-4),
    ("reduced", False, torch.bfloat16, 2e-2),
    ("reduced", True, torch.float32, 1e-3),
    ("reduced", True, torch.bfloat16, 2e-2),
    pytest.param("full", False, torch.bfloat16, 2e-2, marks=pytest.mark.slow),
    pytest.param("full", True, torch.bfloat16, 2e-2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("size,fp8,dtype,tol", CASES)
def test_prelude_matches_oracle(size, fp8, dtype, tol):
    cfg = glm.FULL if size == "full" else glm.REDUCED
    mod = glm.make_prelude(cfg, fp8, dtype)
    inputs = glm.make_inputs(cfg, fp8, dtype, lengths=None if size == "full" else (cfg.context, 100))
    want = glm.oracle(mod, *inputs)  # on the CPU, before the step updates the caches
    mod_d = copy.deepcopy(mod).to(DEV)
    inputs_d = tuple(t.to(DEV) for t in inputs)
    prog = compile_module(mod_d, inputs_d, options=dict(executor="cuda", workers=132 if size == "full" else 16))
    assert prog.executor_kind == "cuda"
    for _ in range(2):  # the second step rewrites the same slots: idempotent
        got = tuple(prog(*inputs_d)) + tuple(inputs_d[5:])
    names = ["residual", "q_mla", "scores", "kv_cache", "index_k_cache", "index_k_scale_cache"]
    errs = {n: rel(g, w) for n, g, w in zip(names, got, want)}
    assert all(e <= tol for e in errs.values()), errs
    if fp8:
        k = min(2048, cfg.context // 8)
        assert overlap(got[2], want[2], k) >= 0.99


# ---- the tensor-core paths of the GLM ops at several shapes (runtime/tilec/ops_glm.cuh) ----

class Fp8Gemm(torch.nn.Module):
    """act_quant then a block-scaled FP8 GEMM, as the prelude's FP8 linears (groups / blocks of g)."""

    def __init__(self, k, n, g=128, pow2=False):
        super().__init__()
        self.g, self.pow2 = g, pow2
        self.lin = glm.Linear(k, n, fp8=True, block=g)
        self.lin.set_weight(torch.randn(n, k) * 0.05)

    def forward(self, x):
        return self.lin(glm.act_quant(x, self.g, self.pow2), out_dtype=x.dtype)


@pytest.mark.parametrize("fuse,stream", [(False, True), (True, True), (True, False)],
                         ids=["unfused", "fused-ring", "fused-loads"])
@pytest.mark.parametrize("m,k,n,tile_n,g", [(1, 512, 200, None, 128), (16, 2048, 136, None, 128),
                                             (40, 1024, 72, None, 128), (16, 6144, 24, None, 128),
                                             (9, 1536, 300, 48, 128), (4, 6144, 40, None, 192)])
def test_fp8_gemm_rows_and_ragged_columns(m, k, n, tile_n, g, fuse, stream):
    """Unfused: fp8_linear_mma_ksplit (<= 16 rows: K blocks over the warps, an uneven share with 12
    blocks, tiles across a weight-scale block with tile_n 48) and fp8_linear_mma (40 rows: passes of
    16). Fused (<= 16 rows, fp8_linear_quant): the quantization in the tile's staging, then the ring
    consumer on FP8 tensor cores (K 6144: a 4096-byte and a 2048-byte item per column group) or,
    without the ring, the K-split path. Column groups of 8 past N; against eager (whose output is
    rounded to bf16 as well: 5e-3 is a few bf16 roundings). K 6144 in groups of 192 does not stream
    (a group would straddle two 4096-byte stream items): the fused tile loads its weights itself."""
    mod = Fp8Gemm(k, n, g).to(DEV)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
    prog = compile_module(mod, (x,), options=dict(executor="cuda", tile_n=tile_n, fuse_fp8_quant=fuse,
                                                  fp8_stream=stream))
    kinds = {op.kind for op in prog.graph.ops}
    assert ("fp8_linear_quant" if fuse and m <= 16 else "fp8_linear") in kinds
    with torch.no_grad():
        want = mod(x)
    assert rel(prog(x), want) < 5e-3


@pytest.mark.parametrize("m,k,n,tile_n,g,pow2", [(1, 128, 1, None, 128, False), (5, 2176, 9, None, 128, False),
                                                  (16, 4224, 130, None, 128, True), (3, 768, 40, 12, 192, False),
                                                  (16, 6144, 24, None, 64, False)])
def test_fp8_gemm_fused_quantization_is_bitwise_the_unfused_one(m, k, n, tile_n, g, pow2):
    """The fused tile's quantization (stage_quant_rows: x * RN(1/s) with a correction, two-value
    casts) gives op_fp8_quant's bytes: with the weights loaded by the tile (fp8_stream off) the
    fused and unfused GEMMs run the same K-split product on them, so the outputs are bitwise equal
    on random inputs (rows, K, N, groups and pow2 scales not GLM-5's)."""
    torch.manual_seed(0)
    mod = Fp8Gemm(k, n, g, pow2).to(DEV)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV) * 3
    outs = []
    for fuse in (True, False):
        prog = compile_module(mod, (x,), options=dict(executor="cuda", tile_n=tile_n, fuse_fp8_quant=fuse,
                                                      fp8_stream=False))
        assert ("fp8_linear_quant" if fuse else "fp8_linear") in {op.kind for op in prog.graph.ops}
        outs.append(prog(x))
    assert torch.equal(outs[0], outs[1])


act_quant_recip = functools.partial(glm.act_quant, recip=True)  # the scale written amax * (1 / 448)


class RecipQuant(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g

    def forward(self, x):
        return tuple(t.float() for t in act_quant_recip(x, self.g))


class RecipGemm(Fp8Gemm):
    def forward(self, x):
        return self.lin(act_quant_recip(x, self.g), out_dtype=x.dtype)


@pytest.mark.parametrize("g", [128, 64])
def test_fp8_scales_written_as_a_product_with_the_reciprocal(g):
    """``amax * (1 / 448)`` (fp8_scale's recip): op_fp8_quant (its 128-group vector path, and a
    warp a group) gives eager's values and scales bitwise (eager on the CPU: CUDA's ``/ 448`` would
    itself multiply by the reciprocal), and the fused GEMM's staging (stage_quant_rows, both paths)
    the unfused GEMM's outputs bitwise, on random inputs."""
    torch.manual_seed(0)
    x = (torch.randn(16, 1024) * 3).to(torch.bfloat16)
    want = RecipQuant(g)(x)
    assert not torch.equal(want[1], glm.act_quant(x, g)[1])  # the two forms differ on these inputs
    xd = x.to(DEV)
    prog = compile_module(RecipQuant(g), (xd,), options=dict(executor="cuda", workers=16))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(prog(xd), want))
    mod = RecipGemm(1024, 40, g).to(DEV)
    outs = [compile_module(mod, (xd,), options=dict(executor="cuda", fuse_fp8_quant=fuse, fp8_stream=False))(xd)
            for fuse in (True, False)]
    assert torch.equal(outs[0], outs[1])


class DivQuant(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g

    def forward(self, x):
        return glm.act_quant(x, self.g)


@pytest.mark.parametrize("g", [128, 64])
def test_fp8_scales_written_as_a_division_are_cuda_eagers_bitwise(g):
    """``amax / 448.`` on CUDA: eager multiplies by the float reciprocal (a Python number's divisor, ATen's
    div_true_kernel_cuda), and op_fp8_quant divided exactly - about half the scales one ulp off CUDA eager's.
    Both forms are the product on CUDA now: values and scales bitwise CUDA eager's, which differ from the CPU's
    quotient on these inputs."""
    torch.manual_seed(0)
    x = (torch.randn(16, 1024) * 3).to(torch.bfloat16)
    xd = x.to(DEV)
    prog = compile_module(DivQuant(g), (xd,), options=dict(executor="cuda", workers=16))
    want = DivQuant(g)(xd)
    assert all(torch.equal(a, b) for a, b in zip(prog(xd), want))
    assert not torch.equal(want[1].cpu(), DivQuant(g)(x)[1])  # CUDA's rounding is not the CPU's here


class Score(torch.nn.Module):
    def forward(self, q, w, k_cache, block_tables, positions):
        return glm.paged_index_score(q, w, k_cache, block_tables, positions, scale=q.shape[-1] ** -0.5)


@pytest.mark.parametrize("heads,dim,dtype", [(32, 128, torch.bfloat16), (16, 64, torch.bfloat16),
                                             (8, 64, torch.bfloat16), (32, 128, torch.float8_e4m3fn)])
def test_index_score_tensor_cores_and_fallback(heads, dim, dtype):
    """index_score_mma (H % 16 == 0, D % 32 == 0) and the scalar fallback (H = 8), bf16 and FP8
    queries and keys, two requests of 8 tokens over 4 shuffled pages of 64 positions."""
    r_, t_, page, pages = 2, 8, 64, 4
    q = (torch.randn(r_, t_, heads, dim) * 0.5).to(dtype)
    w = torch.randn(r_, t_, heads)
    k_cache = (torch.randn(r_ * pages + 1, page, dim) * 0.5).to(dtype)
    block_tables = torch.randperm(r_ * pages + 1)[:r_ * pages].view(r_, pages)
    positions = torch.tensor([[page * pages - t_ + i for i in range(t_)], [100 + i for i in range(t_)]])
    args = tuple(a.to(DEV) for a in (q, w, k_cache, block_tables, positions))
    prog = compile_module(Score(), args, options=dict(executor="cuda"))
    assert any(op.kind == "index_score" for op in prog.graph.ops)
    want = Score()(*args)
    got = prog(*args)
    assert rel(got, want) < 1e-2


def _score_inputs(heads):
    """Two requests of 8 tokens over 4 shuffled pages of 64 positions (bf16, D = 64)."""
    torch.manual_seed(0)
    r_, t_, page, pages = 2, 8, 64, 4
    q = (torch.randn(r_, t_, heads, 64) * 0.5).to(torch.bfloat16)
    w = torch.randn(r_, t_, heads)
    k_cache = (torch.randn(r_ * pages + 1, page, 64) * 0.5).to(torch.bfloat16)
    block_tables = torch.randperm(r_ * pages + 1)[:r_ * pages].view(r_, pages)
    positions = torch.tensor([[page * pages - t_ + i for i in range(t_)], [100 + i for i in range(t_)]])
    return [a.to(DEV) for a in (q, w, k_cache, block_tables, positions)]


@pytest.mark.parametrize("heads", [16, 8])  # the tensor-core path and the scalar one
def test_negative_page_ids_count_from_the_end_as_torch_does(heads):
    """A negative block-table page id read a page before the key cache; torch indexing (eager,
    the reference) counts it from the end, and so does the device now (written without a GPU)."""
    args = _score_inputs(heads)
    args[3][0, 1] -= args[2].shape[0]  # the same page, as a negative id
    args[3][1, 0] = -1
    prog = compile_module(Score(), tuple(args), options=dict(executor="cuda"))
    assert rel(prog(*args), Score()(*args)) < 1e-2


@pytest.mark.parametrize("heads", [16, 8])
@pytest.mark.parametrize("bad", [9, -10, 1 << 40])
def test_a_page_id_outside_the_key_cache_is_reported(heads, bad):
    """A page id outside [-pages, pages) read the key cache out of bounds, silently: the device
    reads page 0 instead and records it, the host raises naming the op, and the next call with a
    good table is right (written without a GPU)."""
    args = _score_inputs(heads)
    prog = compile_module(Score(), tuple(args), options=dict(executor="cuda"))
    wrong = args[3].clone()
    wrong[1, 1] = bad  # request 1's positions 64..127: read (its tokens are at 100..107)
    with pytest.raises(TilecError, match=rf"op index_score.* failed: index {bad} read at run time is outside "
                                         rf"\[-9, 9\)"):
        prog(args[0], args[1], args[2], wrong, args[4])
    assert rel(prog(*args), Score()(*args)) < 1e-2


class _SlotWrite(torch.nn.Module):
    def forward(self, src, slot, cache):
        cache.view(-1, cache.shape[-1]).index_copy_(0, slot, src)
        return src * 2.0


@pytest.mark.parametrize("bad", [24, -25, 1 << 40])
def test_a_slot_outside_the_cache_fails_the_step_and_writes_nothing_there(bad):
    """A slot outside [-rows, rows) wrapped around into the cache (or, below -rows, wrote before
    it): the device skips it and records it, and the host raises naming the op; the next call with
    good slots runs (written without a GPU)."""
    torch.manual_seed(0)
    src = torch.randn(3, 64, device=DEV, dtype=torch.bfloat16)
    cache = torch.randn(6, 4, 64, device=DEV, dtype=torch.bfloat16)
    good = torch.tensor([5, 0, 17], device=DEV)
    prog = compile_module(_SlotWrite(), (src, good, cache.clone()), options=dict(workers=4))
    assert any(op.kind == "paged_cache_write" for op in prog.plan.graph.ops)
    guard = torch.randn(6 * 4 * 64 + 2 * 4096, device=DEV, dtype=torch.bfloat16)  # the cache with room around it
    mine = guard[4096:4096 + 6 * 4 * 64].view(6, 4, 64)
    mine.copy_(cache)
    before = guard.clone()
    with pytest.raises(TilecError, match=rf"op paged_cache_write.* failed: index {bad} read at run time is outside "
                                         rf"\[-24, 24\)"):
        prog(src, torch.tensor([5, bad, 17], device=DEV), mine)
    changed = (guard != before).reshape(-1).nonzero().reshape(-1)
    assert changed.numel() == 0 or bool(((changed >= 4096) & (changed < 4096 + 6 * 4 * 64)).all()), \
        "a write outside the cache"
    want = cache.clone()
    _SlotWrite()(src, good, want)
    got = cache.clone()
    prog(src, good, got)
    assert torch.equal(got, want)
