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
// s = max(amax |x|, amin) / fmax (pow2: exp2(ceil(log2(s)))); q = clamp(x / s, +-fmax) -> fp8
// (round to nearest even, saturating). One warp per (row, group).
template <typename TX, typename TQ, typename TS>
__device__ void op_fp8_quant(TileCtx& c) {
  const Operand &x = c.ops[0], &q = c.ops[1], &s = c.ops[2];
  const int nd = q.ndim, K = q.sizes[nd - 1];
  const int G = c.param(0), pow2 = c.param(1);
  const float amin = c.fparam(2), fmax = c.fparam(3);
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  int rows = 1;
  for (int k = 0; k < nd - 1; ++k) rows *= hi[k] - lo[k];
  const int ngroups = K / G;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long xk = x.strides[nd - 1], qk = q.strides[nd - 1], sk = s.strides[nd - 1];
  for (int u = warp; u < rows * ngroups; u += kWarps) {
    const int r = u / ngroups, g = u % ngroups;
    int idx[4] = {0, 0, 0, 0};
    row_index(r, nd, lo, hi, idx);
    idx[nd - 1] = 0;
    const long long xo = offset4(x, idx) + (long long)g * G * xk, qo = offset4(q, idx) + (long long)g * G * qk;
    float amax = 0.f;
    for (int e = lane; e < G; e += 32) amax = fmaxf(amax, fabsf(ldf<TX>(x, xo + e * xk)));
    amax = warp_max(amax);
    float sc = fmaxf(amax, amin) / fmax;
    if (pow2) sc = exp2f(ceilf(log2f(sc)));
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
template <typename TXQ, typename TXS, typename TWQ, typename TWS, typename TO>
__device__ void op_fp8_linear(TileCtx& c) {
  const Operand &xq = c.ops[0], &xs = c.ops[1], &wq = c.ops[2], &ws = c.ops[3], &out = c.ops[4];
  const int K = c.param(0), G = c.param(1), BN = c.param(2), KB = K / G;
  const int nd = out.ndim;
  int lo[4], hi[4];
  box_of(c, nd, lo, hi);
  const int n0 = lo[nd - 1], n1 = hi[nd - 1];
  int rows = 1;
  for (int k = 0; k < nd - 1; ++k) rows *= hi[k] - lo[k];
  const int xsd = xq.ndim - 1, ssd = xs.ndim - 1;
  const long long xk = xq.strides[xsd], sk = xs.strides[ssd], on = out.strides[nd - 1];
  const long long wn = wq.strides[0], wk = wq.strides[1], wsn = ws.strides[0], wsk = ws.strides[1];
  // shared memory: x, scale and out row offsets, then per staged row KB scales and K bytes
  long long* xoff = reinterpret_cast<long long*>(c.smem);
  long long* soff = xoff + kMaxRows;
  long long* ooff = soff + kMaxRows;
  float* xs_s = reinterpret_cast<float*>(ooff + kMaxRows);
  const long long fixed = 3LL * kMaxRows * 8, per_row = 4LL * KB + K;
  const long long avail = 4LL * c.smem_floats - fixed - 80;  // 16 bytes: aligning the FP8 rows
  const int chunk = (int)min((long long)kMaxRows, avail > 0 ? avail / per_row : 0LL);
  const bool staged = chunk > 0;
  const int pass = staged ? chunk : kMaxRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r0 = 0; r0 < rows; r0 += pass) {
    const int nr = min(pass, rows - r0);
    unsigned char* xq_s = reinterpret_cast<unsigned char*>(xs_s + (staged ? (nr * KB + 3) / 4 * 4 : 0));
    __syncthreads();
    for (int r = threadIdx.x; r < nr; r += blockDim.x) {
      int idx[4] = {0, 0, 0, 0};
      row_index(r0 + r, nd, lo, hi, idx);
      idx[nd - 1] = 0;
      xoff[r] = offset4(xq, idx);
      soff[r] = offset4(xs, idx);
      ooff[r] = offset4(out, idx);
    }
    __syncthreads();
    if (staged) {
      for (int e = threadIdx.x; e < nr * KB; e += blockDim.x) xs_s[e] = ldf<TXS>(xs, soff[e / KB] + (e % KB) * sk);
      for (int e = threadIdx.x; e < nr * K; e += blockDim.x) {
        const TXQ v = ldc<TXQ>(base<TXQ>(xq) + xoff[e / K] + (long long)(e % K) * xk);
        xq_s[e] = *reinterpret_cast<const unsigned char*>(&v);
      }
      __syncthreads();
    }
    auto xval = [&](int m, int k) -> float {
      if (staged) return to_f<TXQ>(*reinterpret_cast<const TXQ*>(xq_s + (long long)m * K + k));
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
                const uint4 xr = *reinterpret_cast<const uint4*>(xq_s + (long long)(m0 + m) * K + k);
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

// ---- bmm: out[b] = a[b] @ w[b] (w optionally a view of a block-scaled FP8 [R, C] buffer) -----
// Per batch b of the tile: a[b] is staged in shared memory as float (when it fits); columns go
// in passes of ncp = min(nc, blockDim) and thread t owns column t % ncp and the K slice t / ncp
// (ks slices, as many as the threads and the reduction buffer allow), accumulating
// kRowsPerPass rows at a time; the slices are summed through shared memory.
template <typename TA, typename TW, typename TS, typename TO, bool kScale>
__device__ void bmm_impl(TileCtx& c) {
  const Operand &a = c.ops[0], &w = c.ops[1], &out = c.ops[kScale ? 3 : 2];
  const int M = a.sizes[1], K = a.sizes[2];
  const int n0 = c.lo(1), n1 = c.hi(1), nc = n1 - n0;
  const long long row_len = c.param(1), w_offset = c.param(2);
  const int br = c.param(3), bc = c.param(4), round_w = c.param(5);
  const int ncp = min(nc, (int)blockDim.x);
  const int ks = max(1, min((int)blockDim.x / ncp, c.smem_floats / (kRowsPerPass * ncp)));
  const int col = threadIdx.x % ncp, slice = threadIdx.x / ncp;
  float* red = c.smem;                          // [ks][kRowsPerPass][ncp] (ks > 1)
  float* a_s = red + (ks > 1 ? ks * kRowsPerPass * ncp : 0);  // [M][K] when it fits
  const bool staged = (long long)(a_s - c.smem) + (long long)M * K <= c.smem_floats;
  const bool active = slice < ks;
  for (int b = c.lo(0); b < c.hi(0); ++b) {
    __syncthreads();
    if (staged)
      for (int e = threadIdx.x; e < M * K; e += blockDim.x) {
        int ai[4] = {b, e / K, e % K, 0};
        a_s[e] = ldf<TA>(a, offset4(a, ai));
      }
    __syncthreads();
    auto aval = [&](int m, int k) -> float {
      if (staged) return a_s[m * K + k];
      int ai[4] = {b, m, k, 0};
      return ldf<TA>(a, offset4(a, ai));
    };
    for (int c0 = 0; c0 < nc; c0 += ncp) {
      const int n = n0 + c0 + col;
      const bool mine = active && c0 + col < nc;
      for (int m0 = 0; m0 < M; m0 += kRowsPerPass) {
        float acc[kRowsPerPass];
#pragma unroll
        for (int m = 0; m < kRowsPerPass; ++m) acc[m] = 0.f;
        if (mine) {
          for (int k = slice; k < K; k += ks) {
            const long long e = (long long)b * w.strides[0] + (long long)k * w.strides[1] + (long long)n * w.strides[2];
            float wv = ldf<TW>(w, e);
            if constexpr (kScale) {
              const long long abs_e = w_offset + e;
              const long long row = abs_e / row_len, cl = abs_e % row_len;
              const Operand& s = c.ops[2];
              wv *= to_f<TS>(base<TS>(s)[(row / br) * s.strides[0] + (cl / bc) * s.strides[1]]);
              if (round_w) wv = round_to<TO>(wv);
            }
#pragma unroll
            for (int m = 0; m < kRowsPerPass; ++m)
              if (m0 + m < M) acc[m] += aval(m0 + m, k) * wv;
          }
        }
        if (ks == 1) {
          if (mine)
            for (int m = 0; m < kRowsPerPass && m0 + m < M; ++m) {
              int oi[4] = {b, m0 + m, n, 0};
              stf<TO>(out, offset4(out, oi), acc[m]);
            }
          continue;
        }
        __syncthreads();
        if (mine)
#pragma unroll
          for (int m = 0; m < kRowsPerPass; ++m) red[(slice * kRowsPerPass + m) * ncp + col] = acc[m];
        __syncthreads();
        for (int e = threadIdx.x; e < kRowsPerPass * ncp; e += blockDim.x) {
          const int m = e / ncp, cc = e % ncp;
          if (m0 + m >= M || c0 + cc >= nc) continue;
          float sum = 0.f;
          for (int s2 = 0; s2 < ks; ++s2) sum += red[(s2 * kRowsPerPass + m) * ncp + cc];
          int oi[4] = {b, m0 + m, n0 + c0 + cc, 0};
          stf<TO>(out, offset4(out, oi), sum);
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
// A negative slot counts from the end, as torch indexing does.
template <typename TS, typename TI, typename TD>
__device__ void op_paged_cache_write(TileCtx& c) {
  const Operand &src = c.ops[0], &slot = c.ops[1], &dst = c.ops[2];
  const int t0 = c.lo(0), t1 = c.hi(0), c0 = c.lo(1), c1 = c.hi(1), nc = c1 - c0;
  const int nd = dst.ndim;
  long long rows = 1;
  for (int k = 0; k < nd - 1; ++k) rows *= dst.sizes[k];
  for (long long e = threadIdx.x; e < (long long)(t1 - t0) * nc; e += blockDim.x) {
    const int t = t0 + (int)(e / nc), col = c0 + (int)(e % nc);
    long long s = (long long)ldc<TI>(base<TI>(slot) + (long long)t * slot.strides[0]);
    if (s < 0) s += rows;
    int idx[4] = {0, 0, 0, 0};
    for (int k = nd - 2; k >= 0; --k) {
      idx[k] = (int)(s % dst.sizes[k]);
      s /= dst.sizes[k];
    }
    idx[nd - 1] = col;
    stf<TD>(dst, offset4(dst, idx), ldf<TS>(src, (long long)t * src.strides[0] + (long long)col * src.strides[1]));
  }
}

// ---- index_score: the lightning indexer over paged keys --------------------------------------
// out[r, t, j] = ks[j] * sum_h w[r,t,h] * relu(scale * q[r,t,h] . k[j]), -inf for j > pos[r, t].
// Tile: one request r, positions [j0, j1). q[r] (tokens x heads x D, padded rows) and w[r] are
// staged in shared memory as float; one warp per position j loads the key row once (through a
// per-warp buffer), then lanes run over heads: lane h dots q[t, h] with the key, weights it,
// and one warp sum per (t, j) gives the score.
template <typename TQ, typename TW, typename TK, typename TKS, typename TI, typename TP, typename TO, bool kKScale>
__device__ void index_score_impl(TileCtx& c) {
  const Operand &q = c.ops[0], &w = c.ops[1], &kc = c.ops[2];
  const Operand &bt = c.ops[kKScale ? 4 : 3], &pos = c.ops[kKScale ? 5 : 4], &out = c.ops[kKScale ? 6 : 5];
  const float scale = c.fparam(0);
  const int page = c.param(1);
  const int T = q.sizes[1], H = q.sizes[2], D = q.sizes[3];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j0 = c.lo(1), j1 = c.hi(1);
  const int DP = D + 1;  // padded rows: lane h reads q_s[h * DP + d] without bank conflicts
  float* k_s = c.smem;                   // [kWarps][D]
  float* w_s = k_s + kWarps * D;         // [T][H]
  float* q_s = w_s + T * H;              // [T][H][DP]
  const bool staged = (long long)kWarps * D + (long long)T * H * (1 + DP) + 16 <= c.smem_floats;
  const bool kbuf = (long long)kWarps * D <= c.smem_floats;
  for (int r = c.lo(0); r < c.hi(0); ++r) {
    __syncthreads();
    if (staged) {
      for (int e = threadIdx.x; e < T * H * D; e += blockDim.x) {
        const int t = e / (H * D), h = (e / D) % H, d = e % D;
        int qi[4] = {r, t, h, d};
        q_s[(t * H + h) * DP + d] = ldf<TQ>(q, offset4(q, qi));
      }
      for (int e = threadIdx.x; e < T * H; e += blockDim.x) {
        int wi[4] = {r, e / H, e % H, 0};
        w_s[e] = ldf<TW>(w, offset4(w, wi));
      }
    }
    __syncthreads();
    long long last = -1;  // the request's latest token position: later positions are all -inf
    for (int t = 0; t < T; ++t)
      last = max(last, (long long)ldc<TP>(base<TP>(pos) + (long long)r * pos.strides[0] + (long long)t * pos.strides[1]));
    for (int j = j0 + warp; j < j1; j += kWarps) {
      const long long p = j <= last ? (long long)ldc<TI>(base<TI>(bt) + (long long)r * bt.strides[0] +
                                                        (long long)(j / page) * bt.strides[1]) : 0;
      const long long ko = p * kc.strides[0] + (long long)(j % page) * kc.strides[1];
      float kscale = 1.f;
      if (j <= last) {  // later positions are never read (their pages may not exist yet)
        if constexpr (kKScale) {
          const Operand& ks = c.ops[3];
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
