// Release-signal lab: what does the executor's event signal (red.release.gpu after a store) cost
// while the SM has loads in flight? Standalone (no tilec). In a Llama-3.2-1B batch-1 step on an
// H200 the signal after a GEMV tile took 0.6-2.6 us while the loader warp streamed the next tile's
// weights, and 0.03 us after the LM head, the last streamed tile (benchmarks/RESULTS.md, twenty-third
// session): does the release wait for other warps' loads in flight?
// One CTA per SM: warp 0 (lane 0) repeats "store a value, then time one release operation" with
// clock64, while warp 1 keeps the SM's memory pipe busy, per mode:
//   none    warp 1 idles
//   bulk    warp 1 streams 32 KiB stages from a buffer larger than L2 into shared memory with
//           cp.async.bulk (mbarrier-completed, kStages in flight: the executor's weight ring)
//   ldg     warp 1 streams the same buffer with 16-byte ld.global.cg loads, 32 in flight per lane
//           (16 KiB a warp: less than the bulk ring's 96 KiB)
//   async   warp 1's 32 lanes stream it into the same 3-stage ring with 16-byte cp.async.cg copies
//           (the SM's load path, LDGSTS, instead of the TMA engine; 96 KiB in flight as with bulk)
//   pref    warp 1 issues a 32 KiB cp.async.bulk.prefetch.L2 every microsecond (32 GB/s a CTA, ~an H200
//           worker's share of HBM): does the release wait for L2 prefetches, which have no completion?
//   none2   two CTAs on each SM (100 KiB of shared memory each); the first to start times the releases,
//           the other idles
//   bulk2   the same, the other CTA streams with bulk copies (the bulk row's ring): does the release wait
//           for the SM's copies in flight or only its own CTA's?
// and per timed operation:
//   red     red.release.gpu.global.add (the executor's signal)
//   fence   fence.release.gpu (the release's fence alone; fence.acq_rel would also invalidate L1)
//   relaxed red.relaxed.gpu.global.add (no fence: the floor; both adds are warp-aggregated alike)
// Each row also prints the streaming warp's rate (GB/s a CTA, median over CTAs).
// Prints the median and 90th percentile over all SMs' samples, in SM cycles and in us at the
// device's clock-rate attribute (its maximum clock). The dynamic shared memory (kSmemBytes) keeps
// one CTA per SM.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o fence_lab fence_lab.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "lab_stream.cuh"

using namespace tilec;  // the runtime's PTX wrappers (runtime/tilec/ptx.cuh): the same instructions

constexpr int kSmemBytes = 120 * 1024;  // the ring uses kStages x 32 KiB; the rest keeps a second CTA off the SM
constexpr int kPairSmemBytes = 100 * 1024;  // none2 / bulk2: exactly two CTAs an SM (a third does not fit)
constexpr long long kPrefetchGapNs = 1000;  // pref: one 32 KiB L2 prefetch a microsecond
constexpr int kLdgLoads = 32;           // ld.global.cg per lane in flight (ldg mode)
constexpr int kSamples = 64;             // timed release operations per SM
constexpr long long kGapNs = 2000;       // between two of them (the loads stay in flight meanwhile)
constexpr long long kWarmNs = 20000;     // before the first (warp 1's stream reaches steady state)

enum Mode { kNone, kBulk, kLdg, kAsync, kPref, kNone2, kBulk2 };
enum Op { kRed, kFence, kRelaxed };

template <int kOp>
__device__ __forceinline__ void release_op(unsigned long long* ctr) {
  if constexpr (kOp == kRed) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
  else if constexpr (kOp == kFence) asm volatile("fence.release.gpu;" ::: "memory");
  else asm volatile("red.relaxed.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
}

// w: the streamed buffer, per_sm bytes per CTA (a multiple of kStageBytes); out: a word per CTA;
// cycles: [SMs][kSamples] clock64 deltas of the release operation. The pair modes (two CTAs an SM) index
// everything by the SM's id; ticket[SMs] (zeroed) picks each SM's timing CTA, pair_done[SMs] (zeroed) stops
// the other CTA's stream.
__device__ __forceinline__ int sm_id() {
  int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
template <int kOp>
__global__ void __launch_bounds__(64, 1) fence_kernel(const char* w, long long per_sm, int mode,
                                                     unsigned long long* ctr, float* out, long long* cycles,
                                                     long long* rate, int* ticket, int* pair_done) {
  extern __shared__ __align__(128) char ring[];
  __shared__ unsigned long long full[kStages];
  __shared__ volatile int done;
  __shared__ int role;  // pair modes: 0 times the releases, 1 is the other CTA
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool pair = mode == kNone2 || mode == kBulk2;
  const int slot = pair ? sm_id() : blockIdx.x;
  const char* mine = w + slot * per_sm;
  if (threadIdx.x == 0) {
    done = 0;
    role = pair ? atomicAdd(ticket + slot, 1) : 0;
    for (int s = 0; s < kStages; ++s) mbar_init(full + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (pair && role == 1) {  // the other CTA on this SM: streams (bulk2) until the timing CTA is done
    if (mode == kBulk2 && threadIdx.x == 0) {
      const unsigned long long t0 = global_timer();
      const long long bytes = stream_stages(ring, full, mine, per_sm, kStages, pair_done + slot);
      rate[2 * slot] = bytes, rate[2 * slot + 1] = (long long)(global_timer() - t0);
    }
    return;
  }
  if (warp == 1) {  // the memory traffic
    const unsigned long long t0 = global_timer();
    long long bytes = 0;
    if (mode == kBulk && lane == 0) {
      bytes = stream_stages(ring, full, mine, per_sm, kStages, &done);
    } else if (mode == kPref && lane == 0) {
      long long off = 0;
      while (!done) {
        const unsigned long long t1 = global_timer();
        prefetch_l2(mine + off, kStageBytes);
        bytes += kStageBytes;
        off = (off + kStageBytes) % per_sm;
        while (!done && global_timer() - t1 < kPrefetchGapNs) {
        }
      }
    } else if (mode == kAsync) {
      bytes = stream_stages_async(ring, mine, per_sm, kStages, &done);
    } else if (mode == kLdg) {
      uint4 acc = make_uint4(0u, 0u, 0u, 0u);
      long long off = 0;  // per_sm is a multiple of kLdgLoads x 512 bytes: no wrap inside an iteration
      while (!done) {
        const uint4* p = reinterpret_cast<const uint4*>(mine + off) + lane;
        uint4 v[kLdgLoads];
#pragma unroll
        for (int u = 0; u < kLdgLoads; ++u) v[u] = __ldcg(p + u * 32);
#pragma unroll
        for (int u = 0; u < kLdgLoads; ++u) acc.x ^= v[u].x, acc.y ^= v[u].y, acc.z ^= v[u].z, acc.w ^= v[u].w;
        off += kLdgLoads * 512;
        bytes += kLdgLoads * 512;
        if (off >= per_sm) off = 0;
      }
      if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) out[blockIdx.x] += 1.f;  // keeps the loads
    }
    if (lane == 0 && !pair) rate[2 * slot] = bytes, rate[2 * slot + 1] = (long long)(global_timer() - t0);
    return;
  }
  if (lane == 0) {  // warp 0: store, then time one release operation
    const unsigned long long t0 = global_timer();
    while (global_timer() - t0 < kWarmNs) {
    }
    for (int k = 0; k < kSamples; ++k) {
      const unsigned long long t1 = global_timer();
      while (global_timer() - t1 < kGapNs) {
      }
      out[blockIdx.x] = (float)k;  // the tile's output store the signal publishes
      const long long c0 = clock64();
      release_op<kOp>(ctr);
      const long long c1 = clock64();
      cycles[slot * kSamples + k] = c1 - c0;
    }
    done = 1;
    if (pair) *(volatile int*)(pair_done + slot) = 1;
  }
}

int main() {
  int dev = 0, sms = 0, l2 = 0, khz = 0;
  lab_device(dev, sms, l2);
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
  const long long per_sm = stream_slice_bytes(l2, sms);  // every CTA streams its own slice
  char* w;
  unsigned long long* ctr;
  float* out;
  long long* cycles;
  CK(cudaMalloc(&w, per_sm * sms));
  CK(cudaMemset(w, 1, per_sm * sms));
  CK(cudaMalloc(&ctr, 8));
  CK(cudaMalloc(&out, sms * sizeof(float)));
  CK(cudaMalloc(&cycles, (size_t)sms * kSamples * sizeof(long long)));
  long long* rate;
  CK(cudaMalloc(&rate, (size_t)sms * 2 * 8));
  int *ticket, *pair_done;
  CK(cudaMalloc(&ticket, sms * sizeof(int)));
  CK(cudaMalloc(&pair_done, sms * sizeof(int)));
  static_assert(kStageBytes % (kLdgLoads * 512) == 0 && kSmemBytes >= kStages * kStageBytes, "layout");
  void (*kernels[])(const char*, long long, int, unsigned long long*, float*, long long*, long long*, int*, int*) = {
      fence_kernel<kRed>, fence_kernel<kFence>, fence_kernel<kRelaxed>};
  for (auto k : kernels) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  printf("%d SMs, L2 %d MiB, %lld KiB streamed per SM, clock rate attribute %.0f MHz (us below at that clock)\n",
         sms, l2 >> 20, per_sm >> 10, khz / 1e3);
  const char* modes[] = {"none", "bulk", "ldg", "async", "pref", "none2", "bulk2"};
  const char* ops[] = {"red.release", "fence.release", "red.relaxed"};
  printf("%-6s %-14s %12s %12s %10s %10s %12s\n", "loads", "operation", "median cyc", "p90 cyc", "median us", "p90 us",
         "GB/s a CTA");
  std::vector<long long> h((size_t)sms * kSamples), rt((size_t)sms * 2);
  for (int mode = kNone; mode <= kBulk2; ++mode)
    for (int op = kRed; op <= kRelaxed; ++op) {
      const bool pair = mode == kNone2 || mode == kBulk2;
      CK(cudaMemset(rate, 0, rt.size() * 8));
      CK(cudaMemset(cycles, 0, h.size() * sizeof(long long)));
      CK(cudaMemset(ticket, 0, sms * sizeof(int)));
      CK(cudaMemset(pair_done, 0, sms * sizeof(int)));
      kernels[op]<<<pair ? 2 * sms : sms, 64, pair ? kPairSmemBytes : kSmemBytes>>>(w, per_sm, mode, ctr, out, cycles,
                                                                                 rate, ticket, pair_done);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(h.data(), cycles, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
      std::sort(h.begin(), h.end());
      const long long med = h[h.size() / 2], p90 = h[h.size() * 9 / 10];
      CK(cudaMemcpy(rt.data(), rate, rt.size() * 8, cudaMemcpyDeviceToHost));
      std::vector<double> gbs;
      for (int c = 0; c < sms; ++c) gbs.push_back(rt[2 * c + 1] > 0 ? (double)rt[2 * c] / rt[2 * c + 1] : 0.0);
      std::sort(gbs.begin(), gbs.end());
      if (h[0] == 0) printf("(some SM ran no timing CTA: the pair modes' placement failed)\n");
      printf("%-6s %-14s %12lld %12lld %10.3f %10.3f %12.2f\n", modes[mode], ops[op], med, p90, med / (khz / 1e3),
             p90 / (khz / 1e3), gbs[gbs.size() / 2]);
    }
  return 0;
}
