// tilec runtime: shared device helpers (operands, element access, reductions).
// Needs the generated layout header (tilec_layout.h) included first.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

namespace tilec {

// A worker CTA is kThreads compute threads (kWarps warps, which run the tile ops) plus one
// loader warp that streams GEMV weights ahead of them and one controller warp that decodes the
// next instruction and waits on its event (executor.cuh). Ops synchronize the compute threads
// only, with block_sync(): the loader and controller warps never join those barriers.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCtaThreads = kThreads + 64;
static_assert(TILEC_MAX_DIMS == 4, "the index helpers and ops hold 4-dim boxes");
constexpr int kMaxRows = 64;  // rows of one GEMV tile (flattened leading dims of the out box)

// Barrier over the kThreads compute threads (named barrier 1; barrier 0 would need the loader).
__device__ __forceinline__ void block_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }

// One operand of the current instruction, decoded from the operand table.
struct Operand {
  char* ptr;            // byte address (for a scalar operand: unused)
  long long scalar;     // value of a scalar operand
  int dtype;
  int ndim;
  int sizes[TILEC_MAX_DIMS];
  long long strides[TILEC_MAX_DIMS];  // elements
};

struct WeightRing;  // stream.cuh

// The current instruction's decoded operands (executor.cuh fills them before dispatch). Ops read
// them through operands(): the compiler then knows they are this array, not the scratch or global
// memory an op stores to, and keeps their fields in registers across those stores.
__shared__ Operand tilec_ops[TILEC_MAX_OPERANDS];
// The weight ring's depth (executor.cuh sets it): read by the GEMV setup from here rather than
// through the per-thread TileCtx, whose fields live in local memory (a dependent LDL, then a
// generic load). H200, Llama-3.2-1B batch 1 (benchmarks/lab/variants_ab.py, same process): a step
// 1.143 against 1.152 ms, Llama-3.1-8B 4.975 against 4.987.
__shared__ int tilec_ring_stages;

// The CTA's dynamic shared memory: the weight ring's stages, then the ops' scratch (executor.cuh).
// A pointer the compiler sees formed from this array is a shared-memory pointer and its accesses
// compile to LDS / STS; one that went through a struct field or a non-inlined function's
// parameter is generic (LD / ST through the generic path, tracked on the long scoreboard like a
// global load, and a store through it may alias anything, so operand fields are reloaded). On an
// H200 (GLM-5 FP8 prelude, ncu source counters) the absorption bmm's inner loop was generic loads
// and 64-bit address arithmetic; with shared-space pointers and operands the FP8 prelude took
// 378.6 us against 411.6 (benchmarks/lab/glm5_variants_ab.py, one process). shared_ptr(p)
// re-forms a pointer into this memory as one the compiler knows.
extern __shared__ float4 tilec_dyn_smem[];
__device__ __forceinline__ Operand* operands() { return tilec_ops; }
template <typename T>
__device__ __forceinline__ T* shared_ptr(T* p) {
  using Byte = typename std::conditional<std::is_const<T>::value, const char, char>::type;
  const size_t off = __cvta_generic_to_shared(p) - __cvta_generic_to_shared(tilec_dyn_smem);
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(tilec_dyn_smem) + off);
}

// The step's first error (executor.cuh: a non-zero flag makes every wait that is not yet satisfied
// give up, so the step ends early; the host reads the record, raises and resets the step state).
// Separately, the step's first index error (index_flag, set by fail_index): a data error that
// aborts nothing - the step completes with the bad index's row skipped or NaN - and the host raises
// it when it next checks.
struct ErrorRecord {
  int flag;        // 0 = ok; 1 = watchdog timeout on an event; 2 = the weight stream stalled;
                   // 3 = no instance for an instruction's (opcode, signature) (program.cu dispatch)
  int worker;
  int instruction;
  int event;
  int task;
  int op;
  long long seen;
  long long target;
  int index_flag;  // 1 = an index read at run time was outside [index_lo, index_hi)
  int index_task;
  int index_op;
  int index_worker;
  long long index;
  long long index_lo;
  long long index_hi;
};

// What an op sees for one instruction.
struct TileCtx {
  const int* d;         // the 32-word descriptor (shared memory)
  float* scratch;       // dynamic shared memory scratch (after the weight ring): use smem()
  int smem_floats;
  const WeightRing* ring;  // the worker's GEMV weight stream (stream.cuh)
  long long* stamp;        // profiling (nullable): [start, end, mark 1, mark 2] of this instruction
  bool x_staged_in;        // the previous instruction left bf16 GEMV x rows in smem (linear_impl)
  bool x_staged_out;       // set by an op that leaves them (the executor passes it on)
  // The instruction's event wait (executor.cuh). The GEMVs (linear, linear_fused),
  // attention_partial and fp8_linear_quant are dispatched before it and call wait() themselves
  // (the GEMVs after their setup) before they read any producer's data; for every other op the
  // executor has waited before dispatching it.
  unsigned long long* counters;
  unsigned long long target;  // the event's count for this step
  int wait_e;                 // the event (-1: none)
  int instr;                  // the instruction's index in the queue (for the error record)
  void* err;                  // the ErrorRecord
  long long timeout_ns;
  int* go;                    // shared: 1 when the wait succeeded, 0 when it gave up
  bool waited;
  unsigned long long epoch;   // this step's epoch (1, 2, ...)
  int* last;                  // shared: arrive()'s answer
  __device__ void mark(int k) const;  // thread 0 records %globaltimer as mark k (1 or 2)
  // Every compute thread calls it at the same point: thread 0 waits for the event, then a block
  // barrier. Returns false when the wait gave up (watchdog or abort): the op must return at once.
  __device__ bool wait();
  // Every compute thread calls it at the same point, after the tile's stores: thread 0 adds one to
  // arrival counter k (counters[k], after the events: tilec/plan.py) with acquire-release
  // semantics, then a block barrier. True (in every thread) when this tile was the step's last
  // of `count` arrivals: it then sees every earlier arriver's stores (read them through L2).
  __device__ bool arrive(int k, unsigned long long count);
  __device__ int lo(int k) const { return d[TILEC_W_COORDS + 2 * k]; }
  __device__ int hi(int k) const { return d[TILEC_W_COORDS + 2 * k + 1]; }
  __device__ int ncoords() const { return d[TILEC_W_NCOORDS]; }
  __device__ int param(int k) const { return d[TILEC_W_PARAMS + k]; }
  __device__ float fparam(int k) const { return __int_as_float(d[TILEC_W_PARAMS + k]); }
  __device__ int variant() const { return d[TILEC_W_VARIANT]; }
  __device__ float* smem() const { return shared_ptr(scratch); }  // the scratch, as a shared-memory pointer
};

// An index the tile read at run time (a token id, a cache slot, a page id) is outside [lo, hi): the
// tile skips what it would have read or written there (or reads a safe row instead); this records
// it (the step's first such error wins) for the host to raise. The step itself goes on: its epoch
// and events stay consistent.
__device__ __noinline__ void fail_index(const TileCtx& c, long long index, long long lo, long long hi) {
  ErrorRecord* err = reinterpret_cast<ErrorRecord*>(c.err);
  if (atomicCAS(&err->index_flag, 0, 1) == 0) {
    err->index_task = c.d[TILEC_W_TASK];
    err->index_op = c.d[TILEC_W_OP];
    err->index_worker = blockIdx.x;
    err->index = index;
    err->index_lo = lo;
    err->index_hi = hi;
    __threadfence_system();
  }
}

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<long long>(long long v) { return (float)v; }
template <> __device__ __forceinline__ float to_f<int>(int v) { return (float)v; }
template <> __device__ __forceinline__ float to_f<bool>(bool v) { return v ? 1.f : 0.f; }
template <> __device__ __forceinline__ float to_f<__nv_fp8_e4m3>(__nv_fp8_e4m3 v) { return float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
// float8_e4m3fn: round to nearest even, saturating to +-448 (torch casts values it clamped first)
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_f<__nv_fp8_e4m3>(float v) { return __nv_fp8_e4m3(v); }

template <typename T> __device__ __forceinline__ T* base(const Operand& o) { return reinterpret_cast<T*>(o.ptr); }

// Element offset of index (i0..i3) in an operand with up to 4 dims (missing dims are 0).
__device__ __forceinline__ long long offset4(const Operand& o, const int* idx) {
  long long off = 0;
#pragma unroll
  for (int k = 0; k < TILEC_MAX_DIMS; ++k)
    if (k < o.ndim) off += (long long)idx[k] * o.strides[k];
  return off;
}

// Iterates the elements of a box (given as per-dim lo/hi over `nd` dims): calls f(idx).
template <typename F>
__device__ __forceinline__ void for_box(int nd, const int* lo, const int* hi, F f) {
  int total = 1;  // a tile's box: fewer than 2^31 elements
  int ext[TILEC_MAX_DIMS] = {1, 1, 1, 1};
#pragma unroll
  for (int k = 0; k < TILEC_MAX_DIMS; ++k)
    if (k < nd) { ext[k] = hi[k] - lo[k]; total *= ext[k]; }
  for (int e = threadIdx.x; e < total; e += kThreads) {
    int r = e;
    int idx[TILEC_MAX_DIMS] = {0, 0, 0, 0};
#pragma unroll
    for (int k = TILEC_MAX_DIMS - 1; k >= 0; --k)
      if (k < nd) { idx[k] = lo[k] + r % ext[k]; r /= ext[k]; }
    f(idx);
  }
}

// Iterates the elements of a box like for_box, kBatch elements per thread at a time: first
// v = load(idx) for every element of the batch, then store(idx, v) for each - so a thread keeps
// kBatch loads in flight instead of one round trip to memory per element (the compiler cannot
// move a load above an earlier store that may alias it). Index arrays stay in registers.
// With kVec > 1 an element is kVec consecutive positions of the last dim (whose extent and lo
// the caller has checked are multiples of kVec); load and store get kVec as an
// std::integral_constant and the index of the first position. Callers take kBatch 1 for boxes of
// at most kSmallBox elements: its loop is a quarter of the code, and a small tile's cost is mostly
// its code fetched cold (GLM-5's prelude on an H200: 308.9 against 327.7 us a step with batch 1 for
// every elementwise tile, binary tiles 12.3 against 15.6 us).
constexpr int kBoxBatch = 4;
constexpr int kSmallBox = 2 * kThreads;
template <int kVec = 1, int kBatch = kBoxBatch, typename L, typename S>
__device__ __forceinline__ void for_box_batched(int nd, const int* lo, const int* hi, L load, S store) {
  int total = 1;  // a tile's box: fewer than 2^31 elements
  int ext[TILEC_MAX_DIMS] = {1, 1, 1, 1}, lo4[TILEC_MAX_DIMS] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < TILEC_MAX_DIMS; ++k)
    if (k < nd) { ext[k] = (hi[k] - lo[k]) / (k == nd - 1 ? kVec : 1); lo4[k] = lo[k]; total *= ext[k]; }
  const std::integral_constant<int, kVec> vec;
  using V = decltype(load(vec, (const int*)nullptr));
  for (int e0 = threadIdx.x; e0 < total; e0 += kBatch * kThreads) {
    int idx[kBatch][TILEC_MAX_DIMS];
    V v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      int r = e0 + u * kThreads;
      if (r >= total) break;
#pragma unroll
      for (int k = TILEC_MAX_DIMS - 1; k >= 0; --k) {
        idx[u][k] = 0;
        if (k < nd) { idx[u][k] = lo4[k] + (k == nd - 1 ? kVec : 1) * (r % ext[k]); r /= ext[k]; }
      }
      v[u] = load(vec, idx[u]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (e0 + u * kThreads < total) store(vec, idx[u], v[u]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions (all threads call; `red` is >= kWarps floats of shared memory).
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  block_sync();
  if (l == 0) red[w] = v;
  block_sync();
  float t = l < kWarps ? red[l] : 0.f;
  return warp_sum(t);
}
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  block_sync();
  if (l == 0) red[w] = v;
  block_sync();
  float t = l < kWarps ? red[l] : -INFINITY;
  return warp_max(t);
}

// Index of the `r`-th row of a box (row-major over its leading dims 0..nd-2; dims nd-1 and up
// are 0). Loops run over all TILEC_MAX_DIMS dims with constant indices, so after inlining the
// arrays stay in registers (a run-time index would put them in local memory).
__device__ __forceinline__ void row_index(int r, int nd, const int* lo, const int* hi, int* idx) {
#pragma unroll
  for (int k = TILEC_MAX_DIMS - 1; k >= 0; --k) {
    idx[k] = 0;
    if (k < nd - 1) {
      const int ext = hi[k] - lo[k];
      if (ext == 1) {  // a decode tile's leading dims: no division (tens of dependent instructions each)
        idx[k] = lo[k];
      } else {
        idx[k] = lo[k] + r % ext;
        r /= ext;
      }
    }
  }
}

// Rows of a box: the product of its leading dims' extents.
__device__ __forceinline__ int box_rows(int nd, const int* lo, const int* hi) {
  int rows = 1;
#pragma unroll
  for (int k = 0; k < TILEC_MAX_DIMS; ++k)
    if (k < nd - 1) rows *= hi[k] - lo[k];
  return rows;
}

}  // namespace tilec
