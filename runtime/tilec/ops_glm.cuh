// tilec runtime: device tile ops of the DSA attention prelude (GLM-5 / DeepSeek-V3.2): FP8
// quantization, block-scaled FP8 GEMM, batched matmul (MLA absorption, optionally over FP8
// weight blocks), paged cache write and the paged lightning-indexer score.
// Semantics mirror the CPU references in tilec/ops/{fp8_quant,fp8_linear,bmm,
// paged_cache_write,index_score}.py: float32 math and accumulation, storage in the operand
// dtype. Shared memory is requested per op by OpDef.smem_bytes (tilec/cuda.py); every op
// checks what it got (c.smem_floats) and falls back to global loads when it is short.
// Included by ops.cuh (needs its ldc / ldf / stf helpers).
#pragma once
#include "common.cuh"

namespace tilec {

// ---- fp8_quant: per group of G along the last dim ---------------------------------------
// s = max(amax |x|, amin) * RN(1 / fmax) (pow2: exp2(ceil(log2(s)))); q = clamp(x / s, +-fmax) -> fp8
// (round to nearest even, saturating). One warp per (row, group).
__device__ __forceinline__ float fp8_scale(float amax, float amin, float fmax, int recip, int pow2) {
  // both forms are this product on CUDA: eager's `amax / 448.` (a Python number's divisor) multiplies by the float
  // reciprocal there too (ATen's div_true_kernel_cuda; measured bitwise on an H100, sixtieth session) - `recip`
  // matters only to the reference executor on the CPU, whose eager divides
  (void)recip;
  const float m = fmaxf(amax, amin), sc = m * (1.f / fmax);
  return pow2 ? exp2f(ceilf(log2f(sc))) : sc;
}
template <typename TX, typename TQ, typename TS>
__device__ void op_fp8_quant(TileCtx& c) {
  const Operand &x = operands()[0], &q = operands()[1], &s = operands()[2];
  const int nd = q.ndim, K = q.sizes[nd - 1];
  const int G = c.param(0), pow2 = c.param(1), recip = c.param(4);
  const float amin = c.fparam(2), fmax = c.fparam(3);
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int rows = box_rows(nd, lo, hi);
  const int ngroups = K / G;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long xk = x.strides[nd - 1], qk = q.strides[nd - 1], sk = s.strides[nd - 1];
  if constexpr (std::is_same<TX, __nv_bfloat16>::value && std::is_same<TQ, __nv_fp8_e4m3>::value) {
    // groups of 128: lane l holds elements 4l..4l+3 of a group (one 8-byte load, one 4-byte
    // store), and each warp loads kQuantBatch groups before reducing any - one round trip per
    // kQuantBatch groups instead of two per group (GLM-5's 16 x 6144 activations: 52 -> a few us)
    bool vec = G == 128 && xk == 1 && qk == 1 && (reinterpret_cast<uintptr_t>(x.ptr) & 7) == 0 &&
               (reinterpret_cast<uintptr_t>(q.ptr) & 3) == 0;
    for (int r = 0; r < rows && vec; ++r) {
      int idx[4] = {0, 0, 0, 0};
      row_index(r, nd, lo, hi, idx);
      vec = offset4(x, idx) % 4 == 0 && offset4(q, idx) % 4 == 0;
    }
    if (vec) {
      constexpr int kQuantBatch = 8;
      const int total = rows * ngroups;
#pragma unroll 1
      for (int u0 = warp; u0 < total; u0 += kWarps * kQuantBatch) {
        uint2 raw[kQuantBatch];
#pragma unroll
        for (int j = 0; j < kQuantBatch; ++j) {
          const int u = u0 + j * kWarps, r = u / ngroups, g = u - r * ngroups;
          raw[j] = make_uint2(0u, 0u);  // (a break here made ptxas spill raw[] and serialize the loads)
          if (u >= total) continue;
          int idx[4] = {0, 0, 0, 0};
          row_index(r, nd, lo, hi, idx);
          raw[j] = __ldcg(reinterpret_cast<const uint2*>(base<__nv_bfloat16>(x) + offset4(x, idx) + g * 128 + lane * 4));
        }
#pragma unroll
        for (int j = 0; j < kQuantBatch; ++j) {
          const int u = u0 + j * kWarps, r = u / ngroups, g = u - r * ngroups;
          if (u >= total) break;
          const float v[4] = {__uint_as_float(raw[j].x << 16), __uint_as_float(raw[j].x & 0xffff0000u),
                              __uint_as_float(raw[j].y << 16), __uint_as_float(raw[j].y & 0xffff0000u)};
          const float amax = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
          const float sc = fp8_scale(amax, amin, fmax, recip, pow2);
          unsigned word = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i)
            word |= (unsigned)from_f<__nv_fp8_e4m3>(fminf(fmaxf(v[i] / sc, -fmax), fmax)).__x << (8 * i);
          int idx[4] = {0, 0, 0, 0};
          row_index(r, nd, lo, hi, idx);
          *reinterpret_cast<unsigned*>(base<__nv_fp8_e4m3>(q) + offset4(q, idx) + g * 128 + lane * 4) = word;
          if (lane == 0) stf<TS>(s, offset4(s, idx) + (long long)g * sk, sc);
        }
      }
      return;
    }
  }
  for (int u = warp; u < rows * ngroups; u += kWarps) {
    const int r = u / ngroups, g = u % ngroups;
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    const long long xo = offset4(x, idx) + (long long)g * G * xk, qo = offset4(q, idx) + (long long)g * G * qk;
    float amax = 0.f;
    for (int e = lane; e < G; e += 32) amax = fmaxf(amax, fabsf(ldf<TX>(x, xo + e * xk)));
    amax = warp_max(amax);
    const float sc = fp8_scale(amax, amin, fmax, recip, pow2);
    for (int e = lane; e < G; e += 32) {
      const float v = ldf<TX>(x, xo + e * xk) / sc;
      stf<TQ>(q, qo + e * qk, fminf(fmaxf(v, -fmax), fmax));
    }
    if (lane == 0) stf<TS>(s, offset4(s, idx) + (long long)g * sk, sc);
  }
}

// ---- fp8_linear: out[m, n] = sum_kb xs[m, kb] ws[n / BN, kb] sum_{k in kb} xq[m, k] wq[n, k] ----
// The tile's rows (<= kMaxRows per pass) are staged in shared memory (raw FP8 bytes and their
// scales); one warp per output column n, lanes over K in 16-byte vectors of FP8 weights
// (16 | G, so a vector never straddles a K block). Each vector's partial dot product is
// scaled by xs * ws and accumulated in float32; one warp sum per (row, column).
// 8 FP8 e4m3 bytes (packed in a uint2) as 4 bf16 pairs (exact: e4m3 has 3 mantissa bits).
__device__ __forceinline__ uint4 fp8x8_to_bf16(uint2 raw) {
  float f[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    __nv_fp8_e4m3 v;
    v.__x = (unsigned char)(((i < 4 ? raw.x : raw.y) >> (8 * (i & 3))) & 0xffu);
    f[i] = float(v);
  }
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]), pack_bf16x2(f[6], f[7]));
}

// fp8_linear on tensor cores for nr <= 16 staged rows (xq_s [nr][K] FP8 bytes, xs_s [nr][KB]
// scales): FP8 values are exact in bf16, so each K block of G (a multiple of 32) is one chain
// of bf16 m16n8k16 products in float32, then scaled by xs[m, kb] * ws[n / BN, kb] and summed
// (the DeepGEMM recipe). Warp w owns column groups of 8 and streams kU x 8 weight bytes per
// lane at a time; lane (g, q) brings 8 consecutive k (see mma_k32).
template <typename TWS, typename TO>
__device__ __noinline__ void fp8_linear_mma(const TileCtx& c, const unsigned char* wq, long long wn, const Operand& ws,
                                            int n0, int n1, int K, int G, int BN, const unsigned char* xq_s,
                                            const float* xs_s, int nr, const Operand& out, const long long* ooff) {
  xq_s = shared_ptr(xq_s), xs_s = shared_ptr(xs_s), ooff = shared_ptr(ooff);
  constexpr int kU = 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3;
  const int rlo = lane >> 2, rhi = rlo + 8, KB = K / G;
  const long long on = out.strides[out.ndim - 1], wsn = ws.strides[0], wsk = ws.strides[1];
  const unsigned long long policy = evict_first_policy();
  auto load_a = [&](int r, int k) -> uint4 {
    return r < nr ? fp8x8_to_bf16(*reinterpret_cast<const uint2*>(xq_s + (long long)r * K + k)) : make_uint4(0u, 0u, 0u, 0u);
  };
#pragma unroll 1
  for (int g8 = warp; g8 * 8 < n1 - n0; g8 += kWarps) {
    const int col = min(n0 + g8 * 8 + rlo, n1 - 1);  // past n1: a valid row, never stored
    const unsigned char* wrow = wq + (long long)col * wn + 8 * q;
    const int ca = min(n0 + g8 * 8 + 2 * q, n1 - 1), cb = min(ca + 1, n1 - 1);  // this lane's output columns
    float tot[4] = {0.f, 0.f, 0.f, 0.f}, blk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int kb0 = 0; kb0 < K; kb0 += 32 * kU) {
      uint2 b[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (kb0 + 32 * u < K)
          asm volatile("ld.global.cg.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
                       : "=r"(b[u].x), "=r"(b[u].y) : "l"(wrow + kb0 + 32 * u), "l"(policy));
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int k = kb0 + 32 * u;
        if (k >= K) break;
        mma_k32(blk, load_a(rlo, k + 8 * q), load_a(rhi, k + 8 * q), fp8x8_to_bf16(b[u]));
        if ((k + 32) % G == 0) {  // end of K block kb: scale and fold into the total
          const int kb = k / G;
          const float wa = to_f<TWS>(base<TWS>(ws)[(long long)(ca / BN) * wsn + kb * wsk]);
          const float wb = to_f<TWS>(base<TWS>(ws)[(long long)(cb / BN) * wsn + kb * wsk]);
          const float xl = rlo < nr ? xs_s[rlo * KB + kb] : 0.f, xh = rhi < nr ? xs_s[rhi * KB + kb] : 0.f;
          tot[0] += blk[0] * xl * wa;
          tot[1] += blk[1] * xl * wb;
          tot[2] += blk[2] * xh * wa;
          tot[3] += blk[3] * xh * wb;
          blk[0] = blk[1] = blk[2] = blk[3] = 0.f;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = i < 2 ? rlo : rhi, n = n0 + g8 * 8 + 2 * q + (i & 1);
      if (m < nr && n < n1) stf<TO>(out, ooff[m] + (long long)n * on, tot[i]);
    }
  }
}

// The same product with the K blocks spread over the warps (warp w takes blocks w, w + kWarps, ...)
// so every warp streams weights however few columns the tile has (GLM-5's QKV-A tiles have 24),
// two column groups at a time with kFp8Steps 16-byte loads per lane in flight per group (16 FP8
// of one weight row; lane (g, q) holds k 16q..16q+15 of each 64-k step, fed to two mma_k32 as
// its halves - the same permutation for A and B). Rows of xq_s are xp bytes apart (K + 64: for
// K % 128 == 0 the eight rows of a 16-byte load land in distinct banks); the tile's weight scales are staged in
// ws_s [rows n0 / BN .. (n1 - 1) / BN][KB]. The warps' block-scaled partials of a column group are
// summed in a fixed order through red (kWarps x 128 floats), so results do not depend on timing.
// Needs G % 64 == 0.
constexpr int kFp8Steps = 8;
template <typename TO>
__device__ __noinline__ void fp8_linear_mma_ksplit(const TileCtx& c, const unsigned char* wq, long long wn, int n0,
                                                   int n1, int K, int G, int BN, const unsigned char* xq_s, int xp,
                                                   const float* xs_s, const float* ws_s, int nr, const Operand& out,
                                                   const long long* ooff, float* red) {
  xq_s = shared_ptr(xq_s), xs_s = shared_ptr(xs_s), ws_s = shared_ptr(ws_s), ooff = shared_ptr(ooff), red = shared_ptr(red);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3;
  const int rlo = lane >> 2, rhi = rlo + 8, KB = K / G, spb = G / 64;  // 64-k steps per K block
  const int mine = (KB - warp + kWarps - 1) / kWarps * spb;            // this warp's steps
  const long long on = out.strides[out.ndim - 1];
  const int ng = (n1 - n0 + 7) / 8, b0 = n0 / BN;
  const unsigned long long policy = evict_first_policy();
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll 1
  for (int g0 = 0; g0 < ng; g0 += 2) {
    float tot[2][4] = {}, blk[2][4] = {};
    const unsigned char* wrow[2];
    int ca[2], cb[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int base_col = n0 + min(g0 + p, ng - 1) * 8;
      wrow[p] = wq + (long long)min(base_col + rlo, n1 - 1) * wn + 16 * q;  // past n1: a valid row, never stored
      ca[p] = min(base_col + 2 * q, n1 - 1) / BN - b0;
      cb[p] = min(base_col + 2 * q + 1, n1 - 1) / BN - b0;
    }
#pragma unroll 1
    for (int t0 = 0; t0 < mine; t0 += kFp8Steps) {
      uint4 b[2][kFp8Steps];
#pragma unroll
      for (int u = 0; u < kFp8Steps; ++u) {
        const int t = t0 + u, k = ((t / spb) * kWarps + warp) * G + (t % spb) * 64;
#pragma unroll
        for (int p = 0; p < 2; ++p)
          if (t < mine && g0 + p < ng)
            asm volatile("ld.global.cg.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                         : "=r"(b[p][u].x), "=r"(b[p][u].y), "=r"(b[p][u].z), "=r"(b[p][u].w)
                         : "l"(wrow[p] + k), "l"(policy));
      }
#pragma unroll
      for (int u = 0; u < kFp8Steps; ++u) {
        const int t = t0 + u;
        if (t >= mine) break;
        const int kb = (t / spb) * kWarps + warp, k = kb * G + (t % spb) * 64 + 16 * q;
        const uint4 alo = rlo < nr ? *reinterpret_cast<const uint4*>(xq_s + rlo * xp + k) : zero;
        const uint4 ahi = rhi < nr ? *reinterpret_cast<const uint4*>(xq_s + rhi * xp + k) : zero;
        const uint4 a0 = fp8x8_to_bf16(make_uint2(alo.x, alo.y)), a1 = fp8x8_to_bf16(make_uint2(alo.z, alo.w));
        const uint4 h0 = fp8x8_to_bf16(make_uint2(ahi.x, ahi.y)), h1 = fp8x8_to_bf16(make_uint2(ahi.z, ahi.w));
        const bool last = t % spb == spb - 1;  // the end of K block kb: scale and fold into the totals
        const float xl = rlo < nr ? xs_s[rlo * KB + kb] : 0.f, xh = rhi < nr ? xs_s[rhi * KB + kb] : 0.f;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          if (g0 + p >= ng) break;
          mma_k32(blk[p], a0, h0, fp8x8_to_bf16(make_uint2(b[p][u].x, b[p][u].y)));
          mma_k32(blk[p], a1, h1, fp8x8_to_bf16(make_uint2(b[p][u].z, b[p][u].w)));
          if (last) {
            const float wa = ws_s[ca[p] * KB + kb], wb = ws_s[cb[p] * KB + kb];
            tot[p][0] += blk[p][0] * xl * wa;
            tot[p][1] += blk[p][1] * xl * wb;
            tot[p][2] += blk[p][2] * xh * wa;
            tot[p][3] += blk[p][3] * xh * wb;
            blk[p][0] = blk[p][1] = blk[p][2] = blk[p][3] = 0.f;
          }
        }
      }
    }
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      if (g0 + p >= ng) break;
      block_sync();  // red is free
      reinterpret_cast<float4*>(red)[warp * 32 + lane] = make_float4(tot[p][0], tot[p][1], tot[p][2], tot[p][3]);
      block_sync();
      if (threadIdx.x < 128) {
        const int l = threadIdx.x >> 2, a = threadIdx.x & 3;  // lane l's accumulator a (see gemv_bf16_ring_mma)
        float v = 0.f;
        for (int w = 0; w < kWarps; ++w) v += red[(w * 32 + l) * 4 + a];
        const int m = (l >> 2) + (a < 2 ? 0 : 8), n = n0 + (g0 + p) * 8 + 2 * (l & 3) + (a & 1);
        if (m < nr && n < n1) stf<TO>(out, ooff[m] + (long long)n * on, v);
      }
    }
  }
  block_sync();  // red and the staged rows are free
}

template <typename TXQ, typename TXS, typename TWQ, typename TWS, typename TO>
__device__ void op_fp8_linear(TileCtx& c) {
  const Operand &xq = operands()[0], &xs = operands()[1], &wq = operands()[2], &ws = operands()[3], &out = operands()[4];
  const int K = c.param(0), G = c.param(1), BN = c.param(2), KB = K / G;
  const int nd = out.ndim;
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int n0 = c.lo(nd - 1), n1 = c.hi(nd - 1);
  const int rows = box_rows(nd, lo, hi);
  const int xsd = xq.ndim - 1, ssd = xs.ndim - 1;
  const long long xk = xq.strides[xsd], sk = xs.strides[ssd], on = out.strides[nd - 1];
  const long long wn = wq.strides[0], wk = wq.strides[1], wsn = ws.strides[0], wsk = ws.strides[1];
  // The K-split tensor-core path (fp8_linear_mma_ksplit) takes tiles of <= 16 rows whose blocks
  // are whole 64-k steps; it stages rows xp = K + 64 bytes apart, the tile's weight scales and its
  // cross-warp sums as well.
  constexpr bool kFp8 = std::is_same<TXQ, __nv_fp8_e4m3>::value && std::is_same<TWQ, __nv_fp8_e4m3>::value;
  const int nb = (n1 - 1) / BN - n0 / BN + 1;  // weight-scale rows of the tile
  const bool wvec = wk == 1 && wn % 16 == 0 && (reinterpret_cast<uintptr_t>(wq.ptr) & 15) == 0;
  bool ks = kFp8 && wvec && rows <= 16 && G % 64 == 0 && K % G == 0;
  // shared memory: x, scale and out row offsets, then per staged row KB scales and xp bytes
  long long* xoff = reinterpret_cast<long long*>(c.smem());
  long long* soff = xoff + kMaxRows;
  long long* ooff = soff + kMaxRows;
  float* xs_s = reinterpret_cast<float*>(ooff + kMaxRows);
  const long long fixed = 3LL * kMaxRows * 8 + 80;  // 16 bytes: aligning the FP8 rows
  const long long ks_extra = 4LL * (nb * KB + 4) + 4LL * kWarps * 128 + 16;
  if (ks && 4LL * c.smem_floats - fixed - ks_extra < (long long)rows * (4LL * KB + K + 64)) ks = false;
  const int xp = ks ? K + 64 : K;
  const long long per_row = 4LL * KB + xp;
  const long long avail = 4LL * c.smem_floats - fixed - (ks ? ks_extra : 0);
  const int chunk = (int)min((long long)kMaxRows, avail > 0 ? avail / per_row : 0LL);
  const bool staged = chunk > 0;
  const int pass = staged ? chunk : kMaxRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r0 = 0; r0 < rows; r0 += pass) {
    const int nr = min(pass, rows - r0);
    unsigned char* xq_s = reinterpret_cast<unsigned char*>(xs_s + (staged ? (nr * KB + 3) / 4 * 4 : 0));
    float* ws_s = reinterpret_cast<float*>(xq_s + (long long)nr * xp);  // (ks) 16-byte aligned: xp % 16 == 0
    float* red = ws_s + (nb * KB + 3) / 4 * 4;
    block_sync();
    for (int r = threadIdx.x; r < nr; r += kThreads) {
      int idx[4] = {0, 0, 0, 0};
      row_index(r0 + r, nd, lo, hi, idx);
      xoff[r] = offset4(xq, idx);
      soff[r] = offset4(xs, idx);
      ooff[r] = offset4(out, idx);
    }
    block_sync();
    if (staged) {
      for (int e = threadIdx.x; e < nr * KB; e += kThreads) xs_s[e] = ldf<TXS>(xs, soff[e / KB] + (e % KB) * sk);
      if (ks)
        for (int e = threadIdx.x; e < nb * KB; e += kThreads)
          ws_s[e] = ldf<TWS>(ws, (long long)(n0 / BN + e / KB) * wsn + (e % KB) * wsk);
      bool vec = sizeof(TXQ) == 1 && xk == 1 && K % 16 == 0;  // 16 FP8 bytes per load, 8 loads in flight
      for (int r = 0; r < nr && vec; ++r) vec = ((reinterpret_cast<uintptr_t>(base<TXQ>(xq) + xoff[r]) & 15) == 0);
      if (vec) {
        const int nv = nr * (K / 16);
        for (int v0 = threadIdx.x; v0 < nv; v0 += 8 * kThreads) {
          uint4 raw[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int v = v0 + j * kThreads;
            if (v < nv)
              raw[j] = __ldcg(reinterpret_cast<const uint4*>(base<TXQ>(xq) + xoff[v / (K / 16)]) + v % (K / 16));
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int v = v0 + j * kThreads;
            if (v < nv) *reinterpret_cast<uint4*>(xq_s + (long long)(v / (K / 16)) * xp + (v % (K / 16)) * 16) = raw[j];
          }
        }
      } else {
        for (int e = threadIdx.x; e < nr * K; e += kThreads) {
          const TXQ v = ldc<TXQ>(base<TXQ>(xq) + xoff[e / K] + (long long)(e % K) * xk);
          xq_s[(long long)(e / K) * xp + e % K] = *reinterpret_cast<const unsigned char*>(&v);
        }
      }
      block_sync();
    }
    if constexpr (kFp8) {
      if (ks) {  // staged: ks implies the rows fit in one pass
        fp8_linear_mma_ksplit<TO>(c, reinterpret_cast<const unsigned char*>(wq.ptr), wn, n0, n1, K, G, BN, xq_s, xp,
                                  xs_s, ws_s, nr, out, ooff, red);
        continue;
      }
      if (staged && wvec && G % 32 == 0 && K % 32 == 0) {
        for (int m0 = 0; m0 < nr; m0 += 16)
          fp8_linear_mma<TWS, TO>(c, reinterpret_cast<const unsigned char*>(wq.ptr), wn, ws, n0, n1, K, G, BN,
                                  xq_s + (long long)m0 * K, xs_s + m0 * KB, min(16, nr - m0), out, ooff + m0);
        continue;
      }
    }
    auto xval = [&](int m, int k) -> float {
      if (staged) return to_f<TXQ>(*reinterpret_cast<const TXQ*>(xq_s + (long long)m * xp + k));
      return ldf<TXQ>(xq, xoff[m] + (long long)k * xk);
    };
    auto xscale = [&](int m, int kb) -> float {
      return staged ? xs_s[m * KB + kb] : ldf<TXS>(xs, soff[m] + kb * sk);
    };
    for (int n = n0 + warp; n < n1; n += kWarps) {
      const TWQ* wrow = base<TWQ>(wq) + (long long)n * wn;
      const TWS* wsrow = base<TWS>(ws) + (long long)(n / BN) * wsn;
      const bool vec = staged && sizeof(TWQ) == 1 && wk == 1 && G % 16 == 0 && K % 16 == 0 &&
                       (reinterpret_cast<uintptr_t>(wrow) & 15) == 0;
      for (int m0 = 0; m0 < nr; m0 += kRowsPerPass) {
        float acc[kRowsPerPass];
#pragma unroll
        for (int m = 0; m < kRowsPerPass; ++m) acc[m] = 0.f;
        if (vec) {
          for (int k = lane * 16; k < K; k += 32 * 16) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(wrow + k));
            const TWQ* wv = reinterpret_cast<const TWQ*>(&raw);
            float wf[16];
#pragma unroll
            for (int e = 0; e < 16; ++e) wf[e] = to_f<TWQ>(wv[e]);
            const int kb = k / G;
            const float wsc = to_f<TWS>(wsrow[(long long)kb * wsk]);
#pragma unroll
            for (int m = 0; m < kRowsPerPass; ++m) {
              if (m0 + m < nr) {
                const uint4 xr = *reinterpret_cast<const uint4*>(xq_s + (long long)(m0 + m) * xp + k);
                const TXQ* xv = reinterpret_cast<const TXQ*>(&xr);
                float p = 0.f;
#pragma unroll
                for (int e = 0; e < 16; ++e) p += to_f<TXQ>(xv[e]) * wf[e];
                acc[m] += p * (xs_s[(m0 + m) * KB + kb] * wsc);
              }
            }
          }
        } else {
          for (int k = lane; k < K; k += 32) {
            const int kb = k / G;
            const float wv = to_f<TWQ>(wrow[(long long)k * wk]) * to_f<TWS>(wsrow[(long long)kb * wsk]);
#pragma unroll
            for (int m = 0; m < kRowsPerPass; ++m)
              if (m0 + m < nr) acc[m] += xval(m0 + m, k) * xscale(m0 + m, kb) * wv;
          }
        }
#pragma unroll
        for (int m = 0; m < kRowsPerPass; ++m) acc[m] = warp_sum(acc[m]);
        if (lane == 0)
          for (int m = 0; m < kRowsPerPass && m0 + m < nr; ++m) stf<TO>(out, ooff[m0 + m] + (long long)n * on, acc[m]);
      }
    }
  }
}

// ---- fp8_linear_quant: fp8_quant of bf16 x fused into the FP8 GEMM ------------------------
// out = fp8_linear(fp8_quant(x)) with the quantization done while the tile stages its rows
// (tilec/passes/fuse_fp8_quant.py): one dependent stage and one op fewer per GEMM, and the weights
// stream through the worker's ring (stream.cuh, 1-byte items) while the tile waits for x.

// FP8 e4m3 bytes as f16 (exact: e4m3 has 4 exponent bits and 3 mantissa bits), two per
// instruction; byte i of raw becomes half i of the result.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned raw16) {
  unsigned r;
  asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}" : "=r"(r) : "r"(raw16));
  return r;
}
__device__ __forceinline__ uint4 e4m3x8_to_f16(unsigned lo, unsigned hi) {
  return make_uint4(e4m3x2_to_f16x2(lo & 0xffffu), e4m3x2_to_f16x2(lo >> 16), e4m3x2_to_f16x2(hi & 0xffffu),
                    e4m3x2_to_f16x2(hi >> 16));
}
__device__ __forceinline__ void mma_16816_f16(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// mma_k32 (ops.cuh) on f16 operands: two m16n8k16 products over 32 k, 8 consecutive k per lane.
__device__ __forceinline__ void mma_k32_f16(float* acc, const uint4& alo, const uint4& ahi, const uint4& b) {
  const unsigned a1[4] = {alo.x, ahi.x, alo.y, ahi.y}, a2[4] = {alo.z, ahi.z, alo.w, ahi.w};
  mma_16816_f16(acc, a1, b.x, b.y);
  mma_16816_f16(acc, a2, b.z, b.w);
}

// Quantizes nr rows of bf16 x (element offsets xoff[m], K stride xk) in groups of G along K into
// FP8 rows xq_s [nr][xp] bytes and scales xs_s [nr][K / G], as op_fp8_quant does: s = max(amax,
// amin) / fmax (fp8_scale), q = x / s cast to e4m3 with saturation (the cast saturates, so no clamp
// is needed). G == 128 with unit stride and 16-byte aligned rows: a thread takes 32 elements (four
// 16-byte loads) of a group at a time, four lanes a group, in a rolled loop with the next chunk's
// loads in flight while this one is quantized; x / s as x * RN(1 / s) corrected by one fused
// multiply-add (Markstein), a third of a full division's instructions. That is the correctly
// rounded quotient unless the residual underflows: for a subnormal x, whose quotient is below
// 2^-26 (and casts to FP8 zero either way) once s >= 2^-100 - so this path needs amin / fmax >=
// 2^-100 (fuse_fp8_quant.py MIN_AMIN; GLM-5 / DeepSeek-V3 use amin 1e-4) and has no branch per
// element. Code size and registers decide its speed: a GLM-5 QKV-A tile (16 x 6144 rows) staged in
// 48 us on an H200 with 12 loads a thread unrolled and a division branch per element (~4200
// instructions, spilling), 26-27 us with two chunks a batch (spilling), 16.4 us with one
// (kStageChunks; ptxas still reports 20 B of spill stores, against 160). Non-finite x: the group max
// ignores NaN (as fmaxf), a NaN element casts to 0x7f, an infinite one makes its group NaN - the
// unfused op clamps NaN to -448 and gives the finite elements of such a group zero; torch would give
// NaN groups. Otherwise one warp per group, one element per lane at a time, true division. Ends
// with a block barrier.
constexpr int kStageChunks = 1;
__device__ __forceinline__ float div_rn(float x, float s, float r) {  // RN(x / s) given r = RN(1 / s)
  const float q = x * r;
  return __fmaf_rn(__fmaf_rn(-q, s, x), r, q);
}
__device__ __forceinline__ unsigned e4m3x4(float a, float b, float c, float d) {  // saturating RN casts
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return (unsigned)lo | ((unsigned)hi << 16);
}
__device__ __noinline__ void stage_quant_rows(const __nv_bfloat16* x, const long long* xoff, long long xk, int nr,
                                              int K, int G, int pow2, int recip, float amin, float fmax,
                                              unsigned char* xq_s, int xp, float* xs_s) {
  xoff = shared_ptr(xoff), xq_s = shared_ptr(xq_s), xs_s = shared_ptr(xs_s);
  const int KB = K / G, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // every scale at least amin / fmax >= 2^-100: x * RN(1 / s) + correction is x / s correctly
  // rounded wherever that is not FP8 zero, and the loop has no division
  bool vec = G == 128 && K % 128 == 0 && xk == 1 && xp % 16 == 0 && amin / fmax >= 7.88860905e-31f;
  for (int r = 0; r < nr && vec; ++r) vec = (reinterpret_cast<uintptr_t>(x + xoff[r]) & 15) == 0;
  if (vec) {
    // chunks of 4 vectors (32 elements, 64 bytes): a thread holds a quarter of a group, so a group's
    // max takes two shuffles and its scale and reciprocal are found once per 32 elements
    const int per = K / 8, nc = nr * per / 4, step = kStageChunks * kThreads;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    auto load = [&](uint4 (*r)[4], int it) {
#pragma unroll
      for (int j = 0; j < kStageChunks; ++j) {
        const int ch = threadIdx.x + it + j * kThreads, m = 4 * ch / per;
        const uint4* src = reinterpret_cast<const uint4*>(x + xoff[ch < nc ? m : 0]) + (4 * ch - m * per);
#pragma unroll
        for (int i = 0; i < 4; ++i) r[j][i] = ch < nc ? __ldcg(src + i) : zero;
      }
    };
    uint4 cur[kStageChunks][4], nxt[kStageChunks][4];
    load(cur, 0);
#pragma unroll 1
    for (int it = 0; threadIdx.x - lane + it < nc; it += step) {  // warp-uniform
      load(nxt, it + step);  // the next batch is in flight while this one is quantized
#pragma unroll
      for (int j = 0; j < kStageChunks; ++j) {
        const int ch = threadIdx.x + it + j * kThreads, m = 4 * ch / per, k = (4 * ch - m * per) * 8;
        const unsigned* wd = reinterpret_cast<const unsigned*>(cur[j]);
        __nv_bfloat162 mx = __floats2bfloat162_rn(0.f, 0.f);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const unsigned a = wd[i] & 0x7fff7fffu;  // |x| of both halves
          mx = __hmax2(mx, *reinterpret_cast<const __nv_bfloat162*>(&a));
        }
        float amax = fmaxf(__low2float(mx), __high2float(mx));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float sc = fp8_scale(amax, amin, fmax, recip, pow2);
        const float rc = __frcp_rn(sc);
        if (ch < nc) {
          unsigned q[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const unsigned w0 = wd[2 * i], w1 = wd[2 * i + 1];
            q[i] = e4m3x4(div_rn(__uint_as_float(w0 << 16), sc, rc), div_rn(__uint_as_float(w0 & 0xffff0000u), sc, rc),
                          div_rn(__uint_as_float(w1 << 16), sc, rc), div_rn(__uint_as_float(w1 & 0xffff0000u), sc, rc));
          }
          uint4* dst = reinterpret_cast<uint4*>(xq_s + (long long)m * xp + k);
          dst[0] = make_uint4(q[0], q[1], q[2], q[3]);
          dst[1] = make_uint4(q[4], q[5], q[6], q[7]);
          if ((lane & 3) == 0) xs_s[m * KB + k / 128] = sc;
        }
      }
#pragma unroll
      for (int j = 0; j < kStageChunks; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) cur[j][i] = nxt[j][i];
    }
  } else {
#pragma unroll 1
    for (int u = warp; u < nr * KB; u += kWarps) {
      const int m = u / KB, g = u - m * KB;
      const __nv_bfloat16* xg = x + xoff[m] + (long long)g * G * xk;
      float amax = 0.f;
      for (int e = lane; e < G; e += 32) amax = fmaxf(amax, fabsf(__bfloat162float(ldc<__nv_bfloat16>(xg + e * xk))));
      amax = warp_max(amax);
      const float sc = fp8_scale(amax, amin, fmax, recip, pow2);
      for (int e = lane; e < G; e += 32) {
        const float v = __bfloat162float(ldc<__nv_bfloat16>(xg + e * xk)) / sc;
        xq_s[(long long)m * xp + g * G + e] = from_f<__nv_fp8_e4m3>(fminf(fmaxf(v, -fmax), fmax)).__x;
      }
      if (lane == 0) xs_s[m * KB + g] = sc;
    }
  }
  block_sync();
}

// The block-scaled FP8 product of nr <= 16 staged rows (xq_s [nr][xp] bytes, xp = K + 64: for
// K % 128 == 0 the two rows of a quarter-warp's 16-byte loads fall in different halves of the
// bank line; scales xs_s [nr][KB]) with
// weights from the ring: an item is one column group of 8 weight rows x up to 2 kStreamK FP8
// bytes of K, or (paired, K <= kStreamK) two groups side by side (stream.cuh). Warp w takes K
// slice [w s, (w + 1) s) of each item, s a whole number of K blocks (G, a multiple of 64, divides
// the 4096-byte item or K fits one: Fp8LinearQuant.stream, checked here too), and per K block
// accumulates 16 x 8 products on tensor cores, then folds them into its totals scaled by
// xs[m, kb] * ws[n / BN, kb] (ws_s: the tile's weight-scale rows n0 / BN ..).
// Operands are widened to f16 (exact) with one cvt per two bytes, A once for both groups of an
// item: Hopper has no FP8 mma.sync (an e4m3 mma.sync is emulated through f16 products as well).
// At a column group's last item the warps' totals are summed in a fixed order through red
// (2 x kWarps x 128 floats). A warp whose stream wait gave up keeps iterating without waiting
// (see gemv_bf16_ring_mma), so all warps reach the same barriers.
template <typename TO>
__device__ __forceinline__ void fp8_linear_ring(const TileCtx& c, const StreamTile& t, int G, int BN,
                                                const unsigned char* xq_s, int xp, const float* xs_s,
                                                const float* ws_s, int nr, const Operand& out,
                                                const long long* ooff, float* red) {
  const WeightRing& r = *c.ring;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int kl = t.k1 - t.k0, kblocks = t.kblocks(), items = t.items(), kitem = t.kitem(), KB = kl / G;
  const int np = t.paired ? 2 : 1, b0 = t.n0 / BN;
  const long long on = out.strides[out.ndim - 1];
  const int first = *r.next;
  int s = first % r.nstages;
  unsigned ph = (unsigned)(first / r.nstages) & 1u;
  c.mark(1);  // x quantized and staged
  float tot[2][4] = {};
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  bool live = true;
  int gi = 0, kb = 0;  // item i = (column group (pair) gi, K block kb of the stream), kb fastest
#pragma unroll 1
  for (int i = 0; i < items; ++i) {
    const int kk = kb * kitem, len = min(kitem, kl - kk);
    const int slice = (len / kWarps + G - 1) / G * G, k0 = warp * slice, k1 = min(k0 + slice, len);
    if (live && !__all_sync(0xffffffffu, mbar_wait(r.full + s, ph, r.abort, r.timeout_ns))) {
      *r.gave_up = 1;
      live = false;
    }
    if (i == 0) c.mark(2);  // the first weight stage is in
    if (live) {
      const unsigned char* stage = reinterpret_cast<const unsigned char*>(shared_ptr(r.stages) + s * kStageBytes) + g * kRowPitch;
      int ca[2], cb[2];
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const int col = t.n0 + (gi * np + p) * kWarps + 2 * q;
        ca[p] = min(col, t.n1 - 1) / BN - b0;
        cb[p] = min(col + 1, t.n1 - 1) / BN - b0;
      }
#pragma unroll 1
      for (int k = k0; k < k1; k += G) {  // one K block
        float blk[2][4] = {};
#pragma unroll 2
        for (int j = 0; j < G; j += 64) {
          const int kq = k + j + 16 * q;  // this lane's 16 bytes of a 64-k step
          const uint4 lo = g < nr ? *reinterpret_cast<const uint4*>(xq_s + g * xp + kk + kq) : zero;
          const uint4 hi = g + 8 < nr ? *reinterpret_cast<const uint4*>(xq_s + (g + 8) * xp + kk + kq) : zero;
          const uint4 a0 = e4m3x8_to_f16(lo.x, lo.y), a1 = e4m3x8_to_f16(lo.z, lo.w);
          const uint4 h0 = e4m3x8_to_f16(hi.x, hi.y), h1 = e4m3x8_to_f16(hi.z, hi.w);
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            if (p >= np) break;
            const uint4 b = *reinterpret_cast<const uint4*>(stage + p * kStreamK + kq);
            mma_k32_f16(blk[p], a0, h0, e4m3x8_to_f16(b.x, b.y));
            mma_k32_f16(blk[p], a1, h1, e4m3x8_to_f16(b.z, b.w));
          }
        }
        const int kbi = (kk + k) / G;
        const float xl = g < nr ? xs_s[g * KB + kbi] : 0.f, xh = g + 8 < nr ? xs_s[(g + 8) * KB + kbi] : 0.f;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          if (p >= np) break;
          const float wa = ws_s[ca[p] * KB + kbi], wb = ws_s[cb[p] * KB + kbi];
          tot[p][0] += blk[p][0] * xl * wa;
          tot[p][1] += blk[p][1] * xl * wb;
          tot[p][2] += blk[p][2] * xh * wa;
          tot[p][3] += blk[p][3] * xh * wb;
        }
      }
      mbar_arrive(r.empty + s);  // every thread releases its own reads
    }
    if (++s == r.nstages) s = 0, ph ^= 1u;
    if (kb == kblocks - 1) {  // the column group(s): sum the warps' K slices
#pragma unroll
      for (int p = 0; p < 2; ++p)
        reinterpret_cast<float4*>(red)[(p * kWarps + warp) * 32 + lane] =
            make_float4(tot[p][0], tot[p][1], tot[p][2], tot[p][3]);
      block_sync();
      if (live && threadIdx.x < 128 * np) {
        const int p = threadIdx.x >> 7, l = (threadIdx.x >> 2) & 31, a = threadIdx.x & 3;  // lane l's accumulator a
        float v = 0.f;
        for (int w = 0; w < kWarps; ++w) v += red[((p * kWarps + w) * 32 + l) * 4 + a];
        const int m = (l >> 2) + (a < 2 ? 0 : 8), n = t.n0 + (gi * np + p) * kWarps + 2 * (l & 3) + (a & 1);
        if (m < nr && n < t.n1) stf<TO>(out, ooff[m] + (long long)n * on, v);
      }
      block_sync();  // red is free again
#pragma unroll
      for (int p = 0; p < 2; ++p) tot[p][0] = tot[p][1] = tot[p][2] = tot[p][3] = 0.f;
      kb = 0, ++gi;
    } else {
      ++kb;
    }
  }
  block_sync();  // every compute thread has read r.next
  if (threadIdx.x == 0) *r.next = first + items;
}

// Operands: x [..., K] bf16, wq [N, K] FP8, ws [ceil(N / BN), K / G] float32, out [..., N].
// Params: K, G, BN, pow2, amin (float bits), FP8 max (float bits), recip (fp8_scale). The plan
// guarantees at most 16 rows a tile, G % 64 == 0, K % G == 0 and shared memory for the staged rows
// (fp8_linear.py Fp8LinearQuant.smem_bytes); a tile that breaks that is a plan bug and aborts the step. Dispatched
// before its event wait (executor.cuh): the row offsets and the weight scales are set up first.
template <typename TX, typename TWQ, typename TWS, typename TO>
__device__ void op_fp8_linear_quant(TileCtx& c) {
  static_assert(std::is_same<TX, __nv_bfloat16>::value && std::is_same<TWQ, __nv_fp8_e4m3>::value,
                "fp8_linear_quant: bf16 x, FP8 weights (tilec/passes/fuse_fp8_quant.py)");
  const Operand &x = operands()[0], &wq = operands()[1], &ws = operands()[2], &out = operands()[3];
  const int K = c.param(0), G = c.param(1), BN = c.param(2), pow2 = c.param(3), recip = c.param(6), KB = K / G;
  const float amin = c.fparam(4), fmax = c.fparam(5);
  const int nd = out.ndim;
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int n0 = c.lo(nd - 1), n1 = c.hi(nd - 1), nr = box_rows(nd, lo, hi);
  const int nb = (n1 - 1) / BN - n0 / BN + 1, xp = K + 64;
  const long long wn = wq.strides[0], wk = wq.strides[1], wsn = ws.strides[0], wsk = ws.strides[1];
  // shared memory: row offsets, scales, weight scales, cross-warp sums, then the FP8 rows
  long long* xoff = reinterpret_cast<long long*>(c.smem());
  long long* ooff = xoff + 16;
  float* xs_s = reinterpret_cast<float*>(ooff + 16);
  float* ws_s = xs_s + (16 * KB + 3) / 4 * 4;
  float* red = ws_s + (nb * KB + 3) / 4 * 4;
  unsigned char* xq_s = reinterpret_cast<unsigned char*>(red + 2 * kWarps * 128);
  const bool fits = (xq_s - reinterpret_cast<unsigned char*>(c.smem())) + (long long)nr * xp <= 4LL * c.smem_floats;
  if (nr > 16 || G % 64 != 0 || K % G != 0 || !fits) {  // the plan promised otherwise: fail loudly
    if (threadIdx.x == 0) atomicCAS(c.ring->abort, 0, 2);
    *c.ring->gave_up = 1;
    return;
  }
  for (int r = threadIdx.x; r < nr; r += kThreads) {
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    xoff[r] = offset4(x, idx);
    ooff[r] = offset4(out, idx);
  }
  for (int e = threadIdx.x; e < nb * KB; e += kThreads)
    ws_s[e] = ldf<TWS>(ws, (long long)(n0 / BN + e / KB) * wsn + (e % KB) * wsk);
  StreamTile t;
  const bool ring = tilec_ring_stages > 0 && stream_range(c.d, wq.ptr, wn, t);
  if (ring && t.kblocks() > 1 && t.kitem() % G != 0) {  // a K block across two items: the plan rules it out
    if (threadIdx.x == 0) atomicCAS(c.ring->abort, 0, 2);
    *c.ring->gave_up = 1;
    return;
  }
  if (!c.wait()) return;  // (its barrier also publishes the offsets and scales)
  stage_quant_rows(base<__nv_bfloat16>(x), xoff, x.strides[x.ndim - 1], nr, K, G, pow2, recip, amin, fmax, xq_s,
                   xp, xs_s);
  if (ring) {
    fp8_linear_ring<TO>(c, t, G, BN, xq_s, xp, xs_s, ws_s, nr, out, ooff, red);
  } else if (wk == 1 && wn % 16 == 0 && (reinterpret_cast<uintptr_t>(wq.ptr) & 15) == 0) {
    fp8_linear_mma_ksplit<TO>(c, reinterpret_cast<const unsigned char*>(wq.ptr), wn, n0, n1, K, G, BN, xq_s, xp, xs_s,
                              ws_s, nr, out, ooff, red);
  } else {  // weights a strided or unaligned view: one warp per column, lanes over K
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll 1
    for (int n = n0 + warp; n < n1; n += kWarps) {
      const TWQ* wrow = base<TWQ>(wq) + (long long)n * wn;
      for (int m = 0; m < nr; ++m) {
        float acc = 0.f;
        for (int k = lane; k < K; k += 32)
          acc += to_f<__nv_fp8_e4m3>(*reinterpret_cast<const __nv_fp8_e4m3*>(xq_s + (long long)m * xp + k)) *
                 xs_s[m * KB + k / G] * (to_f<TWQ>(wrow[(long long)k * wk]) * ws_s[(n / BN - n0 / BN) * KB + k / G]);
        acc = warp_sum(acc);
        if (lane == 0) stf<TO>(out, ooff[m] + (long long)n * out.strides[nd - 1], acc);
      }
    }
  }
}

// ---- bmm: out[b] = a[b] @ w[b] (w optionally a view of a block-scaled FP8 [R, C] buffer) -----
// Per batch b of the tile: a[b] is staged in shared memory as float, then the tile's columns go
// in passes of ncp = min(nc, 128): each pass stages K chunks of its weight columns as float
// (dequantized) with every load of the chunk in flight at once (16-byte loads along n when the
// columns are contiguous), and thread t accumulates column t % ncp for up to kBmmRows rows
// (rows t / ncp, t / ncp + kThreads / ncp, ...). So a GLM-5 absorption tile (16 x 192 x 128)
// costs two round trips to memory instead of one per few k.
constexpr int kBmmRows = 8;    // accumulator rows per thread
constexpr int kBmmVecs = 4;    // 16-byte weight loads per thread in flight
constexpr int kBmmScalar = 8;  // scalar loads per thread in flight
// bmm on tensor cores for M <= 16 rows of bf16 a and bf16 weights - stored so, or FP8 blocks
// dequantized and rounded to bf16 (round_w, bf16 out) as eager's weight_dequant(...).to(bf16)
// does, so the products are those of the CUDA-core path (exact in float32; float32 sums in
// another order). Per batch b: a[b] staged as bf16 rows a16 [16][K + 8] (zeros past M), then
// the tile's columns in passes of up to 128: the pass's K x np weights dequantized into
// w16 [K][np + 8] bf16 (16-byte loads along n, every load of the pass in flight; one scale per
// vector from the row-block index and column each k row starts at, taken once per tile), and
// warp w multiplies column groups w, w + 8, ... of 8 (m16n8k16, A rows g and g + 8 as 32-bit
// loads, B packed from two bf16 of consecutive k). Returns false (nothing done) when the shapes,
// dtypes or strides do not fit; the CUDA-core path below takes those. On an H200 a GLM-5 FP8
// absorption tile took 12.5 us against 30.0 on the CUDA-core path, the prelude 378.6 against
// 396.3 us (benchmarks/lab/glm5_variants_ab.py, one process; 36 us a tile before the ops'
// shared-space pointers).
template <typename TA, typename TW, typename TS, typename TO, bool kScale>
__device__ __noinline__ bool bmm_mma(TileCtx& c) {
  constexpr bool kTypes = std::is_same<TA, __nv_bfloat16>::value && std::is_same<TO, __nv_bfloat16>::value &&
                          (kScale ? std::is_same<TW, __nv_fp8_e4m3>::value : std::is_same<TW, __nv_bfloat16>::value);
  if constexpr (!kTypes) {
    return false;
  } else {
    const Operand &a = operands()[0], &w = operands()[1], &out = operands()[kScale ? 3 : 2];
    const int M = a.sizes[1], K = a.sizes[2];
    const int n0 = c.lo(1), n1 = c.hi(1), nc = n1 - n0;
    const long long row_len = c.param(1), w_offset = c.param(2);
    const int br = c.param(3), bc = c.param(4), round_w = c.param(5);
    const long long as0 = a.strides[0], as1 = a.strides[1];
    const long long ws0 = w.strides[0], ws1 = w.strides[1];
    constexpr int V = 16 / sizeof(TW);  // weights per 16-byte load
    const int ap = K + 8, ncp = min(nc, 128), wp = ncp + 8;  // row pitches (elements): 16-byte rows, spread banks
    const long long need = 2LL * 16 * ap + 2LL * K * wp + 8LL * K + 64;
    // 16-byte vectors everywhere; with scales, a vector never straddles a buffer row or column block
    const bool ok = M <= 16 && K % 16 == 0 && a.strides[2] == 1 && as0 % 8 == 0 && as1 % 8 == 0 &&
                    w.strides[2] == 1 && ws0 % V == 0 && ws1 % V == 0 && n0 % V == 0 && nc % V == 0 &&
                    ncp % V == 0 && need <= 4LL * c.smem_floats && (reinterpret_cast<uintptr_t>(a.ptr) & 15) == 0 &&
                    (reinterpret_cast<uintptr_t>(w.ptr) & 15) == 0 &&
                    (!kScale || (round_w && w_offset % V == 0 && row_len % V == 0 && bc % V == 0 &&
                                 c.param(6) != 0));  // every view row within one buffer row (Bmm.params)
    if (!ok) return false;
    __nv_bfloat16* a16 = reinterpret_cast<__nv_bfloat16*>(c.smem());  // [16][ap]
    __nv_bfloat16* w16 = a16 + 16 * ap;                                // [K][wp]
    int* srow = reinterpret_cast<int*>(w16 + (long long)K * wp);      // [K]: k's row block (kScale)
    int* scol = srow + K;                                              // [K]: the buffer column k's row starts at
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int b = c.lo(0); b < c.hi(0); ++b) {
      block_sync();  // the previous batch's readers are done
#pragma unroll 1
      for (int e = threadIdx.x; e < 16 * (K / 8); e += kThreads) {  // a[b] rows, zeros past M
        const int m = e / (K / 8), k = (e % (K / 8)) * 8;
        *reinterpret_cast<uint4*>(a16 + m * ap + k) =
            m < M ? __ldcg(reinterpret_cast<const uint4*>(base<TA>(a) + b * as0 + m * as1 + k)) : zero;
      }
      if constexpr (kScale) {
        for (int k = threadIdx.x; k < K; k += kThreads) {
          const long long e = w_offset + (long long)b * ws0 + (long long)k * ws1;
          srow[k] = (int)((e / row_len) / br);
          scol[k] = (int)(e % row_len);
        }
      }
      c.mark(1);  // a[b] staged (this thread's share)
#pragma unroll 1
      for (int c0 = 0; c0 < nc; c0 += ncp) {
        const int np = min(ncp, nc - c0), nv = np / V, total = K * nv;
        const long long wb = (long long)b * ws0 + n0 + c0;  // element offset of (k = 0, column c0) in the view
        block_sync();  // the previous pass's readers are done with w16; srow / scol are written
#pragma unroll 1
        for (int v0 = threadIdx.x; v0 < total; v0 += 4 * kThreads) {
          uint4 raw[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int v = v0 + j * kThreads;
            if (v < total) raw[j] = __ldcg(reinterpret_cast<const uint4*>(base<TW>(w) + wb + (long long)(v / nv) * ws1 + (v % nv) * V));
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int v = v0 + j * kThreads;
            if (v >= total) break;
            const int k = v / nv, n = (v % nv) * V;
            __nv_bfloat16* dst = w16 + k * wp + n;
            if constexpr (kScale) {
              const Operand& sc = operands()[2];
              const float s = to_f<TS>(base<TS>(sc)[(long long)srow[k] * sc.strides[0] +
                                                   (long long)((scol[k] + n0 + c0 + n) / bc) * sc.strides[1]]);
              const uint4 lo = e4m3x8_to_f16(raw[j].x, raw[j].y), hi = e4m3x8_to_f16(raw[j].z, raw[j].w);
              const unsigned hw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
              unsigned o[8];
#pragma unroll
              for (int i = 0; i < 8; ++i) {
                const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hw[i]));
                o[i] = pack_bf16x2(f.x * s, f.y * s);
              }
              *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
              *reinterpret_cast<uint4*>(dst + 8) = make_uint4(o[4], o[5], o[6], o[7]);
            } else {
              *reinterpret_cast<uint4*>(dst) = raw[j];
            }
          }
        }
        block_sync();
        if (b == c.lo(0) && c0 == 0) c.mark(2);  // the first pass's weights are staged
#pragma unroll 1
        for (int grp = warp; grp * 8 < np; grp += kWarps) {
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
          const int n = grp * 8 + g;  // this lane's B column
#pragma unroll 4
          for (int k0 = 0; k0 < K; k0 += 16) {
            const unsigned* alo = reinterpret_cast<const unsigned*>(a16 + g * ap + k0 + 2 * q);
            const unsigned* ahi = reinterpret_cast<const unsigned*>(a16 + (g + 8) * ap + k0 + 2 * q);
            const unsigned af[4] = {alo[0], ahi[0], alo[4], ahi[4]};
            const unsigned short* bk = reinterpret_cast<const unsigned short*>(w16 + (k0 + 2 * q) * wp + n);
            const unsigned b0 = bk[0] | ((unsigned)bk[wp] << 16), b1 = bk[8 * wp] | ((unsigned)bk[9 * wp] << 16);
            mma_16816(acc, af, b0, b1);
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // accumulator i: row g (+ 8 for i >= 2), column 2q + (i & 1)
            const int m = g + (i < 2 ? 0 : 8), nn = grp * 8 + 2 * q + (i & 1);
            if (m < M && nn < np) {
              int oi[4] = {b, m, n0 + c0 + nn, 0};
              stf<TO>(out, offset4(out, oi), acc[i]);
            }
          }
        }
      }
    }
    return true;
  }
}

template <typename TA, typename TW, typename TS, typename TO, bool kScale>
__device__ void bmm_impl(TileCtx& c) {
  if (bmm_mma<TA, TW, TS, TO, kScale>(c)) return;
  const Operand &a = operands()[0], &w = operands()[1], &out = operands()[kScale ? 3 : 2];
  const int M = a.sizes[1], K = a.sizes[2];
  const int n0 = c.lo(1), n1 = c.hi(1), nc = n1 - n0;
  const long long row_len = c.param(1), w_offset = c.param(2);
  const int br = c.param(3), bc = c.param(4), round_w = c.param(5);
  const long long as0 = a.strides[0], as1 = a.strides[1], as2 = a.strides[2];
  const long long ws0 = w.strides[0], ws1 = w.strides[1], ws2 = w.strides[2];
  const int ncp = min(nc, 128), groups = kThreads / ncp;
  const int col = threadIdx.x % ncp, rg = threadIdx.x / ncp;
  const bool mine = rg < groups;  // the threads past groups * ncp only help load
  float* a_s = c.smem();             // [M][K]
  float* w_s = c.smem() + M * K;     // [kc][ncp]
  const int kc = max(1, min(K, (c.smem_floats - M * K - 16) / ncp));
  // 16-byte weight loads along n: unit n stride, aligned, ncp a multiple of the vector
  constexpr int V = 16 / sizeof(TW);
  auto scale_of = [&](long long e) -> float {  // e: element offset in the [R, C] buffer
    const Operand& sc = operands()[2];
    return to_f<TS>(base<TS>(sc)[((e / row_len) / br) * sc.strides[0] + ((e % row_len) / bc) * sc.strides[1]]);
  };
  auto dequant = [&](float v, long long e) -> float {
    if constexpr (kScale) {
      v *= scale_of(w_offset + e);
      if (round_w) v = round_to<TO>(v);
    }
    return v;
  };
  for (int b = c.lo(0); b < c.hi(0); ++b) {
    block_sync();
    for (int e0 = threadIdx.x; e0 < M * K; e0 += kBmmScalar * kThreads) {  // a[b] as float
      float v[kBmmScalar];
#pragma unroll
      for (int j = 0; j < kBmmScalar; ++j) {
        const int e = e0 + j * kThreads;
        if (e < M * K) v[j] = ldf<TA>(a, (long long)b * as0 + (e / K) * as1 + (long long)(e % K) * as2);
      }
#pragma unroll
      for (int j = 0; j < kBmmScalar; ++j)
        if (e0 + j * kThreads < M * K) a_s[e0 + j * kThreads] = v[j];
    }
    if (b == c.lo(0)) c.mark(1);  // a[b] staged (this thread's share)
    for (int c0 = 0; c0 < nc; c0 += ncp) {
      const int np = min(ncp, nc - c0);  // columns of this pass
      const long long wb = (long long)b * ws0 + (long long)(n0 + c0) * ws2;
      const bool vec = ws2 == 1 && np % V == 0 && (reinterpret_cast<uintptr_t>(base<TW>(w) + wb) & 15) == 0 &&
                       (ws1 * sizeof(TW)) % 16 == 0;
      for (int mb = 0; mb < M; mb += groups * kBmmRows) {  // row blocks (one for M <= kBmmRows * groups)
        float acc[kBmmRows];
#pragma unroll
        for (int r = 0; r < kBmmRows; ++r) acc[r] = 0.f;
        for (int k0 = 0; k0 < K; k0 += kc) {
          const int kn = min(kc, K - k0), total = kn * np;
          block_sync();  // the previous chunk's readers are done with w_s (and a_s is written)
          if (vec) {
            for (int v0 = threadIdx.x; v0 * V < total; v0 += kBmmVecs * kThreads) {
              uint4 raw[kBmmVecs];
#pragma unroll
              for (int j = 0; j < kBmmVecs; ++j) {
                const int e = (v0 + j * kThreads) * V;
                if (e < total) raw[j] = __ldcg(reinterpret_cast<const uint4*>(base<TW>(w) + wb + (long long)(k0 + e / np) * ws1 + e % np));
              }
#pragma unroll
              for (int j = 0; j < kBmmVecs; ++j) {
                const int e = (v0 + j * kThreads) * V;
                if (e >= total) continue;
                const TW* t = reinterpret_cast<const TW*>(&raw[j]);
                const long long eb = wb + (long long)(k0 + e / np) * ws1 + e % np;
                float* dst = w_s + (e / np) * ncp + e % np;
                if constexpr (kScale) {
                  // one scale when the V weights of the vector share a row and a column block of
                  // the [R, C] buffer (the usual case: 128-column blocks, 16-byte aligned vectors) -
                  // the 64-bit index divisions once per vector instead of once per weight
                  const long long in_row = (w_offset + eb) % row_len;
                  if (in_row + V <= row_len && in_row % bc + V <= bc) {
                    const float sc = scale_of(w_offset + eb);
#pragma unroll
                    for (int u = 0; u < V; ++u) {
                      const float v = to_f<TW>(t[u]) * sc;
                      dst[u] = round_w ? round_to<TO>(v) : v;
                    }
                    continue;
                  }
                }
#pragma unroll
                for (int u = 0; u < V; ++u) dst[u] = dequant(to_f<TW>(t[u]), eb + u);
              }
            }
          } else {
            for (int e0 = threadIdx.x; e0 < total; e0 += kBmmScalar * kThreads) {
              float v[kBmmScalar];
#pragma unroll
              for (int j = 0; j < kBmmScalar; ++j) {
                const int e = e0 + j * kThreads;
                if (e < total) v[j] = ldf<TW>(w, wb + (long long)(k0 + e / np) * ws1 + (long long)(e % np) * ws2);
              }
#pragma unroll
              for (int j = 0; j < kBmmScalar; ++j) {
                const int e = e0 + j * kThreads;
                if (e < total)
                  w_s[(e / np) * ncp + e % np] = dequant(v[j], wb + (long long)(k0 + e / np) * ws1 + (long long)(e % np) * ws2);
              }
            }
          }
          block_sync();
          if (b == c.lo(0) && c0 == 0 && mb == 0 && k0 == 0) c.mark(2);  // the first weight chunk is staged
          if (mine && col < np) {
#pragma unroll 4
            for (int k = 0; k < kn; ++k) {
              const float wv = w_s[k * ncp + col];
#pragma unroll
              for (int r = 0; r < kBmmRows; ++r) {
                const int m = mb + rg + r * groups;
                if (m < M) acc[r] += a_s[m * K + k0 + k] * wv;
              }
            }
          }
        }
        if (mine && col < np) {
#pragma unroll
          for (int r = 0; r < kBmmRows; ++r) {
            const int m = mb + rg + r * groups;
            if (m < M) {
              int oi[4] = {b, m, n0 + c0 + col, 0};
              stf<TO>(out, offset4(out, oi), acc[r]);
            }
          }
        }
      }
    }
  }
}
template <typename TA, typename TW, typename TO>
__device__ void op_bmm(TileCtx& c) { bmm_impl<TA, TW, float, TO, false>(c); }
template <typename TA, typename TW, typename TS, typename TO>
__device__ void op_bmm(TileCtx& c) { bmm_impl<TA, TW, TS, TO, true>(c); }

// ---- paged_cache_write: cache[slot[t]] = src[t] (slot over the cache's leading dims) ---------
// A negative slot counts from the end, as torch indexing does; a slot outside the cache (eager
// PyTorch raises IndexError) writes nothing and is reported (fail_index).
template <typename TS, typename TI, typename TD>
__device__ void op_paged_cache_write(TileCtx& c) {
  const Operand &src = operands()[0], &slot = operands()[1], &dst = operands()[2];
  const int t0 = c.lo(0), t1 = c.hi(0), c0 = c.lo(1), c1 = c.hi(1), nc = c1 - c0;
  const int nd = dst.ndim;
  long long rows = 1;
  for (int k = 0; k < nd - 1; ++k) rows *= dst.sizes[k];
  // 16 bytes of consecutive columns per access when source and cache share the element type and
  // both rows allow it; kCacheBatch accesses per thread in flight (slots first, then the copies):
  // one element after another, a GLM-5 latent-cache tile (16 x 576) took 33-36 us on an H200
  constexpr int V = std::is_same<TS, TD>::value ? 16 / (int)sizeof(TD) : 1;
  bool vec = V > 1 && src.strides[1] == 1 && dst.strides[nd - 1] == 1 && nc % V == 0 && c0 % V == 0 &&
             aligned16(src.ptr) && aligned16(dst.ptr) && (src.strides[0] * (long long)sizeof(TS)) % 16 == 0;
  for (int k = 0; k < nd - 1; ++k) vec = vec && (dst.strides[k] * (long long)sizeof(TD)) % 16 == 0;
  const int v = vec ? V : 1, per = nc / v, n = (t1 - t0) * per;
  constexpr int kCacheBatch = 4;
#pragma unroll 1
  for (int e0 = threadIdx.x; e0 < n; e0 += kCacheBatch * kThreads) {
    long long so[kCacheBatch], dof[kCacheBatch];
    bool in[kCacheBatch];
#pragma unroll
    for (int u = 0; u < kCacheBatch; ++u) {
      const int e = min(e0 + u * kThreads, n - 1), t = t0 + e / per;
      so[u] = (long long)ldc<TI>(base<TI>(slot) + (long long)t * slot.strides[0]);
    }
#pragma unroll
    for (int u = 0; u < kCacheBatch; ++u) {
      const int e = min(e0 + u * kThreads, n - 1), t = t0 + e / per, col = c0 + (e % per) * v;
      long long s = so[u] < 0 ? so[u] + rows : so[u], off = (long long)col * dst.strides[nd - 1];
      in[u] = 0 <= s && s < rows;
      if (!in[u]) {
        fail_index(c, so[u], -rows, rows);
        s = 0;
      }
      for (int k = nd - 2; k >= 0; --k) {
        off += (s % dst.sizes[k]) * dst.strides[k];
        s /= dst.sizes[k];
      }
      dof[u] = off;
      so[u] = (long long)t * src.strides[0] + (long long)col * src.strides[1];
    }
    if (vec) {
      uint4 val[kCacheBatch];
#pragma unroll
      for (int u = 0; u < kCacheBatch; ++u) val[u] = __ldcg(reinterpret_cast<const uint4*>(base<TS>(src) + so[u]));
#pragma unroll
      for (int u = 0; u < kCacheBatch; ++u)
        if (e0 + u * kThreads < n && in[u]) *reinterpret_cast<uint4*>(base<TD>(dst) + dof[u]) = val[u];
    } else {
      float val[kCacheBatch];
#pragma unroll
      for (int u = 0; u < kCacheBatch; ++u) val[u] = ldf<TS>(src, so[u]);
#pragma unroll
      for (int u = 0; u < kCacheBatch; ++u)
        if (e0 + u * kThreads < n && in[u]) stf<TD>(dst, dof[u], val[u]);
    }
  }
}

// 8 consecutive elements at p (16-byte aligned for 2-byte types, 8-byte for FP8) as bf16 pairs.
template <typename T>
__device__ __forceinline__ uint4 load8_bf16(const T* p) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __ldcg(reinterpret_cast<const uint4*>(p));
  } else if constexpr (std::is_same<T, __nv_fp8_e4m3>::value) {
    return fp8x8_to_bf16(__ldcg(reinterpret_cast<const uint2*>(p)));
  } else {
    float f[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_f<T>(ldc<T>(p + i));
    return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]), pack_bf16x2(f[6], f[7]));
  }
}

// A page id read from the block table, indexed as torch does (a negative id counts from the end):
// one outside [-pages, pages) is recorded (fail_index) and page 0 read instead, so the tile stays
// inside the cache and the host raises at its next check.
__device__ __forceinline__ long long cache_page(const TileCtx& c, long long id, long long pages) {
  const long long p = id < 0 ? id + pages : id;
  if ((unsigned long long)p < (unsigned long long)pages) return p;
  fail_index(c, id, -pages, pages);
  return 0;
}

// index_score helpers shared by the tensor-core and scalar tiles: request r's head weights
// w[r] as float into w_s [T * H], and its latest token position (later positions are -inf).
template <typename TW>
__device__ __forceinline__ void stage_head_weights(const Operand& w, int r, int T, int H, float* w_s) {
  for (int e = threadIdx.x; e < T * H; e += kThreads) {
    int wi[4] = {r, e / H, e % H, 0};
    w_s[e] = ldf<TW>(w, offset4(w, wi));
  }
}
template <typename TP>
__device__ __forceinline__ long long latest_position(const Operand& pos, int r, int T) {
  long long last = -1;
  for (int t = 0; t < T; ++t)
    last = max(last, (long long)ldc<TP>(base<TP>(pos) + (long long)r * pos.strides[0] + (long long)t * pos.strides[1]));
  return last;
}

// The query quantization of a fused index_score (param 3; tilec/passes/fuse_fp8_quant.py
// fuse_index_quant): the staged query rows (nrows x D values of T at `pitch` elements) are
// replaced in place by their e4m3 quantization - s = max(amax |x|, amin) / fmax (fp8_scale, recip
// param 8; pow2: rounded up to a power of two), q = x / s saturated, as op_fp8_quant computes it -
// held exactly in T, and the head weights w_s[row] (row = t * H + h, as the rows) become
// (w * s) * w_scale, the float32 products of the unfused graph. kLanes lanes per row (a whole
// number of rows per warp).
template <typename T, int kLanes>
__device__ void quantize_query_rows(const TileCtx& c, T* rows, int pitch, int nrows, int D, float* w_s) {
  static_assert(32 % kLanes == 0, "rows per warp");
  const int pow2 = c.param(4), recip = c.param(8);
  const float amin = c.fparam(5), fmax = c.fparam(6), w_scale = c.fparam(7);
  const int lane = threadIdx.x & 31, sub = lane % kLanes;
  const int per_pass = kThreads / kLanes;
#pragma unroll 1
  for (int r0 = 0; r0 < nrows; r0 += per_pass) {  // uniform trip count: every lane reaches the shuffles
    const int row = r0 + threadIdx.x / kLanes;
    T* x = rows + (long long)min(row, nrows - 1) * pitch;
    float amax = 0.f;
    for (int d = sub; d < D; d += kLanes) amax = fmaxf(amax, fabsf(to_f<T>(x[d])));
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float sc = fp8_scale(amax, amin, fmax, recip, pow2);
    __syncwarp();
    if (row < nrows) {
      for (int d = sub; d < D; d += kLanes)  // an e4m3 value is exact in bf16 and float
        x[d] = from_f<T>(to_f<__nv_fp8_e4m3>(from_f<__nv_fp8_e4m3>(fminf(fmaxf(to_f<T>(x[d]) / sc, -fmax), fmax))));
      if (sub == 0) w_s[row] = (w_s[row] * sc) * w_scale;
    }
  }
}

// index_score on tensor cores (bf16 or FP8 q and keys; the products are exact in bf16 and
// accumulate in float32): per request, the tile's queries Q [T * H, D] are staged as bf16; warp
// w takes 8 positions at a time, lane (g, q) holding key row g's D values in registers, and for
// each token t multiplies Q[t] (H / 16 m16 tiles) by the 8 keys, applies ReLU(scale * .) and
// the head weights, and sums the heads with shuffles. Returns false (nothing done) when the
// shapes or strides do not fit (H % 16, D % 32, D <= 256, contiguous 8-element runs).
template <typename TQ, typename TW, typename TK, typename TKS, typename TI, typename TP, typename TO, bool kKScale>
__device__ __noinline__ bool index_score_mma(TileCtx& c) {
  constexpr int kMaxDC = 8;  // D / 32 chunks held per lane
  const Operand &q = operands()[0], &w = operands()[1], &kc = operands()[2];
  const Operand &bt = operands()[kKScale ? 4 : 3], &pos = operands()[kKScale ? 5 : 4], &out = operands()[kKScale ? 6 : 5];
  const int T = q.sizes[1], H = q.sizes[2], D = q.sizes[3];
  const int rows = T * H, ldq = D + ((4 - (D / 8) % 8 + 8) % 8) * 8;  // row stride (elements): 16-byte loads conflict-free
  const bool fits = H % 16 == 0 && D % 32 == 0 && D <= 32 * kMaxDC && q.strides[3] == 1 && kc.strides[2] == 1 &&
                    q.strides[0] % 8 == 0 && q.strides[1] % 8 == 0 && q.strides[2] % 8 == 0 && kc.strides[0] % 8 == 0 &&
                    kc.strides[1] % 8 == 0 && (reinterpret_cast<uintptr_t>(q.ptr) & 15) == 0 &&
                    (reinterpret_cast<uintptr_t>(kc.ptr) & 15) == 0 &&
                    (long long)rows * ldq / 2 + rows + T + 16 <= c.smem_floats;
  if (!fits) return false;
  const float scale = c.fparam(0);
  const int page = c.param(1);
  const bool quant = c.param(3) != 0;  // bf16 queries quantized here (quantize_query_rows)
  if (quant && !std::is_same<TQ, __nv_bfloat16>::value) return false;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, qq = lane & 3;
  const int j0 = c.lo(1), j1 = c.hi(1);
  __nv_bfloat16* q16 = reinterpret_cast<__nv_bfloat16*>(c.smem());  // [rows][ldq]
  float* w_s = c.smem() + (rows * ldq + 1) / 2;                        // [rows]
  int* pos_s = reinterpret_cast<int*>(w_s + rows);                   // [T]: each token's position
  for (int r = c.lo(0); r < c.hi(0); ++r) {
    block_sync();
    if constexpr (std::is_same<TQ, __nv_bfloat16>::value) {  // every row's copies in flight at once
#pragma unroll 1
      for (int e = threadIdx.x; e < rows * (D / 8); e += kThreads) {
        const int row = e / (D / 8);
        int qi[4] = {r, row / H, row % H, (e % (D / 8)) * 8};
        cp_async16(q16 + row * ldq + (e % (D / 8)) * 8, base<TQ>(q) + offset4(q, qi));
      }
      cp_async_wait_all();
    } else {  // other query dtypes (FP8) widened to bf16: 4 loads in flight per thread
      for (int e0 = threadIdx.x; e0 < rows * (D / 8); e0 += 4 * kThreads) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = e0 + j * kThreads, row = e / (D / 8);
          int qi[4] = {r, row / H, row % H, (e % (D / 8)) * 8};
          if (e < rows * (D / 8)) v[j] = load8_bf16<TQ>(base<TQ>(q) + offset4(q, qi));
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = e0 + j * kThreads;
          if (e < rows * (D / 8)) *reinterpret_cast<uint4*>(q16 + (e / (D / 8)) * ldq + (e % (D / 8)) * 8) = v[j];
        }
      }
    }
    stage_head_weights<TW>(w, r, T, H, w_s);
    for (int t = threadIdx.x; t < T; t += kThreads)
      pos_s[t] = (int)ldc<TP>(base<TP>(pos) + (long long)r * pos.strides[0] + (long long)t * pos.strides[1]);
    block_sync();
    if (quant) {
      quantize_query_rows<__nv_bfloat16, 8>(c, q16, ldq, rows, D, w_s);
      block_sync();
    }
    int last = -1;
    for (int t = 0; t < T; ++t) last = max(last, pos_s[t]);
#pragma unroll 1
    for (int j8 = j0 + warp * 8; j8 < j1; j8 += kWarps * 8) {
      const int j = j8 + g;  // this lane's key row (B column g)
      uint4 b[kMaxDC];
      // the key scales of the two positions this lane stores, loaded with the keys (not per token)
      float ksc[2] = {1.f, 1.f};
      if constexpr (kKScale) {
        if (g == 0) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int jj = j8 + 2 * qq + i;
            if (jj < j1 && jj <= last) {
              const long long p = cache_page(c, ldc<TI>(base<TI>(bt) + (long long)r * bt.strides[0] +
                                                         (long long)(jj / page) * bt.strides[1]), kc.sizes[0]);
              const Operand& ks = operands()[3];
              ksc[i] = ldf<TKS>(ks, p * ks.strides[0] + (long long)(jj % page) * ks.strides[1]);
            }
          }
        }
      }
      if (j < j1 && j <= last) {  // later positions are never read (their pages may not exist yet)
        const long long p = cache_page(c, ldc<TI>(base<TI>(bt) + (long long)r * bt.strides[0] +
                                                   (long long)(j / page) * bt.strides[1]), kc.sizes[0]);
        const TK* krow = base<TK>(kc) + p * kc.strides[0] + (long long)(j % page) * kc.strides[1] + 8 * qq;
#pragma unroll
        for (int d = 0; d < kMaxDC; ++d)
          if (d * 32 < D) b[d] = load8_bf16<TK>(krow + d * 32);
      } else {
#pragma unroll
        for (int d = 0; d < kMaxDC; ++d) b[d] = make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll 1
      for (int t = 0; t < T; ++t) {
        float sum0 = 0.f, sum1 = 0.f;  // columns 2qq and 2qq + 1 of the 8 positions
#pragma unroll 1
        for (int h0 = 0; h0 < H; h0 += 16) {
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
          const __nv_bfloat16* alo = q16 + (t * H + h0 + g) * ldq + 8 * qq;
#pragma unroll
          for (int d = 0; d < kMaxDC; ++d)
            if (d * 32 < D)
              mma_k32(acc, *reinterpret_cast<const uint4*>(alo + d * 32),
                      *reinterpret_cast<const uint4*>(alo + 8 * ldq + d * 32), b[d]);
          const float wlo = w_s[t * H + h0 + g], whi = w_s[t * H + h0 + g + 8];
          sum0 += wlo * fmaxf(acc[0] * scale, 0.f) + whi * fmaxf(acc[2] * scale, 0.f);
          sum1 += wlo * fmaxf(acc[1] * scale, 0.f) + whi * fmaxf(acc[3] * scale, 0.f);
        }
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {  // over the 8 row groups g
          sum0 += __shfl_xor_sync(0xffffffffu, sum0, o);
          sum1 += __shfl_xor_sync(0xffffffffu, sum1, o);
        }
        if (g == 0) {
          const int pt = pos_s[t];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int jj = j8 + 2 * qq + i;
            if (jj >= j1) continue;
            float v = -INFINITY;
            if (jj <= pt) {
              v = i ? sum1 : sum0;
              if constexpr (kKScale) v *= ksc[i];
            }
            int oi[4] = {r, t, jj, 0};
            stf<TO>(out, offset4(out, oi), v);
          }
        }
      }
    }
  }
  return true;
}

// ---- index_score: the lightning indexer over paged keys --------------------------------------
// out[r, t, j] = ks[j] * sum_h w[r,t,h] * relu(scale * q[r,t,h] . k[j]), -inf for j > pos[r, t].
// Tile: one request r, positions [j0, j1). q[r] (tokens x heads x D, padded rows) and w[r] are
// staged in shared memory as float; one warp per position j loads the key row once (through a
// per-warp buffer), then lanes run over heads: lane h dots q[t, h] with the key, weights it,
// and one warp sum per (t, j) gives the score.
template <typename TQ, typename TW, typename TK, typename TKS, typename TI, typename TP, typename TO, bool kKScale>
__device__ void index_score_impl(TileCtx& c) {
  if (index_score_mma<TQ, TW, TK, TKS, TI, TP, TO, kKScale>(c)) return;
  const Operand &q = operands()[0], &w = operands()[1], &kc = operands()[2];
  const Operand &bt = operands()[kKScale ? 4 : 3], &pos = operands()[kKScale ? 5 : 4], &out = operands()[kKScale ? 6 : 5];
  const float scale = c.fparam(0);
  const int page = c.param(1);
  const int T = q.sizes[1], H = q.sizes[2], D = q.sizes[3];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j0 = c.lo(1), j1 = c.hi(1);
  const int DP = D + 1;  // padded rows: lane h reads q_s[h * DP + d] without bank conflicts
  float* k_s = c.smem();                   // [kWarps][D]
  float* w_s = k_s + kWarps * D;         // [T][H]
  float* q_s = w_s + T * H;              // [T][H][DP]
  const bool staged = (long long)kWarps * D + (long long)T * H * (1 + DP) + 16 <= c.smem_floats;
  const bool kbuf = (long long)kWarps * D <= c.smem_floats;
  const bool quant = c.param(3) != 0;  // the queries quantized here: needs them staged
  if (quant && !staged) {  // the plan reserves room for them (IndexScore.smem_bytes): fail loudly
    if (threadIdx.x == 0) atomicCAS(c.ring->abort, 0, 2);
    *c.ring->gave_up = 1;
    return;
  }
  for (int r = c.lo(0); r < c.hi(0); ++r) {
    block_sync();
    if (staged) {
      for (int e = threadIdx.x; e < T * H * D; e += kThreads) {
        const int t = e / (H * D), h = (e / D) % H, d = e % D;
        int qi[4] = {r, t, h, d};
        q_s[(t * H + h) * DP + d] = ldf<TQ>(q, offset4(q, qi));
      }
      stage_head_weights<TW>(w, r, T, H, w_s);
    }
    block_sync();
    if (quant) {
      quantize_query_rows<float, 32>(c, q_s, DP, T * H, D, w_s);
      block_sync();
    }
    const long long last = latest_position<TP>(pos, r, T);
    for (int j = j0 + warp; j < j1; j += kWarps) {
      const long long p = j <= last ? cache_page(c, ldc<TI>(base<TI>(bt) + (long long)r * bt.strides[0] +
                                                            (long long)(j / page) * bt.strides[1]), kc.sizes[0]) : 0;
      const long long ko = p * kc.strides[0] + (long long)(j % page) * kc.strides[1];
      float kscale = 1.f;
      if (j <= last) {  // later positions are never read (their pages may not exist yet)
        if constexpr (kKScale) {
          const Operand& ks = operands()[3];
          kscale = ldf<TKS>(ks, p * ks.strides[0] + (long long)(j % page) * ks.strides[1]);
        }
        if (kbuf)
          for (int d = lane; d < D; d += 32) k_s[warp * D + d] = ldf<TK>(kc, ko + (long long)d * kc.strides[2]);
        __syncwarp();
      }
      for (int t = 0; t < T; ++t) {
        const long long pt = (long long)ldc<TP>(base<TP>(pos) + (long long)r * pos.strides[0] +
                                                (long long)t * pos.strides[1]);
        float partial = 0.f;
        if (j <= pt) {
          for (int h = lane; h < H; h += 32) {
            float dot = 0.f;
            for (int d = 0; d < D; ++d) {
              const float kv = kbuf ? k_s[warp * D + d] : ldf<TK>(kc, ko + (long long)d * kc.strides[2]);
              float qv;
              if (staged) {
                qv = q_s[(t * H + h) * DP + d];
              } else {
                int qi[4] = {r, t, h, d};
                qv = ldf<TQ>(q, offset4(q, qi));
              }
              dot += qv * kv;
            }
            float wv;
            if (staged) {
              wv = w_s[t * H + h];
            } else {
              int wi[4] = {r, t, h, 0};
              wv = ldf<TW>(w, offset4(w, wi));
            }
            partial += wv * fmaxf(dot * scale, 0.f);
          }
        }
        partial = warp_sum(partial);
        if (lane == 0) {
          int oi[4] = {r, t, j, 0};
          stf<TO>(out, offset4(out, oi), j <= pt ? partial * kscale : -INFINITY);
        }
      }
      __syncwarp();
    }
  }
}
template <typename TQ, typename TW, typename TK, typename TI, typename TP, typename TO>
__device__ void op_index_score(TileCtx& c) { index_score_impl<TQ, TW, TK, float, TI, TP, TO, false>(c); }
template <typename TQ, typename TW, typename TK, typename TKS, typename TI, typename TP, typename TO>
__device__ void op_index_score(TileCtx& c) { index_score_impl<TQ, TW, TK, TKS, TI, TP, TO, true>(c); }

}  // namespace tilec
