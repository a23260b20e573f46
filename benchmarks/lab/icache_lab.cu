// Instruction-fetch lab: what does running code an SM has not run recently cost, per KiB of SASS?
// Standalone (no tilec). The executor is one kernel holding every op (about 1 MB of SASS for
// GLM-5's prelude), and small ops there take 5-15 us whatever their size; this measures whether
// cold code explains it. One CTA per SM (256 threads, like a worker) calls kFns distinct
// straight-line functions of about 7.5 KiB each, in order, several passes; thread 0 stamps
// %globaltimer around each call. Three runs:
//   cold    first pass after an L2 flush: code comes from HBM
//   L2      first pass without the flush: code from L2, not in the SM's instruction caches
//   warm    later passes over a set small enough to stay in the instruction cache
// Prints the median microseconds per call and per KiB for each.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o icache_lab icache_lab.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../../runtime/tilec/ptx.cuh"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int kFns = 64;     // distinct functions (64 x ~7.5 KiB: more than the instruction caches hold)
constexpr int kSteps = 256;  // FMAs per function; with the constants' moves ~30 bytes of SASS each:
                             // ~7.5 KiB (readelf on an nvcc 13.0 sm_90a build)
constexpr int kPasses = 4;

// Straight-line code: kSteps dependent FMAs with constants unique to I, so no two functions share code.
template <int I>
__device__ __noinline__ float body(float x) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s) x = fmaf(x, 1.0f + (I * kSteps + s) * 1e-7f, (float)(I + s) * 1e-3f);
  return x;
}

template <int... Is>
__device__ float call(int f, float x, std::integer_sequence<int, Is...>) {
  float r = x;
  ((f == Is ? (r = body<Is>(x), 0) : 0), ...);
  return r;
}

// stamps[block][pass][fn]: nanoseconds of call fn in pass; fns < nfns are called, in order.
__global__ void run(long long* stamps, float* sink, int nfns) {
  float x = threadIdx.x * 1e-3f;
  for (int p = 0; p < kPasses; ++p) {
    for (int f = 0; f < nfns; ++f) {
      __syncthreads();
      const unsigned long long t0 = tilec::global_timer();
      x = call(f, x, std::make_integer_sequence<int, kFns>{});
      __syncthreads();
      if (threadIdx.x == 0) stamps[((size_t)blockIdx.x * kPasses + p) * kFns + f] = (long long)(tilec::global_timer() - t0);
    }
  }
  if (x == 12345.f) sink[threadIdx.x] = x;  // keeps the work
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  long long* stamps;
  float* sink;
  char* flush;
  const size_t flush_bytes = 256u << 20;  // > L2
  CK(cudaMalloc(&stamps, sizeof(long long) * sms * kPasses * kFns));
  CK(cudaMalloc(&sink, 1024 * sizeof(float)));
  CK(cudaMalloc(&flush, flush_bytes));
  std::vector<long long> h((size_t)sms * kPasses * kFns);
  const double kib_per_fn = 7.5;  // see kSteps
  printf("instruction-fetch lab: %d CTAs x 256 threads, %d functions of ~%.1f KiB SASS each\n", sms, kFns, kib_per_fn);
  printf("%-36s %12s %12s\n", "run", "us per call", "us per KiB");
  auto report = [&](const char* label, int nfns, int pass) {
    std::vector<double> us;
    for (int b = 0; b < sms; ++b)
      for (int f = 0; f < nfns; ++f) us.push_back(h[((size_t)b * kPasses + pass) * kFns + f] / 1e3);
    const double m = median(us);
    printf("%-36s %12.3f %12.3f\n", label, m, m / kib_per_fn);
  };
  for (int nfns : {kFns, 4}) {
    for (int flushed = 1; flushed >= 0; --flushed) {
      // all functions first (~480 KiB: the first ones leave the SM's instruction caches, assumed to
      // hold far less; all stay in L2), then optionally flush L2
      run<<<sms, 256>>>(stamps, sink, kFns);
      CK(cudaDeviceSynchronize());
      if (flushed) CK(cudaMemset(flush, flushed, flush_bytes));
      run<<<sms, 256>>>(stamps, sink, nfns);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(h.data(), stamps, sizeof(long long) * h.size(), cudaMemcpyDeviceToHost));
      char label[64];
      snprintf(label, sizeof label, "%d fns, pass 1, %s", nfns, flushed ? "L2 flushed (cold)" : "code in L2");
      report(label, nfns, 0);
      snprintf(label, sizeof label, "%d fns, pass %d (warm if they fit)", nfns, kPasses);
      report(label, nfns, kPasses - 1);
    }
  }
  printf("compute alone: %d dependent FMAs ~ %.2f us at 1.98 GHz (4 cycles each)\n", kSteps, kSteps * 4 / 1980.0);
  return 0;
}
