"""The GLM-5 DSA attention prelude of one decode step (issue 5; the seed's workload).

From the residual add of a GLM-5 decoder layer to the paged indexer scores, before TopK and
sparse MLA, for M = R x T tokens (2 requests x 8 new tokens) over paged caches:

1. ``residual <- residual + hidden_in``; ``x <- RMSNorm(residual)``
2. three independent branches of x:
   QKV-A ``x W_qkv_a^T`` (q_lora_rank + kv_lora_rank + rope columns; ``[W_q_a; W_kv_a]`` fused);
   head gate ``w <- (x W_weights_proj^T) * n_index_heads^-1/2``;
   indexer K ``k <- LayerNorm(x W_k^T)``, RoPE on its first ``rope`` dims, written into the
   paged indexer key cache at the token's slot
3. ``q_resid <- RMSNorm(QKV-A[:q_lora_rank])``, then
   main path ``q <- q_resid W_q_b^T`` (heads x (nope + rope)), RoPE on the rope part, the nope
   part absorbed through W_UK (the key half of ``kv_b_proj``, per head nope -> kv_lora_rank):
   ``q_mla <- [q_latent, q_rope]`` ``[M, heads, kv_lora_rank + rope]``;
   indexer Q ``qi <- q_resid W_iq_b^T`` (index heads x index_head_dim), RoPE on the first dims
4. kv path: ``[RMSNorm(QKV-A[q_lora:q_lora+kv_lora]), RoPE(QKV-A[-rope:])]`` written into the
   paged latent cache at the token's slot
5. ``score[t, s] = sum_h w[t,h] ReLU(qi[t,h] . k[s]) index_head_dim^-1/2`` over the cached
   positions s of the token's request (through its block table), -inf for s > position(t).

Outputs ``(residual [M, hidden], q_mla [M, heads, kv_lora_rank + rope], scores [M, context])``;
both caches are updated in place. RoPE is the interleaved form of ``transformers``'
``apply_rotary_pos_emb_interleave`` (DeepSeek-V3 / GLM), with cos/sin computed from each
token's position as ``GlmMoeDsaRotaryEmbedding`` does.

FP8 variant (``fp8=True``, DeepSeek-V3 / V3.2's recipe): GEMM weights are float8_e4m3fn with
one float32 scale per 128 x 128 block (``weight_scale_inv``; the head-gate projection stays in
the activation dtype); GEMM activations are quantized per token in groups of 128 with
``scale = amax / 448`` (``pow2_scales``: rounded up to a power of two); the absorption reads
``kv_b_proj``'s FP8 blocks dequantized; indexer keys are stored in FP8 with one scale per
position (a second cache), indexer queries in FP8 with one scale per (token, head), and the
query scales and ``index_head_dim^-1/2`` are folded into the head weights, the key scale into
the score (as DeepSeek-V3.2's ``fp8_index`` does). The module expresses FP8 GEMMs as
dequantize-then-matmul in plain torch (bit-for-bit what an FP8 GEMM with float32 accumulation
computes, up to summation order); tilec recognizes these patterns and runs FP8 tiles.

Parameters carry the names and shapes of ``transformers``' ``GlmMoeDsaAttention`` and
``GlmMoeDsaIndexer`` (``q_a_proj`` and ``kv_a_proj_with_mqa`` fused as ``qkv_a_proj``, as
SGLang's ``fused_qkv_a_proj_with_mqa``; see :func:`load_from_hf`), plus the decoder layer's
``input_layernorm``.

:func:`oracle` computes the same prelude in plain torch, written independently (loops over
requests, tokens, heads and K blocks; slots derived from the block tables, not from the slot
mapping). ``python examples/glm5_dsa_prelude.py`` compiles the reduced configuration with tilec
and checks it against the oracle on the CPU reference executor.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_MIN = 1e-4  # amax floor of a quantization group (DeepSeek-V3's act_quant)


@dataclass(frozen=True)
class PreludeConfig:
    """Sizes of the prelude; the defaults are GLM-5's (``GlmMoeDsaConfig``) and the seed's workload."""

    hidden_size: int = 6144
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256  # only for kv_b_proj's shape (the value half is not used here)
    num_heads: int = 64
    index_n_heads: int = 32
    index_head_dim: int = 128
    rms_norm_eps: float = 1e-5
    index_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    requests: int = 2
    tokens_per_request: int = 8  # new tokens per request: the last ones of its context
    context: int = 8192  # cached positions per request (KV)
    page_size: int = 64
    spare_pages: int = 3  # pages owned by no request (the block tables are a permutation)
    fp8_block: int = 128

    @property
    def tokens(self) -> int:
        return self.requests * self.tokens_per_request

    @property
    def pages_per_request(self) -> int:
        return self.context // self.page_size

    @property
    def num_pages(self) -> int:
        return self.requests * self.pages_per_request + self.spare_pages

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


FULL = PreludeConfig()
REDUCED = PreludeConfig(hidden_size=256, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32, num_heads=4, index_n_heads=4, index_head_dim=32,
                        context=256)


# ---- building blocks (plain torch: what tilec's frontend recognizes) -------------------------

class RMSNorm(nn.Module):
    """``GlmMoeDsaRMSNorm``: float32 statistics, rounded to the input dtype, times the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    """``transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.apply_rotary_pos_emb_interleave``
    (a verbatim copy, so the example runs without transformers; a test checks they agree)."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def rope_interleave(x, cos, sin, unsqueeze_dim=1):
    """One half of :func:`apply_rotary_pos_emb_interleave` (its query's), for a lone tensor."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def act_quant(x: torch.Tensor, group: int = 128, pow2: bool = False, *, recip: bool = False):
    """Per-group FP8 quantization of the last dim: ``(q float8_e4m3fn [..., K], scale float32 [..., K/group])``
    with ``scale = max(amax, 1e-4) / 448`` (``recip``: ``* (1 / 448)``, as some FP8 recipes write it - another
    float32 value in about half of random groups; rounded up to a power of two with ``pow2``)."""
    xg = x.to(torch.float32).unflatten(-1, (-1, group))
    amax = xg.abs().amax(-1, keepdim=True).clamp(min=SCALE_MIN)
    scale = amax * (1.0 / FP8_MAX) if recip else amax / FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2), scale.squeeze(-1)


def act_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`act_quant` in float32."""
    group = q.shape[-1] // scale.shape[-1]
    return (q.to(torch.float32).unflatten(-1, (-1, group)) * scale.unsqueeze(-1)).flatten(-2)


def weight_quant(w: torch.Tensor, block: int = 128):
    """Block FP8 quantization of a ``[N, K]`` weight: ``(q float8_e4m3fn [N, K], scale float32 [ceil(N/b), ceil(K/b)])``."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, block, kb, block)
    scale = blocks.abs().amax((1, 3)).clamp(min=SCALE_MIN) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(nb * block, kb * block)
    return q[:n, :k].contiguous(), scale


def weight_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Float32 ``q * scale`` with each scale broadcast over its ``block x block`` block."""
    n, k = q.shape
    nb, kb = scale.shape
    full = scale[:, None, :, None].expand(nb, block, kb, block).reshape(nb * block, kb * block)[:n, :k]
    return q.to(torch.float32) * full


class Linear(nn.Module):
    """A bias-free linear layer, in the activation dtype or (``fp8``) with block-scaled FP8 weights.

    The FP8 form takes the quantized activation ``(q, scale)`` (shared by the GEMMs of one input)
    and returns ``out_dtype``."""

    def __init__(self, in_features: int, out_features: int, fp8: bool = False, block: int = 128):
        super().__init__()
        self.in_features, self.out_features, self.fp8, self.block = in_features, out_features, fp8, block
        if fp8:
            self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8), requires_grad=False)
            self.weight_scale_inv = nn.Parameter(torch.ones(-(-out_features // block), -(-in_features // block)),
                                                 requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def set_weight(self, w: torch.Tensor) -> None:
        """Sets the weight from a high-precision ``[out, in]`` tensor (quantized in the FP8 form)."""
        with torch.no_grad():
            if self.fp8:
                q, s = weight_quant(w, self.block)
                self.weight.data = q.to(self.weight.device)
                self.weight_scale_inv.data = s.to(self.weight.device)
            else:
                self.weight.data = w.to(self.weight.dtype).to(self.weight.device)

    def dequantized(self) -> torch.Tensor:
        return weight_dequant(self.weight, self.weight_scale_inv, self.block) if self.fp8 else self.weight

    def forward(self, x, out_dtype=None):
        if not self.fp8:
            return F.linear(x, self.weight)
        xq, xs = x
        return F.linear(act_dequant(xq, xs), self.dequantized()).to(out_dtype)


def paged_index_score(q, w, k_cache, block_tables, positions, scale=None, k_scale_cache=None):
    """``score[r, t, s] = sum_h w[r,t,h] ReLU(q[r,t,h] . k[s] (* scale)) (* k_scale[s])``, -inf for s > position.

    q [R, T, H, D]; w [R, T, H] float32; k_cache [pages, page, D]; block_tables [R, P];
    positions [R, T]; k_scale_cache [pages, page] (FP8 keys). Returns float32 [R, T, P * page].
    """
    k = k_cache[block_tables].flatten(1, 2)  # [R, KV, D]: each request's pages in order
    logits = torch.matmul(q.float(), k.float().unsqueeze(1).transpose(-1, -2))  # [R, T, H, KV]
    if scale is not None:
        logits = logits * scale
    score = torch.matmul(w.unsqueeze(-2), torch.relu(logits)).squeeze(-2)  # [R, T, KV]
    if k_scale_cache is not None:
        score = score * k_scale_cache[block_tables].flatten(1, 2).unsqueeze(1)
    later = torch.arange(score.shape[-1], device=score.device) > positions.unsqueeze(-1)
    return score.masked_fill(later, float("-inf"))


class Indexer(nn.Module):
    """The parameters of ``GlmMoeDsaIndexer`` (``weights_proj`` is never FP8)."""

    def __init__(self, cfg: PreludeConfig, fp8: bool):
        super().__init__()
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, fp8, cfg.fp8_block)
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim, fp8, cfg.fp8_block)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=cfg.index_norm_eps)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)


class GlmDsaPrelude(nn.Module):
    """The prelude as one module (see the module docstring).

    ``forward(hidden_in [M, hidden], residual [M, hidden], positions [M] int64, block_tables [R, P]
    int64, slot_mapping [M] int64, kv_cache [pages, page, kv_lora + rope], index_k_cache
    [pages, page, index_head_dim] (, index_k_scale_cache [pages, page] float32 when fp8))``
    -> ``(residual, q_mla, scores)``. Tokens are request-major (token ``r * T + i`` is the
    i-th new token of request r); ``slot_mapping[t] = block_tables[r, pos // page] * page + pos % page``.
    The caches are updated in place at the slots.
    """

    def __init__(self, cfg: PreludeConfig = FULL, fp8: bool = False, pow2_scales: bool = False):
        super().__init__()
        self.cfg, self.fp8, self.pow2_scales = cfg, fp8, pow2_scales
        c = cfg
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv_a_proj = Linear(c.hidden_size, c.q_lora_rank + c.latent_dim, fp8, c.fp8_block)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = Linear(c.q_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), fp8,
                               c.fp8_block)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), fp8, c.fp8_block)
        self.indexer = Indexer(c, fp8)
        dim = c.qk_rope_head_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def linears(self) -> dict[str, Linear]:
        return {"qkv_a_proj": self.qkv_a_proj, "q_b_proj": self.q_b_proj, "kv_b_proj": self.kv_b_proj,
                "indexer.wq_b": self.indexer.wq_b, "indexer.wk": self.indexer.wk}

    def w_uk(self, dtype) -> torch.Tensor:
        """W_UK [heads, nope, kv_lora]: the key half of kv_b_proj (dequantized in the FP8 form)."""
        c = self.cfg
        w = self.kv_b_proj.dequantized().to(dtype)
        return w.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)[:, :c.qk_nope_head_dim]

    def rotary(self, positions, dtype):
        """``GlmMoeDsaRotaryEmbedding``: ``cos, sin`` of ``cat(freqs, freqs)``, [M, rope]."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def quant(self, x):
        return act_quant(x, self.cfg.fp8_block, self.pow2_scales)

    # The stages of forward, as methods so that benchmarks/glm5_prelude.py can run the three
    # independent branches on separate CUDA streams with the very same code.
    def stem(self, hidden_in, residual, positions):
        """Residual add, RMSNorm, RoPE angles: ``(residual, x, x for the GEMMs, cos, sin)``."""
        residual = residual + hidden_in
        x = self.input_layernorm(residual)
        cos, sin = self.rotary(positions, hidden_in.dtype)
        return residual, x, self.quant(x) if self.fp8 else x, cos, sin

    def head_gate(self, x):
        """Branch 2: the indexer's per-head weights ``[M, IH]`` (float32)."""
        return self.indexer.weights_proj(x).float() * self.cfg.index_n_heads ** -0.5

    def index_key(self, xa, cos, sin, slot_mapping, index_k_cache, index_k_scale_cache, dtype):
        """Branch 3: the indexer key, normalized and roped, written into the paged key cache."""
        c, r = self.cfg, self.cfg.qk_rope_head_dim
        k = self.indexer.k_norm(self.indexer.wk(xa, dtype))
        k = torch.cat([rope_interleave(k[:, None, :r], cos, sin)[:, 0], k[:, r:]], dim=-1)
        if self.fp8:
            kq, ks = act_quant(k, c.index_head_dim, self.pow2_scales)
            index_k_cache.view(-1, c.index_head_dim)[slot_mapping] = kq
            index_k_scale_cache.view(-1)[slot_mapping] = ks.view(-1)
        else:
            index_k_cache.view(-1, c.index_head_dim)[slot_mapping] = k

    def queries_and_latent(self, xa, cos, sin, slot_mapping, kv_cache, dtype):
        """Branch 1 and what follows it: QKV-A; q_resid; the MLA query ``q_mla`` and the indexer
        query ``qi`` (FP8: ``(values, scales)``); the latent written into the paged latent cache."""
        c, m = self.cfg, xa[0].shape[0] if self.fp8 else xa.shape[0]
        r, nope = c.qk_rope_head_dim, c.qk_nope_head_dim
        qkv = self.qkv_a_proj(xa, dtype)
        q_a, kv_a, k_pe = torch.split(qkv, [c.q_lora_rank, c.kv_lora_rank, r], dim=-1)
        q_resid = self.q_a_layernorm(q_a)
        qa = self.quant(q_resid) if self.fp8 else q_resid
        q = self.q_b_proj(qa, dtype).view(m, c.num_heads, nope + r)
        q_nope, q_pe = torch.split(q, [nope, r], dim=-1)
        q_pe, k_pe = apply_rotary_pos_emb_interleave(q_pe, k_pe.view(m, 1, r), cos, sin)
        q_latent = torch.einsum("thd,hdc->thc", q_nope, self.w_uk(dtype))  # absorbed through W_UK
        q_mla = torch.cat([q_latent, q_pe], dim=-1)
        qi = self.indexer.wq_b(qa, dtype).view(m, c.index_n_heads, c.index_head_dim)
        qi = torch.cat([rope_interleave(qi[..., :r], cos, sin), qi[..., r:]], dim=-1)
        if self.fp8:
            qi = act_quant(qi, c.index_head_dim, self.pow2_scales)  # [M, IH, D], [M, IH, 1]
        latent = torch.cat([self.kv_a_layernorm(kv_a), k_pe[:, 0]], dim=-1)
        kv_cache.view(-1, c.latent_dim)[slot_mapping] = latent
        return q_mla, qi

    def scores(self, qi, w, positions, block_tables, index_k_cache, index_k_scale_cache):
        """The paged indexer scores ``[M, KV]`` (after the key cache write)."""
        c = self.cfg
        rt = (c.requests, c.tokens_per_request)
        if self.fp8:  # query scales and index_head_dim^-1/2 folded into the head weights
            qq, qs = qi
            wf = w * qs[..., 0] * c.index_head_dim ** -0.5
            score = paged_index_score(qq.view(*rt, c.index_n_heads, c.index_head_dim), wf.view(*rt, -1),
                                      index_k_cache, block_tables, positions.view(rt), None, index_k_scale_cache)
        else:
            score = paged_index_score(qi.view(*rt, c.index_n_heads, c.index_head_dim), w.view(*rt, -1),
                                      index_k_cache, block_tables, positions.view(rt), c.index_head_dim ** -0.5)
        return score.view(c.tokens, -1)

    def forward(self, hidden_in, residual, positions, block_tables, slot_mapping, kv_cache, index_k_cache,
                index_k_scale_cache=None):
        dtype = hidden_in.dtype
        residual, x, xa, cos, sin = self.stem(hidden_in, residual, positions)
        w = self.head_gate(x)
        self.index_key(xa, cos, sin, slot_mapping, index_k_cache, index_k_scale_cache, dtype)
        q_mla, qi = self.queries_and_latent(xa, cos, sin, slot_mapping, kv_cache, dtype)
        score = self.scores(qi, w, positions, block_tables, index_k_cache, index_k_scale_cache)
        return residual, q_mla, score


# ---- weights and inputs ------------------------------------------------------------------------

def make_prelude(cfg: PreludeConfig = REDUCED, fp8: bool = False, dtype=torch.float32, device="cpu",
                 pow2_scales: bool = False, seed: int = 0) -> GlmDsaPrelude:
    """A prelude with random weights (the same high-precision weights for fp8 and not, per seed);
    the norms' weights are near 1, projections scaled by 1/sqrt(fan-in)."""
    gen = torch.Generator().manual_seed(seed)
    mod = GlmDsaPrelude(cfg, fp8, pow2_scales)
    with torch.no_grad():
        for name, lin in mod.linears().items():
            lin.set_weight(torch.randn(lin.out_features, lin.in_features, generator=gen) / math.sqrt(lin.in_features))
        for norm in (mod.input_layernorm, mod.q_a_layernorm, mod.kv_a_layernorm):
            norm.weight.copy_(1.0 + 0.1 * torch.randn(norm.weight.shape, generator=gen))
        mod.indexer.k_norm.weight.copy_(1.0 + 0.1 * torch.randn(cfg.index_head_dim, generator=gen))
        mod.indexer.k_norm.bias.copy_(0.1 * torch.randn(cfg.index_head_dim, generator=gen))
        mod.indexer.weights_proj.weight.copy_(torch.randn(cfg.index_n_heads, cfg.hidden_size, generator=gen)
                                              / math.sqrt(cfg.hidden_size))
    for p in mod.parameters():  # FP8 weights and their scales keep their dtypes
        if p.dtype == torch.float32 and not (fp8 and p.dim() == 2 and p is not mod.indexer.weights_proj.weight):
            p.data = p.data.to(dtype)
    return mod.to(device).eval()


def make_inputs(cfg: PreludeConfig = REDUCED, fp8: bool = False, dtype=torch.float32, device="cpu", seed: int = 1,
                lengths=None):
    """``(hidden_in, residual, positions, block_tables, slot_mapping, kv_cache, index_k_cache
    [, index_k_scale_cache])``: each request's new tokens are the last ``tokens_per_request``
    positions of its context (``lengths[r]`` positions; default ``cfg.context``, the planned
    maximum: scores of later positions are -inf); the block tables are a random permutation
    of the pages; the caches hold random earlier entries (FP8 keys quantized with their
    per-position scales)."""
    gen = torch.Generator().manual_seed(seed)
    c = cfg
    m = c.tokens
    lengths = [c.context] * c.requests if lengths is None else list(lengths)
    if len(lengths) != c.requests or not all(c.tokens_per_request <= n <= c.context for n in lengths):
        raise ValueError(f"lengths {lengths}: need {c.requests} values in [{c.tokens_per_request}, {c.context}]")
    hidden_in = torch.randn(m, c.hidden_size, generator=gen)
    residual = torch.randn(m, c.hidden_size, generator=gen)
    positions = torch.cat([torch.arange(n - c.tokens_per_request, n) for n in lengths])
    perm = torch.randperm(c.num_pages, generator=gen)
    block_tables = perm[:c.requests * c.pages_per_request].view(c.requests, c.pages_per_request)
    req = torch.arange(c.requests).repeat_interleave(c.tokens_per_request)
    slot_mapping = block_tables[req, positions // c.page_size] * c.page_size + positions % c.page_size
    kv_cache = torch.randn(c.num_pages, c.page_size, c.latent_dim, generator=gen)
    keys = torch.randn(c.num_pages, c.page_size, c.index_head_dim, generator=gen)
    args = [hidden_in.to(dtype), residual.to(dtype), positions, block_tables, slot_mapping, kv_cache.to(dtype)]
    if fp8:
        kq, ks = act_quant(keys, c.index_head_dim)
        args += [kq, ks.view(c.num_pages, c.page_size)]
    else:
        args.append(keys.to(dtype))
    return tuple(a.to(device) for a in args)


def load_from_hf(prelude: GlmDsaPrelude, attn, input_layernorm=None) -> None:
    """Copies the weights of a ``transformers`` ``GlmMoeDsaAttention`` (non-FP8 prelude): ``q_a_proj``
    and ``kv_a_proj_with_mqa`` are fused into ``qkv_a_proj``, the rest map by name."""
    with torch.no_grad():
        prelude.qkv_a_proj.set_weight(torch.cat([attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight]))
        for name in ("q_a_layernorm", "kv_a_layernorm", "q_b_proj", "kv_b_proj"):
            getattr(prelude, name).weight.copy_(getattr(attn, name).weight)
        for name in ("wq_b", "wk", "k_norm", "weights_proj"):
            getattr(prelude.indexer, name).load_state_dict(getattr(attn.indexer, name).state_dict())
        if input_layernorm is not None:
            prelude.input_layernorm.weight.copy_(input_layernorm.weight)


# ---- the oracle -------------------------------------------------------------------------------

@torch.no_grad()
def oracle(mod: GlmDsaPrelude, hidden_in, residual, positions, block_tables, slot_mapping, kv_cache, index_k_cache,
           index_k_scale_cache=None):
    """The prelude in plain torch, written independently of :class:`GlmDsaPrelude`'s forward.

    Computes in float32 and rounds to the activation dtype where the module's tensors are
    stored in it; FP8 GEMMs accumulate each 128-wide K block in float32 and then scale it (as
    DeepGEMM does); scores loop over requests, tokens and the pages of the block table; the
    cache slots come from the block tables and positions (``slot_mapping`` is not read).
    Returns ``(residual, q_mla, scores, kv_cache, index_k_cache[, index_k_scale_cache])``: new
    tensors, the inputs are left untouched.
    """
    c, fp8, pow2 = mod.cfg, mod.fp8, mod.pow2_scales
    dt = hidden_in.dtype
    f32 = torch.float32
    rd = lambda t: t.to(dt).to(f32)  # noqa: E731  (round to the activation dtype)
    m, r, nope, blk = c.tokens, c.qk_rope_head_dim, c.qk_nope_head_dim, c.fp8_block
    kv_cache, index_k_cache = kv_cache.clone(), index_k_cache.clone()
    index_k_scale_cache = None if index_k_scale_cache is None else index_k_scale_cache.clone()

    def rms(v, weight, eps):
        return rd(weight.to(f32) * rd(v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)))

    def quant(v, group):  # -> (fp8 values as float32, scales [.., K/group])
        out, scales = torch.empty_like(v), []
        for g0 in range(0, v.shape[-1], group):
            part = v[..., g0:g0 + group]
            s = torch.maximum(part.abs().amax(-1), torch.tensor(SCALE_MIN)) / FP8_MAX
            if pow2:
                s = 2.0 ** torch.ceil(torch.log2(s))
            out[..., g0:g0 + group] = torch.clamp(part / s[..., None], -FP8_MAX, FP8_MAX).to(FP8).to(f32)
            scales.append(s)
        return out, torch.stack(scales, -1)

    def gemm(v, lin):  # v [M, K] float32 (already rounded) -> [M, N] float32 rounded to dt
        if not lin.fp8:
            return rd(v @ lin.weight.to(f32).t())
        vq, vs = quant(v, blk)
        wq, ws = lin.weight.to(f32), lin.weight_scale_inv
        out = torch.zeros(v.shape[0], wq.shape[0])
        for kb in range(wq.shape[1] // blk):
            ks = slice(kb * blk, (kb + 1) * blk)
            part = vq[:, ks] @ wq[:, ks].t()
            out += part * vs[:, kb:kb + 1] * ws[torch.arange(wq.shape[0]) // blk, kb][None, :]
        return rd(out)

    def rope(v, ang):  # v [..., r] in interleaved pairs; ang [r/2]: pairs rotated, evens first then odds
        z = torch.complex(v[..., 0::2], v[..., 1::2]) * torch.polar(torch.ones_like(ang), ang)
        return torch.cat([z.real, z.imag], -1)

    res = rd(residual.to(f32) + hidden_in.to(f32))
    x = rms(res, mod.input_layernorm.weight, c.rms_norm_eps)
    ang = positions.to(f32)[:, None] * mod.inv_freq.to(f32)[None, :]  # [M, r/2]

    def rot(v, t):  # RoPE of token t on v [..., r] (interleaved pairs): rotated evens first, then odds
        if dt == f32:
            z = torch.complex(v[..., 0::2], v[..., 1::2]) * torch.polar(torch.ones_like(ang[t]), ang[t])
            return torch.cat([z.real, z.imag], -1)
        # lower precision: the module rounds cos/sin and each product to the activation dtype
        cos_, sin_ = rd(torch.cos(ang[t])), rd(torch.sin(ang[t]))
        v1, v2 = v[..., 0::2], v[..., 1::2]
        return rd(torch.cat([rd(v1 * cos_) - rd(v2 * sin_), rd(v2 * cos_) + rd(v1 * sin_)], -1))

    qkv = gemm(x, mod.qkv_a_proj)
    q_a, kv_a, k_pe = qkv[:, :c.q_lora_rank], qkv[:, c.q_lora_rank:c.q_lora_rank + c.kv_lora_rank], qkv[:, -r:]
    w = rd(x @ mod.indexer.weights_proj.weight.to(f32).t()) * c.index_n_heads ** -0.5  # [M, IH] float32
    kn = mod.indexer.k_norm
    k = gemm(x, mod.indexer.wk)
    k = rd(F.layer_norm(k, (c.index_head_dim,), kn.weight.to(f32), kn.bias.to(f32), c.index_norm_eps))
    q_resid = rms(q_a, mod.q_a_layernorm.weight, c.rms_norm_eps)
    q = gemm(q_resid, mod.q_b_proj).view(m, c.num_heads, nope + r)
    qi = gemm(q_resid, mod.indexer.wq_b).view(m, c.index_n_heads, c.index_head_dim)
    kv_norm = rms(kv_a, mod.kv_a_layernorm.weight, c.rms_norm_eps)
    # W_UK of head h: rows [h * (nope + v), h * (nope + v) + nope) of kv_b_proj
    kvb = mod.kv_b_proj
    wkvb = kvb.weight.to(f32)
    if kvb.fp8:
        rows, cols = torch.arange(wkvb.shape[0]) // blk, torch.arange(wkvb.shape[1]) // blk
        wkvb = wkvb * kvb.weight_scale_inv[rows][:, cols]
    wkvb = rd(wkvb)
    q_mla = torch.empty(m, c.num_heads, c.latent_dim)
    scores = torch.full((m, c.context), float("-inf"))
    for t in range(m):  # per token: query, caches
        req, pos = t // c.tokens_per_request, int(positions[t])
        page, off = int(block_tables[req, pos // c.page_size]), pos % c.page_size
        for h in range(c.num_heads):
            w_uk = wkvb[h * (nope + c.v_head_dim):h * (nope + c.v_head_dim) + nope]  # [nope, kv_lora]
            q_mla[t, h, :c.kv_lora_rank] = rd(q[t, h, :nope] @ w_uk)
        q_mla[t, :, c.kv_lora_rank:] = rot(q[t, :, nope:], t)
        qi[t, :, :r] = rot(qi[t, :, :r], t)
        kv_cache[page, off] = torch.cat([kv_norm[t], rot(k_pe[t], t)]).to(kv_cache.dtype)
        k_t = torch.cat([rot(k[t, :r], t), k[t, r:]])
        if fp8:
            kq, ks = quant(k_t, c.index_head_dim)
            index_k_cache[page, off] = kq.to(FP8)
            index_k_scale_cache[page, off] = ks[0]
        else:
            index_k_cache[page, off] = k_t.to(index_k_cache.dtype)
    for t in range(m):  # per token: indexer scores over the request's pages (after all cache writes)
        req, pos = t // c.tokens_per_request, int(positions[t])
        keys = torch.cat([index_k_cache[int(p)].to(f32) for p in block_tables[req]])  # [KV, D]
        if fp8:
            qq, qs = quant(qi[t], c.index_head_dim)  # [IH, D], [IH, 1]
            kscale = torch.cat([index_k_scale_cache[int(p)] for p in block_tables[req]])
            head_w = w[t] * qs[:, 0] * c.index_head_dim ** -0.5
            s = (torch.relu(qq @ keys.t()) * head_w[:, None]).sum(0) * kscale
        else:
            s = (torch.relu(qi[t] @ keys.t() * c.index_head_dim ** -0.5) * w[t][:, None]).sum(0)
        scores[t, :pos + 1] = s[:pos + 1]
    out = (res.to(dt), q_mla.to(dt), scores, kv_cache, index_k_cache)
    return out + ((index_k_scale_cache,) if fp8 else ())


# ---- command line: compile the reduced prelude and check it ---------------------------------------

def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tilec.api import compile_module

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--full", action="store_true", help="full GLM-5 sizes (slow on the CPU reference executor)")
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    cfg = FULL if args.full else REDUCED
    mod = make_prelude(cfg, args.fp8)
    inputs = make_inputs(cfg, args.fp8)
    want = oracle(mod, *inputs)
    prog = compile_module(mod, inputs, options=dict(workers=args.workers))
    print(prog.stats)
    got_outs = prog(*inputs)
    got = tuple(got_outs) + tuple(inputs[5:])
    names = ["residual", "q_mla", "scores", "kv_cache", "index_k_cache", "index_k_scale_cache"]
    for name, g, w in zip(names, got, want):
        g, w = g.double(), w.double()
        fin = torch.isfinite(w)
        assert torch.equal(fin, torch.isfinite(g)), name
        err = float((g[fin] - w[fin]).norm() / w[fin].norm())
        print(f"{name:<20} relative L2 error {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
