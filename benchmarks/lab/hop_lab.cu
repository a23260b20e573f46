// Phase-boundary lab: what one all-to-all dependency between GEMV phases costs, with the executor's
// event protocol against an "LL" protocol in the style of NCCL's low-latency one (each 8-byte word
// carries its own flag, so no release fence and no separate counter poll).
//
// One CTA per SM (every SM of the GPU, co-resident by a cooperative launch), 8 compute warps plus
// one warp that, per mode, streams 32 KiB stages of an HBM-sized buffer into shared memory with
// bulk copies (as the executor's weight loader does: bulk, 3 stages in flight; bulk1, one stage -
// 8 bulk copies of 4 KiB - at a time), with 16-byte cp.async copies of all its lanes (the SM's load
// path instead of the TMA engine: async, 3 stages in flight; async1, one) or idles. The stream's rate
// beside the chain (bytes the streaming warp copied over its span, GB/s a CTA: median over CTAs, and
// the sum over CTAs in TB/s) is printed beside each row. The compute warps run a chain of
// kRounds rounds; in round r every CTA
//   consumes: waits until all CTAs have written vector v[r-1] (kN bf16, 4 KiB: a decoder's
//     hidden state), loads all of it, checks every value and sums it across the CTA (per warp,
//     a barrier, then every thread adds the warps' sums: the x staging and RMSNorm sum of the
//     next GEMV), then
//   produces: writes its slice (`slice` elements, kN / CTAs rounded up to even: with 132 CTAs 16,
//     so CTAs 128-131 write nothing) of v[r].
// So a round is one phase boundary without the GEMV work: the hop latency the streaming cannot hide.
//   event: v as bf16; slice stores, CTA barrier, one red.release.gpu on counter[r] (the executor's
//          signal); the consumer's thread 0 polls ld.acquire.gpu until counter[r-1] == CTAs, a CTA
//          barrier, then every thread loads its 16 bytes of v[r-1] (ld.global.cg).
//   sleep: event, with the executor's poll backoff (__nanosleep 32 ns doubling to 256 ns).
//   ll:    v as 8-byte words (two bf16, then the 32-bit round number as the flag); the producer
//          stores its words (st.relaxed.gpu, no fence: each aligned 8-byte store is single-copy
//          atomic, so value and flag land together); every consumer thread polls its own words
//          (ld.relaxed.gpu .v2.u64, both loads in flight) until their flags read r-1. Twice the bytes
//          per vector, one CTA barrier a round (event: three).
// Prints per mode the median, p90 and mean time of a round (CTA 0's %globaltimer at each round's
// start, kept in shared memory until the chain ends; the first kWarm rounds left out; the timer's
// tick, 32 ns on an H200, bounds the resolution) and the number of values that read wrong (must be
// 0). Every protocol poll has a watchdog (kTimeoutNs): a protocol bug ends the kernel and is
// reported instead of hanging the GPU.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o hop_lab hop_lab.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "lab_stream.cuh"

using namespace tilec;  // the runtime's PTX wrappers (runtime/tilec/ptx.cuh)

constexpr int kN = 2048;                  // bf16 elements of a vector
constexpr int kThreads = 256;             // compute threads (8 warps); one more warp streams
constexpr int kRounds = 256;
constexpr int kWarm = 32;
constexpr int kSmemBytes = 120 * 1024;    // one CTA per SM
static_assert(kN * 2 == kThreads * 16, "event mode: one 16-byte load per thread");
static_assert(kN / 2 == kThreads * 4, "ll mode: four 8-byte words (two 16-byte loads) per thread");
static_assert(kSmemBytes >= kStages * kStageBytes, "the streaming ring fits");

enum Stream { kIdle, kBulk, kBulk1, kAsync, kAsync1 };
enum Proto { kEvent, kEventSleep, kLL };

__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }
// A poll's watchdog: after kTimeoutNs it sets *abort, and every poll of every CTA that reads it
// (each 64th try, so the flag's line is not a second round trip per try) gives up - the kernel
// ends and the host reports it, so a protocol bug cannot hang the GPU.
constexpr unsigned long long kTimeoutNs = 50'000'000;
__device__ __forceinline__ bool gave_up(int* abort, unsigned long long t0, unsigned tries) {
  if ((tries & 63) == 63 && *(volatile int*)abort) return true;
  if (global_timer() - t0 < kTimeoutNs) return false;
  atomicExch(abort, 1);
  return true;
}
__device__ __forceinline__ float value(int r, int j) { return (float)((r + j) % 64); }  // exact in bf16

// slice: elements per CTA (slice * gridDim.x >= kN, even); v: the vectors (event: bf16 [kRounds][kN],
// ll: u64 [kRounds][kN / 2]); ctr: [kRounds] (event); stamps: [kRounds] ns of CTA 0 (written after
// the chain); bad: wrong values; abort: a poll timed out; rate: [CTAs][2] the streaming warp's bytes and ns
template <int kProto>
__global__ void __launch_bounds__(kThreads + 32, 1)
hop_kernel(const char* w, long long per_sm, int stream, int slice, void* v, unsigned long long* ctr,
           unsigned long long* stamps, unsigned* bad, int* abort, long long* rate) {
  extern __shared__ __align__(128) char ring[];
  __shared__ unsigned long long full[kStages];
  __shared__ volatile int done;
  __shared__ float part[2][kThreads / 32];  // by round parity: ll mode has one barrier a round
  __shared__ unsigned long long stamp[kRounds];  // CTA 0's round starts, stored to global after the chain
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = gridDim.x;
  if (threadIdx.x == 0) {
    done = 0;
    for (int s = 0; s < kStages; ++s) mbar_init(full + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kThreads / 32) {  // the streaming warp (lab_stream.cuh)
    const unsigned long long t0 = global_timer();
    long long bytes = 0;
    if ((stream == kBulk || stream == kBulk1) && lane == 0)  // kBulk: kStages stages in flight, kBulk1: one
      bytes = stream_stages(ring, full, w + blockIdx.x * per_sm, per_sm, stream == kBulk ? kStages : 1, &done);
    else if (stream == kAsync || stream == kAsync1)
      bytes = stream_stages_async(ring, w + blockIdx.x * per_sm, per_sm, stream == kAsync ? kStages : 1, &done);
    if (lane == 0) rate[2 * blockIdx.x] = bytes, rate[2 * blockIdx.x + 1] = (long long)(global_timer() - t0);
    return;
  }
  unsigned wrong = 0;
  float total = 0.f;
  for (int r = 1; r < kRounds; ++r) {
    if (threadIdx.x == 0) stamp[r] = global_timer();
    // consume v[r - 1]
    float sum = 0.f;
    if constexpr (kProto != kLL) {
      if (threadIdx.x == 0) {
        unsigned long long c;
        unsigned ns = 32;
        const unsigned long long t0 = global_timer();
        for (unsigned tries = 0;; ++tries) {
          asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(ctr + r - 1) : "memory");
          if (c >= (unsigned long long)G || gave_up(abort, t0, tries)) break;
          if (kProto == kEventSleep) {  // the executor's backoff (executor.cuh wait_event)
            __nanosleep(ns);
            if (ns < 256) ns <<= 1;
          }
        }
      }
      csync();
      const __nv_bfloat16* p = static_cast<const __nv_bfloat16*>(v) + (size_t)(r - 1) * kN + threadIdx.x * 8;
      const uint4 q = __ldcg(reinterpret_cast<const uint4*>(p));
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&q);
      for (int k = 0; k < 8; ++k) {
        const float x = __bfloat162float(e[k]);
        wrong += x != value(r - 1, threadIdx.x * 8 + k);
        sum += x;
      }
    } else {
      const unsigned long long* p = static_cast<const unsigned long long*>(v) + (size_t)(r - 1) * (kN / 2);
      // words 2t, 2t + 1 and 2t + 512, 2t + 513: two coalesced 16-byte loads in flight, and only a
      // load whose flags are not yet r - 1 is issued again
      const unsigned long long* a[2] = {p + 2 * threadIdx.x, p + 2 * threadIdx.x + 2 * kThreads};
      unsigned long long x[2][2];
      bool ready[2] = {false, false};
      const unsigned long long t0 = global_timer();
      for (unsigned tries = 0; !(ready[0] && ready[1]); ++tries) {
        for (int h = 0; h < 2; ++h)
          if (!ready[h])
            asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(x[h][0]), "=l"(x[h][1]) : "l"(a[h]) : "memory");
        for (int h = 0; h < 2; ++h)
          ready[h] = (unsigned)(x[h][0] >> 32) == (unsigned)(r - 1) && (unsigned)(x[h][1] >> 32) == (unsigned)(r - 1);
        if (!(ready[0] && ready[1]) && gave_up(abort, t0, tries)) break;
      }
      for (int h = 0; h < 2; ++h)
        for (int u = 0; u < 2; ++u) {
          const int j = 2 * (2 * threadIdx.x + h * 2 * kThreads + u);  // the word's first element
          const unsigned bits = (unsigned)x[h][u];
          const float lo = __uint_as_float(bits << 16), hi = __uint_as_float(bits & 0xffff0000u);
          wrong += (lo != value(r - 1, j)) + (hi != value(r - 1, j + 1));
          sum += lo + hi;
        }
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) part[r & 1][warp] = sum;
    csync();  // every thread has read v[r - 1]
    float cta = 0.f;  // the CTA's sum (as an RMSNorm's), in every thread
    for (int k = 0; k < kThreads / 32; ++k) cta += part[r & 1][k];
    total += cta;
    // produce this CTA's slice of v[r]
    const int j0 = blockIdx.x * slice;
    if constexpr (kProto != kLL) {
      __nv_bfloat16* q = static_cast<__nv_bfloat16*>(v) + (size_t)r * kN;
      if (threadIdx.x < slice && j0 + threadIdx.x < kN) q[j0 + threadIdx.x] = __float2bfloat16(value(r, j0 + threadIdx.x));
      csync();
      if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(ctr + r) : "memory");
    } else {
      unsigned long long* q = static_cast<unsigned long long*>(v) + (size_t)r * (kN / 2);
      const int j = j0 + 2 * threadIdx.x;  // slice is even: a word never straddles two CTAs
      if (2 * threadIdx.x < slice && j < kN) {
        const unsigned lo = __float_as_uint(value(r, j)) >> 16, hi = __float_as_uint(value(r, j + 1)) & 0xffff0000u;
        const unsigned long long word = ((unsigned long long)(unsigned)r << 32) | hi | lo;
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(q + j / 2), "l"(word) : "memory");
      }
    }
  }
  if (total < 0.f) wrong += 1;  // keeps the sums
  if (wrong) atomicAdd(bad, wrong);
  csync();
  if (threadIdx.x == 0) done = 1;
  if (blockIdx.x == 0)
    for (int r = 1 + threadIdx.x; r < kRounds; r += kThreads) stamps[r] = stamp[r];
}

int main() {
  int dev = 0, sms = 0, l2 = 0, coop = 0;
  lab_device(dev, sms, l2);
  CK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  if (!coop) {
    printf("needs cooperative launch (every CTA spins on the others)\n");
    return 1;
  }
  int slice = (kN + sms - 1) / sms;
  slice += slice & 1;
  const long long per_sm = stream_slice_bytes(l2, sms);
  char* w;
  void* vec;
  unsigned long long *ctr, *stamps;
  unsigned* bad;
  int* abort;
  long long* rate;
  if (slice > kThreads) {  // a thread per element of a slice (event mode)
    printf("%d SMs: a slice of %d elements is more than %d threads write\n", sms, slice, kThreads);
    return 1;
  }
  CK(cudaMalloc(&w, per_sm * sms));
  CK(cudaMemset(w, 1, per_sm * sms));
  CK(cudaMalloc(&vec, (size_t)kRounds * kN * 4));
  CK(cudaMalloc(&ctr, kRounds * 8));
  CK(cudaMalloc(&stamps, kRounds * 8));
  CK(cudaMalloc(&bad, 4));
  CK(cudaMalloc(&abort, 4));
  CK(cudaMalloc(&rate, (size_t)sms * 2 * 8));
  // round 0's vector, written by the host in both layouts
  std::vector<__nv_bfloat16> v0(kN);
  std::vector<unsigned long long> w0(kN / 2);
  for (int j = 0; j < kN; ++j) v0[j] = __float2bfloat16((float)(j % 64));
  for (int j = 0; j < kN; j += 2) {
    const float lo = (float)(j % 64), hi = (float)((j + 1) % 64);
    unsigned blo, bhi;
    memcpy(&blo, &lo, 4);
    memcpy(&bhi, &hi, 4);
    w0[j / 2] = (blo >> 16) | (bhi & 0xffff0000u);  // flag 0
  }
  void (*kernels[])(const char*, long long, int, int, void*, unsigned long long*, unsigned long long*, unsigned*, int*,
                   long long*) = {
      hop_kernel<kEvent>, hop_kernel<kEventSleep>, hop_kernel<kLL>};
  for (auto k : kernels) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  printf("%d CTAs (one per SM), %d bf16 per vector, %d per CTA slice, %d rounds (first %d left out)\n", sms, kN,
         slice, kRounds, kWarm);
  printf("%-6s %-6s %10s %10s %10s %8s %12s %10s\n", "stream", "proto", "median us", "p90 us", "mean us", "wrong",
         "GB/s a CTA", "TB/s");
  const char* streams[] = {"idle", "bulk", "bulk1", "async", "async1"};
  const char* protos[] = {"event", "sleep", "ll"};
  std::vector<unsigned long long> h(kRounds);
  for (int s = kIdle; s <= kAsync1; ++s)
    for (int p = kEvent; p <= kLL; ++p) {
      // every flag / counter of rounds >= 1 must read "not yet": ll flags are round numbers, so 0xff bytes
      CK(cudaMemset(vec, 0xff, (size_t)kRounds * kN * 4));
      CK(cudaMemset(ctr, 0, kRounds * 8));
      CK(cudaMemset(bad, 0, 4));
      CK(cudaMemset(abort, 0, 4));
      unsigned long long g = sms;
      CK(cudaMemcpy(ctr, &g, 8, cudaMemcpyHostToDevice));
      if (p != kLL) CK(cudaMemcpy(vec, v0.data(), kN * 2, cudaMemcpyHostToDevice));
      else CK(cudaMemcpy(vec, w0.data(), kN * 4, cudaMemcpyHostToDevice));
      long long ps = per_sm;
      int stream = s;
      void* args[] = {&w, &ps, &stream, &slice, &vec, &ctr, &stamps, &bad, &abort, &rate};
      CK(cudaLaunchCooperativeKernel((const void*)kernels[p], dim3(sms), dim3(kThreads + 32), args, kSmemBytes, 0));
      CK(cudaDeviceSynchronize());
      unsigned nbad = 0;
      int timed_out = 0;
      CK(cudaMemcpy(&nbad, bad, 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&timed_out, abort, 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(h.data(), stamps, kRounds * 8, cudaMemcpyDeviceToHost));
      std::vector<double> d;
      for (int r = kWarm; r + 1 < kRounds; ++r) d.push_back((h[r + 1] - h[r]) / 1e3);
      std::sort(d.begin(), d.end());
      const double mean = (h[kRounds - 1] - h[kWarm]) / 1e3 / (kRounds - 1 - kWarm);
      std::vector<long long> rt((size_t)sms * 2);
      CK(cudaMemcpy(rt.data(), rate, rt.size() * 8, cudaMemcpyDeviceToHost));
      std::vector<double> gbs;  // bytes / ns = GB/s
      for (int c = 0; c < sms; ++c) gbs.push_back(rt[2 * c + 1] > 0 ? (double)rt[2 * c] / rt[2 * c + 1] : 0.0);
      double tbs = 0;
      for (double g : gbs) tbs += g / 1e3;
      std::sort(gbs.begin(), gbs.end());
      if (timed_out) printf("%-6s %-6s a poll timed out (protocol bug)\n", streams[s], protos[p]);
      else printf("%-6s %-6s %10.3f %10.3f %10.3f %8u %12.2f %10.3f\n", streams[s], protos[p], d[d.size() / 2],
                  d[d.size() * 9 / 10], mean, nbad, gbs[gbs.size() / 2], tbs);
    }
  return 0;
}
