// GEMV weight-streaming lab: how fast can one persistent CTA per SM stream bf16 weights?
// Standalone (no tilec): each of the 132 CTAs computes columns [n0, n1) of y = W x for 8
// consecutive weight matrices (like 8 executor instructions), with several streaming schemes:
//   A  per-tile ring: mbarrier-completed bulk copies, __syncthreads per stage, ring restarted
//      at every tile (tilec's gemv_bf16_tma up to ABI 3)
//   B  continuous ring: one producer warp walks all the CTA's tiles and refills a stage as soon
//      as the consumer warps release it (full/empty mbarriers, no block barrier), so tile i+1's
//      weights stream while tile i finishes
//   C  register streaming: 16-byte ld.global.cg, 8 loads in flight per column, 2 columns per warp
// Prints GB/s per scheme, shape, stage size and stage count. -DLAB_PAD=64 pads scheme B's stage rows as the
// executor's kRowPitch does.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o gemv_stream_lab gemv_stream_lab.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include <algorithm>

#include "lab_stream.cuh"  // CK, dot8, warp_sum (and runtime/tilec/ptx.cuh)

constexpr int kConsumers = 8;
#ifndef LAB_PAD
#define LAB_PAD 0  // bytes of padding after each weight row of a scheme-B stage (the executor's kRowPitch: 64)
#endif
constexpr int kMats = 8;

using namespace tilec;  // the runtime's PTX wrappers (runtime/tilec/ptx.cuh): the same instructions
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  while (!mbar_test(bar, parity)) {
  }
}

struct Prob {
  const __nv_bfloat16* w;  // [kMats][N][K]
  const float* x;          // [K]
  float* y;                // [kMats][N]
  int N, K, cols;          // cols per tile (per CTA)
};

__device__ void stage_x(const Prob& p, float* xs) {
  for (int k = threadIdx.x; k < p.K; k += blockDim.x) xs[k] = p.x[k];
}

// ---- A: per-tile ring, block barrier per stage -------------------------------------------
__global__ void __launch_bounds__(256, 1) kern_a(Prob p, int kc, int nstages) {
  extern __shared__ float4 sm4[];
  float* xs = reinterpret_cast<float*>(sm4);
  char* ring = reinterpret_cast<char*>(xs + p.K);
  const int stage_bytes = kConsumers * kc * 2;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(ring + (size_t)nstages * stage_bytes);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  stage_x(p, xs);
  const unsigned long long policy = evict_first_policy();
  for (int t = 0; t < kMats; ++t) {
    const __nv_bfloat16* w = p.w + (size_t)t * p.N * p.K;
    const int n0 = blockIdx.x * p.cols, n1 = min(p.N, n0 + p.cols);
    if (n0 >= n1) continue;
    const int kblocks = (p.K + kc - 1) / kc, groups = (n1 - n0 + kConsumers - 1) / kConsumers;
    const int items = groups * kblocks;
    auto issue = [&](int i) {
      const int g = i / kblocks, kb = i % kblocks;
      const int c0 = n0 + g * kConsumers, rows = min(kConsumers, n1 - c0);
      const int kk = kb * kc, len = min(kc, p.K - kk);
      char* stage = ring + (size_t)(i % nstages) * stage_bytes;
      unsigned long long* bar = bars + (i % nstages);
      mbar_expect_tx(bar, (unsigned)(rows * len * 2));
      for (int r = 0; r < rows; ++r)
        bulk_load(stage + r * kc * 2, w + (long long)(c0 + r) * p.K + kk, (unsigned)(len * 2), bar, policy);
    };
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int s = 0; s < nstages; ++s) mbar_init(bars + s, 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int i = 0; i < min(nstages, items); ++i) issue(i);
    float acc = 0.f;
    for (int i = 0; i < items; ++i) {
      const int g = i / kblocks, kb = i % kblocks;
      const int n = n0 + g * kConsumers + warp;
      const int kk = kb * kc, len = min(kc, p.K - kk);
      mbar_wait(bars + (i % nstages), (unsigned)((i / nstages) & 1));
      if (n < n1) {
        const uint4* row = reinterpret_cast<const uint4*>(ring + (size_t)(i % nstages) * stage_bytes + warp * kc * 2);
#pragma unroll 2
        for (int v = lane; v < len / 8; v += 32) acc += dot8(row[v], xs + kk + v * 8);
      }
      if (kb == kblocks - 1) {
        acc = warp_sum(acc);
        if (lane == 0 && n < n1) p.y[(size_t)t * p.N + n] = acc;
        acc = 0.f;
      }
      __syncthreads();
      if (threadIdx.x == 0 && i + nstages < items) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue(i + nstages);
      }
    }
  }
}

// ---- B: continuous ring, producer warp + full/empty barriers --------------------------------
// Work items run over (tile t, column group g, K block kb) in order, across all tiles.
__global__ void __launch_bounds__(288, 1) kern_b(Prob p, int kc, int nstages) {
  extern __shared__ float4 sm4[];
  float* xs = reinterpret_cast<float*>(sm4);
  char* ring = reinterpret_cast<char*>(xs + p.K);
  const int pitch = kc * 2 + LAB_PAD, stage_bytes = kConsumers * pitch;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(ring + (size_t)nstages * stage_bytes);
  unsigned long long* empty = full + nstages;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < nstages; ++s) { mbar_init(full + s, 1); mbar_init(empty + s, kConsumers); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  stage_x(p, xs);
  __syncthreads();
  const int n0 = blockIdx.x * p.cols, n1 = min(p.N, n0 + p.cols);
  if (n0 >= n1) return;
  const int kblocks = (p.K + kc - 1) / kc, groups = (n1 - n0 + kConsumers - 1) / kConsumers;
  const int per_tile = groups * kblocks, items = kMats * per_tile;
  if (warp == kConsumers) {  // producer
    if (lane == 0) {
      const unsigned long long policy = evict_first_policy();
      for (int i = 0; i < items; ++i) {
        const int s = i % nstages;
        if (i >= nstages) mbar_wait(empty + s, (unsigned)(((i / nstages) - 1) & 1));
        const int t = i / per_tile, j = i % per_tile, g = j / kblocks, kb = j % kblocks;
        const __nv_bfloat16* w = p.w + (size_t)t * p.N * p.K;
        const int c0 = n0 + g * kConsumers, rows = min(kConsumers, n1 - c0);
        const int kk = kb * kc, len = min(kc, p.K - kk);
        char* stage = ring + (size_t)s * stage_bytes;
        mbar_expect_tx(full + s, (unsigned)(rows * len * 2));
        for (int r = 0; r < rows; ++r)
          bulk_load(stage + r * pitch, w + (long long)(c0 + r) * p.K + kk, (unsigned)(len * 2), full + s, policy);
      }
    }
    return;
  }
  float acc = 0.f;
  for (int i = 0; i < items; ++i) {
    const int s = i % nstages;
    const int t = i / per_tile, j = i % per_tile, g = j / kblocks, kb = j % kblocks;
    const int n = n0 + g * kConsumers + warp;
    const int kk = kb * kc, len = min(kc, p.K - kk);
    mbar_wait(full + s, (unsigned)((i / nstages) & 1));
    if (n < n1) {
      const uint4* row = reinterpret_cast<const uint4*>(ring + (size_t)s * stage_bytes + warp * pitch);
#pragma unroll 2
      for (int v = lane; v < len / 8; v += 32) acc += dot8(row[v], xs + kk + v * 8);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + s);
    if (kb == kblocks - 1) {
      acc = warp_sum(acc);
      if (lane == 0 && n < n1) p.y[(size_t)t * p.N + n] = acc;
      acc = 0.f;
    }
  }
}

// ---- C: register streaming ------------------------------------------------------------------
__global__ void __launch_bounds__(256, 1) kern_c(Prob p) {
  extern __shared__ float4 sm4[];
  float* xs = reinterpret_cast<float*>(sm4);
  stage_x(p, xs);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned long long policy = evict_first_policy();
  constexpr int U = 8;
  for (int t = 0; t < kMats; ++t) {
    const __nv_bfloat16* w = p.w + (size_t)t * p.N * p.K;
    const int n0 = blockIdx.x * p.cols, n1 = min(p.N, n0 + p.cols);
    for (int n = n0 + warp; n < n1; n += 2 * kConsumers) {
      const int nb = n + kConsumers < n1 ? n + kConsumers : n;
      const __nv_bfloat16* w0 = w + (long long)n * p.K;
      const __nv_bfloat16* w1 = w + (long long)nb * p.K;
      float a0 = 0.f, a1 = 0.f;
      for (int kb = 0; kb < p.K; kb += U * 256) {
        uint4 r0[U], r1[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = kb + u * 256 + lane * 8;
          if (k < p.K) { r0[u] = ld_stream16(w0 + k, policy); r1[u] = ld_stream16(w1 + k, policy); }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = kb + u * 256 + lane * 8;
          if (k < p.K) { a0 += dot8(r0[u], xs + k); a1 += dot8(r1[u], xs + k); }
        }
      }
      a0 = warp_sum(a0); a1 = warp_sum(a1);
      if (lane == 0) { p.y[(size_t)t * p.N + n] = a0; if (nb != n) p.y[(size_t)t * p.N + nb] = a1; }
    }
  }
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int shapes[][2] = {{2048, 8192}, {4096, 14336}, {128256, 2048}, {2048, 2048}, {3072, 2048}};
  size_t maxw = 0;
  for (auto& s : shapes) maxw = std::max(maxw, (size_t)kMats * s[0] * s[1]);
  __nv_bfloat16* w;
  float *x, *y, *yref;
  CK(cudaMalloc(&w, maxw * 2));
  CK(cudaMalloc(&x, 16384 * 4));
  CK(cudaMalloc(&y, (size_t)kMats * 128256 * 4));
  CK(cudaMalloc(&yref, (size_t)kMats * 128256 * 4));
  lab_fill_bf16<<<1024, 256>>>(w, maxw, 17u);
  std::vector<float> hx(16384);
  for (int i = 0; i < 16384; ++i) hx[i] = ((i * 7919) % 1000) / 1000.f - 0.5f;
  CK(cudaMemcpy(x, hx.data(), 16384 * 4, cudaMemcpyHostToDevice));
  CK(cudaFuncSetAttribute(kern_a, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  CK(cudaFuncSetAttribute(kern_b, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  CK(cudaFuncSetAttribute(kern_c, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  printf("%-8s %-14s %6s %4s %9s %9s %9s %10s\n", "scheme", "W [N,K]", "KiB/st", "st", "us", "us/tile", "TB/s", "max|dy|");
  for (auto& s : shapes) {
    const int N = s[0], K = s[1];
    Prob p{w, x, y, N, K, (N + sms - 1) / sms};
    const double bytes = (double)kMats * N * K * 2;
    // reference: scheme C
    kern_c<<<sms, 256, K * 4>>>(Prob{w, x, yref, N, K, p.cols});
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> href((size_t)kMats * N), hy((size_t)kMats * N);
    CK(cudaMemcpy(href.data(), yref, href.size() * 4, cudaMemcpyDeviceToHost));
    struct Cfg { char scheme; int kc; int st; };
    std::vector<Cfg> cfgs = {{'C', 0, 0}};
    for (int kc : {1024, 2048, 4096})
      for (int st : {2, 3, 4, 6, 8, 12}) {
        const long long need = (long long)K * 4 + (long long)st * kConsumers * (kc * 2 + LAB_PAD) + 256;
        if (need > 227 * 1024) continue;
        cfgs.push_back({'A', kc, st});
        cfgs.push_back({'B', kc, st});
      }
    for (auto& cf : cfgs) {
      const int smem = cf.scheme == 'C' ? K * 4 : K * 4 + cf.st * kConsumers * (cf.kc * 2 + (cf.scheme == 'B' ? LAB_PAD : 0)) + 256;
      auto launch = [&]() {
        if (cf.scheme == 'A') kern_a<<<sms, 256, smem>>>(p, cf.kc, cf.st);
        else if (cf.scheme == 'B') kern_b<<<sms, 288, smem>>>(p, cf.kc, cf.st);
        else kern_c<<<sms, 256, smem>>>(p);
      };
      CK(cudaMemset(y, 0xff, (size_t)kMats * N * 4));
      launch();
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(hy.data(), y, hy.size() * 4, cudaMemcpyDeviceToHost));
      double err = 0;
      for (size_t i = 0; i < hy.size(); ++i) err = std::max(err, (double)fabsf(hy[i] - href[i]));
      std::vector<float> ts;
      for (int r = 0; r < 15; ++r) {
        CK(cudaEventRecord(e0));
        launch();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        ts.push_back(ms);
      }
      std::sort(ts.begin(), ts.end());
      const double us = ts[ts.size() / 2] * 1e3;
      char name[32];
      snprintf(name, sizeof name, "%dx%d", N, K);
      printf("%-8c %-14s %6d %4d %9.1f %9.2f %9.2f %10.2e\n", cf.scheme, name, cf.kc * 16 / 1024, cf.st, us,
             us / kMats, bytes / us / 1e6, err);
    }
  }
  return 0;
}
