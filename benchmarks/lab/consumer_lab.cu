// Consumer lab: how fast can the executor's 8 compute warps ingest a batch-1 GEMV's weight stream
// once its bytes are in shared memory? Standalone (no tilec). 132 persistent CTAs (one per SM), a
// loader warp filling a 3-stage ring of the executor's stages (8 weight rows of 2048 bf16, rows padded
// to kRowPitch, full / empty mbarriers as runtime/tilec/stream.cuh does) and 8 consumer warps:
//   V0  wait for the stage, release it (no reads): what the ring itself can move
//   V1  the executor's batch-1 consumer (gemv_bf16_ring<1>): warp w owns row w of a stage, each lane
//       8 x 16-byte weight chunks against bf16 x read from shared memory per chunk, one accumulator,
//       a warp sum and a store per column
//   V2  K slices: warp w owns K elements [256 w, 256 w + 256) of all 8 rows of a stage, so a lane
//       holds its 8 x values in registers (loaded once: the lab runs V2 only with one K block) and
//       keeps 8 accumulators (one per row); at a column group's last K block a butterfly over the
//       lanes leaves each row's warp partial in a lane quad, written to shared memory and summed
//       over the 8 warps once per tile (the tile's epilogue)
//   V3  V2 with x read from shared memory for every stage (the tile's K spans several blocks)
// Two placements of the weights: `l2` (a CTA re-reads 96 or 128 KiB, 13.0 / 17.3 MB in all, so reads after
// the first pass should hit the L2: what the consumer can do when bytes arrive faster than HBM gives them;
// with 160 KiB a CTA, 21.6 MB in all, an H100's V0 ran at 27 GB/s a CTA, about its HBM share, and one lease
// read the 17.3 MB set at 33 GB/s - the loader keeps the executor's evict-first hint in every mode)
// and `hbm` (4x the L2 in all, read once). Prints per variant the median CTA's GB/s (its bytes over
// its stamped span), the aggregate TB/s over the launch's stamped span, and the results' largest
// difference from V1 (float32 sums in another order).
// Question (fiftieth session): the forty-ninth session's H200 numbers leave a worker's consumer
// (~1 us a 32 KiB item in traces, ~32 GB/s) below its HBM share (35 GB/s); the consumer's rate is a
// property of the SM (the H100's and H200's SMs and clocks are the same), so an H100 answers it.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o consumer_lab consumer_lab.cu
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "lab_stream.cuh"  // CK, lab_device, warp_sum (and runtime/tilec/ptx.cuh)

constexpr int kKBlock = 2048;                // K elements of a stage row (the executor's kStreamK)
constexpr int kPitch = kKBlock * 2 + 64;     // bytes from one stage row to the next (kRowPitch)
constexpr int kStage = 8 * kPitch;           // one stage: 8 rows
constexpr int kRing = 3;                     // stages
constexpr int kCons = 256;                   // consumer threads (8 warps)

struct Args {
  const __nv_bfloat16* w;  // [132 * rows][K]: CTA b's rows start at b * rows
  const __nv_bfloat16* x;  // [K]
  float* y;                // [132 * rows]
  unsigned long long* stamp;  // [132][2]: start, end
  int rows, K, reps;
};

__device__ __forceinline__ float lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }
// the executor's dot8_bf16 (bf16 x from shared memory)
__device__ __forceinline__ float dot8x(const uint4& w, const __nv_bfloat16* x) {
  const uint4 a = *reinterpret_cast<const uint4*>(x);
  return lo(a.x) * lo(w.x) + hi(a.x) * hi(w.x) + lo(a.y) * lo(w.y) + hi(a.y) * hi(w.y) + lo(a.z) * lo(w.z) +
         hi(a.z) * hi(w.z) + lo(a.w) * lo(w.w) + hi(a.w) * hi(w.w);
}
// 8 weights against 8 float x values in registers, added to acc
__device__ __forceinline__ float fma8(const uint4& w, const float* x, float acc) {
  acc = fmaf(x[0], lo(w.x), acc); acc = fmaf(x[1], hi(w.x), acc);
  acc = fmaf(x[2], lo(w.y), acc); acc = fmaf(x[3], hi(w.y), acc);
  acc = fmaf(x[4], lo(w.z), acc); acc = fmaf(x[5], hi(w.z), acc);
  acc = fmaf(x[6], lo(w.w), acc); acc = fmaf(x[7], hi(w.w), acc);
  return acc;
}
__device__ __forceinline__ void load_x8(const __nv_bfloat16* p, float* x) {
  const uint4 a = *reinterpret_cast<const uint4*>(p);
  x[0] = lo(a.x); x[1] = hi(a.x); x[2] = lo(a.y); x[3] = hi(a.y);
  x[4] = lo(a.z); x[5] = hi(a.z); x[6] = lo(a.w); x[7] = hi(a.w);
}
// a[0..7] per lane (row r's partial in a[r]) -> lane l returns row ((l >> 2) & 7)'s sum over the warp
__device__ __forceinline__ float butterfly8(float* a, int lane) {
  const bool u4 = lane & 16, u2 = lane & 8, u1 = lane & 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float send = u4 ? a[j] : a[j + 4], keep = u4 ? a[j + 4] : a[j];
    a[j] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float send = u2 ? a[j] : a[j + 2], keep = u2 ? a[j + 2] : a[j];
    a[j] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
  const float send = u1 ? a[0] : a[1], keep = u1 ? a[1] : a[0];
  float v = keep + __shfl_xor_sync(0xffffffffu, send, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v + __shfl_xor_sync(0xffffffffu, v, 1);
}
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kCons) : "memory"); }

template <int V>
__global__ void __launch_bounds__(kCons + 32, 1) kern(Args a) {
  extern __shared__ __align__(128) unsigned char sm[];
  char* ring = reinterpret_cast<char*>(sm);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(sm + kRing * kStage);
  const int kblocks = a.K / kKBlock, groups = a.rows / 8, items = groups * kblocks;
  float* part = reinterpret_cast<float*>(xs + a.K);  // [groups][8 rows][8 warps]
  __shared__ unsigned long long full[kRing], empty[kRing];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRing; ++s) { tilec::mbar_init(full + s, 1); tilec::mbar_init(empty + s, kCons); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int k = threadIdx.x; k < a.K / 8; k += blockDim.x)
    reinterpret_cast<uint4*>(xs)[k] = reinterpret_cast<const uint4*>(a.x)[k];
  __syncthreads();
  const __nv_bfloat16* w = a.w + (long long)blockIdx.x * a.rows * a.K;
  const int total = items * a.reps;
  if (warp == 8) {  // loader
    if (lane == 0) {
      const unsigned long long policy = tilec::evict_first_policy();
      for (int i = 0; i < total; ++i) {
        const int s = i % kRing, j = i % items, g = j / kblocks, kb = j % kblocks;
        if (i >= kRing)
          while (!tilec::mbar_test(empty + s, ((i / kRing) - 1) & 1)) {
          }
        tilec::mbar_expect_tx(full + s, 8 * kKBlock * 2);
        for (int r = 0; r < 8; ++r)
          tilec::bulk_load(ring + s * kStage + r * kPitch, w + (long long)(g * 8 + r) * a.K + kb * kKBlock,
                           kKBlock * 2, full + s, policy);
      }
    }
    return;
  }
  unsigned long long t0 = tilec::global_timer();
  float acc = 0.f, acc8[8], xr[8];
#pragma unroll
  for (int r = 0; r < 8; ++r) acc8[r] = 0.f;
  if (V == 2) load_x8(xs + warp * 256 + lane * 8, xr);  // one K block: x stays in registers
  for (int i = 0; i < total; ++i) {
    const int s = i % kRing, j = i % items, g = j / kblocks, kb = j % kblocks;
    while (!tilec::mbar_test(full + s, (i / kRing) & 1)) {
    }
    const char* st = ring + s * kStage;
    if (V == 1) {
      const uint4* row = reinterpret_cast<const uint4*>(st + warp * kPitch);
#pragma unroll 2
      for (int v = lane; v < kKBlock / 8; v += 32) acc += dot8x(row[v], xs + kb * kKBlock + v * 8);
    } else if (V >= 2) {
      if (V == 3) load_x8(xs + kb * kKBlock + warp * 256 + lane * 8, xr);
      uint4 wv[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) wv[r] = reinterpret_cast<const uint4*>(st + r * kPitch)[warp * 32 + lane];
#pragma unroll
      for (int r = 0; r < 8; ++r) acc8[r] = fma8(wv[r], xr, acc8[r]);
    }
    tilec::mbar_arrive(empty + s);
    if (kb == kblocks - 1) {
      if (V == 1) {
        acc = warp_sum(acc);
        if (lane == 0) a.y[(long long)blockIdx.x * a.rows + g * 8 + warp] = acc;
        acc = 0.f;
      } else if (V >= 2) {
        const float v = butterfly8(acc8, lane);
        if ((lane & 3) == 0) part[(g * 8 + (lane >> 2)) * 8 + warp] = v;
#pragma unroll
        for (int r = 0; r < 8; ++r) acc8[r] = 0.f;
      }
    }
    if (V >= 2 && j == items - 1) {  // the tile's epilogue: the columns' sums over the warps
      consumer_sync();
      for (int c = threadIdx.x; c < a.rows; c += kCons) {
        float y = 0.f;
#pragma unroll
        for (int q = 0; q < 8; ++q) y += part[c * 8 + q];
        a.y[(long long)blockIdx.x * a.rows + c] = y;
      }
      consumer_sync();
    }
  }
  consumer_sync();
  if (threadIdx.x == 0) {
    a.stamp[2 * blockIdx.x] = t0;
    a.stamp[2 * blockIdx.x + 1] = tilec::global_timer();
  }
}

int main() {
  int dev, sms, l2;
  lab_device(dev, sms, l2);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, l2 >> 20);
  struct Mode { const char* name; int rows, K, reps; };
  const int hbm_rows = (int)((4LL * l2 / sms) / (8LL * 2048 * 2) + 1) * 8;  // K 2048: 4x the L2 in all
  const Mode modes[] = {{"l2", 24, 2048, 24}, {"l2", 8, 8192, 20}, {"hbm", hbm_rows, 2048, 1},
                       {"hbm", (hbm_rows / 4 + 7) / 8 * 8, 8192, 1}};
  size_t maxw = 0;
  for (auto& m : modes) maxw = std::max(maxw, (size_t)sms * m.rows * m.K);
  __nv_bfloat16 *w, *x;
  float *y, *y1;
  unsigned long long* stamp;
  CK(cudaMalloc(&w, maxw * 2));
  CK(cudaMalloc(&x, 8192 * 2));
  CK(cudaMalloc(&y, (size_t)sms * hbm_rows * 4));
  CK(cudaMalloc(&y1, (size_t)sms * hbm_rows * 4));
  CK(cudaMalloc(&stamp, sms * 16));
  lab_fill_bf16<<<1024, 256>>>(w, maxw, 17u);
  lab_fill_bf16<<<8, 256>>>(x, 8192, 91u);
  CK(cudaDeviceSynchronize());
  void (*kerns[])(Args) = {kern<0>, kern<1>, kern<2>, kern<3>};
  printf("%-5s %6s %6s %5s %3s %12s %12s %12s %10s\n", "place", "rows", "K", "reps", "V", "CTA GB/s", "p10 GB/s",
         "agg TB/s", "max|dy|");
  for (auto& m : modes) {
    const int smem = kRing * kStage + m.K * 2 + m.rows * 8 * 4;
    const double cta_bytes = (double)m.rows * m.K * 2 * m.reps;
    std::vector<float> h1((size_t)sms * m.rows), hv((size_t)sms * m.rows);
    for (int v = 0; v < 4; ++v) {
      if (v == 2 && m.K != kKBlock) continue;  // x in registers: one K block only
      CK(cudaFuncSetAttribute(kerns[v], cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      Args a{w, x, v == 1 ? y1 : y, stamp, m.rows, m.K, m.reps};
      std::vector<double> med, agg, p10;
      for (int r = 0; r < 12; ++r) {
        kerns[v]<<<sms, kCons + 32, smem>>>(a);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<unsigned long long> hs(sms * 2);
        CK(cudaMemcpy(hs.data(), stamp, sms * 16, cudaMemcpyDeviceToHost));
        std::vector<double> rate;
        unsigned long long lo_ = ~0ull, hi_ = 0;
        for (int b = 0; b < sms; ++b) {
          rate.push_back(cta_bytes / (double)(hs[2 * b + 1] - hs[2 * b]));  // bytes per ns = GB/s
          lo_ = std::min(lo_, hs[2 * b]);
          hi_ = std::max(hi_, hs[2 * b + 1]);
        }
        std::sort(rate.begin(), rate.end());
        if (r < 2) continue;  // warm-up (and the L2's first fill)
        med.push_back(rate[sms / 2]);
        p10.push_back(rate[sms / 10]);
        agg.push_back(cta_bytes * sms / (double)(hi_ - lo_) / 1e3);
      }
      std::sort(med.begin(), med.end());
      std::sort(p10.begin(), p10.end());
      std::sort(agg.begin(), agg.end());
      double err = 0;
      if (v >= 1) {
        CK(cudaMemcpy(v == 1 ? h1.data() : hv.data(), v == 1 ? y1 : y, h1.size() * 4, cudaMemcpyDeviceToHost));
        if (v >= 2)
          for (size_t i = 0; i < h1.size(); ++i) err = std::max(err, (double)fabsf(hv[i] - h1[i]));
      }
      printf("%-5s %6d %6d %5d %3d %12.1f %12.1f %12.2f %10.2e\n", m.name, m.rows, m.K, m.reps, v, med[med.size() / 2],
             p10[p10.size() / 2], agg[agg.size() / 2], err);
    }
  }
  return 0;
}
