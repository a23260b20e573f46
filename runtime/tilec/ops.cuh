// tilec runtime: device implementations of the tile ops (one function template per op
// kind; the generated translation unit instantiates the dtype variants a plan uses).
// Semantics mirror the CPU references in tilec/ops/*.py: storage in the operand dtype,
// float32 math, rounding to the input dtype where HF rounds.
#pragma once
#include <type_traits>
#include "common.cuh"
#include "stream.cuh"

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
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // constant indices: lo / hi stay in registers
    lo[k] = k < nd ? c.lo(k) : 0;
    hi[k] = k < nd ? c.hi(k) : 1;
  }
}

// ---- embedding: out[..., c] = W[ids[...], c] ----------------------------------------
// Defined after the elementwise helpers (for_out_box, ldv / stv) below.

// ---- row-wise ops: rows of the out box's leading dims, whole last dim --------------
template <typename F>
__device__ __forceinline__ void for_rows(const TileCtx& c, int nd, F f) {
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int rows = box_rows(nd, lo, hi);
  for (int r = 0; r < rows; ++r) {
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    f(idx);
    block_sync();
  }
}

// bf16 rows of unit stride, 16-byte aligned, D % 8 == 0, D <= 8 * kRmsVecs * kThreads: one row
// at a time over the whole block, every x and weight load of the row in flight at once (a row
// of 6144 is one round trip to memory instead of 192 per lane). Returns false when not so.
constexpr int kRmsVecs = 4;
__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
__device__ __forceinline__ unsigned bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
__device__ __forceinline__ bool rmsnorm_rows_bf16(const TileCtx& c, int nd, const int* lo, const int* hi, int rows, int D,
                                               float eps) {
  const Operand &x = operands()[0], &w = operands()[1], &out = operands()[2];
  if (x.strides[nd - 1] != 1 || out.strides[nd - 1] != 1 || w.strides[0] != 1 || D % 8 != 0 ||
      D > 8 * kRmsVecs * kThreads || !aligned16(w.ptr))
    return false;
  for (int r = 0; r < rows; ++r) {  // every row 16-byte aligned, or none is done this way
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    if (!aligned16(base<__nv_bfloat16>(x) + offset4(x, idx)) || !aligned16(base<__nv_bfloat16>(out) + offset4(out, idx)))
      return false;
  }
  const int nv = D / 8;
  for (int r = 0; r < rows; ++r) {
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    const uint4* xp = reinterpret_cast<const uint4*>(base<__nv_bfloat16>(x) + offset4(x, idx));
    uint4* op = reinterpret_cast<uint4*>(base<__nv_bfloat16>(out) + offset4(out, idx));
    const uint4* wp = reinterpret_cast<const uint4*>(w.ptr);
    uint4 xv[kRmsVecs], wv[kRmsVecs];
#pragma unroll
    for (int j = 0; j < kRmsVecs; ++j) {
      const int e = threadIdx.x + j * kThreads;
      if (e < nv) xv[j] = __ldcg(xp + e), wv[j] = __ldcg(wp + e);
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kRmsVecs; ++j) {
      if (threadIdx.x + j * kThreads >= nv) continue;
      const unsigned u[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float a = __uint_as_float(u[t] << 16), b = __uint_as_float(u[t] & 0xffff0000u);
        ss += a * a + b * b;
      }
    }
    const float rs = rsqrtf(block_sum(ss, c.smem()) / D + eps);
#pragma unroll
    for (int j = 0; j < kRmsVecs; ++j) {
      const int e = threadIdx.x + j * kThreads;
      if (e >= nv) continue;
      const unsigned u[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w}, g[4] = {wv[j].x, wv[j].y, wv[j].z, wv[j].w};
      unsigned o[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {  // round_to<bf16>(x * rs) * w, stored as bf16 (as op_rmsnorm's row loop)
        const float a = round_to<__nv_bfloat16>(__uint_as_float(u[t] << 16) * rs) * __uint_as_float(g[t] << 16);
        const float b = round_to<__nv_bfloat16>(__uint_as_float(u[t] & 0xffff0000u) * rs) * __uint_as_float(g[t] & 0xffff0000u);
        o[t] = bf16x2_bits(a, b);
      }
      op[e] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  return true;
}

// One warp per row (the tile's rows in parallel, not one round trip after another); a tile of
// fewer bf16 rows than warps takes its rows one at a time over the whole block instead.
template <typename TX, typename TW, typename TO>
__device__ void op_rmsnorm(TileCtx& c) {
  const Operand &x = operands()[0], &w = operands()[1], &out = operands()[2];
  const int nd = out.ndim, D = out.sizes[nd - 1];
  const float eps = c.fparam(0);
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int rows = box_rows(nd, lo, hi);
  if constexpr (std::is_same<TX, __nv_bfloat16>::value && std::is_same<TW, __nv_bfloat16>::value &&
                std::is_same<TO, __nv_bfloat16>::value) {
    if (rows < kWarps && rmsnorm_rows_bf16(c, nd, lo, hi, rows, D, eps)) return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long xs = x.strides[nd - 1], os = out.strides[nd - 1];
  for (int r = warp; r < rows; r += kWarps) {
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    const long long xo = offset4(x, idx), oo = offset4(out, idx);
    float ss = 0.f;
    for (int d = lane; d < D; d += 32) { const float v = ldf<TX>(x, xo + d * xs); ss += v * v; }
    const float rs = rsqrtf(warp_sum(ss) / D + eps);
    for (int d = lane; d < D; d += 32) {
      const float v = round_to<TX>(ldf<TX>(x, xo + d * xs) * rs);
      stf<TO>(out, oo + d * os, v * to_f<TW>(base<TW>(w)[d * w.strides[0]]));
    }
  }
}

// Rows of at most 32 x kLnVals elements: one warp per row, the row held in registers (every load
// in flight, warp sums, no block barrier). A GLM-5 indexer-key tile (4 rows of 128) took 10.3 us on
// an H200 with a row at a time over the block (three round trips and two block sums per row).
constexpr int kLnVals = 8;
template <typename TX, typename TW, typename TB, typename TO, bool kBias>
__device__ __forceinline__ void layernorm_warp_rows(const TileCtx& c, int nd, float eps, int D) {
  const Operand &x = operands()[0], &w = operands()[1], &out = operands()[kBias ? 3 : 2];
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int rows = box_rows(nd, lo, hi), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long xs = x.strides[nd - 1], os = out.strides[nd - 1];
#pragma unroll 1
  for (int r = warp; r < rows; r += kWarps) {
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    const long long xo = offset4(x, idx), oo = offset4(out, idx);
    float v[kLnVals], s = 0.f;
#pragma unroll
    for (int i = 0; i < kLnVals; ++i) {
      const int d = lane + 32 * i;
      v[i] = d < D ? ldf<TX>(x, xo + d * xs) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kLnVals; ++i) s += v[i];
    const float mean = warp_sum(s) / D;
    float v2 = 0.f;
#pragma unroll
    for (int i = 0; i < kLnVals; ++i) {
      const float t = lane + 32 * i < D ? v[i] - mean : 0.f;
      v2 += t * t;
    }
    const float rr = rsqrtf(warp_sum(v2) / D + eps);
#pragma unroll
    for (int i = 0; i < kLnVals; ++i) {
      const int d = lane + 32 * i;
      if (d >= D) continue;
      float y = (v[i] - mean) * rr * to_f<TW>(base<TW>(w)[d * w.strides[0]]);
      if constexpr (kBias) y += to_f<TB>(base<TB>(operands()[2])[d * operands()[2].strides[0]]);
      stf<TO>(out, oo + d * os, y);
    }
  }
}
template <typename TX, typename TW, typename TB, typename TO, bool kBias>
__device__ void layernorm_impl(TileCtx& c) {
  const Operand &x = operands()[0], &w = operands()[1];
  const Operand &out = operands()[kBias ? 3 : 2];
  const int nd = out.ndim, D = out.sizes[nd - 1];
  const float eps = c.fparam(0);
  if (D <= 32 * kLnVals) {
    layernorm_warp_rows<TX, TW, TB, TO, kBias>(c, nd, eps, D);
    return;
  }
  for_rows(c, nd, [&](int* idx) {
    long long xo = offset4(x, idx), oo = offset4(out, idx);
    long long xs = x.strides[nd - 1], os = out.strides[nd - 1];
    float s = 0.f;
    for (int d = threadIdx.x; d < D; d += kThreads) s += ldf<TX>(x, xo + d * xs);
    float mean = block_sum(s, c.smem()) / D;
    float v2 = 0.f;
    for (int d = threadIdx.x; d < D; d += kThreads) { float t = ldf<TX>(x, xo + d * xs) - mean; v2 += t * t; }
    float r = rsqrtf(block_sum(v2, c.smem()) / D + eps);
    for (int d = threadIdx.x; d < D; d += kThreads) {
      float y = (ldf<TX>(x, xo + d * xs) - mean) * r * to_f<TW>(base<TW>(w)[d * w.strides[0]]);
      if constexpr (kBias) y += to_f<TB>(base<TB>(operands()[2])[d * operands()[2].strides[0]]);
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
  const Operand &x = operands()[0], &out = operands()[1];
  const int nd = out.ndim, D = out.sizes[nd - 1];
  for_rows(c, nd, [&](int* idx) {
    long long xo = offset4(x, idx), oo = offset4(out, idx), xs = x.strides[nd - 1], os = out.strides[nd - 1];
    float m = -INFINITY;
    for (int d = threadIdx.x; d < D; d += kThreads) m = fmaxf(m, ldf<TX>(x, xo + d * xs));
    m = block_max(m, c.smem());
    float s = 0.f;
    for (int d = threadIdx.x; d < D; d += kThreads) s += __expf(ldf<TX>(x, xo + d * xs) - m);
    s = block_sum(s, c.smem());
    for (int d = threadIdx.x; d < D; d += kThreads) stf<TO>(out, oo + d * os, __expf(ldf<TX>(x, xo + d * xs) - m) / s);
  });
}

// ---- RoPE: rotate-half (style 0), interleaved pairs (style 1) or pairs in place (style 2) ----
template <typename TX, typename TC, typename TS, typename TO>
__device__ void op_rope(TileCtx& c) {
  const Operand &x = operands()[0], &cs = operands()[1], &sn = operands()[2], &out = operands()[3];
  const int nd = out.ndim, D = out.sizes[nd - 1], h = D / 2, style = c.param(0);
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int rows = box_rows(nd, lo, hi);
  const long long xs = x.strides[nd - 1], os = out.strides[nd - 1], cst = cs.strides[nd - 1], sst = sn.strides[nd - 1];
  // every (row, pair) of the tile at once: one round trip, not one per row
  for (int e = threadIdx.x; e < rows * h; e += kThreads) {
    const int r = e / h, i = e % h;
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    const long long xo = offset4(x, idx), oo = offset4(out, idx), co = offset4(cs, idx), so = offset4(sn, idx);
    float a, b, c0, s0, c1, s1;
    if (style == 0) {
      a = ldf<TX>(x, xo + i * xs); b = ldf<TX>(x, xo + (i + h) * xs);
      c0 = ldf<TC>(cs, co + i * cst); s0 = ldf<TS>(sn, so + i * sst);
      c1 = ldf<TC>(cs, co + (i + h) * cst); s1 = ldf<TS>(sn, so + (i + h) * sst);
    } else if (style == 1) {
      a = ldf<TX>(x, xo + 2 * i * xs); b = ldf<TX>(x, xo + (2 * i + 1) * xs);
      c0 = c1 = ldf<TC>(cs, co + i * cst); s0 = s1 = ldf<TS>(sn, so + i * sst);
    } else {  // style 2: cos / sin [D], a value per element (HF repeats each frequency twice)
      a = ldf<TX>(x, xo + 2 * i * xs); b = ldf<TX>(x, xo + (2 * i + 1) * xs);
      c0 = ldf<TC>(cs, co + 2 * i * cst); s0 = ldf<TS>(sn, so + 2 * i * sst);
      c1 = ldf<TC>(cs, co + (2 * i + 1) * cst); s1 = ldf<TS>(sn, so + (2 * i + 1) * sst);
    }
    // each product rounded to the storage type, as eager HF computes x*cos + rot(x)*sin
    // (style 1's interleaved inputs come out de-interleaved, as HF's apply_rotary_pos_emb_interleave
    // does; style 2's stay interleaved, as GPT-J's rotate_every_two keeps them);
    // __fmul_rn: never contracted into an FMA with the sum (float32 rows: eager rounds each product)
    const long long o0 = style == 2 ? oo + 2 * i * os : oo + i * os;
    const long long o1 = style == 2 ? oo + (2 * i + 1) * os : oo + (i + h) * os;
    stf<TO>(out, o0, round_to<TX>(__fmul_rn(a, c0)) - round_to<TX>(__fmul_rn(b, s0)));
    stf<TO>(out, o1, round_to<TX>(__fmul_rn(b, c1)) + round_to<TX>(__fmul_rn(a, s1)));
  }
}

// ---- elementwise -----------------------------------------------------------------------
// The out box's elements in batches (for_box_batched): v = load(idx), then store(idx, v). When
// every operand is laid out for it (vec_ok), an element is 8 consecutive positions of the last dim
// moved with 16-byte loads and stores: a tile of a few thousand bf16 values is one round trip.
// load/store are generic lambdas taking the vector width K (an integral_constant: 1 or 8).
constexpr int kEwVec = 8;
template <int K> struct Vals { float v[K]; };
template <int K> struct Vals2 { float a[K], b[K]; };
// K values at element offset off (K == 8 from 16-byte aligned bf16/half/float32 rows: one or two
// 16-byte loads, all in flight)
template <int K, typename T> __device__ __forceinline__ void ldv(const Operand& o, long long off, float* v) {
  if constexpr (K == 8 && (std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value)) {
    const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(base<T>(o) + off));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_f<T>(e[i]);
  } else if constexpr (K == 8 && std::is_same<T, float>::value) {
    const float4 p = __ldcg(reinterpret_cast<const float4*>(base<T>(o) + off));
    const float4 q = __ldcg(reinterpret_cast<const float4*>(base<T>(o) + off + 4));
    v[0] = p.x, v[1] = p.y, v[2] = p.z, v[3] = p.w, v[4] = q.x, v[5] = q.y, v[6] = q.z, v[7] = q.w;
  } else {
#pragma unroll
    for (int i = 0; i < K; ++i) v[i] = ldf<T>(o, off + i);
  }
}
template <int K, typename T> __device__ __forceinline__ void stv(const Operand& o, long long off, const float* v) {
  if constexpr (K == 8 && (std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value)) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = from_f<T>(v[i]);
    *reinterpret_cast<uint4*>(base<T>(o) + off) = raw;
  } else if constexpr (K == 8 && std::is_same<T, float>::value) {
    *reinterpret_cast<float4*>(base<T>(o) + off) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(base<T>(o) + off + 4) = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int i = 0; i < K; ++i) stf<T>(o, off + i, v[i]);
  }
}
// Whether operand o (nd dims, like the out box) can be accessed kEwVec positions of the last dim
// at a time from last-dim index lo: unit last stride, 16-byte aligned rows.
template <typename T> __device__ __forceinline__ bool vec_ok(const Operand& o, int nd, int lo) {
  constexpr long long es = sizeof(T);
  if (nd == 0 || o.ndim != nd || o.strides[nd - 1] != 1 || !aligned16(o.ptr) || (lo * es) % 16) return false;
#pragma unroll
  for (int k = 0; k < TILEC_MAX_DIMS - 1; ++k)
    if (k < nd - 1 && (o.strides[k] * es) % 16) return false;
  return true;
}
template <typename L, typename S>
__device__ __forceinline__ void for_out_box(const TileCtx& c, const Operand& out, bool vec, L load, S store) {
  int lo[4], hi[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) { lo[k] = k < out.ndim ? c.lo(k) : 0; hi[k] = k < out.ndim ? c.hi(k) : 1; }
  const int nd = out.ndim;
  const int n = box_rows(nd, lo, hi) * (nd ? hi[nd - 1] - lo[nd - 1] : 1);
  if (vec && nd > 0 && (hi[nd - 1] - lo[nd - 1]) % kEwVec == 0) {
    if (n <= kSmallBox * kEwVec) for_box_batched<kEwVec, 1>(nd, lo, hi, load, store);
    else for_box_batched<kEwVec>(nd, lo, hi, load, store);
  } else if (n <= kSmallBox) {
    for_box_batched<1, 1>(nd, lo, hi, load, store);
  } else {
    for_box_batched<1>(nd, lo, hi, load, store);
  }
}
// last-dim lo of the out box (the vec_ok argument of operands indexed like out)
__device__ __forceinline__ int last_lo(const TileCtx& c, const Operand& out) { return out.ndim ? c.lo(out.ndim - 1) : 0; }

// The gather in batches of the out box (for_out_box): 8 positions of a row with one 16-byte load
// and store when the table rows and out allow it, so a decode step's row is one round trip after
// the id's. Element by element, every load waited for the previous element's store (the compiler
// cannot move a load above a store that may alias it). Measured on an H200 (variants_ab.py,
// Llama-3.2-1B batch 1, context 1024, one process, 7 rounds): 1.106 against 1.112 ms a step, the
// step's first instruction (two tiles of 1024 bf16 columns) 6.9 against 9.3 us.
// An id outside the table gives NaN rows (never an out-of-bounds read; eager would raise), reported
// through fail_index for the host to raise.
template <typename TW, typename TI, typename TO>
__device__ void op_embedding(TileCtx& c) {
  const Operand &w = operands()[0], &ids = operands()[1], &out = operands()[2];
  const int nd = out.ndim, lo = last_lo(c, out);
  constexpr long long es = sizeof(TW);
  // vec: unit-stride 16-byte aligned table rows, and an id constant along out's last dim
  const bool vec = nd > 0 && w.strides[1] == 1 && aligned16(w.ptr) && (w.strides[0] * es) % 16 == 0 &&
                   (lo * es) % 16 == 0 && (ids.ndim < nd || ids.strides[nd - 1] == 0) && vec_ok<TO>(out, nd, lo);
  auto load = [&](auto kv, const int* idx) {
    constexpr int K = decltype(kv)::value;
    Vals<K> r;
    const long long id = (long long)ldc<TI>(base<TI>(ids) + offset4(ids, idx));
    if (id < 0 || id >= w.sizes[0]) {  // eager raises: a NaN row (no out-of-table read), reported
      fail_index(c, id, 0, w.sizes[0]);
#pragma unroll
      for (int i = 0; i < K; ++i) r.v[i] = __int_as_float(0x7fc00000);
    } else {
      ldv<K, TW>(w, id * w.strides[0] + (long long)idx[nd - 1] * w.strides[1], r.v);
    }
    return r;
  };
  auto store = [&](auto kv, const int* idx, const auto& r) {
    stv<decltype(kv)::value, TO>(out, offset4(out, idx), r.v);
  };
  for_out_box(c, out, vec, load, store);
}
#define TILEC_EW_K constexpr int K = decltype(kv)::value

// codes follow tilec/ops/ewise.py UNARY_FNS order. The transcendental and division cases are out
// of line: the elementwise loops are unrolled (kBoxBatch x kEwVec elements), and code that size
// would crowd the instruction cache the whole persistent kernel shares.
__device__ __noinline__ float unary_slow(int fn, float x, float a) {
  switch (fn) {
    case 1: return x / (1.f + __expf(-x));
    case 3: return 0.5f * x * (1.f + erff(x * 0.70710678118f));
    case 4: return 0.5f * x * (1.f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
    case 5: return 1.f / (1.f + __expf(-x));
    case 6: return tanhf(x);
    case 7: return __expf(x);
    case 8: return rsqrtf(x);
    case 9: return sqrtf(x);
    case 10: return cosf(x);
    case 11: return sinf(x);
    case 16: return x * (1.f / a);  // div_scalar: as CUDA eager divides by a Python number (tilec/ops/ewise.py)
    case 17: return powf(x, a);
    case 19: return x / a;          // div_exact_scalar
    case 20: return 1.f / x;        // reciprocal (ATen's reciprocal kernel: 1 / x in float, rounded once)
  }
  return x;
}
__device__ __forceinline__ float unary_fn(int fn, float x, float a) {
  switch (fn) {
    case 0: return -x;
    case 2: return x <= 0.f ? 0.f : x;  // relu: NaN stays NaN, as eager's (fmaxf(NaN, 0) is 0)
    case 12: return x;
    case 13: return x * a;
    case 14: return x + a;
    case 15: return a - x;
    case 18: return fabsf(x);
  }
  return unary_slow(fn, x, a);
}
__device__ __noinline__ float divide(float x, float y) { return x / y; }

// out = f(x) for one input read like out (unary: fn(x, a); copies and cache writes: x)
template <typename TX, typename TO, typename F>
__device__ __forceinline__ void map1(const TileCtx& c, const Operand& x, const Operand& out, F f) {
  const int nd = out.ndim, l = last_lo(c, out);
  for_out_box(c, out, vec_ok<TX>(x, nd, l) && vec_ok<TO>(out, nd, l),
              [&](auto kv, const int* idx) {
                TILEC_EW_K;
                Vals<K> p;
                ldv<K, TX>(x, offset4(x, idx), p.v);
                return p;
              },
              [&](auto kv, const int* idx, const auto& p) {
                TILEC_EW_K;
                float r[K];
#pragma unroll
                for (int i = 0; i < K; ++i) r[i] = f(p.v[i]);
                stv<K, TO>(out, offset4(out, idx), r);
              });
}

// out = f(a, b) for two inputs read like out (binary ops, SiLU-mul)
template <typename TA, typename TB, typename TO, typename F>
__device__ __forceinline__ void map2(const TileCtx& c, const Operand& a, const Operand& b, const Operand& out, F f) {
  const int nd = out.ndim, l = last_lo(c, out);
  for_out_box(c, out, vec_ok<TA>(a, nd, l) && vec_ok<TB>(b, nd, l) && vec_ok<TO>(out, nd, l),
              [&](auto kv, const int* idx) {
                TILEC_EW_K;
                Vals2<K> p;
                ldv<K, TA>(a, offset4(a, idx), p.a);
                ldv<K, TB>(b, offset4(b, idx), p.b);
                return p;
              },
              [&](auto kv, const int* idx, const auto& p) {
                TILEC_EW_K;
                float r[K];
#pragma unroll
                for (int i = 0; i < K; ++i) r[i] = f(p.a[i], p.b[i]);
                stv<K, TO>(out, offset4(out, idx), r);
              });
}

template <typename TG, typename TU, typename TO>
__device__ void op_silu_mul(TileCtx& c) {
  map2<TG, TU, TO>(c, operands()[0], operands()[1], operands()[2],
                   [](float g, float u) { return round_to<TG>(g / (1.f + __expf(-g))) * u; });
}

template <typename TX, typename TO>
__device__ void op_unary(TileCtx& c) {
  const int fn = c.param(0);
  const float a = c.fparam(1);
  map1<TX, TO>(c, operands()[0], operands()[1], [&](float v) { return unary_fn(fn, v, a); });
}

template <typename TA, typename TB, typename TO>
__device__ void op_binary(TileCtx& c) {
  const int fn = c.param(0);
  map2<TA, TB, TO>(c, operands()[0], operands()[1], operands()[2], [&](float x, float y) {
    switch (fn) {  // tilec/ops/ewise.py BINARY_FNS order
      case 0: return x + y;
      case 1: return x - y;
      case 2: return x * y;
      case 3: return divide(x, y);
      // NaN-propagating, as torch.maximum / minimum (fmaxf / fminf return the other operand)
      case 4: return x != x ? x : y != y ? y : fmaxf(x, y);
      default: return x != x ? x : y != y ? y : fminf(x, y);
    }
  });
}

// Integer (and bool) elements moved exactly, one at a time: the elementwise helpers (map1,
// for_out_box) carry values as float32, exact only up to 2^24 (int64 ids or slots past it came out
// rounded). out's box; x is indexed like out, less `start` along dim `dim` (a concat's slab; -1:
// none). Integer copies, cache writes and concats are small (ids, slots), so no vector path.
template <typename TX, typename TO>
__device__ void move_integers(const TileCtx& c, const Operand& x, const Operand& out, int dim = -1, int start = 0) {
  const int nd = out.ndim;
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int l0 = nd ? lo[nd - 1] : 0, len = nd ? hi[nd - 1] - l0 : 1, rows = box_rows(nd, lo, hi);
  for (int e = threadIdx.x; e < rows * len; e += kThreads) {
    int idx[4] = {0, 0, 0, 0}, j[4];
    row_index(e / len, nd, lo, hi, idx);
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // constant indices: the arrays stay in registers
      if (k == nd - 1) idx[k] = l0 + e % len;
      j[k] = idx[k] - (k == dim ? start : 0);
    }
    base<TO>(out)[offset4(out, idx)] = static_cast<TO>(base<TX>(x)[offset4(x, j)]);
  }
}
template <typename TX, typename TO>
constexpr bool kIntegers = std::is_integral<TX>::value && std::is_integral<TO>::value;

template <typename TX, typename TO>
__device__ void op_copy(TileCtx& c) {
  if constexpr (kIntegers<TX, TO>)
    move_integers<TX, TO>(c, operands()[0], operands()[1]);
  else
    map1<TX, TO>(c, operands()[0], operands()[1], [](float v) { return v; });
}

// Copies the tile's rows of 2-byte T 16 bytes at a time in one rolled loop (every copy in flight
// at once) when both operands allow map1's 16-byte path (vec_ok) and 8 | the box's last extent.
// Returns false (nothing copied) otherwise. A decode step's cache write is a few hundred bytes
// on the critical path: what it costs is code, so the loop stays small (the unrolled elementwise
// path of map1 is ~38 KB of SASS, mostly fetched cold from L2 once per layer).
template <typename T>
__device__ __forceinline__ bool copy_rows16(const TileCtx& c, const Operand& src, const Operand& dst) {
  static_assert(sizeof(T) == 2, "copy_rows16 moves 8 elements of 2 bytes per 16-byte access");
  const int nd = dst.ndim, l0 = last_lo(c, dst);
  if (!vec_ok<T>(src, nd, l0) || !vec_ok<T>(dst, nd, l0)) return false;
  const int len = c.hi(nd - 1) - l0;
  if (len % 8 != 0) return false;
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int rows = box_rows(nd, lo, hi), vpr = len / 8;
#pragma unroll 1
  for (int e = threadIdx.x; e < rows * vpr; e += kThreads) {
    const int r = e / vpr, v = e - r * vpr;
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);  // idx[nd - 1] = 0: the last dim's offset is added below (unit stride)
    const long long k = l0 + 8 * v;
    const uint4 val = __ldcg(reinterpret_cast<const uint4*>(src.ptr + 2 * (offset4(src, idx) + k)));
    *reinterpret_cast<uint4*>(dst.ptr + 2 * (offset4(dst, idx) + k)) = val;
  }
  return true;
}
template <typename TS, typename TD>
__device__ __noinline__ void cache_write_generic(TileCtx& c) {
  map1<TS, TD>(c, operands()[0], operands()[1], [](float v) { return v; });
}
template <typename TS, typename TD>
__device__ void op_cache_write(TileCtx& c) {
  if constexpr (kIntegers<TS, TD>) {
    move_integers<TS, TD>(c, operands()[0], operands()[1]);
    return;
  }
#ifndef TILEC_CACHE_WRITE_GENERIC  // an experiment's knob: always the unrolled elementwise path
  if constexpr (std::is_same<TS, TD>::value && sizeof(TS) == 2)
    if (copy_rows16<TS>(c, operands()[0], operands()[1])) return;
#endif
  cache_write_generic<TS, TD>(c);
}

// concat: variant i copies input i into its slab [lo, hi) of the out dim
template <typename TI, typename TO>
__device__ void op_concat(TileCtx& c) {
  const int i = c.variant(), dim = c.param(0);
  int n_in = 0;
  while (n_in < TILEC_MAX_OPERANDS && operands()[n_in].dtype != TILEC_UNUSED_OPERAND) ++n_in;
  const Operand &x = operands()[i], &out = operands()[n_in - 1];
  const int start = c.lo(dim), nd = out.ndim, l = last_lo(c, out);
  if constexpr (kIntegers<TI, TO>) {
    move_integers<TI, TO>(c, x, out, dim, start);
    return;
  }
  for_out_box(c, out, vec_ok<TI>(x, nd, dim == nd - 1 ? l - start : l) && vec_ok<TO>(out, nd, l),
              [&](auto kv, const int* idx) {
                TILEC_EW_K;
                int j[4] = {idx[0], idx[1], idx[2], idx[3]};
#pragma unroll
                for (int k = 0; k < 4; ++k) j[k] -= k == dim ? start : 0;
                Vals<K> p;
                ldv<K, TI>(x, offset4(x, j), p.v);
                return p;
              },
              [&](auto kv, const int* idx, const auto& p) {
                TILEC_EW_K;
                stv<K, TO>(out, offset4(out, idx), p.v);
              });
}
#undef TILEC_EW_K

// ---- linear / GEMV: out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) ------------------------
// One warp per output column n; the tile's rows (<= kMaxRows, processed kRowsPerPass at a
// time) accumulate in registers; lanes stride over K. x rows are staged in shared memory as
// float when they fit. Fast path (bf16 W with unit K-stride and 16-byte aligned rows, staged
// x, <= kRowsPerPass rows): each warp streams two columns at once with kGemvLoads 16-byte
// loads per column in flight per lane (L2 evict-first, no L1 allocation), so an SM keeps
// ~64 KiB of weights in flight - what HBM latency x per-SM bandwidth needs (HOPPER.md).
constexpr int kRowsPerPass = 8;
constexpr int kGemvLoads = 8;

// dot of 8 bf16 (packed in a uint4) with 8 floats
__device__ __forceinline__ float dot8_bf16(const uint4& w, const float* x) {
  const float4 a = reinterpret_cast<const float4*>(x)[0], b = reinterpret_cast<const float4*>(x)[1];
  return a.x * __uint_as_float(w.x << 16) + a.y * __uint_as_float(w.x & 0xffff0000u) +
         a.z * __uint_as_float(w.y << 16) + a.w * __uint_as_float(w.y & 0xffff0000u) +
         b.x * __uint_as_float(w.z << 16) + b.y * __uint_as_float(w.z & 0xffff0000u) +
         b.z * __uint_as_float(w.w << 16) + b.w * __uint_as_float(w.w & 0xffff0000u);
}
// the same with the 8 x values as bf16 (one conflict-free 16-byte shared-memory load instead of two
// float4 loads at a 32-byte lane stride); the same products in the same order
__device__ __forceinline__ float dot8_bf16(const uint4& w, const __nv_bfloat16* x) {
  const uint4 a = *reinterpret_cast<const uint4*>(x);
  return __uint_as_float(a.x << 16) * __uint_as_float(w.x << 16) +
         __uint_as_float(a.x & 0xffff0000u) * __uint_as_float(w.x & 0xffff0000u) +
         __uint_as_float(a.y << 16) * __uint_as_float(w.y << 16) +
         __uint_as_float(a.y & 0xffff0000u) * __uint_as_float(w.y & 0xffff0000u) +
         __uint_as_float(a.z << 16) * __uint_as_float(w.z << 16) +
         __uint_as_float(a.z & 0xffff0000u) * __uint_as_float(w.z & 0xffff0000u) +
         __uint_as_float(a.w << 16) * __uint_as_float(w.w << 16) +
         __uint_as_float(a.w & 0xffff0000u) * __uint_as_float(w.w & 0xffff0000u);
}

// ---- tensor-core helpers: mma.sync m16n8k16 (bf16 in, float32 accumulate) ----
__device__ __forceinline__ void mma_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
// Two m16n8k16 products over 32 consecutive k: lane (g = lane / 4, q = lane % 4) brings 8
// consecutive k of A rows g and g + 8 (alo, ahi) and of B column g (b), and the k order inside
// each product is permuted the same way for A and B (slot 2q + j <-> k 8q + j, slot 2q + 8 + j
// <-> k 8q + 2 + j), so each operand is one 16-byte load per lane instead of four.
__device__ __forceinline__ void mma_k32(float* acc, const uint4& alo, const uint4& ahi, const uint4& b) {
  const unsigned a1[4] = {alo.x, ahi.x, alo.y, ahi.y}, a2[4] = {alo.z, ahi.z, alo.w, ahi.w};
  mma_16816(acc, a1, b.x, b.y);
  mma_16816(acc, a2, b.z, b.w);
}

// The output side of a GEMV tile: the fused epilogue - a residual add, or SiLU of the rounded
// value (tilec/ops/linear_fused.py epilogues 1, 2) - then store.
// ooff/roff: per-row element offsets of out/resid; on/rn: their column strides.
template <typename TO>
struct GemvStore {
  const Operand& out;
  const Operand* resid;  // nullptr: plain store
  const long long* ooff;
  const long long* roff;
  long long on, rn;
  int variant;  // 0 write (callers add the bias), 2 split-K partial (atomic float32 add, no bias)
  bool silu = false;
  __device__ void operator()(int m, int n, float v) const {
    if (variant == 2) {  // split-K partial: the init tile (variant 1) wrote the bias
      atomicAdd(reinterpret_cast<float*>(out.ptr) + shared_ptr(ooff)[m] + (long long)n * on, v);
      return;
    }
    if (resid) v = round_to<TO>(v) + ldf<TO>(*resid, shared_ptr(roff)[m] + (long long)n * rn);
    if (silu) {  // as the silu_mul prologue computes it from the stored value (stage_bf16_rows)
      const float g = round_to<TO>(v);
      v = g / (1.f + __expf(-g));
    }
    stf<TO>(out, shared_ptr(ooff)[m] + (long long)n * on, v);
  }
};

// Fast path: columns [n0, n1) of bf16 W [N, K] (row stride wn elements), K range [k0, k1)
// (k1 - k0 a multiple of 8), against nr <= kR staged float rows xs [nr][k1 - k0]. kR (1, 4 or
// 8 rows) keeps the accumulators of small batches out of the register budget.
template <int kR, typename TB, typename TO, bool kBias>
__device__ __noinline__ void gemv_bf16_stream(const TileCtx& c, const __nv_bfloat16* w, long long wn, int n0, int n1,
                                              int k0, int k1, const float* xs, int nr, const GemvStore<TO>& store) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kl = k1 - k0;
  const unsigned long long policy = evict_first_policy();
  xs = shared_ptr(xs);
  for (int n = n0 + warp; n < n1; n += 2 * kWarps) {
    const int nb = n + kWarps < n1 ? n + kWarps : n;  // second column (or a repeat, not stored)
    const __nv_bfloat16* w0 = w + (long long)n * wn + k0;
    const __nv_bfloat16* w1 = w + (long long)nb * wn + k0;
    float acc0[kR], acc1[kR];
#pragma unroll
    for (int m = 0; m < kR; ++m) acc0[m] = acc1[m] = 0.f;
    for (int kb = 0; kb < kl; kb += kGemvLoads * 256) {
      uint4 r0[kGemvLoads], r1[kGemvLoads];
#pragma unroll
      for (int u = 0; u < kGemvLoads; ++u) {
        const int k = kb + u * 256 + lane * 8;
        if (k < kl) {
          r0[u] = ld_stream16(w0 + k, policy);
          r1[u] = ld_stream16(w1 + k, policy);
        }
      }
#pragma unroll
      for (int u = 0; u < kGemvLoads; ++u) {
        const int k = kb + u * 256 + lane * 8;
        if (k < kl) {
#pragma unroll
          for (int m = 0; m < kR; ++m) {
            if (m < nr) {
              acc0[m] += dot8_bf16(r0[u], xs + m * kl + k);
              acc1[m] += dot8_bf16(r1[u], xs + m * kl + k);
            }
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kR; ++m) {
      if (m < nr) {
        acc0[m] = warp_sum(acc0[m]);
        acc1[m] = warp_sum(acc1[m]);
      }
    }
    if (lane == 0) {
      float b0 = 0.f, b1 = 0.f;
      if (kBias && store.variant == 0) {
        b0 = to_f<TB>(base<TB>(operands()[2])[(long long)n * operands()[2].strides[0]]);
        b1 = to_f<TB>(base<TB>(operands()[2])[(long long)nb * operands()[2].strides[0]]);
      }
      for (int m = 0; m < nr; ++m) {
        store(m, n, acc0[m] + b0);
        if (nb != n) store(m, nb, acc1[m] + b1);
      }
    }
  }
}

// ---- streamed weights: the ring the loader warp fills (stream.cuh) ---------------------
// Columns [t.n0, t.n1) of the streamed tile against nr <= kR staged rows xs [nr][k1 - k0] (float,
// or bf16 when the rows are bf16):
// the compute warps consume the tile's stream items in order (warp w owns row w of a stage),
// releasing each stage to the loader as soon as they have read it - no block barrier per stage.
// Inlined into the op (as are the staging helpers below): each thread has 168 registers
// (ptxas), and every out-of-line call saves and restores registers through
// local memory, which the small L1 left beside the shared-memory carve-out sends to L2 (each a
// round trip on the instruction's critical path). Inlining them took a Llama-3.2-1B step from
// 2.236 to 2.138 ms on an H200 (benchmarks/lab/ring_sweep.py, INLINE variant, 2 ring stages).
// The ring's fields are copied into registers once per tile: read through c.ring, every item
// loaded several of them from the shared WeightRing with dependent generic loads before its wait
// and its release. Measured on an H200 (benchmarks/lab/variants_ab.py, Llama-3.2-1B batch 1,
// context 1024, one process, logits bitwise equal; TILEC_LAB_RREG of benchmarks/lab/patches/
// s29-labs.patch): 1.162 against 1.173 ms a step; the LM-head tiles 126.1 against 128.8 us,
// gate / up 20.4 against 20.8. Llama-3.1-8B: unchanged (5.213 ms).
template <int kR, typename TB, typename TO, bool kBias, typename TXS>
__device__ __forceinline__ void gemv_bf16_ring(const TileCtx& c, const StreamTile& t, const TXS* xs, int nr,
                                               const GemvStore<TO>& store) {
  const WeightRing r = *c.ring;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kl = t.k1 - t.k0, kblocks = t.kblocks(), items = t.items();
  const int first = *r.next;
  int s = first % r.nstages;                      // the ring slot of the tile's first item
  unsigned ph = (unsigned)(first / r.nstages) & 1u;  // and the phase its full barrier completes
  c.mark(1);  // x staged (and its prologue applied)
  float acc[kR];
#pragma unroll
  for (int m = 0; m < kR; ++m) acc[m] = 0.f;
  // 2..4 bf16 x rows on tensor cores (kDiag, below; 5..8 rows go to gemv_bf16_ring_mma, so the
  // kR = 8 instance's bf16 path is not reached). H200, Llama-3.2-1B context 1024, one process
  // (benchmarks/lab/variants_ab.py): batch 4 2.891 against 3.399 ms a step on CUDA cores. One row
  // stays on CUDA cores: on tensor cores a batch-1 step took 1.172 against 1.112 ms (the LM-head
  // tiles 130.4 against 119.8 us; TILEC_LAB_MMA1_DIAG of benchmarks/lab/patches/s30-labs.patch).
  constexpr bool kDiag = kR > 1 && std::is_same<TXS, __nv_bfloat16>::value;
  constexpr int kPairs = (kR + 1) / 2;  // kDiag: x rows 2p (A rows 0..7) and 2p + 1 (A rows 8..15) share an mma
  float dA[kPairs][4], dB[kPairs][4];   // two accumulator chains per row pair
#pragma unroll
  for (int p = 0; p < kPairs; ++p)
#pragma unroll
    for (int e = 0; e < 4; ++e) dA[p][e] = dB[p][e] = 0.f;
  int g = 0, kb = 0;  // item i = (column group g, K block kb), kb fastest
#pragma unroll 1
  for (int i = 0; i < items; ++i) {
    const int n = t.n0 + g * kWarps + warp;
    const int kk = kb * kStreamK, len = min(kStreamK, kl - kk);
    // aborted (watchdog, or a stalled stream): leave the loop, still joining the closing barrier
    const bool in = mbar_wait(r.full + s, ph, r.abort, r.timeout_ns);
    if (!__all_sync(0xffffffffu, in)) {  // aborted: the whole warp leaves (warp_sum below needs all lanes)
      *r.gave_up = 1;
      break;
    }
    if (i == 0) c.mark(2);  // the first weight stage is in
    if (n < t.n1) {
      const uint4* row = reinterpret_cast<const uint4*>(shared_ptr(r.stages) + s * kStageBytes + warp * kRowPitch);
      // A tile of exactly kR rows (a batch-4 step's 4) runs a loop without the per-row tests: with
      // them nvcc branches around every row's dot product (BSSY / BSYNC; an ncu profile of a
      // Llama-3.2-1B batch-4 step put 83 % of its stall samples in this instance, on branch
      // resolution, short-scoreboard waits and a local-memory reload). H200, same process
      // (benchmarks/lab/variants_ab.py --batch 4): 3.584 against 5.002 ms a step, gate / up tiles
      // ~79 against ~124 us, logits bitwise equal. kR = 1 tiles keep the one loop. (bf16 rows of
      // kR > 1 tiles now take the tensor cores, kDiag; float32 rows still this loop.)
      auto dots = [&](auto full) {  // full: every row of the instance in use (a compile-time bool)
#pragma unroll 2
        for (int v = lane; v < len / 8; v += 32) {
          const uint4 wv = row[v];
#pragma unroll
          for (int m = 0; m < kR; ++m)
            if (decltype(full)::value || m < nr) acc[m] += dot8_bf16(wv, xs + m * kl + kk + v * 8);
        }
      };
      if constexpr (kDiag) {
        // x rows on tensor cores, the warp's own weight row split into 8 chunks: lane (g, q)
        // loads the same 16 bytes (k 8 lane..) of each 256-k segment as the CUDA-core loop (dots), and
        // m16n8k16 multiplies x chunk g of row 2p (A row g) and of row 2p + 1 (A row g + 8) by
        // weight chunk n (B column n); the diagonals D[g][g] and D[g + 8][g] hold chunk g's dot
        // products (see mma_k32's k permutation).
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll 2
        for (int v0 = 0; v0 < len / 8; v0 += 32) {
          const bool in = v0 + lane < len / 8;
          const uint4 wv = in ? row[v0 + lane] : zero;
#pragma unroll
          for (int p = 0; p < kPairs; ++p) {
            const uint4 lo = in && 2 * p < nr ? reinterpret_cast<const uint4*>(xs + 2 * p * kl + kk)[v0 + lane] : zero;
            const uint4 hi = in && 2 * p + 1 < nr ? reinterpret_cast<const uint4*>(xs + (2 * p + 1) * kl + kk)[v0 + lane] : zero;
            const unsigned a1[4] = {lo.x, hi.x, lo.y, hi.y}, a2[4] = {lo.z, hi.z, lo.w, hi.w};
            mma_16816(dA[p], a1, wv.x, wv.y);
            mma_16816(dB[p], a2, wv.z, wv.w);
          }
        }
      } else if (kR > 1 && nr == kR) {
        dots(std::true_type{});
      } else {
        dots(std::false_type{});
      }
    }
    mbar_arrive(r.empty + s);  // every thread releases its own reads (PTX: arrive releases the caller's)
    if (++s == r.nstages) s = 0, ph ^= 1u;
    if (kb == kblocks - 1) {
#pragma unroll
      for (int m = 0; m < kR; ++m)
        if (!kDiag && m < nr) acc[m] = warp_sum(acc[m]);
      if constexpr (kDiag) {
        // lane (g, q) holds D[g][2q], D[g][2q + 1] (row 2p) and D[g + 8][2q], D[g + 8][2q + 1] (row
        // 2p + 1): the diagonal where g / 2 == q
        const int gg = lane >> 2;
        const bool diag = (gg >> 1) == (lane & 3), odd = gg & 1;
#pragma unroll
        for (int p = 0; p < kPairs; ++p) {
          if (2 * p < nr) acc[2 * p] = warp_sum(diag ? (odd ? dA[p][1] + dB[p][1] : dA[p][0] + dB[p][0]) : 0.f);
          if (2 * p + 1 < kR && 2 * p + 1 < nr)
            acc[2 * p + 1] = warp_sum(diag ? (odd ? dA[p][3] + dB[p][3] : dA[p][2] + dB[p][2]) : 0.f);
#pragma unroll
          for (int e = 0; e < 4; ++e) dA[p][e] = dB[p][e] = 0.f;
        }
      }
      // lane m stores row m (warp_sum leaves every lane the sums): the rows' residual loads and
      // stores go out together rather than one after another from lane 0, and acc stays in
      // registers (lane 0's loop indexed it at run time, which put it in local memory). H100, Llama-3.2-1B
      // batch 4, context 1024: 2.203 against 2.776 ms a step, logits bitwise equal (TILEC_LAB_PAR_STORE
      // of the thirty-ninth session's lab patch, A/B in one process on 2026-12-05)
      if (lane < nr && n < t.n1) {
        float b = 0.f;
        if (kBias && store.variant == 0) b = to_f<TB>(base<TB>(operands()[2])[(long long)n * operands()[2].strides[0]]);
        float v = acc[0];
#pragma unroll
        for (int m = 1; m < kR; ++m)
          if (lane == m) v = acc[m];
        store(lane, n, v + b);
      }
#pragma unroll
      for (int m = 0; m < kR; ++m) acc[m] = 0.f;
      kb = 0, ++g;
    } else {
      ++kb;
    }
  }
  block_sync();  // every compute thread has read r.next
  if (threadIdx.x == 0) *r.next = first + items;
}

// ---- tensor-core GEMV for 9..64 rows ----
// Rows [0, nr <= 16) x columns [n0, n1) of bf16 W [N, K] (unit K stride, 16-byte aligned rows,
// (k1 - k0) % 32 == 0) with tensor cores: warp w owns column groups of 8, streaming its 8 rows of
// W with kU 16-byte loads per lane in flight. A comes from the staged float rows xs [nr][kl]
// (xs != nullptr) or straight from bf16 x rows at element offsets xrow[m] + k0.
template <typename TB, typename TO, bool kBias>
__device__ __noinline__ void gemv_bf16_mma(const TileCtx& c, const __nv_bfloat16* w, long long wn, int n0, int n1,
                                           int k0, int k1, const float* xs, const __nv_bfloat16* x,
                                           const long long* xrow, int nr, const GemvStore<TO>& store) {
  if (xs) xs = shared_ptr(xs);
  xrow = shared_ptr(xrow);
  constexpr int kU = 8;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3;
  const int kl = k1 - k0, rlo = lane >> 2, rhi = rlo + 8;
  const unsigned long long policy = evict_first_policy();
  auto load_a = [&](int r, int k) -> uint4 {  // 8 bf16 of A row r at k (zeros past nr)
    if (r >= nr) return make_uint4(0u, 0u, 0u, 0u);
    if (xs) {
      const float4 u = *reinterpret_cast<const float4*>(xs + r * kl + k);
      const float4 v = *reinterpret_cast<const float4*>(xs + r * kl + k + 4);
      return make_uint4(pack_bf16x2(u.x, u.y), pack_bf16x2(u.z, u.w), pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
    }
    return __ldcg(reinterpret_cast<const uint4*>(x + xrow[r] + k0 + k));
  };
#pragma unroll 1
  for (int g8 = warp; g8 * 8 < n1 - n0; g8 += kWarps) {
    const int col = min(n0 + g8 * 8 + rlo, n1 - 1);  // past n1: a valid row, never stored
    const __nv_bfloat16* wrow = w + (long long)col * wn + k0 + 8 * q;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int kb = 0; kb < kl; kb += 32 * kU) {
      uint4 b[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (kb + 32 * u < kl) b[u] = ld_stream16(wrow + kb + 32 * u, policy);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int k = kb + 32 * u + 8 * q;
        if (kb + 32 * u < kl) mma_k32(acc, load_a(rlo, k), load_a(rhi, k), b[u]);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // accumulator i: row (i < 2 ? rlo : rhi), column 2q + (i & 1) of the group
      const int m = i < 2 ? rlo : rhi, n = n0 + g8 * 8 + 2 * q + (i & 1);
      if (m < nr && n < n1) {
        float b0 = 0.f;
        if (kBias && store.variant == 0) b0 = to_f<TB>(base<TB>(operands()[2])[(long long)n * operands()[2].strides[0]]);
        store(m, n, acc[i] + b0);
      }
    }
  }
}

// ---- streamed weights on tensor cores: TILEC_GEMV_RING_ROWS + 1 .. 16 x rows -------------
// The ring's stages (8 weight rows = 8 output columns x a K block) feed mma.sync m16n8k16: warp w
// takes K slice [w * kStreamK / kWarps, ...) of every stage - B is stage row g at k + 8q, one
// 16-byte load per lane (rows kRowPitch apart: conflict-free, see stream.cuh), A the bf16 x rows
// xb at pitch xpitch (kl + 32: likewise) - accumulating a 16 x 8 partial product; at a column group's
// last K block the warps' partials are summed through shared memory (red: kWarps x 128 floats).
// A warp whose stream wait gave up keeps iterating without waiting (every later wait fails at
// once), so all warps reach the same block barriers.
template <typename TB, typename TO, bool kBias>
__device__ __forceinline__ void gemv_bf16_ring_mma(const TileCtx& c, const StreamTile& t, const __nv_bfloat16* xb,
                                                   int xpitch, int nr, float* red, const GemvStore<TO>& store) {
  static_assert(kWarps == 8 && kStreamK % (32 * kWarps) == 0, "a column group is the mma's n = 8");
  const WeightRing& r = *c.ring;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int kl = t.k1 - t.k0, kblocks = t.kblocks(), items = t.items();
  const int first = *r.next;
  int s = first % r.nstages;
  unsigned ph = (unsigned)(first / r.nstages) & 1u;
  c.mark(1);  // x staged (and its prologue applied)
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  bool live = true;
  int gi = 0, kb = 0;  // item i = (column group gi, K block kb), kb fastest
#pragma unroll 1
  for (int i = 0; i < items; ++i) {
    const int kk = kb * kStreamK, len = min(kStreamK, kl - kk);
    if (live && !__all_sync(0xffffffffu, mbar_wait(r.full + s, ph, r.abort, r.timeout_ns))) {
      *r.gave_up = 1;  // aborted: the executor leaves the queue after this op
      live = false;
    }
    if (i == 0) c.mark(2);  // the first weight stage is in
    if (live) {
      const char* stage = shared_ptr(r.stages) + s * kStageBytes;
#pragma unroll 2
      for (int j = 0; j < kStreamK / (32 * kWarps); ++j) {
        const int k = warp * (kStreamK / kWarps) + 32 * j, kq = k + 8 * q;  // k within the stage
        if (k >= len) break;  // the same for the whole warp
        const bool in = kq < len;  // kl % 8 == 0: a lane's 8 k are all in or all out
        const uint4 b = in ? *reinterpret_cast<const uint4*>(stage + g * kRowPitch + kq * 2) : zero;
        const uint4 alo = in && g < nr ? *reinterpret_cast<const uint4*>(xb + g * xpitch + kk + kq) : zero;
        const uint4 ahi = in && g + 8 < nr ? *reinterpret_cast<const uint4*>(xb + (g + 8) * xpitch + kk + kq) : zero;
        mma_k32(acc, alo, ahi, b);
      }
      mbar_arrive(r.empty + s);  // every thread releases its own reads
    }
    if (++s == r.nstages) s = 0, ph ^= 1u;
    if (kb == kblocks - 1) {  // the column group: sum the warps' K slices
      reinterpret_cast<float4*>(red)[warp * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      block_sync();
      if (live && threadIdx.x < 128) {
        const int l = threadIdx.x >> 2, a = threadIdx.x & 3;  // lane l's accumulator a
        float v = 0.f;
        for (int w = 0; w < kWarps; ++w) v += red[(w * 32 + l) * 4 + a];
        // accumulator a of lane l: row l / 4 (+ 8 for a >= 2), column 2 (l % 4) + a % 2 of the group
        const int m = (l >> 2) + (a < 2 ? 0 : 8), n = t.n0 + gi * kWarps + 2 * (l & 3) + (a & 1);
        if (m < nr && n < t.n1) {
          float bias = 0.f;
          if (kBias && store.variant == 0) bias = to_f<TB>(base<TB>(operands()[2])[(long long)n * operands()[2].strides[0]]);
          store(m, n, v + bias);
        }
      }
      block_sync();  // red is free again
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      kb = 0, ++gi;
    } else {
      ++kb;
    }
  }
  block_sync();  // every compute thread has read r.next
  if (threadIdx.x == 0) *r.next = first + items;
}

// Stages rows [nr][k1 - k0] of x (element offsets xoff[r], K stride xk) into xs as float.
template <typename TX>
__device__ void stage_rows(const Operand& x, const long long* xoff, long long xk, int nr, int k0, int k1, float* xs) {
  const int kl = k1 - k0;
  bool vec = sizeof(TX) == 2 && xk == 1 && kl % 8 == 0;
  for (int r = 0; r < nr && vec; ++r) vec = ((reinterpret_cast<uintptr_t>(base<TX>(x) + xoff[r] + k0) & 15) == 0);
  if constexpr (std::is_same<TX, __nv_bfloat16>::value) {
    if (vec) {  // 16-byte loads of 8 bf16 (x is produced by other CTAs: L2-coherent loads)
      const int nv = nr * (kl / 8);
      for (int e0 = threadIdx.x; e0 < nv; e0 += 2 * kThreads) {  // 2 loads in flight per thread
        uint4 raw[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int e = e0 + j * kThreads;
          if (e < nv) {
            const int r = e / (kl / 8), k = (e % (kl / 8)) * 8;
            raw[j] = __ldcg(reinterpret_cast<const uint4*>(base<TX>(x) + xoff[r] + k0 + k));
          }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int e = e0 + j * kThreads;
          if (e < nv) {
            const int r = e / (kl / 8), k = (e % (kl / 8)) * 8;
            const uint4 v = raw[j];
            float4* dst = reinterpret_cast<float4*>(xs + r * kl + k);
            dst[0] = make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                                 __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
            dst[1] = make_float4(__uint_as_float(v.z << 16), __uint_as_float(v.z & 0xffff0000u),
                                 __uint_as_float(v.w << 16), __uint_as_float(v.w & 0xffff0000u));
          }
        }
      }
      return;
    }
  }
  for (int e = threadIdx.x; e < nr * kl; e += kThreads)
    xs[e] = ldf<TX>(x, xoff[e / kl] + (long long)(k0 + e % kl) * xk);
}

// xs[e] = f(e, xs[e], side element) over nr staged rows of kl elements (e = r * kl + k): the
// side operand is a vector (offset k0 + k; rowoff == nullptr) or rows at element offsets
// rowoff[r]. bf16 with unit stride loads 8 elements per 16-byte load, 2 loads in flight.
template <typename TX, typename F>
__device__ __forceinline__ void apply_side(const Operand& side, const long long* rowoff, int nr, int k0, int kl,
                                           float* xs, F f) {
  const long long st = side.strides[side.ndim - 1];
  bool vec = std::is_same<TX, __nv_bfloat16>::value && st == 1 && kl % 8 == 0;
  for (int r = 0; r < (rowoff ? nr : 1) && vec; ++r)
    vec = ((reinterpret_cast<uintptr_t>(base<TX>(side) + (rowoff ? rowoff[r] : 0) + k0) & 15) == 0);
  if (vec) {
    const int nv = nr * (kl / 8);
    for (int v0 = threadIdx.x; v0 < nv; v0 += 2 * kThreads) {
      uint4 raw[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int v = v0 + j * kThreads;
        if (v < nv) {
          const int r = v / (kl / 8), k = (v % (kl / 8)) * 8;
          raw[j] = __ldcg(reinterpret_cast<const uint4*>(base<TX>(side) + (rowoff ? rowoff[r] : 0) + k0 + k));
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int v = v0 + j * kThreads;
        if (v < nv) {
          const int e = v * 8;
          const unsigned wd[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            const float sv = __uint_as_float(t & 1 ? (wd[t / 2] & 0xffff0000u) : (wd[t / 2] << 16));
            xs[e + t] = f(e + t, xs[e + t], sv);
          }
        }
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < nr * kl; e += kThreads) {
    const int r = e / kl, k = e % kl;
    xs[e] = f(e, xs[e], ldf<TX>(side, (rowoff ? rowoff[r] : 0) + (long long)(k0 + k) * st));
  }
}

// The fused prologues (inlined into the op: see gemv_bf16_ring).
template <typename TX>
__device__ __forceinline__ void gemv_rmsnorm_rows(const TileCtx& c, int nr, int k0, int kl, float* xs_smem, float* rscale,
                                               float eps) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (nr <= 2) {  // decode rows: all warps share each row's sum (a lone warp's pass is latency-bound)
    for (int m = 0; m < nr; ++m) {
      float ss = 0.f;
      for (int k = threadIdx.x; k < kl; k += kThreads) ss += xs_smem[m * kl + k] * xs_smem[m * kl + k];
      ss = block_sum(ss, rscale + 32);  // rscale[32..40) is free: at most 2 rows here
      if (threadIdx.x == 0) rscale[m] = rsqrtf(ss / kl + eps);
    }
  } else {
    for (int m = warp; m < nr; m += kWarps) {
      float ss = 0.f;
      for (int k = lane; k < kl; k += 32) ss += xs_smem[m * kl + k] * xs_smem[m * kl + k];
      ss = warp_sum(ss);
      if (lane == 0) rscale[m] = rsqrtf(ss / kl + eps);
    }
  }
  block_sync();
  apply_side<TX>(operands()[1], nullptr, nr, k0, kl, xs_smem, [&](int e, float x, float wv) {
    return round_to<TX>(round_to<TX>(x * rscale[e / kl]) * wv);
  });
}
template <typename TX>
__device__ __forceinline__ void gemv_silu_mul_rows(const TileCtx& c, const long long* soff, int nr, int k0, int kl,
                                                float* xs_smem) {
  apply_side<TX>(operands()[1], soff, nr, k0, kl, xs_smem, [&](int, float g, float u) {
    return round_to<TX>(round_to<TX>(g / (1.f + __expf(-g))) * u);
  });
}
template <typename TX>
__device__ __forceinline__ void gemv_mul_rows(const TileCtx& c, const long long* soff, int nr, int k0, int kl,
                                           float* xs_smem) {
  apply_side<TX>(operands()[1], soff, nr, k0, kl, xs_smem, [&](int, float s, float u) { return round_to<TX>(s * u); });
}

// A ring-fed GEMV tile's bf16 x rows, staged as bf16 rows xb [nr][pitch] with the fused prologue
// applied (pro 1: RMSNorm with weight operand 1; pro 2: SiLU(x) * operand 1 rows at soff; pro 3:
// x * operand 1 rows at soff). The rows
// (and the RMSNorm weight, or the SiLU-mul side rows, into side_s: kl, or nr x kl elements) come
// in with 16-byte cp.async copies issued by a rolled loop - every copy in flight at once, in a few
// instructions - and the prologue is applied in shared memory. The executor is one kernel that
// holds every op, so a tile's code is often not in the instruction cache: unrolled staging code
// cost more in instruction fetches than its loads did (a 16 x 2048 staging took ~24 us on an
// H200). The RMSNorm row sums are taken in a fixed order. Same rounding points as
// gemv_stage_rows. Returns false (nothing staged) unless x and the side operand allow it: unit K
// stride, 16-byte aligned rows, kl % 8 == 0.
__device__ __forceinline__ float bf16_lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }
// q plus the squares of 8 bf16 values (a 16-byte vector), added in element pairs.
__device__ __forceinline__ float sumsq_bf16x8(float q, const uint4& a) {
  const unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) q += bf16_lo(w[i]) * bf16_lo(w[i]) + bf16_hi(w[i]) * bf16_hi(w[i]);
  return q;
}
// 8 RMSNormed bf16 values: round_to<bf16>(x * rs) * w, as gemv_rmsnorm_rows rounds them.
__device__ __forceinline__ uint4 rmsnorm_bf16x8(const uint4& a, const uint4& g, float rs) {
  const unsigned xw[4] = {a.x, a.y, a.z, a.w}, sw[4] = {g.x, g.y, g.z, g.w};
  unsigned res[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    res[i] = bf16x2_bits(round_to<__nv_bfloat16>(bf16_lo(xw[i]) * rs) * bf16_lo(sw[i]),
                         round_to<__nv_bfloat16>(bf16_hi(xw[i]) * rs) * bf16_hi(sw[i]));
  return make_uint4(res[0], res[1], res[2], res[3]);
}
// Whether stage_bf16_rows can stage these rows (it stages nothing otherwise).
__device__ __forceinline__ bool bf16_rows_stageable(const TileCtx& c, const long long* xoff, const long long* soff,
                                                    long long xk, int nr, int k0, int kl, int pro, int pitch) {
  const Operand &x = operands()[0], &side = operands()[1];
  if (xk != 1 || kl % 8 || pitch % 8) return false;
  if (pro != 0 && (side.strides[side.ndim - 1] != 1 || !aligned16(side.ptr))) return false;
  for (int r = 0; r < nr; ++r) {
    if (!aligned16(base<__nv_bfloat16>(x) + xoff[r] + k0)) return false;
    if (pro >= 2 && !aligned16(base<__nv_bfloat16>(side) + soff[r] + k0)) return false;
  }
  return pro != 1 || aligned16(base<__nv_bfloat16>(side) + k0);
}
__device__ __forceinline__ bool stage_bf16_rows(const TileCtx& c, const long long* xoff, const long long* soff, long long xk,
                                                int nr, int k0, int kl, int pro, float eps, __nv_bfloat16* xb, int pitch,
                                                __nv_bfloat16* side_s, float* rscale, bool checked = false) {
  const Operand &x = operands()[0], &side = operands()[1];
  const int vpr = kl / 8, nv = nr * vpr;  // 16-byte vectors per row, in all
  if (!checked && !bf16_rows_stageable(c, xoff, soff, xk, nr, k0, kl, pro, pitch)) return false;
  const __nv_bfloat16* xp = base<__nv_bfloat16>(x);
  const __nv_bfloat16* sp = base<__nv_bfloat16>(side);
  // One row's RMSNorm from registers: x and the norm weight come in with 16-byte loads (one
  // round trip), every warp sums its own vectors' squares, one barrier for the 8 warp sums (added
  // in warp order), and each thread writes its normed bf16 vectors; the multi-row path below
  // stages through shared memory and one warp sums a row (8 dependent rounds). Measured on an
  // H200 (benchmarks/lab/variants_ab.py, Llama-3.2-1B batch 1, context 1024, one process): a
  // step 1.312 against 1.339 ms, the q/k/v and gate/up tiles' staging 1.15-1.22 against 2.0-2.1
  // us, logits bitwise equal (the sums' order differs from the other path's: last-bit
  // differences in the scale are possible).
  if (pro == 1 && nr == 1 && vpr <= kThreads) {  // one 16-byte vector per thread (kl <= 2048): few registers
    const int v = threadIdx.x;
    uint4 xr = make_uint4(0u, 0u, 0u, 0u), wr = xr;
    if (v < vpr) {
      xr = __ldcg(reinterpret_cast<const uint4*>(xp + xoff[0] + k0 + v * 8));
      wr = __ldcg(reinterpret_cast<const uint4*>(sp + k0 + v * 8));
    }
    const float q = warp_sum(sumsq_bf16x8(0.f, xr));
    float* part = rscale + 32;  // rscale[1..kMaxRows) is free with one row
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = q;
    block_sync();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += part[w];
    const float rs = rsqrtf(total / kl + eps);
    if (v < vpr) *reinterpret_cast<uint4*>(xb + v * 8) = rmsnorm_bf16x8(xr, wr, rs);
    block_sync();
    return true;
  }
#pragma unroll 1
  for (int v = threadIdx.x; v < nv; v += kThreads) {
    const int r = v / vpr, k = (v - r * vpr) * 8;
    cp_async16(xb + r * pitch + k, xp + xoff[r] + k0 + k);
    if (pro >= 2) cp_async16(side_s + r * kl + k, sp + soff[r] + k0 + k);
  }
  if (pro == 1)
#pragma unroll 1
    for (int v = threadIdx.x; v < vpr; v += kThreads) cp_async16(side_s + v * 8, sp + k0 + v * 8);
  cp_async_wait_all();
  block_sync();
  if (pro == 0) return true;
  if (pro == 1) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll 1
    for (int r = warp; r < nr; r += kWarps) {  // each row's sum of squares in a fixed order
      float q = 0.f;
#pragma unroll 1
      for (int v = lane; v < vpr; v += 32) q = sumsq_bf16x8(q, *reinterpret_cast<const uint4*>(xb + r * pitch + v * 8));
      q = warp_sum(q);
      if (lane == 0) rscale[r] = rsqrtf(q / kl + eps);
    }
    block_sync();
  }
#pragma unroll 1
  for (int v = threadIdx.x; v < nv; v += kThreads) {
    const int r = v / vpr, k = (v - r * vpr) * 8;
    uint4* p = reinterpret_cast<uint4*>(xb + r * pitch + k);
    const uint4 a = *p, g = *reinterpret_cast<const uint4*>(side_s + (pro == 1 ? k : r * kl + k));
    const unsigned xw[4] = {a.x, a.y, a.z, a.w}, sw[4] = {g.x, g.y, g.z, g.w};
    unsigned res[4];
    if (pro == 1) {
      const uint4 n = rmsnorm_bf16x8(a, g, rscale[r]);
      res[0] = n.x, res[1] = n.y, res[2] = n.z, res[3] = n.w;
    } else if (pro == 2) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // round_to<bf16>(silu(g)) * u, as gemv_silu_mul_rows
        const float gl = bf16_lo(xw[i]), gh = bf16_hi(xw[i]);
        res[i] = bf16x2_bits(round_to<__nv_bfloat16>(gl / (1.f + __expf(-gl))) * bf16_lo(sw[i]),
                             round_to<__nv_bfloat16>(gh / (1.f + __expf(-gh))) * bf16_hi(sw[i]));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)  // s * u: the producer's epilogue applied the SiLU
        res[i] = bf16x2_bits(bf16_lo(xw[i]) * bf16_lo(sw[i]), bf16_hi(xw[i]) * bf16_hi(sw[i]));
    }
    *p = make_uint4(res[0], res[1], res[2], res[3]);
  }
  block_sync();
  return true;
}
// Shared-memory floats stage_bf16_rows' side_s needs for prologue pro (kl elements of the RMSNorm
// weight; nr x kl side rows for SiLU-mul or mul), a multiple of 4.
__device__ __forceinline__ int stage_side_floats(int pro, int nr, int kl) {
  return pro == 1 ? (kl / 2 + 3) / 4 * 4 : pro >= 2 ? (nr * kl / 2 + 3) / 4 * 4 : 0;
}

// ---- streamed weights on tensor cores, K blocks outer: the same rows over a long K ---------
// For K ranges whose bf16 x rows do not fit in shared memory beside the ring (GLM-5's 16 x 6144
// QKV-A projection): the stream is ordered K block outer (stream.cuh), x is staged one K block at
// a time (xb [nr][kStreamK + 32], stage_bf16_rows) and every warp keeps the 16 x 8 partial
// products of all (at most kKouterGroups) column groups of the tile in registers across K blocks;
// the warps' partials are summed through shared memory (red: kWarps x 128 floats) at the end.
// No prologue. A warp whose stream wait gave up keeps iterating without waiting (see
// gemv_bf16_ring_mma), so all warps reach the same block barriers.
constexpr int kKouterGroups = 4;
template <typename TB, typename TO, bool kBias>
__device__ __forceinline__ void gemv_bf16_ring_kouter(const TileCtx& c, const StreamTile& t, const long long* xoff,
                                                      long long xk, int nr, __nv_bfloat16* xb, float* red,
                                                      const GemvStore<TO>& store) {
  constexpr int pitch = kStreamK + 32;
  const WeightRing& r = *c.ring;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int kl = t.k1 - t.k0, kblocks = t.kblocks(), ng = t.groups(), items = t.items();
  const int first = *r.next;
  int s = first % r.nstages;
  unsigned ph = (unsigned)(first / r.nstages) & 1u;
  float acc[kKouterGroups][4] = {};
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  bool live = true;
#pragma unroll 1
  for (int kb = 0; kb < kblocks; ++kb) {
    const int kk = kb * kStreamK, len = min(kStreamK, kl - kk);
    block_sync();  // the previous K block's rows are read
    if (!stage_bf16_rows(c, xoff, nullptr, xk, nr, t.k0 + kk, len, 0, 0.f, xb, pitch, nullptr, nullptr)) {
      // x rows not 16-byte aligned or strided along K (a user's view): one element at a time
      const __nv_bfloat16* xp = base<__nv_bfloat16>(operands()[0]);
#pragma unroll 1
      for (int e = threadIdx.x; e < nr * len; e += kThreads) {
        const int m = e / len, k = e - m * len;
        xb[m * pitch + k] = ldc<__nv_bfloat16>(xp + xoff[m] + (long long)(t.k0 + kk + k) * xk);
      }
      block_sync();
    }
    if (kb == 0) c.mark(1);
#pragma unroll
    for (int gi = 0; gi < kKouterGroups; ++gi) {
      if (gi >= ng) break;
      if (live && !__all_sync(0xffffffffu, mbar_wait(r.full + s, ph, r.abort, r.timeout_ns))) {
        *r.gave_up = 1;
        live = false;
      }
      if (kb == 0 && gi == 0) c.mark(2);
      if (live) {
        const char* stage = shared_ptr(r.stages) + s * kStageBytes;
#pragma unroll 2
        for (int j = 0; j < kStreamK / (32 * kWarps); ++j) {
          const int k = warp * (kStreamK / kWarps) + 32 * j, kq = k + 8 * q;  // k within the K block
          if (k >= len) break;  // the same for the whole warp
          const bool in = kq < len;
          const uint4 b = in ? *reinterpret_cast<const uint4*>(stage + g * kRowPitch + kq * 2) : zero;
          const uint4 alo = in && g < nr ? *reinterpret_cast<const uint4*>(xb + g * pitch + kq) : zero;
          const uint4 ahi = in && g + 8 < nr ? *reinterpret_cast<const uint4*>(xb + (g + 8) * pitch + kq) : zero;
          mma_k32(acc[gi], alo, ahi, b);
        }
        mbar_arrive(r.empty + s);
      }
      if (++s == r.nstages) s = 0, ph ^= 1u;
    }
  }
#pragma unroll
  for (int gi = 0; gi < kKouterGroups; ++gi) {
    if (gi >= ng) break;
    block_sync();  // red is free
    reinterpret_cast<float4*>(red)[warp * 32 + lane] = make_float4(acc[gi][0], acc[gi][1], acc[gi][2], acc[gi][3]);
    block_sync();
    if (live && threadIdx.x < 128) {
      const int l = threadIdx.x >> 2, a = threadIdx.x & 3;  // lane l's accumulator a (see gemv_bf16_ring_mma)
      float v = 0.f;
      for (int w = 0; w < kWarps; ++w) v += red[(w * 32 + l) * 4 + a];
      const int m = (l >> 2) + (a < 2 ? 0 : 8), n = t.n0 + gi * kWarps + 2 * (l & 3) + (a & 1);
      if (m < nr && n < t.n1) {
        float bias = 0.f;
        if (kBias && store.variant == 0) bias = to_f<TB>(base<TB>(operands()[2])[(long long)n * operands()[2].strides[0]]);
        store(m, n, v + bias);
      }
    }
  }
  block_sync();  // every compute thread has read r.next and red
  if (threadIdx.x == 0) *r.next = first + items;
}

// Stages a GEMV tile's x rows as float in shared memory, then applies the fused prologue (pro 1:
// RMSNorm with weight operand 1; pro 2: SiLU(x) * operand 1; pro 3: x * operand 1).
template <typename TX>
__device__ __forceinline__ void gemv_stage_rows(const TileCtx& c, const Operand& x, const long long* xoff,
                                             const long long* soff, long long xk, int nr, int k0, int k1,
                                             float* xs_smem, float* rscale, int pro, float eps) {
  stage_rows<TX>(x, xoff, xk, nr, k0, k1, xs_smem);
  block_sync();
  if (pro == 1) gemv_rmsnorm_rows<TX>(c, nr, k0, k1 - k0, xs_smem, rscale, eps);
  else if (pro == 2) gemv_silu_mul_rows<TX>(c, soff, nr, k0, k1 - k0, xs_smem);
  else if (pro == 3) gemv_mul_rows<TX>(c, soff, nr, k0, k1 - k0, xs_smem);
  if (pro != 0) block_sync();
}

// The GEMV for any dtypes and strides (warp per column, lanes over K); out of line.
template <typename TX, typename TW, typename TB, typename TO, bool kBias>
__device__ __noinline__ void gemv_generic(const TileCtx& c, const Operand& x, const Operand& w, const Operand& out,
                                          int n0, int n1, int k0, int k1, int nr, const long long* xoff,
                                          const long long* ooff, long long xk, long long wn, long long wk, long long on,
                                          bool staged, const float* xs_smem, int variant, const GemvStore<TO>& store) {
  const int kl = k1 - k0;
  xoff = shared_ptr(xoff), ooff = shared_ptr(ooff), xs_smem = shared_ptr(xs_smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int n = n0 + warp; n < n1; n += kWarps) {
    const TW* wrow = base<TW>(w) + (long long)n * wn;
    float bias = 0.f;  // added by write tiles (0) and init tiles (1), never by split-K partials (2)
    if (kBias && variant != 2) bias = to_f<TB>(base<TB>(operands()[2])[(long long)n * operands()[2].strides[0]]);
    for (int m0 = 0; m0 < nr; m0 += kRowsPerPass) {
      float acc[kRowsPerPass];
#pragma unroll
      for (int m = 0; m < kRowsPerPass; ++m) acc[m] = 0.f;
      if (variant != 1) {
        for (int k = k0 + lane; k < k1; k += 32) {
          float wv = to_f<TW>(wrow[(long long)k * wk]);
#pragma unroll
          for (int m = 0; m < kRowsPerPass; ++m)
            if (m0 + m < nr)
              acc[m] += (staged ? xs_smem[(m0 + m) * kl + (k - k0)]
                                : ldf<TX>(x, xoff[m0 + m] + (long long)k * xk)) * wv;
        }
#pragma unroll
        for (int m = 0; m < kRowsPerPass; ++m) acc[m] = warp_sum(acc[m]);
      }
      if (lane == 0) {
        for (int m = 0; m < kRowsPerPass && m0 + m < nr; ++m) {
          if (variant == 1) stf<TO>(out, ooff[m0 + m] + (long long)n * on, bias);
          else store(m0 + m, n, acc[m] + bias);
        }
      }
    }
  }
}

// A GEMV tile's setup, done ahead by the executor's controller warp (executor.cuh control) for
// instruction slot `slot` while the compute warps still run the previous instruction:
// tilec_rowoff[slot][k][r] = element offset of row r of the out box in operand k (k < kPrepOps
// covers linear's x, W, out and linear_fused's x, side, W, resid, out), tilec_stream[slot] and
// tilec_stream_ok[slot] = its weight stream's range (stream_range), and tilec_rowinfo[slot] = rows |
// out dims << 16, or 0 when the tile has more than kPrepRows rows (it then sets itself up). On an
// H200 the two took ~0.9 us of a GEMV's setup before its wait (lab marks, benchmarks/RESULTS.md,
// twenty-eighth session); with the stream range from here too the Llama-3.2-1B step took 1.132
// against 1.178 ms with the row offsets alone (one process, logits bitwise equal).
constexpr int kPrepRows = 8, kPrepOps = 5;
__shared__ long long tilec_rowoff[2][kPrepOps][kPrepRows];
__shared__ int tilec_rowinfo[2];
__shared__ StreamTile tilec_stream[2];
__shared__ int tilec_stream_ok[2];
// One warp: descriptor d's row offsets and stream range in operands ops (decoded) into slot `slot`.
__device__ __forceinline__ void gemv_prepare(const int* d, const Operand* ops, int slot) {
  const int nd = d[TILEC_W_NCOORDS] - 1;  // the out box's dims, then the K range
  int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (k < nd) lo[k] = d[TILEC_W_COORDS + 2 * k], hi[k] = d[TILEC_W_COORDS + 2 * k + 1];
  const int rows = box_rows(nd, lo, hi);
  if (rows <= kPrepRows)
    for (int e = threadIdx.x & 31; e < kPrepOps * rows; e += 32) {
      const int k = e / rows, r = e - k * rows;
      int idx[4];
      row_index(r, nd, lo, hi, idx);
      tilec_rowoff[slot][k][r] = offset4(ops[k], idx);
    }
  if ((threadIdx.x & 31) == 0) {
    const int s = d[TILEC_W_STREAM], wo = (s & 15) - 1;  // the streamed weight's operand
    StreamTile t{};
    tilec_stream_ok[slot] = wo >= 0 && stream_range(d, ops[wo].ptr, ops[wo].strides[0], t);
    tilec_stream[slot] = t;
    tilec_rowinfo[slot] = rows <= kPrepRows ? rows | nd << 16 : 0;
  }
}

// GEMV tile. `wi`/`oi`: operand indices of W and out. Fused (linear_fused) tiles also apply
// a prologue to the staged rows - pro 1: RMSNorm with weight operand 1 (eps), pro 2: SiLU(x)
// times operand 1, pro 3: x times operand 1 - and an epilogue (epi 1: + resid, operand wi + 1;
// epi 2: SiLU of the rounded value), with the rounding
// points of the unfused rmsnorm / silu_mul / binary-add ops (tilec/ops/linear_fused.py).
// kRowCap: a bound on the op's rows that the plan guarantees (1, 4, 8 or 16; 0 = any,
// tilec.ops.row_cap); the instance keeps only the paths its rows can take. Llama-3.2-1B's
// linear_fused instance went from 185 to 82 KB of SASS, and 8 independent M = 1 GEMVs from
// 2.13 / 3.01 / 3.04 to 2.44 / 3.31 / 3.39 TB/s on an H200 (2048 x 8192, 4096 x 14336,
// 128256 x 2048; same run, 2 ring stages). A tile with more rows than promised is a plan bug:
// the worker aborts the step (the host raises a WatchdogError).
// reuse_x: the worker's previous instruction staged the same bf16 x rows (tilec/plan.py sets it
// from OpDef.staged_x; same x, prologue, rows and K range): when the executor confirms they are
// still in shared memory (c.x_staged_in), they are not staged again. A tile of at most kPrepRows rows
// takes its row offsets and stream range from the controller (gemv_prepare).
template <typename TX, typename TW, typename TB, typename TO, bool kBias, int kRowCap, bool kFused = false>
__device__ void linear_impl(TileCtx& c, int wi, int oi, int pro = 0, int epi = 0, float eps = 0.f, bool reuse_x = false) {
  constexpr int kRingRows = TILEC_GEMV_RING_ROWS;                      // the CUDA-core ring consumer's rows at most
  constexpr bool kMmaRows = kRowCap == 0 || kRowCap > kRingRows;      // tensor-core rows may occur
  // K-outer tiles of 2..kRingRows rows come only from plain linears (a fused tile reserves its float
  // rows: tilec/ops/linear_fused.py); compiled into the fused 4-row instance the branch added spills
  // to its other paths (ptxas -v: 1012 -> 1268 bytes of spill loads)
  constexpr bool kKouter = kMmaRows || (kRowCap != 1 && !kFused);
  constexpr int kR = kRowCap == 1 ? 1 : kRowCap == 4 ? 4 : 8;         // the widest row-register instance
  const Operand &x = operands()[0], &w = operands()[wi];
  const Operand &out = operands()[oi];
  const Operand* resid = epi == 1 ? &operands()[wi + 1] : nullptr;
  const int nd = out.ndim;
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int n0 = c.lo(nd - 1), n1 = c.hi(nd - 1);
  const int k0 = c.lo(nd), k1 = c.hi(nd);
  const int variant = c.variant();
  const int rows = box_rows(nd, lo, hi);
  long long* xoff = reinterpret_cast<long long*>(c.smem());
  long long* ooff = xoff + kMaxRows;
  long long* roff = ooff + kMaxRows;  // resid rows (epilogue), or the side operand's rows (SiLU-mul)
  long long* soff = roff + kMaxRows;
  float* rscale = reinterpret_cast<float*>(soff + kMaxRows);  // per-row RMSNorm factors
  float* xs_smem = rscale + kMaxRows;                          // 16-byte aligned (2304 bytes in)
  const int slot = c.instr & 1;
  const bool prepared = tilec_rowinfo[slot] == (rows | nd << 16);  // the controller's setup (gemv_prepare)
  if (prepared) {
    xoff = tilec_rowoff[slot][0];
    ooff = tilec_rowoff[slot][oi];
    if (resid) roff = tilec_rowoff[slot][wi + 1];
    soff = tilec_rowoff[slot][1];
  }
  const long long xk = x.strides[x.ndim - 1], wn = w.strides[0], wk = w.strides[1], on = out.strides[nd - 1];
  const int kl = k1 - k0;
  if (kRowCap != 0 && rows > kRowCap) {  // the plan promised fewer rows: fail loudly
    if (threadIdx.x == 0) atomicCAS(c.ring->abort, 0, 2);
    *c.ring->gave_up = 1;
    return;
  }
  // The executor dispatches a GEMV before its event wait (TileCtx::wait): everything up to the
  // wait below reads only the descriptor and the operand table, never a producer's data.
  for (int r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int nr = min(kMaxRows, rows - r0);
    if (!prepared) {
      if (r0 > 0) block_sync();  // the previous chunk is done with the row offsets
      for (int r = threadIdx.x; r < nr; r += kThreads) {
        int idx[4] = {0, 0, 0, 0};
        row_index(r0 + r, nd, lo, hi, idx);
        xoff[r] = offset4(x, idx);
        ooff[r] = offset4(out, idx);
        if (resid) roff[r] = offset4(*resid, idx);
        if (pro >= 2) soff[r] = offset4(operands()[1], idx);
      }
      block_sync();
    }
    // stage this chunk's x rows (K range) in shared memory as float when they fit (fused
    // tiles always fit: the fusion pass checks)
    const bool staged = (long long)nr * kl + 2304 / 4 <= (long long)c.smem_floats - 64;
    const GemvStore<TO> store{out, resid, ooff, roff, on, resid ? resid->strides[resid->ndim - 1] : 0, variant, epi == 2};
    // Streamed weights (the loader fills the ring): x as bf16 rows xb [nr][pitch] - pitch kl, or for
    // the tensor-core consumer (kRingRows + 1..16 rows) kl + 32, which puts rows 64 mod 128 bytes apart (for
    // kl % 64 == 0: conflict-free A loads), with room after them for its cross-warp sums (red).
    StreamTile t;
    bool ring = false;
    if (std::is_same<TW, __nv_bfloat16>::value && tilec_ring_stages > 0) {
      if (prepared) {
        t = tilec_stream[slot];
        ring = tilec_stream_ok[slot] != 0;
      } else {
        ring = stream_range(c.d, w.ptr, wn, t);
      }
    }
    const bool mma = kMmaRows && nr > kRingRows;
    // tensor-core bf16 rows over a long K, no prologue (tilec/ops/__init__.py kouter_rows): 5..16 rows,
    // or 2..kRingRows whose float rows would leave the ring no room
    if (kKouter && ring && t.kouter) {
      constexpr int kPitch = kStreamK + 32;
      if (std::is_same<TX, __nv_bfloat16>::value && nr > 1 && nr <= 16 && pro == 0 && variant != 1 &&
          t.n1 - t.n0 <= kWarps * kKouterGroups && 576 + nr * kPitch / 2 + kWarps * 128 <= c.smem_floats - 64) {
        if (!c.wait()) return;
        gemv_bf16_ring_kouter<TB, TO, kBias>(c, t, xoff, xk, nr, reinterpret_cast<__nv_bfloat16*>(xs_smem),
                                             xs_smem + nr * kPitch / 2, store);
      } else {  // plan.py rules this out; fail loudly
        if (threadIdx.x == 0) atomicCAS(c.ring->abort, 0, 2);
        *c.ring->gave_up = 1;
      }
      continue;
    }
    if (ring && (!staged || variant == 1 ||
                 (mma && (!std::is_same<TX, __nv_bfloat16>::value || nr > 16 || kl > 4096 || kl < 32 ||
                          576 + nr * kl + kWarps * 128 > c.smem_floats - 64)))) {  // plan.py rules these out; fail loudly:
      if (threadIdx.x == 0) atomicCAS(c.ring->abort, 0, 2);  // the host raises "weight stream" WatchdogError
      *c.ring->gave_up = 1;                                   // and this worker leaves its queue
      continue;
    }
    const int pitch = mma ? kl + 32 : kl;
    __nv_bfloat16* xb = reinterpret_cast<__nv_bfloat16*>(xs_smem);
    float* side_s = xs_smem + nr * pitch / 2;                // the prologue's other operand (stage_bf16_rows)
    float* red = side_s + stage_side_floats(pro, nr, kl);  // the mma's cross-warp sums
    bool stageable = false;                                  // bf16 x can go straight to bf16 rows xb
    if constexpr (std::is_same<TX, __nv_bfloat16>::value)
      stageable = ring && 576 + (red - xs_smem) + (mma ? kWarps * 128 : 0) <= c.smem_floats - 64 &&
                  bf16_rows_stageable(c, xoff, soff, xk, nr, k0, kl, pro, pitch);
    if (!c.wait()) return;  // the producers of x (and of the prologue's side rows) are done
    bool ready = false;     // xb staged (or still there from the previous instruction)
    if constexpr (std::is_same<TX, __nv_bfloat16>::value)
      ready = stageable && ((reuse_x && c.x_staged_in && rows <= kMaxRows) ||
                            stage_bf16_rows(c, xoff, soff, xk, nr, k0, kl, pro, eps, xb, pitch,
                                            reinterpret_cast<__nv_bfloat16*>(side_s), rscale, true));
    c.x_staged_out = ready && rows <= kMaxRows;  // the bf16 rows stay at xs_smem for the next instruction
    if (!ready && staged && variant != 1) gemv_stage_rows<TX>(c, x, xoff, soff, xk, nr, k0, k1, xs_smem, rscale, pro, eps);
    if (ring) {
      if (!ready && !mma) {
        // bf16 rows (their staged floats are bf16 values) go to the consumer as bf16: half the
        // shared-memory reads per weight (tilec/ops/linear_fused.py ring_staged_bytes reserves them)
        if (!std::is_same<TX, __nv_bfloat16>::value || 576 + nr * kl + nr * kl / 2 > c.smem_floats - 64) {
          gemv_bf16_ring<kR, TB, TO, kBias>(c, t, xs_smem, nr, store);  // float32 rows: one general instance
          continue;
        }
        xb = reinterpret_cast<__nv_bfloat16*>(xs_smem + nr * kl);
        for (int e = threadIdx.x * 8; e < nr * kl; e += kThreads * 8) {
          const float4 a = *reinterpret_cast<const float4*>(xs_smem + e), b = *reinterpret_cast<const float4*>(xs_smem + e + 4);
          *reinterpret_cast<uint4*>(xb + e) = make_uint4(
              (__float_as_uint(a.x) >> 16) | (__float_as_uint(a.y) & 0xffff0000u),
              (__float_as_uint(a.z) >> 16) | (__float_as_uint(a.w) & 0xffff0000u),
              (__float_as_uint(b.x) >> 16) | (__float_as_uint(b.y) & 0xffff0000u),
              (__float_as_uint(b.z) >> 16) | (__float_as_uint(b.w) & 0xffff0000u));
        }
        block_sync();
      } else if (!ready) {
        // the staged float rows become bf16 rows at the pitch in place, one row at a time (for
        // kl >= 32 bf16 row m ends before float row m + 1 starts: no unread row is overwritten)
        red = xs_smem + nr * kl;
        for (int m = 0; m < nr; ++m) {
          float v[4096 / kThreads];
#pragma unroll
          for (int j = 0; j < 4096 / kThreads; ++j) {
            const int k = threadIdx.x + j * kThreads;
            if (k < kl) v[j] = xs_smem[m * kl + k];
          }
          block_sync();
#pragma unroll
          for (int j = 0; j < 4096 / kThreads; ++j) {
            const int k = threadIdx.x + j * kThreads;
            if (k < kl) xb[m * pitch + k] = __float2bfloat16_rn(v[j]);  // exact: the rows are bf16 values
          }
        }
        block_sync();
      }
      if (mma) gemv_bf16_ring_mma<TB, TO, kBias>(c, t, xb, pitch, nr, red, store);
      else if (kR == 1 || nr == 1) gemv_bf16_ring<1, TB, TO, kBias>(c, t, xb, nr, store);
      else if (kR == 4 || nr <= 4) gemv_bf16_ring<4, TB, TO, kBias>(c, t, xb, nr, store);
      else gemv_bf16_ring<8, TB, TO, kBias>(c, t, xb, nr, store);
      continue;
    }
    if constexpr (std::is_same<TW, __nv_bfloat16>::value) {
      const bool wvec = variant != 1 && wk == 1 && (wn * 2) % 16 == 0 &&
                        ((reinterpret_cast<uintptr_t>(base<TW>(w) + k0) & 15) == 0);
      bool xvec = std::is_same<TX, __nv_bfloat16>::value && xk == 1;  // A straight from bf16 x rows
      for (int r = 0; r < nr && xvec; ++r) xvec = ((reinterpret_cast<uintptr_t>(base<TX>(x) + xoff[r] + k0) & 15) == 0);
      if (kMmaRows && wvec && nr > kRowsPerPass && kl % 32 == 0 && (staged || xvec)) {
        const __nv_bfloat16* wp = base<TW>(w);
        for (int m0 = 0; m0 < nr; m0 += 16) {  // 16 rows per pass of W
          const GemvStore<TO> sub{out, resid, ooff + m0, roff + m0, on, store.rn, variant, store.silu};
          gemv_bf16_mma<TB, TO, kBias>(c, wp, wn, n0, n1, k0, k1, staged ? xs_smem + (long long)m0 * kl : nullptr,
                                       reinterpret_cast<const __nv_bfloat16*>(base<TX>(x)), xoff + m0,
                                       min(16, nr - m0), sub);
        }
        continue;
      }
      const bool fast = wvec && staged && nr <= kRowsPerPass && kl % 8 == 0;
      if (fast) {
        const __nv_bfloat16* wp = base<TW>(w);
        if (kR == 1 || nr == 1) gemv_bf16_stream<1, TB, TO, kBias>(c, wp, wn, n0, n1, k0, k1, xs_smem, nr, store);
        else if (kR == 4 || nr <= 4) gemv_bf16_stream<4, TB, TO, kBias>(c, wp, wn, n0, n1, k0, k1, xs_smem, nr, store);
        else gemv_bf16_stream<8, TB, TO, kBias>(c, wp, wn, n0, n1, k0, k1, xs_smem, nr, store);
        continue;
      }
    }
    gemv_generic<TX, TW, TB, TO, kBias>(c, x, w, out, n0, n1, k0, k1, nr, xoff, ooff, xk, wn, wk, on, staged,
                                        xs_smem, variant, store);
  }
}
template <typename TX, typename TW, typename TO, int kRowCap>
__device__ void op_linear(TileCtx& c) { linear_impl<TX, TW, TW, TO, false, kRowCap>(c, 1, 2); }
template <typename TX, typename TW, typename TB, typename TO, int kRowCap>
__device__ void op_linear(TileCtx& c) { linear_impl<TX, TW, TB, TO, true, kRowCap>(c, 1, 3); }
// linear_fused: operands (x | x, norm_w | g, u | s, u), W, (resid: epilogue 1), out; params K, prologue,
// epilogue, eps
template <typename TX, typename TW, typename TO, int kRowCap>
__device__ void op_linear_fused(TileCtx& c) {
  const int pro = c.param(1), epi = c.param(2);
  const int wi = pro ? 2 : 1;
  linear_impl<TX, TW, TW, TO, false, kRowCap, true>(c, wi, wi + (epi == 1 ? 2 : 1), pro, epi, c.fparam(3),
                                                    c.param(4) != 0);
}

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
  const Operand &q = operands()[0], &k = operands()[1], &v = operands()[2], &out = operands()[3];
  const long long valid = operands()[4].scalar;
  const float scale = c.fparam(0);
  const int causal = c.param(1);
  const int Hq = q.sizes[1], Sq = q.sizes[2], D = q.sizes[3], Hkv = k.sizes[1], S = k.sizes[2], Dv = v.sizes[3];
  const int G = Hq / Hkv, nq = G * Sq;
  const int n = causal ? (int)min((long long)S, valid + Sq - 1) : S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qs = c.smem();                       // [kQChunk][256]
  float* sums = qs + kQChunk * 256;         // [kQChunk]
  float* part = sums + kQChunk;             // [kWarps][kQChunk][256] partial P.V
  float* sc = part + kWarps * kQChunk * 256;  // [kQChunk][n]
  for (int b = c.lo(0); b < c.hi(0); ++b)
    for (int h = c.lo(1); h < c.hi(1); ++h)
      for (int q0 = 0; q0 < nq; q0 += kQChunk) {
        const int qc = min(kQChunk, nq - q0);
        block_sync();
        for (int e = threadIdx.x; e < kQChunk * 256; e += kThreads) {
          int qq = e / 256, d = e % 256;
          float val = 0.f;
          if (qq < qc && d < D) {
            int g = (q0 + qq) / Sq, i = (q0 + qq) % Sq;
            int qi[4] = {b, h * G + g, i, d};
            val = ldf<TQ>(q, offset4(q, qi)) * scale;
          }
          qs[e] = val;
        }
        block_sync();
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
        block_sync();
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
        block_sync();
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
        block_sync();
        for (int e = threadIdx.x; e < qc * Dv; e += kThreads) {
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
#include "ops_attention.cuh"  // split-KV decode attention (flash-decoding partials + combine)
