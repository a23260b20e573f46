// tilec runtime: thin wrappers of the Hopper PTX the weight stream uses - mbarriers, bulk
// (TMA-engine) copies into shared memory, L2 eviction policies, the global timer. Self-contained
// (no generated header), so benchmarks/lab/gemv_stream_lab.cu measures the very same instructions.
#pragma once
#include <cuda_runtime.h>

namespace tilec {

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Whether the phase of `parity` of `bar` has completed (one try; callers loop).
__device__ __forceinline__ bool mbar_test(unsigned long long* bar, unsigned parity) {
  unsigned done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into this
// CTA's shared memory, completing as transaction bytes on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                                          unsigned long long policy) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy) : "memory");
}
// Starts pulling [p, p + bytes) from HBM into L2 (Hopper bulk prefetch; a hint, nothing
// completes). The bulk range starts at p rounded down to 16 bytes and never reaches past p + bytes
// (its size is a multiple of 16: the last < 16 bytes of an unaligned range are left out).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned long long bytes) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(p), start = a & ~15ull;
  const unsigned long long n = (a + bytes - start) & ~15ull;
  if (n > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(start), "r"((unsigned)n) : "memory");
}
// 16-byte load of streamed-once data: bypasses L1, with the given L2 policy (evict-first).
__device__ __forceinline__ uint4 ld_stream16(const void* p, unsigned long long policy) {
  uint4 r;
  asm volatile("ld.global.cg.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(policy));
  return r;
}
// Two 8x8 matrices of 16-bit elements from shared memory, transposed (ldmatrix .x2 .trans): lanes
// 0..7 give the 16-byte row addresses of matrix 0, lanes 8..15 those of matrix 1; lane l receives
// elements (2 (l % 4) + 0..1, l / 4) of matrix 0 in r0 and of matrix 1 in r1 - the B fragment of a
// bf16 mma.m16n8k16 when the rows are K's 16 values of 8 columns.
__device__ __forceinline__ void ldsm_x2_trans(unsigned& r0, unsigned& r1, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(smem_u32(p)));
}
// 16-byte asynchronous copy global -> shared, L2 only (cp.async.cg: data other CTAs wrote, read
// after an acquire); a rolled loop of them keeps every copy in flight. cp_async_wait_all waits
// for the calling thread's copies.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

}  // namespace tilec
