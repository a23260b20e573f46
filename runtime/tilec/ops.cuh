// tilec runtime: device implementations of the tile ops (one function template per op
// kind; the generated translation unit instantiates the dtype variants a plan uses).
// Semantics mirror the CPU references in tilec/ops/*.py: storage in the operand dtype,
// float32 math, rounding to the input dtype where HF rounds.
#pragma once
#include "common.cuh"

namespace tilec {

// Loads of values written earlier in the same step go to L2 (ld.global.cg): a stale L1
// line must never be read after an event wait. Read-only data (weights) may use __ldg.
template <typename T> __device__ __forceinline__ T ldc(const T* p) { return __ldcg(p); }
template <> __device__ __forceinline__ bool ldc<bool>(const bool* p) {
  return __ldcg(reinterpret_cast<const unsigned char*>(p)) != 0;
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 ldc<__nv_fp8_e4m3>(const __nv_fp8_e4m3* p) {
  __nv_fp8_e4m3 v;
  v.__x = __ldcg(reinterpret_cast<const unsigned char*>(p));
  return v;
}
template <typename T> __device__ __forceinline__ float ldf(const Operand& o, long long off) {
  return to_f<T>(ldc<T>(base<T>(o) + off));
}
template <typename T> __device__ __forceinline__ void stf(const Operand& o, long long off, float v) {
  base<T>(o)[off] = from_f<T>(v);
}
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f<T>(from_f<T>(v)); }

__device__ __forceinline__ void box_of(const TileCtx& c, int nd, int* lo, int* hi) {
  for (int k = 0; k < nd; ++k) { lo[k] = c.lo(k); hi[k] = c.hi(k); }
}

// ---- embedding: out[..., c] = W[ids[...], c] ----------------------------------------
template <typename TW, typename TI, typename TO>
__device__ void op_embedding(TileCtx& c) {
  const Operand &w = c.ops[0], &ids = c.ops[1], &out = c.ops[2];
  int nd = out.ndim, lo[4], hi[4];
  box_of(c, nd, lo, hi);
  for_box(nd, lo, hi, [&](const int* idx) {
    long long id = (long long)ldc<TI>(base<TI>(ids) + offset4(ids, idx));
    float v = to_f<TW>(base<TW>(w)[id * w.strides[0] + (long long)idx[nd - 1] * w.strides[1]]);
    stf<TO>(out, offset4(out, idx), v);
  });
}

// ---- row-wise ops: rows of the out box's leading dims, whole last dim --------------
template <typename F>
__device__ __forceinline__ void for_rows(const TileCtx& c, int nd, F f) {
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  int rows = 1;
  for (int k = 0; k < nd - 1; ++k) rows *= hi[k] - lo[k];
  for (int r = 0; r < rows; ++r) {
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    idx[nd - 1] = 0;
    f(idx);
    __syncthreads();
  }
}

template <typename TX, typename TW, typename TO>
__device__ void op_rmsnorm(TileCtx& c) {
  const Operand &x = c.ops[0], &w = c.ops[1], &out = c.ops[2];
  const int nd = out.ndim, D = out.sizes[nd - 1];
  const float eps = c.fparam(0);
  for_rows(c, nd, [&](int* idx) {
    long long xo = offset4(x, idx), oo = offset4(out, idx);
    long long xs = x.strides[nd - 1], os = out.strides[nd - 1];
    float ss = 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) { float v = ldf<TX>(x, xo + d * xs); ss += v * v; }
    ss = block_sum(ss, c.smem);
    float r = rsqrtf(ss / D + eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float v = round_to<TX>(ldf<TX>(x, xo + d * xs) * r);
      stf<TO>(out, oo + d * os, v * to_f<TW>(base<TW>(w)[d * w.strides[0]]));
    }
  });
}

template <typename TX, typename TW, typename TB, typename TO, bool kBias>
__device__ void layernorm_impl(TileCtx& c) {
  const Operand &x = c.ops[0], &w = c.ops[1];
  const Operand &out = c.ops[kBias ? 3 : 2];
  const int nd = out.ndim, D = out.sizes[nd - 1];
  const float eps = c.fparam(0);
  for_rows(c, nd, [&](int* idx) {
    long long xo = offset4(x, idx), oo = offset4(out, idx);
    long long xs = x.strides[nd - 1], os = out.strides[nd - 1];
    float s = 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) s += ldf<TX>(x, xo + d * xs);
    float mean = block_sum(s, c.smem) / D;
    float v2 = 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) { float t = ldf<TX>(x, xo + d * xs) - mean; v2 += t * t; }
    float r = rsqrtf(block_sum(v2, c.smem) / D + eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float y = (ldf<TX>(x, xo + d * xs) - mean) * r * to_f<TW>(base<TW>(w)[d * w.strides[0]]);
      if constexpr (kBias) y += to_f<TB>(base<TB>(c.ops[2])[d * c.ops[2].strides[0]]);
      stf<TO>(out, oo + d * os, y);
    }
  });
}
template <typename TX, typename TW, typename TO>
__device__ void op_layernorm(TileCtx& c) { layernorm_impl<TX, TW, TW, TO, false>(c); }
template <typename TX, typename TW, typename TB, typename TO>
__device__ void op_layernorm(TileCtx& c) { layernorm_impl<TX, TW, TB, TO, true>(c); }

template <typename TX, typename TO>
__device__ void op_softmax(TileCtx& c) {
  const Operand &x = c.ops[0], &out = c.ops[1];
  const int nd = out.ndim, D = out.sizes[nd - 1];
  for_rows(c, nd, [&](int* idx) {
    long long xo = offset4(x, idx), oo = offset4(out, idx), xs = x.strides[nd - 1], os = out.strides[nd - 1];
    float m = -INFINITY;
    for (int d = threadIdx.x; d < D; d += blockDim.x) m = fmaxf(m, ldf<TX>(x, xo + d * xs));
    m = block_max(m, c.smem);
    float s = 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) s += __expf(ldf<TX>(x, xo + d * xs) - m);
    s = block_sum(s, c.smem);
    for (int d = threadIdx.x; d < D; d += blockDim.x) stf<TO>(out, oo + d * os, __expf(ldf<TX>(x, xo + d * xs) - m) / s);
  });
}

// ---- RoPE: rotate-half (style 0) or interleaved pairs (style 1) --------------------
template <typename TX, typename TC, typename TS, typename TO>
__device__ void op_rope(TileCtx& c) {
  const Operand &x = c.ops[0], &cs = c.ops[1], &sn = c.ops[2], &out = c.ops[3];
  const int nd = out.ndim, D = out.sizes[nd - 1], h = D / 2, style = c.param(0);
  for_rows(c, nd, [&](int* idx) {
    long long xo = offset4(x, idx), oo = offset4(out, idx), co = offset4(cs, idx), so = offset4(sn, idx);
    long long xs = x.strides[nd - 1], os = out.strides[nd - 1], cst = cs.strides[nd - 1], sst = sn.strides[nd - 1];
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
      float a, b, c0, s0, c1, s1;
      if (style == 0) {
        a = ldf<TX>(x, xo + i * xs); b = ldf<TX>(x, xo + (i + h) * xs);
        c0 = ldf<TC>(cs, co + i * cst); s0 = ldf<TS>(sn, so + i * sst);
        c1 = ldf<TC>(cs, co + (i + h) * cst); s1 = ldf<TS>(sn, so + (i + h) * sst);
      } else {
        a = ldf<TX>(x, xo + 2 * i * xs); b = ldf<TX>(x, xo + (2 * i + 1) * xs);
        c0 = c1 = ldf<TC>(cs, co + i * cst); s0 = s1 = ldf<TS>(sn, so + i * sst);
      }
      // each product rounded to the storage type, as eager HF computes x*cos + rot(x)*sin
      stf<TO>(out, oo + i * os, round_to<TX>(a * c0) - round_to<TX>(b * s0));
      stf<TO>(out, oo + (i + h) * os, round_to<TX>(b * c1) + round_to<TX>(a * s1));
    }
  });
}

// ---- elementwise -----------------------------------------------------------------------
template <typename F>
__device__ __forceinline__ void for_out_box(const TileCtx& c, const Operand& out, F f) {
  int lo[4], hi[4];
  box_of(c, out.ndim, lo, hi);
  for_box(out.ndim, lo, hi, f);
}

template <typename TG, typename TU, typename TO>
__device__ void op_silu_mul(TileCtx& c) {
  const Operand &g = c.ops[0], &u = c.ops[1], &out = c.ops[2];
  for_out_box(c, out, [&](const int* idx) {
    float gv = ldf<TG>(g, offset4(g, idx));
    float s = round_to<TG>(gv / (1.f + __expf(-gv)));
    stf<TO>(out, offset4(out, idx), s * ldf<TU>(u, offset4(u, idx)));
  });
}

__device__ __forceinline__ float unary_fn(int fn, float x, float a) {
  // codes follow tilec/ops/ewise.py UNARY_FNS order
  switch (fn) {
    case 0: return -x;
    case 1: return x / (1.f + __expf(-x));
    case 2: return fmaxf(x, 0.f);
    case 3: return 0.5f * x * (1.f + erff(x * 0.70710678118f));
    case 4: return 0.5f * x * (1.f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
    case 5: return 1.f / (1.f + __expf(-x));
    case 6: return tanhf(x);
    case 7: return __expf(x);
    case 8: return rsqrtf(x);
    case 9: return sqrtf(x);
    case 10: return cosf(x);
    case 11: return sinf(x);
    case 12: return x;
    case 13: return x * a;
    case 14: return x + a;
    case 15: return a - x;
    case 16: return x / a;
    case 17: return powf(x, a);
    case 18: return fabsf(x);
  }
  return x;
}

template <typename TX, typename TO>
__device__ void op_unary(TileCtx& c) {
  const Operand &x = c.ops[0], &out = c.ops[1];
  const int fn = c.param(0);
  const float a = c.fparam(1);
  for_out_box(c, out, [&](const int* idx) {
    stf<TO>(out, offset4(out, idx), unary_fn(fn, ldf<TX>(x, offset4(x, idx)), a));
  });
}

template <typename TA, typename TB, typename TO>
__device__ void op_binary(TileCtx& c) {
  const Operand &a = c.ops[0], &b = c.ops[1], &out = c.ops[2];
  const int fn = c.param(0);
  for_out_box(c, out, [&](const int* idx) {
    float x = ldf<TA>(a, offset4(a, idx)), y = ldf<TB>(b, offset4(b, idx)), r;
    switch (fn) {  // tilec/ops/ewise.py BINARY_FNS order
      case 0: r = x + y; break;
      case 1: r = x - y; break;
      case 2: r = x * y; break;
      case 3: r = x / y; break;
      case 4: r = fmaxf(x, y); break;
      default: r = fminf(x, y); break;
    }
    stf<TO>(out, offset4(out, idx), r);
  });
}

template <typename TX, typename TO>
__device__ void op_copy(TileCtx& c) {
  const Operand &x = c.ops[0], &out = c.ops[1];
  for_out_box(c, out, [&](const int* idx) { stf<TO>(out, offset4(out, idx), ldf<TX>(x, offset4(x, idx))); });
}

template <typename TS, typename TD>
__device__ void op_cache_write(TileCtx& c) {
  const Operand &s = c.ops[0], &d = c.ops[1];
  for_out_box(c, d, [&](const int* idx) { stf<TD>(d, offset4(d, idx), ldf<TS>(s, offset4(s, idx))); });
}

// concat: variant i copies input i into its slab [lo, hi) of the out dim
template <typename TI, typename TO>
__device__ void op_concat(TileCtx& c) {
  const int i = c.variant(), dim = c.param(0);
  int n_in = 0;
  while (n_in < TILEC_MAX_OPERANDS && c.ops[n_in].dtype != TILEC_UNUSED_OPERAND) ++n_in;
  const Operand &x = c.ops[i], &out = c.ops[n_in - 1];
  const int start = c.lo(dim);
  for_out_box(c, out, [&](const int* idx) {
    int j[4] = {idx[0], idx[1], idx[2], idx[3]};
    j[dim] -= start;
    stf<TO>(out, offset4(out, idx), ldf<TI>(x, offset4(x, j)));
  });
}

// ---- linear / GEMV: out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) ------------------------
// One warp per output column n; the tile's rows (<= kMaxRows, processed kRowsPerPass at a
// time) accumulate in registers; lanes stride over K. bf16 weights with unit K-stride and
// 16-byte alignment stream as 8-element vectors.
constexpr int kRowsPerPass = 8;

template <typename TX, typename TW, typename TB, typename TO, bool kBias>
__device__ void linear_impl(TileCtx& c) {
  const Operand &x = c.ops[0], &w = c.ops[1];
  const Operand &out = c.ops[kBias ? 3 : 2];
  const int nd = out.ndim;
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int n0 = lo[nd - 1], n1 = hi[nd - 1];
  const int k0 = c.lo(nd), k1 = c.hi(nd);
  const int variant = c.variant();
  int rows = 1;
  for (int k = 0; k < nd - 1; ++k) rows *= hi[k] - lo[k];
  long long* xoff = reinterpret_cast<long long*>(c.smem);
  long long* ooff = xoff + kMaxRows;
  const long long xk = x.strides[x.ndim - 1], wn = w.strides[0], wk = w.strides[1], on = out.strides[nd - 1];
  for (int r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int nr = min(kMaxRows, rows - r0);
    __syncthreads();
    for (int r = threadIdx.x; r < nr; r += blockDim.x) {
      int idx[4] = {0, 0, 0, 0};
      row_index(r0 + r, nd, lo, hi, idx);
      idx[nd - 1] = 0;
      xoff[r] = offset4(x, idx);
      ooff[r] = offset4(out, idx);
    }
    __syncthreads();
    // stage this chunk's x rows (K range) in shared memory as float when they fit
    float* xs_smem = reinterpret_cast<float*>(ooff + kMaxRows);
    const int kl = k1 - k0;
    const bool staged = (long long)nr * kl + 4 * kMaxRows <= (long long)c.smem_floats - 64;
    if (staged && variant != 1) {
      for (int e = threadIdx.x; e < nr * kl; e += blockDim.x)
        xs_smem[e] = ldf<TX>(x, xoff[e / kl] + (long long)(k0 + e % kl) * xk);
      __syncthreads();
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int n = n0 + warp; n < n1; n += kWarps) {
      const TW* wrow = base<TW>(w) + (long long)n * wn;
      float bias = 0.f;
      if constexpr (kBias) bias = to_f<TB>(base<TB>(c.ops[2])[(long long)n * c.ops[2].strides[0]]);
      for (int m0 = 0; m0 < nr; m0 += kRowsPerPass) {
        float acc[kRowsPerPass];
#pragma unroll
        for (int m = 0; m < kRowsPerPass; ++m) acc[m] = 0.f;
        if (variant != 1) {
          bool vec = sizeof(TW) == 2 && wk == 1 && ((k1 - k0) % 8 == 0) &&
                     ((reinterpret_cast<uintptr_t>(wrow + k0) & 15) == 0);
          if (vec) {
            for (int k = k0 + lane * 8; k < k1; k += 32 * 8) {
              uint4 raw = __ldg(reinterpret_cast<const uint4*>(wrow + k));
              const TW* wv = reinterpret_cast<const TW*>(&raw);
#pragma unroll
              for (int m = 0; m < kRowsPerPass; ++m) {
                if (m0 + m < nr) {
                  if (staged) {
                    const float4* xr = reinterpret_cast<const float4*>(xs_smem + (m0 + m) * kl + (k - k0));
                    float4 a = xr[0], b = xr[1];
                    acc[m] += a.x * to_f<TW>(wv[0]) + a.y * to_f<TW>(wv[1]) + a.z * to_f<TW>(wv[2]) +
                              a.w * to_f<TW>(wv[3]) + b.x * to_f<TW>(wv[4]) + b.y * to_f<TW>(wv[5]) +
                              b.z * to_f<TW>(wv[6]) + b.w * to_f<TW>(wv[7]);
                  } else {
                    const long long xo = xoff[m0 + m];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[m] += ldf<TX>(x, xo + (long long)(k + e) * xk) * to_f<TW>(wv[e]);
                  }
                }
              }
            }
          } else {
            for (int k = k0 + lane; k < k1; k += 32) {
              float wv = to_f<TW>(wrow[(long long)k * wk]);
#pragma unroll
              for (int m = 0; m < kRowsPerPass; ++m)
                if (m0 + m < nr)
                  acc[m] += (staged ? xs_smem[(m0 + m) * kl + (k - k0)]
                                    : ldf<TX>(x, xoff[m0 + m] + (long long)k * xk)) * wv;
            }
          }
#pragma unroll
          for (int m = 0; m < kRowsPerPass; ++m) acc[m] = warp_sum(acc[m]);
        }
        if (lane == 0) {
          for (int m = 0; m < kRowsPerPass && m0 + m < nr; ++m) {
            long long o = ooff[m0 + m] + (long long)n * on;
            if (variant == 0) stf<TO>(out, o, acc[m] + bias);
            else if (variant == 1) stf<TO>(out, o, bias);
            else atomicAdd(reinterpret_cast<float*>(out.ptr) + o, acc[m]);  // split-K: float32 out only
          }
        }
      }
    }
  }
}
template <typename TX, typename TW, typename TO>
__device__ void op_linear(TileCtx& c) { linear_impl<TX, TW, TW, TO, false>(c); }
template <typename TX, typename TW, typename TB, typename TO>
__device__ void op_linear(TileCtx& c) { linear_impl<TX, TW, TB, TO, true>(c); }

// ---- decode attention over a static KV cache (GQA) -------------------------------------
// Per (batch, KV head), queries (the G heads of the group x Sq tokens) in chunks of
// kQChunk: (1) warp per cache position j: the K row is loaded once (lanes over d,
// coalesced) and dotted with every query of the chunk; scores go to shared memory;
// (2) warp per query: max, exp, sum; (3) warp per position subset: P.V with lanes over d
// and kQChunk x 8 accumulators per lane, then a cross-warp sum in shared memory.
// Like fused SDPA kernels, exp(s - max) is rounded to the value type for P.V while the
// normalizer sums the unrounded values. Needs D, Dv <= 256.
constexpr int kQChunk = 4;

template <typename TQ, typename TK, typename TV, typename TO>
__device__ void op_attention(TileCtx& c) {
  const Operand &q = c.ops[0], &k = c.ops[1], &v = c.ops[2], &out = c.ops[3];
  const long long valid = c.ops[4].scalar;
  const float scale = c.fparam(0);
  const int causal = c.param(1);
  const int Hq = q.sizes[1], Sq = q.sizes[2], D = q.sizes[3], Hkv = k.sizes[1], S = k.sizes[2], Dv = v.sizes[3];
  const int G = Hq / Hkv, nq = G * Sq;
  const int n = causal ? (int)min((long long)S, valid + Sq - 1) : S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qs = c.smem;                       // [kQChunk][256]
  float* sums = qs + kQChunk * 256;         // [kQChunk]
  float* part = sums + kQChunk;             // [kWarps][kQChunk][256] partial P.V
  float* sc = part + kWarps * kQChunk * 256;  // [kQChunk][n]
  for (int b = c.lo(0); b < c.hi(0); ++b)
    for (int h = c.lo(1); h < c.hi(1); ++h)
      for (int q0 = 0; q0 < nq; q0 += kQChunk) {
        const int qc = min(kQChunk, nq - q0);
        __syncthreads();
        for (int e = threadIdx.x; e < kQChunk * 256; e += blockDim.x) {
          int qq = e / 256, d = e % 256;
          float val = 0.f;
          if (qq < qc && d < D) {
            int g = (q0 + qq) / Sq, i = (q0 + qq) % Sq;
            int qi[4] = {b, h * G + g, i, d};
            val = ldf<TQ>(q, offset4(q, qi)) * scale;
          }
          qs[e] = val;
        }
        __syncthreads();
        // (1) scores
        for (int j = warp; j < n; j += kWarps) {
          int ki[4] = {b, h, j, 0};
          const long long ko = offset4(k, ki);
          float kr[8];
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            int d = lane + 32 * t;
            kr[t] = d < D ? ldf<TK>(k, ko + (long long)d * k.strides[3]) : 0.f;
          }
#pragma unroll
          for (int qq = 0; qq < kQChunk; ++qq) {
            if (qq < qc) {
              float s = 0.f;
#pragma unroll
              for (int t = 0; t < 8; ++t) s += kr[t] * qs[qq * 256 + lane + 32 * t];
              s = warp_sum(s);
              const int i = (q0 + qq) % Sq;
              const long long limit = causal ? valid + i : S;
              if (lane == 0) sc[qq * n + j] = j < limit ? s : -INFINITY;
            }
          }
        }
        __syncthreads();
        // (2) softmax statistics, one warp per query
        for (int qq = warp; qq < qc; qq += kWarps) {
          float m = -INFINITY;
          for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[qq * n + j]);
          m = warp_max(m);
          float sum = 0.f;
          for (int j = lane; j < n; j += 32) {
            float s = sc[qq * n + j];
            float p = s == -INFINITY ? 0.f : __expf(s - m);
            sum += p;
            sc[qq * n + j] = round_to<TV>(p);
          }
          sum = warp_sum(sum);
          if (lane == 0) sums[qq] = sum;
        }
        __syncthreads();
        // (3) P.V
        float acc[kQChunk][8];
#pragma unroll
        for (int qq = 0; qq < kQChunk; ++qq)
#pragma unroll
          for (int t = 0; t < 8; ++t) acc[qq][t] = 0.f;
        for (int j = warp; j < n; j += kWarps) {
          int vi[4] = {b, h, j, 0};
          const long long vo = offset4(v, vi);
          float vr[8];
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            int d = lane + 32 * t;
            vr[t] = d < Dv ? ldf<TV>(v, vo + (long long)d * v.strides[3]) : 0.f;
          }
#pragma unroll
          for (int qq = 0; qq < kQChunk; ++qq) {
            float p = qq < qc ? sc[qq * n + j] : 0.f;
#pragma unroll
            for (int t = 0; t < 8; ++t) acc[qq][t] += p * vr[t];
          }
        }
#pragma unroll
        for (int qq = 0; qq < kQChunk; ++qq)
#pragma unroll
          for (int t = 0; t < 8; ++t) part[(warp * kQChunk + qq) * 256 + lane + 32 * t] = acc[qq][t];
        __syncthreads();
        for (int e = threadIdx.x; e < qc * Dv; e += blockDim.x) {
          const int qq = e / Dv, d = e % Dv;
          float o = 0.f;
          for (int w = 0; w < kWarps; ++w) o += part[(w * kQChunk + qq) * 256 + d];
          const int g = (q0 + qq) / Sq, i = (q0 + qq) % Sq;
          int oi[4] = {b, h * G + g, i, d};
          stf<TO>(out, offset4(out, oi), o / sums[qq]);
        }
      }
}

}  // namespace tilec

#include "ops_glm.cuh"  // the DSA prelude's ops (FP8, absorption, paged caches)
