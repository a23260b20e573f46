// tilec runtime: split-KV decode attention (flash-decoding; Dao, Haziza, Massa, Sizov 2023,
// "Flash-Decoding for long-context inference"). Semantics mirror the CPU references in
// tilec/ops/attention_split.py:
//   op_attention_partial  per (batch, KV head, split of `chunk` cache positions) and every query
//                         of the head group (G heads x Sq tokens): m = max score over the split,
//                         l = sum exp(s - m), o = sum round_V(exp(s - m)) V  (float32, unnormalized);
//                         With attr append it also writes the step's new K / V rows it holds into the cache;
//                         with a folded combine the last tile of a head group to finish then combines it.
//   op_attention_combine  out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s, M = max_s m_s.
// o_part [B, Hq * Sq, NS, Dv] and ml [B, Hq * Sq, NS, 2] are float32 (row r = hq * Sq + i).
// Shared memory is sized by OpDef.smem_bytes (the constants below are mirrored there).
// Included by ops.cuh (needs its ldc / ldf / stf / round_to helpers).
#pragma once
#include "common.cuh"

namespace tilec {

// Loops with a run-time trip count stay rolled (#pragma unroll 1; nvcc unrolls them by 4 by
// default): this code runs once per layer on a worker, fetched cold, and rolled it is smaller
// (the partial's SASS 48 -> 39 KiB, the combine's 18 -> 9 KiB). On an H200 the step time did not
// move (variants_ab.py, Llama-3.2-1B batch 1, context 1024: 1.471 ms rolled, 1.468 unrolled).
constexpr int kAttnQ = 4;          // queries per pass over a split (ATTN_Q in attention_split.py)
constexpr int kAttnSegMax = 2048;  // cache positions per shared-memory score segment (ATTN_SEG_MAX)

// Lanes that share one cache row (8 elements each): the next power of two >= ceil(d / 8), so
// a warp covers 32 / lanes rows per load and a row's dot product reduces within its lane group.
__device__ __forceinline__ int attn_lanes(int d) {
  const int n = (d + 7) / 8;
  return n <= 1 ? 1 : 1 << (32 - __clz(n - 1));
}
// log2 of a power of two
__device__ __forceinline__ int attn_log2(int p) { return __ffs(p) - 1; }

// 16-byte loads need 2-byte elements, a unit last stride, 8 | row length and 16-byte aligned rows.
__device__ __forceinline__ bool attn_vec_ok(const Operand& o) {
  if (o.strides[3] != 1 || o.sizes[3] % 8 != 0 || (reinterpret_cast<uintptr_t>(o.ptr) & 15) != 0) return false;
  for (int k = 0; k < 3; ++k)
    if (o.sizes[k] > 1 && o.strides[k] % 8 != 0) return false;
  return true;
}

// Element `hi` (0: low, 1: high half) of a 32-bit word holding two 2-byte values, as float
// (bit operations, so the raw vector never needs an address and stays in registers).
template <typename T> __device__ __forceinline__ float attn_half_of(unsigned int w, int hi);
template <> __device__ __forceinline__ float attn_half_of<__nv_bfloat16>(unsigned int w, int hi) {
  return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
}
template <> __device__ __forceinline__ float attn_half_of<__half>(unsigned int w, int hi) {
  return __half2float(__ushort_as_half((unsigned short)(hi ? w >> 16 : w & 0xffffu)));
}

// Elements d0 .. d0 + 7 of one cache row (zeros past the row's n elements, or when !ok).
// kStaged: the row sits in shared memory (rows of 2-byte elements staged by the tile: row jj of
// the segment at rows + jj * pitch); otherwise 8 strided scalar loads from global memory
// converted to float.
template <bool kStaged, typename T> struct AttnRow8;
template <typename T> struct AttnRow8<true, T> {
  uint4 raw;
  __device__ __forceinline__ void load(const T* rows, int jj, int n, int pitch, int d0, bool ok) {
    raw = ok && d0 < n ? *reinterpret_cast<const uint4*>(rows + (long long)jj * pitch + d0) : make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ float operator[](int e) const {  // e: a compile-time constant after unrolling
    const unsigned int w = e < 2 ? raw.x : e < 4 ? raw.y : e < 6 ? raw.z : raw.w;
    return attn_half_of<T>(w, e & 1);
  }
};
template <typename T> struct AttnRow8<false, T> {
  float v[8];
  __device__ __forceinline__ void load(const Operand& o, long long off, long long stride, int d0, int n, bool ok) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = ok && d0 + e < n ? ldf<T>(o, off + (long long)(d0 + e) * stride) : 0.f;
  }
  __device__ __forceinline__ float operator[](int e) const { return v[e]; }
};

// The end of split s's positions [s * chunk, end) that some query sees (query i sees positions
// < valid + i when causal); end == s * chunk when none does.
__device__ __forceinline__ int attn_split_end(int s, int chunk, int S, int causal, long long valid, int Sq) {
  const int j0 = s * chunk, j1 = min(S, j0 + chunk);
  return causal ? (int)max((long long)j0, min((long long)j1, valid + Sq - 1)) : j1;
}

// Shared-memory pitches of a staged segment of seg positions, chosen so that the tensor-core
// paths' fragment loads (8 rows x 4 lanes of 32-bit words) hit 32 different banks: a K or V row
// of n elements takes n + 8 (16 bytes more: with 64- or 128-element rows, row r + 1 starts 4
// banks after row r); a query's scores take attn_score_pitch(seg) floats (8 more than a multiple
// of 32); its probabilities, as bf16 pairs, attn_p_pitch(seg) words (4 more than a multiple of 8,
// covering seg rounded up to 16). Unpadded, 64-element rows (128 bytes) all start in bank 0 and
// those loads were 4- to 8-way conflicts (by the layout; no profiler counts). Measured on an H200
// (Llama-3.2-1B batch 1, context 1024, traces of benchmarks/lab/variants_ab.py from two leases):
// a 96-position split's scores took 0.83 against 1.41 us, its P.V 0.96 against 1.60, the tile 7.33
// against 8.45; the step 1.157 ms against 1.175 / 1.178 for the unpadded runtime in processes of
// the same lease before and after it.
__device__ __forceinline__ int attn_score_pitch(int seg) { return (seg + 31) / 32 * 32 + 8; }
__device__ __forceinline__ int attn_p_pitch(int seg) { return (seg + 15) / 16 * 8 + 4; }
// Cache positions per segment when the tile stages its K / V rows in shared memory: what fits
// beside the queries, the statistics and the segment's scores (0: too few, stage nothing). The
// padding is bounded per query by 39 score floats and (loosely) 19 probability words
// (attn_score_pitch, attn_p_pitch), per position by 8 floats (16 bytes of a K and of a V row).
__device__ __forceinline__ int attn_staged_seg(const TileCtx& c, int chunk, int D, int Dv) {
  const int per_pos = kAttnQ + kAttnQ / 2 + (D + Dv + 16) / 2;  // floats: scores, p pairs, a K and a V row
  const int fit = (c.smem_floats - kAttnQ * 256 - 32 - kAttnQ * (39 + 19)) / per_pos;
  const int seg = min(min(chunk, kAttnSegMax), fit);
  return seg >= min(chunk, 32) ? seg : 0;
}

// ---- attention_partial ---------------------------------------------------------------------
// Per (b, KV head h, split s) and pass of <= kAttnQ queries, over segments of <= kAttnSegMax
// visible positions (online softmax between segments; one segment whenever the split fits):
//  (0) kStaged: the segment's K and V rows come into shared memory with 16-byte cp.async copies,
//      all in flight at once (a split of 128 positions of a 64-dim bf16 head is 32 KB: one round
//      trip instead of one per 32 rows);
//  (1) scores: with bf16 queries and staged bf16 K rows (D % 16 == 0) on tensor cores - mma
//      m16n8k16, A = the unscaled queries (exact in bf16; rows >= the pass's queries zero), B =
//      8 staged K rows, warp w taking the 8-position tiles w, w + kWarps, ..; each score then
//      times the scale. Otherwise lane groups of LK = attn_lanes(D) lanes per K row: a dot over
//      the lane's 8 elements with the scaled queries (shared memory, float), then a shuffle
//      reduction inside the group. Masked scores go to shared memory;
//  (2) one warp per query: segment max, running max m, p = exp(s - m) (stored rounded to V's
//      dtype), l (unrounded sum), and the rescale factor alpha of the earlier segments;
//  (3) P.V: with staged bf16 V rows on tensor cores - A = p (bf16 values: exact), B = V, warp
//      w owning the 8-column tiles w, w + kWarps, .. of Dv over all positions (float32
//      accumulators in registers, no cross-warp sum). Otherwise lane groups of LV =
//      attn_lanes(Dv) lanes per V row, float32 accumulators per lane (kAttnQ x 8); at the end of
//      the split a shuffle reduction across the warp's groups and a deterministic sum over warps
//      in shared memory. o, m, l are stored.
// The tensor-core paths sum in another order than the lane-group paths (float32 reassociation).
// Measured on an H200 (benchmarks/lab/variants_ab.py, Llama-3.2-1B batch 1, context 1024, one
// process): a step 1.297 against 1.308 ms with the lane-group paths, the partial tile 7.0
// against 8.0 us (medians; scores + softmax 2.1 against 2.5 us); logits max |diff| 3.1e-2 (bf16 noise:
// the greedy checks of tests/gpu/test_cuda_models.py pass).
// Shared memory: queries [kAttnQ][256] floats (bf16 [kAttnQ][D + 8] for the tensor-core scores),
// statistics (32 floats), scores [kAttnQ][seg] (at the end the per-warp P.V partials), then with
// kStaged K rows [seg][D + 8], V rows [seg][Dv + 8] and the bf16 probabilities of the tensor-core
// P.V, the staged layouts padded as attn_score_pitch says.
// Query element qi[3] of row qi (b, head, token) with the folded rotate-half RoPE applied
// (tilec/passes/fold_rope.py; rotate-half only - AttentionPartial.params refuses another style;
// also a new key's element, tilec/passes/fold_kv_append.py, with q = k_new and a KV head):
// operands 6 and 7 are cos and sin of q's shape and dtype (the frontend's views broadcast them
// with zero strides), and the arithmetic is op_rope's - each product rounded to TQ, then the sum
// rounded (op_rope's store) - so the value is bitwise the rope op's output.
template <typename TQ>
__device__ __forceinline__ float rope_query(const Operand& q, int* qi, int D) {
  const Operand &cs = operands()[6], &sn = operands()[7];
  const int d = qi[3], h = D / 2;
  const float c = ldf<TQ>(cs, offset4(cs, qi)), s = ldf<TQ>(sn, offset4(sn, qi));
  const float x = ldf<TQ>(q, offset4(q, qi));
  qi[3] = d < h ? d + h : d - h;  // rotate_half's partner: -x[d + h] for d < h, x[d - h] after
  const float y = ldf<TQ>(q, offset4(q, qi));
  qi[3] = d;
  const float xc = round_to<TQ>(__fmul_rn(x, c)), ys = round_to<TQ>(__fmul_rn(y, s));  // as op_rope: no FMA
  return round_to<TQ>(d < h ? xc - ys : xc + ys);
}

template <bool kStaged, bool kAppend, typename TQ, typename TK, typename TV, typename TP, typename TM>
__device__ void attention_partial_impl(TileCtx& c, int seg) {
  static_assert(!kAppend || kStaged, "the unstaged path reads the new rows from the cache (attn_append_rows)");
  const Operand &q = operands()[0], &k = operands()[1], &v = operands()[2], &op = operands()[3], &ml = operands()[4];
  const long long valid = operands()[5].scalar;
  const float scale = c.fparam(0);
  const int causal = c.param(1), chunk = c.param(2), rope = c.param(3);
  const int Hq = q.sizes[1], Sq = q.sizes[2], D = q.sizes[3], Hkv = k.sizes[1], S = k.sizes[2], Dv = v.sizes[3];
  const int G = Hq / Hkv, nq = G * Sq;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int LK = attn_lanes(D), LV = attn_lanes(Dv), PK = 32 / LK, PV = 32 / LV, DVP = 8 * LV;
  const int lk = attn_log2(LK), lv = attn_log2(LV);  // LK, LV are powers of two: shifts, not divisions
  const int gk = lane >> lk, ik = lane & (LK - 1), gv = lane >> lv, iv = lane & (LV - 1);
  const long long kj = k.strides[2], kd = k.strides[3], vj = v.strides[2], vd = v.strides[3];
  // staged rows and scores are padded (attn_score_pitch): pitches DP, VP elements, scp floats
  const int DP = kStaged ? D + 8 : D, VP = kStaged ? Dv + 8 : Dv, scp = kStaged ? attn_score_pitch(seg) : seg;
  float* qs = c.smem();             // [kAttnQ][256] queries (scaled unless mma_qk), zero past D; mma_qk:
                                    // bf16 [kAttnQ][D + 8]
  float* st = qs + kAttnQ * 256;  // m[kAttnQ], l[kAttnQ], alpha[kAttnQ]; zrow at st + 28
  float* zrow = st + 28;          // 16 zero bytes: the tensor-core P.V's V row past len
  float* sc = st + 32;            // [kAttnQ][scp] scores -> p (the tensor-core P.V's p: pb); at the end
                                  // [kWarps][kAttnQ][DVP] P.V partials
  TK* ks = reinterpret_cast<TK*>(sc + kAttnQ * scp);  // kStaged: [seg][DP]
  // bf16 queries and staged bf16 K rows: the scores on tensor cores (phase 1 above)
  const bool mma_qk = kStaged && std::is_same<TQ, __nv_bfloat16>::value && std::is_same<TK, __nv_bfloat16>::value &&
                      D % 16 == 0;
  TV* vs = reinterpret_cast<TV*>(ks + (long long)seg * DP);  // kStaged: [seg][VP]
  unsigned* pb = reinterpret_cast<unsigned*>(vs + (long long)seg * VP);  // kMmaPV: p as bf16 pairs [kAttnQ][pbw]
  const int pbw = attn_p_pitch(seg);
  __nv_bfloat16* qb = reinterpret_cast<__nv_bfloat16*>(qs);  // mma_qk (so kStaged): the queries as bf16, pitch DP
#pragma unroll 1
  for (int b = c.lo(0); b < c.hi(0); ++b)
#pragma unroll 1
    for (int h = c.lo(1); h < c.hi(1); ++h)
#pragma unroll 1
      for (int s = c.lo(2); s < c.hi(2); ++s) {
        const int j0 = s * chunk, jend = attn_split_end(s, chunk, S, causal, valid, Sq);
        int hi0[4] = {b, h, 0, 0};
        const long long kb = offset4(k, hi0), vb = offset4(v, hi0);
        // The step's new rows [a0, a1) this split holds (kAppend: attr append, staged rows): the
        // tile writes them into its staged rows from k_new / v_new (and into the cache slots on its
        // first pass of queries), their loads in the same round trip as the queries', rather than
        // writing the slots first (attn_append_rows, a round trip and a barrier) and copying them
        // back with the other rows. Measured on an H200 (variants_ab.py, batch 1, context 1024, one
        // process, logits bitwise equal): Llama-3.2-1B 1.115 against 1.121 ms a step (the attention
        // phase 10.46 against 10.67 us), Llama-3.1-8B 4.775 against 4.777.
        const int a0 = kAppend ? (int)max((long long)j0, valid - 1) : 0;
        const int a1 = kAppend ? (int)min((long long)jend, valid - 1 + Sq) : 0;
        // Element e of the new rows staged from row jj0 of the segment at p0, in rows of D + Dv (a
        // K row, then its V row): append_val loads its value (and says its staged row jj and
        // element d), append_store writes it there and, with wglob, into the cache slot.
        auto append_val = [&](int p0, int jj0, int e, int& jj, int& d) -> float {
          const int r = e / (D + Dv);
          jj = jj0 + r;
          d = e - r * (D + Dv);
          int idx[4] = {b, h, p0 + jj - (int)(valid - 1), d < D ? d : d - D};
          return d < D ? rope_query<TQ>(operands()[8], idx, D) : ldf<TV>(operands()[9], offset4(operands()[9], idx));
        };
        auto append_store = [&](int p0, int jj, int d, float x, bool wglob) {
          int idx[4] = {b, h, p0 + jj - (int)(valid - 1), d < D ? d : d - D};
          if (d < D) {
            ks[jj * DP + d] = from_f<TK>(x);
            if (wglob) stf<TK>(operands()[10], offset4(operands()[10], idx), x);
          } else {
            vs[jj * VP + d - D] = from_f<TV>(x);
            if (wglob) stf<TV>(operands()[11], offset4(operands()[11], idx), x);
          }
        };
        // (0) K and V rows [p0, p0 + len) into shared memory: 16-byte cp.async copies, all in flight
        // (the new rows [a0, a1) skipped: the caller writes them)
        auto stage = [&](int p0, int len) {
          const int kv = D / 8, vv = Dv / 8;
          const int sk0 = a0 - p0, sk1 = a1 - p0;  // rows jj in [sk0, sk1) are not copied
          if (!(kv & (kv - 1)) && !(vv & (vv - 1))) {  // 16-byte chunks per row a power of two: shifts
            const int sk = attn_log2(kv), sv = attn_log2(vv);
#pragma unroll 1
            for (int e = threadIdx.x; e < len * kv; e += kThreads) {
              const int jj = e >> sk, d = (e & (kv - 1)) * 8;
              if (kAppend && jj >= sk0 && jj < sk1) continue;
              cp_async16(ks + jj * DP + d, base<TK>(k) + kb + (long long)(p0 + jj) * kj + d);
            }
#pragma unroll 1
            for (int e = threadIdx.x; e < len * vv; e += kThreads) {
              const int jj = e >> sv, d = (e & (vv - 1)) * 8;
              if (kAppend && jj >= sk0 && jj < sk1) continue;
              cp_async16(vs + jj * VP + d, base<TV>(v) + vb + (long long)(p0 + jj) * vj + d);
            }
            return;
          }
#pragma unroll 1
          for (int e = threadIdx.x; e < len * (kv + vv); e += kThreads) {
            if (e < len * kv) {
              const int jj = e / kv, d = (e - jj * kv) * 8;
              if (kAppend && jj >= sk0 && jj < sk1) continue;
              cp_async16(ks + jj * DP + d, base<TK>(k) + kb + (long long)(p0 + jj) * kj + d);
            } else {
              const int f = e - len * kv, jj = f / vv, d = (f - jj * vv) * 8;
              if (kAppend && jj >= sk0 && jj < sk1) continue;
              cp_async16(vs + jj * VP + d, base<TV>(v) + vb + (long long)(p0 + jj) * vj + d);
            }
          }
        };
#pragma unroll 1
        for (int q0 = 0; q0 < nq; q0 += kAttnQ) {
          const int qc = min(kAttnQ, nq - q0);
          block_sync();  // the previous pass is done with shared memory
          // the first segment's rows start before the queries load: one round trip, not two
          if constexpr (kStaged)
            if (jend > j0) stage(j0, min(seg, jend - j0));
          // the new rows of the first segment load with the queries (the same round trip)
          const int na = kAppend ? max(0, min(a1, j0 + seg) - a0) * (D + Dv) : 0;
          const int nqe = qc * 8 * LK;
#pragma unroll 1
          for (int e = threadIdx.x; e < max(nqe, na); e += kThreads) {
            const int qq = e >> (lk + 3), d = e & (8 * LK - 1);
            float val = 0.f, av = 0.f;
            int ajj = 0, ad = 0;
            if (e < nqe && d < D) {
              int qi[4] = {b, h * G + (q0 + qq) / Sq, (q0 + qq) % Sq, d};
              val = (rope ? rope_query<TQ>(q, qi, D) : ldf<TQ>(q, offset4(q, qi))) * (mma_qk ? 1.f : scale);
            }
            if (kAppend && e < na) av = append_val(j0, a0 - j0, e, ajj, ad);
            if (e < nqe) {
              if (!mma_qk) qs[qq * 256 + d] = val;
              else if (d < D) qb[qq * DP + d] = __float2bfloat16(val);  // exact: a bf16 value
            }
            if (kAppend && e < na) append_store(j0, ajj, ad, av, q0 == 0);
          }
          if (threadIdx.x < kAttnQ) {
            st[threadIdx.x] = -INFINITY;
            st[kAttnQ + threadIdx.x] = 0.f;
          }
          if (threadIdx.x < 4) zrow[threadIdx.x] = 0.f;  // the zero row of P.V's fragment loads past len
          float acc[kAttnQ][8];
          // staged bf16 V rows: P.V on tensor cores (phase 3 above); pv[i][0..1] = O[query lane / 4]
          // [8 (w + kWarps i) + 2 (lane % 4) + 0..1] (rows 8..15 and queries >= qc are zero padding)
          constexpr bool kMmaPV = kStaged && std::is_same<TV, __nv_bfloat16>::value;
          static_assert(kAttnQ <= 8, "the tensor-core paths hold a pass's queries in the mma's rows 0..7");
          static_assert(4 * kWarps * 8 >= 256, "pv: 4 column tiles of 8 per warp cover Dv <= 256 (AttentionPartial checks)");
          float pv[4][4];
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) pv[i][e] = 0.f;
          long long lim[kAttnQ];  // query qq sees cache positions < lim[qq]
          int tok = (q0 % Sq);    // query q0 + qq is token (q0 + qq) % Sq: one division per pass
#pragma unroll
          for (int qq = 0; qq < kAttnQ; ++qq) {
            lim[qq] = causal ? valid + tok : 0x7fffffffffffffffLL;
            if (++tok == Sq) tok = 0;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[qq][e] = 0.f;
          }
#pragma unroll 1
          for (int p0 = j0; p0 < jend; p0 += seg) {
            const int len = min(seg, jend - p0);
            if constexpr (kStaged) {  // (0) the segment's K and V rows into shared memory
              if (p0 != j0) {  // (the first segment's rows were issued with the queries)
                block_sync();  // the previous segment's P.V is done with vs
                stage(p0, len);
                if constexpr (kAppend) {  // new rows in a later segment: written here
                  const int lo = max(a0, p0), n = max(0, min(a1, p0 + len) - lo) * (D + Dv);
#pragma unroll 1
                  for (int e = threadIdx.x; e < n; e += kThreads) {
                    int ajj, ad;
                    const float av = append_val(p0, lo - p0, e, ajj, ad);
                    append_store(p0, ajj, ad, av, q0 == 0);
                  }
                }
              }
              cp_async_wait_all();
            }
            block_sync();  // queries (and rows) staged; the previous segment's P.V is done with sc
            c.mark(1);     // profiling: queries staged (the tile's last head / split / pass / segment)
            // (1) scores; query qq sees the segment's rows jj < seen[qq]
            int seen[kAttnQ];
#pragma unroll
            for (int qq = 0; qq < kAttnQ; ++qq) seen[qq] = (int)max(0LL, min((long long)len, lim[qq] - p0));
            // LK a compile-time constant (kLK > 0) unrolls the lane group's shuffle sum to its log2(LK) steps
            auto scores = [&](auto klk) {
              constexpr int kLK = decltype(klk)::value;
#pragma unroll 1
              for (int t0 = 0; t0 < len; t0 += kWarps * PK) {
                const int jj = t0 + warp * PK + gk;
                AttnRow8<kStaged, TK> kr;
                if constexpr (kStaged) kr.load(ks, jj, D, DP, ik * 8, jj < len);
                else kr.load(k, kb + (long long)(p0 + jj) * kj, kd, ik * 8, D, jj < len);
#pragma unroll
                for (int qq = 0; qq < kAttnQ; ++qq) {
                  if (qq < qc) {  // warp-uniform
                    const float4 a = *reinterpret_cast<const float4*>(qs + qq * 256 + ik * 8);
                    const float4 a2 = *reinterpret_cast<const float4*>(qs + qq * 256 + ik * 8 + 4);
                    float dot = a.x * kr[0] + a.y * kr[1] + a.z * kr[2] + a.w * kr[3] +
                                a2.x * kr[4] + a2.y * kr[5] + a2.z * kr[6] + a2.w * kr[7];
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1)  // LK / 2, LK / 4, .., 1: the lane group's sum
                      if (o < (kLK > 0 ? kLK : LK)) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                    if (ik == 0 && jj < len) sc[qq * scp + jj] = jj < seen[qq] ? dot : -INFINITY;
                  }
                }
              }
            };
            if (mma_qk) {
              const int qr = lane >> 2, kq = (lane & 3) * 2;
              const long long limq = causal ? valid + (q0 + qr) % Sq : 0x7fffffffffffffffLL;
              const int seenq = (int)max(0LL, min((long long)len, limq - p0));
              const unsigned short* kbits = reinterpret_cast<const unsigned short*>(ks);
              // A: query qr's elements d, d + 1 as bf16x2 (0 for padding rows)
              auto qa = [&](int d) -> unsigned {
                return qr < qc ? *reinterpret_cast<const unsigned*>(qb + qr * DP + d) : 0u;
              };
#pragma unroll 1
              for (int t = warp; t * 8 < len; t += kWarps) {
                float d4[4] = {0.f, 0.f, 0.f, 0.f};
                const int pos = t * 8 + qr;  // B column: this lane group's position
#pragma unroll 1
                for (int k0 = 0; k0 < D; k0 += 16) {
                  const unsigned a[4] = {qa(k0 + kq), 0u, qa(k0 + kq + 8), 0u};
                  const unsigned b0 = pos < len ? *reinterpret_cast<const unsigned*>(kbits + pos * DP + k0 + kq) : 0u;
                  const unsigned b1 = pos < len ? *reinterpret_cast<const unsigned*>(kbits + pos * DP + k0 + kq + 8) : 0u;
                  mma_16816(d4, a, b0, b1);
                }
                const int j = t * 8 + kq;  // C: query qr's scores at positions j, j + 1
                if (qr < qc && j < len) sc[qr * scp + j] = j < seenq ? d4[0] * scale : -INFINITY;
                if (qr < qc && j + 1 < len) sc[qr * scp + j + 1] = j + 1 < seenq ? d4[1] * scale : -INFINITY;
              }
            } else if (LK == 8) scores(std::integral_constant<int, 8>{});  // 64-element heads
            else scores(std::integral_constant<int, 0>{});
            block_sync();
            // (2) softmax statistics, one warp per query
#pragma unroll 1
            for (int qq = warp; qq < qc; qq += kWarps) {
              float* row = sc + qq * scp;
              float mx = -INFINITY;
#pragma unroll 1
              for (int j = lane; j < len; j += 32) mx = fmaxf(mx, row[j]);
              mx = warp_max(mx);
              const float m_old = st[qq], m_new = fmaxf(m_old, mx);
              float sum = 0.f;
              if constexpr (kMmaPV) {  // p as bf16 into pb, zeros up to len rounded to 16 (the last k step)
                __nv_bfloat16* prow = reinterpret_cast<__nv_bfloat16*>(pb + qq * pbw);
#pragma unroll 1
                for (int j = lane; j < (len + 15) / 16 * 16; j += 32) {
                  const float x = j < len ? row[j] : -INFINITY;
                  const float p = x == -INFINITY ? 0.f : __expf(x - m_new);
                  sum += p;
                  prow[j] = __float2bfloat16(p);  // round_to<TV>(p), TV bf16
                }
              } else {
#pragma unroll 1
                for (int j = lane; j < len; j += 32) {
                  const float x = row[j];
                  const float p = x == -INFINITY ? 0.f : __expf(x - m_new);
                  sum += p;
                  row[j] = round_to<TV>(p);
                }
              }
              sum = warp_sum(sum);
              __syncwarp();  // every lane has read st[qq] (m_old) before lane 0 replaces it (racecheck)
              if (lane == 0) {
                const float alpha = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
                st[qq] = m_new;
                st[kAttnQ + qq] = st[kAttnQ + qq] * alpha + sum;
                st[2 * kAttnQ + qq] = alpha;
              }
            }
            block_sync();
            c.mark(2);  // profiling: scores and softmax statistics done
            // (3) P.V
            if constexpr (kMmaPV) {
              const int qr = lane >> 2, kq = (lane & 3) * 2, ntiles = Dv >> 3;
              const float alpha = qr < qc ? st[2 * kAttnQ + qr] : 0.f;
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                pv[i][0] *= alpha;
                pv[i][1] *= alpha;
              }
              // A: p of query qr at positions j, j + 1 (bf16 pairs, zero past len; 0 for padding rows)
              auto pa = [&](int j) -> unsigned { return qr < qc ? pb[qr * pbw + (j >> 1)] : 0u; };
              // B: V[k0 + 2 (lane % 4) + 0..1][8 t + lane / 4] and 8 positions on, with one ldmatrix.trans
              // (lanes 0..15 address rows k0 + lane of the 8-column block; a row past len reads the zero
              // row zrow, so stale rows never meet a 0 * inf)
              const int vrow = lane & 15;
#pragma unroll 1
              for (int k0 = 0; k0 < len; k0 += 16) {
                const unsigned a[4] = {pa(k0 + kq), 0u, pa(k0 + kq + 8), 0u};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                  const int t = warp + kWarps * i;
                  if (t < ntiles) {
                    const void* rp = k0 + vrow < len ? static_cast<const void*>(vs + (k0 + vrow) * VP + t * 8)
                                                     : static_cast<const void*>(zrow);
                    unsigned b0, b1;
                    ldsm_x2_trans(b0, b1, rp);
                    mma_16816(pv[i], a, b0, b1);
                  }
                }
              }
              continue;  // the next segment (its block_sync orders these reads of pb and vs)
            }
#pragma unroll
            for (int qq = 0; qq < kAttnQ; ++qq) {
              if (qq < qc) {
                const float alpha = st[2 * kAttnQ + qq];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[qq][e] *= alpha;
              }
            }
#pragma unroll 1
            for (int t0 = 0; t0 < len; t0 += kWarps * PV) {
              const int jj = t0 + warp * PV + gv;
              AttnRow8<kStaged, TV> vr;
              if constexpr (kStaged) vr.load(vs, jj, Dv, VP, iv * 8, jj < len);
              else vr.load(v, vb + (long long)(p0 + jj) * vj, vd, iv * 8, Dv, jj < len);
              if (jj < len) {
#pragma unroll
                for (int qq = 0; qq < kAttnQ; ++qq) {
                  if (qq < qc) {
                    const float p = sc[qq * scp + jj];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[qq][e] += p * vr[e];
                  }
                }
              }
            }
          }
          const int row0 = h * G * Sq + q0;  // o_part / ml row of query q0
          if constexpr (kMmaPV) {
            const int qr = lane >> 2, kq = (lane & 3) * 2;
            if (qr < qc) {
              int oi[4] = {b, row0 + qr, s, 0};
              const long long o0 = offset4(op, oi);
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const int t = warp + kWarps * i;
                if (t < (Dv >> 3)) {
                  stf<TP>(op, o0 + (long long)(t * 8 + kq) * op.strides[3], pv[i][0]);
                  stf<TP>(op, o0 + (long long)(t * 8 + kq + 1) * op.strides[3], pv[i][1]);
                }
              }
            }
          } else {
            // sum the warp's lane groups (lanes iv of every group hold elements iv*8 .. iv*8+7)
#pragma unroll 1
            for (int o = LV; o < 32; o <<= 1) {
#pragma unroll
              for (int qq = 0; qq < kAttnQ; ++qq) {
                if (qq < qc) {
#pragma unroll
                  for (int e = 0; e < 8; ++e) acc[qq][e] += __shfl_xor_sync(0xffffffffu, acc[qq][e], o);
                }
              }
            }
            block_sync();  // every warp is done reading sc: reuse it for the per-warp partials
            float* part = sc;
            if (gv == 0) {
#pragma unroll
              for (int qq = 0; qq < kAttnQ; ++qq) {
                if (qq < qc) {
#pragma unroll
                  for (int e = 0; e < 8; ++e) part[(warp * kAttnQ + qq) * DVP + iv * 8 + e] = acc[qq][e];
                }
              }
            }
            block_sync();
            int oi[4] = {b, row0, s, 0};
            const long long o0 = offset4(op, oi);
#pragma unroll 1
            for (int e = threadIdx.x; e < qc * Dv; e += kThreads) {
              const int qq = e / Dv, d = e - qq * Dv;
              float o = 0.f;
#pragma unroll
              for (int w = 0; w < kWarps; ++w) o += part[(w * kAttnQ + qq) * DVP + d];
              stf<TP>(op, o0 + qq * op.strides[1] + d * op.strides[3], o);
            }
          }
          if (threadIdx.x < qc) {
            int mi[4] = {b, row0 + (int)threadIdx.x, s, 0};
            const long long mo = offset4(ml, mi);
            stf<TM>(ml, mo, st[threadIdx.x]);
            stf<TM>(ml, mo + ml.strides[3], st[kAttnQ + threadIdx.x]);
          }
        }
      }
}

// The strided / any-dtype fallback is kept out of line so the 16-byte path, inlined into the
// dispatch, keeps the registers to itself.
template <typename TQ, typename TK, typename TV, typename TP, typename TM>
__device__ __noinline__ void attention_partial_generic(TileCtx& c) {
  const int seg = min(min(c.param(2), kAttnSegMax), (c.smem_floats - kAttnQ * 256 - 32) / kAttnQ);
  attention_partial_impl<false, false, TQ, TK, TV, TP, TM>(c, seg);
}

// The step's new cache rows p + i (i < Sq) that the tile's splits hold, written into the cache
// slots (attr append, tilec.passes.fold_kv_append): the keys rotated from k_new with the queries'
// cos / sin rows (their head stride is 0) in op_rope's arithmetic (rope_query), the values copied
// from v_new (both of the cache's dtype, as the pass checks). The barrier orders these stores
// before the tile reads its split (the same CTA's loads); no other tile reads those rows. Tiles
// whose splits hold none of them (all but one or two a head) skip it all. For the unstaged path
// only: the staged one writes the rows as it stages them (attention_partial_impl's kAppend).
template <typename TQ, typename TK, typename TV>
__device__ void attn_append_rows(const TileCtx& c) {
  const Operand &q = operands()[0], &k = operands()[1], &kn = operands()[8], &vn = operands()[9];
  const Operand &kslot = operands()[10], &vslot = operands()[11];
  const long long valid = operands()[5].scalar;
  const int chunk = c.param(2), Sq = q.sizes[2], S = k.sizes[2], D = kn.sizes[3], Dv = vn.sizes[3];
  const long long lo = max((long long)c.lo(2) * chunk, valid - 1);
  const long long hi = min(min((long long)c.hi(2) * chunk, (long long)S), valid - 1 + Sq);
  if (lo >= hi) return;  // the same in every thread
  const int n = (int)(hi - lo) * (D + Dv);
#pragma unroll 1
  for (int b = c.lo(0); b < c.hi(0); ++b)
#pragma unroll 1
    for (int h = c.lo(1); h < c.hi(1); ++h)
#pragma unroll 1
      for (int e = threadIdx.x; e < n; e += kThreads) {
        const int r = e / (D + Dv), d = e - r * (D + Dv);
        int idx[4] = {b, h, (int)(lo - (valid - 1)) + r, d < D ? d : d - D};
        if (d < D) stf<TK>(kslot, offset4(kslot, idx), rope_query<TQ>(kn, idx, D));
        else stf<TV>(vslot, offset4(vslot, idx), ldf<TV>(vn, offset4(vn, idx)));
      }
  block_sync();
}

// ---- attention_combine -----------------------------------------------------------------------
// Rows r = hq * Sq + i of the tile's query heads, kWarps at a time: one warp per row computes
// M, the split weights exp(m_s - M) and their normalizer sum_s w_s l_s into shared memory; then
// one thread per (row, d) sums the weighted o_s. A row no split saw (all m = -inf) gets 0.
// When the partials are float32 with contiguous rows, at most 32 splits and shared memory to
// spare, a pass's o_s rows come into shared memory with 16-byte cp.async copies issued before
// the statistics, whose m_s and l_s each lane loads together: the pass is one round trip to L2
// (the partials were just written by other workers), not one for m, one for l and one per few
// o_s. Same arithmetic in the same order either way. combine_rows does batches b0 .. b1 - 1, query
// heads qh0 .. qh1 - 1: for op_attention_combine's tile, or for a split-KV partial with a folded
// combine (attn_combine_last).
template <typename TP, typename TM, typename TO>
__device__ __forceinline__ void combine_rows(const TileCtx& c, const Operand& op, const Operand& ml, const Operand& out,
                                             int b0, int b1, int qh0, int qh1) {
  const int NS = op.sizes[2], Sq = out.sizes[2], Dv = out.sizes[3];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long ms = ml.strides[2], m1 = ml.strides[3], os = op.strides[2];
  float* w = c.smem();                        // [kWarps][NS]
  float* ostage = w + (kWarps * NS + 3) / 4 * 4;  // fast: [nr][NS][Dv] o_s rows
#pragma unroll 1
  for (int b = b0; b < b1; ++b) {
    const int r0 = qh0 * Sq, r1 = qh1 * Sq;
#pragma unroll 1
    for (int rb = r0; rb < r1; rb += kWarps) {
      const int nr = min(kWarps, r1 - rb);
      int pi[4] = {b, rb, 0, 0};
      const long long pass0 = offset4(op, pi);  // o_part row rb, split 0
      const bool fast = std::is_same<TP, float>::value && NS <= 32 && Dv % 4 == 0 && op.strides[3] == 1 && os == Dv &&
                        op.strides[1] == (long long)NS * Dv && aligned16(base<TP>(op) + pass0) &&
                        (ostage - w) + nr * NS * Dv <= c.smem_floats;
      block_sync();  // the previous rows are done with w (and ostage)
      if (fast) {
#pragma unroll 1
        for (int v = threadIdx.x; v < nr * NS * Dv / 4; v += kThreads) cp_async16(ostage + v * 4, base<TP>(op) + pass0 + v * 4);
      }
      if (warp < nr) {
        int mi[4] = {b, rb + warp, 0, 0};
        const long long mo = offset4(ml, mi);
        float mx = -INFINITY, l = 0.f;
        if (fast) {  // one split per lane: m_s and l_s in one round trip
          const float m = lane < NS ? ldf<TM>(ml, mo + lane * ms) : -INFINITY;
          const float ls = lane < NS ? ldf<TM>(ml, mo + lane * ms + m1) : 0.f;
          mx = warp_max(m);
          if (lane < NS) {
            const float wt = m == -INFINITY ? 0.f : __expf(m - mx);
            l += wt * ls;
            w[warp * NS + lane] = wt;
          }
        } else {
#pragma unroll 1
          for (int s = lane; s < NS; s += 32) mx = fmaxf(mx, ldf<TM>(ml, mo + s * ms));
          mx = warp_max(mx);
#pragma unroll 1
          for (int s = lane; s < NS; s += 32) {
            const float m = ldf<TM>(ml, mo + s * ms);
            const float wt = m == -INFINITY ? 0.f : __expf(m - mx);
            l += wt * ldf<TM>(ml, mo + s * ms + m1);
            w[warp * NS + s] = wt;
          }
        }
        l = warp_sum(l);
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll 1
        for (int s = lane; s < NS; s += 32) w[warp * NS + s] *= inv;
      }
      if (fast) cp_async_wait_all();
      block_sync();
#pragma unroll 1
      for (int e = threadIdx.x; e < nr * Dv; e += kThreads) {
        const int rr = e / Dv, d = e % Dv, r = rb + rr;
        float o = 0.f;
        if (fast) {
#pragma unroll 4
          for (int s = 0; s < NS; ++s) o += w[rr * NS + s] * ostage[(rr * NS + s) * Dv + d];
        } else {
          int pj[4] = {b, r, 0, d};
          const long long po = offset4(op, pj);
#pragma unroll 4
          for (int s = 0; s < NS; ++s) o += w[rr * NS + s] * ldf<TP>(op, po + s * os);
        }
        int oi[4] = {b, r / Sq, r % Sq, d};
        stf<TO>(out, offset4(out, oi), o);
      }
    }
  }
}
// With a folded combine (tilec/passes/fold_combine.py; param 5: the op's first arrival counter):
// once its partials are stored, the tile adds one to its (batch, first KV head) counter, and the
// group's last tile of NS combines the group's query heads into out (operand 6, after cos / sin
// and the appended rows' operands when present) - the "last block" reduction, so no combine
// instruction waits on the partials and the output projection waits on them directly.
template <typename TQ, typename TP, typename TM>
__device__ void attn_combine_last(TileCtx& c) {
  const Operand &q = operands()[0], &k = operands()[1], &op = operands()[3];
  const Operand& out = operands()[6 + (c.param(3) ? 2 : 0) + (c.param(4) ? 4 : 0)];
  const int G = q.sizes[1] / k.sizes[1], Hkv = k.sizes[1], NS = op.sizes[2], h0 = c.lo(1);
#pragma unroll 1
  for (int b = c.lo(0); b < c.hi(0); ++b)
    if (c.arrive(c.param(5) + b * Hkv + h0, NS))
      combine_rows<TP, TM, TQ>(c, op, operands()[4], out, b, b + 1, h0 * G, c.hi(1) * G);
}

template <typename TQ, typename TK, typename TV, typename TP, typename TM>
__device__ void op_attention_partial(TileCtx& c) {
  // Dispatched before its wait (executor.cuh), so the call and its first code overlap the wait.
  // It no longer pulls its K / V splits into L2 first (cp.async.bulk.prefetch.L2 from thread 0):
  // right after the layer's q / k / v tile the loader warp has just queued its next stages' bulk
  // copies, and the prefetches' issue apparently waited behind them - 0.77 us of the path to its
  // wait, on the worker whose q / k / v tile finished last. Without them, on an H200
  // (variants_ab.py, batch 1, context 1024, one process, logits bitwise equal): Llama-3.2-1B
  // 1.103 against 1.111 ms a step, Llama-3.1-8B 4.789 against 4.802.
  if (!c.wait()) return;
  bool done = false;
  if constexpr (sizeof(TK) == 2 && sizeof(TV) == 2) {
    const int seg = attn_staged_seg(c, c.param(2), operands()[1].sizes[3], operands()[2].sizes[3]);
    if (seg > 0 && attn_vec_ok(operands()[1]) && attn_vec_ok(operands()[2])) {
      if (c.param(4)) attention_partial_impl<true, true, TQ, TK, TV, TP, TM>(c, seg);  // appends as it stages
      else attention_partial_impl<true, false, TQ, TK, TV, TP, TM>(c, seg);
      done = true;
    }
  }
  if (!done) {
    if (c.param(4)) attn_append_rows<TQ, TK, TV>(c);
    attention_partial_generic<TQ, TK, TV, TP, TM>(c);
  }
  if (c.param(5) >= 0) attn_combine_last<TQ, TP, TM>(c);
}

template <typename TP, typename TM, typename TO>
__device__ void op_attention_combine(TileCtx& c) {
  combine_rows<TP, TM, TO>(c, operands()[0], operands()[1], operands()[2], c.lo(0), c.hi(0), c.lo(1), c.hi(1));
}

}  // namespace tilec
