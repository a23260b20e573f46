// Shared by the standalone labs (fence_lab.cu, hop_lab.cu, gemv_stream_lab.cu, mlp_split_lab.cu, launch_lab.cu,
// sm_rate_lab.cu, consumer_lab.cu): the error check, the device query, the executor-like ring of bulk-copy
// stages, the streaming warp, random bf16 fill, and a bf16-row GEMV's dot product and warp sum.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../runtime/tilec/ptx.cuh"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int kStageBytes = 32 * 1024;  // one ring stage: 8 bulk copies of 4 KiB (the executor's rows)
#ifndef LAB_STAGES
#define LAB_STAGES 3
#endif
constexpr int kStages = LAB_STAGES;     // the executor's default ring depth (3; -DLAB_STAGES=N for another)

// The current device, its SM count and its L2 size in bytes (what stream_slice_bytes sizes by).
inline void lab_device(int& dev, int& sms, int& l2_bytes) {
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, dev));
}

// Bytes each of `sms` CTAs streams: a multiple of kStageBytes, together 4x the L2, so the stream reads HBM.
inline long long stream_slice_bytes(int l2_bytes, int sms) {
  return ((4LL * l2_bytes / sms) / kStageBytes + 1) * kStageBytes;
}

// The streaming warp's lane 0: copies this CTA's `mine` (per_sm bytes, wrapping) stage by stage into
// `ring` (kStages stages, completing on `full`, initialized with count 1) with an evict-first policy,
// at most `ahead` (1..kStages) stages in flight, until *done; then waits for its last copies to land
// (they write this CTA's shared memory). The stages' bytes are never read. Returns the bytes copied.
__device__ inline long long stream_stages(char* ring, unsigned long long* full, const char* mine, long long per_sm,
                                          int ahead, volatile int* done) {
  const unsigned long long policy = tilec::evict_first_policy();
  long long off = 0;
  int i = 0;  // item i fills stage i % kStages; its full barrier's phase parity is (i / kStages) & 1
  for (; !*done; ++i) {
    const int s = i % kStages;
    if (i >= ahead)  // the copy `ahead` items back has landed (with it every earlier one, and stage s's last)
      while (!tilec::mbar_test(full + (i - ahead) % kStages, ((i - ahead) / kStages) & 1)) {
      }
    tilec::mbar_expect_tx(full + s, kStageBytes);
    for (int q = 0; q < kStageBytes / 4096; ++q)
      tilec::bulk_load(ring + s * kStageBytes + q * 4096, mine + off + q * 4096, 4096, full + s, policy);
    off = (off + kStageBytes) % per_sm;
  }
  for (int j = i > kStages ? i - kStages : 0; j < i; ++j)  // drain
    while (!tilec::mbar_test(full + j % kStages, (j / kStages) & 1)) {
    }
  return (long long)i * kStageBytes;
}

// The same stream with the SM's load path instead of the bulk-copy (TMA) engine: all 32 lanes of the
// calling warp copy each 32 KiB stage with 16-byte cp.async.cg (LDGSTS, L2 evict-first hint), one
// commit group a stage, at most `ahead` (1..3) groups in flight, until *done. Returns the bytes copied.
__device__ inline long long stream_stages_async(char* ring, const char* mine, long long per_sm, int ahead,
                                                volatile int* done) {
  const unsigned long long policy = tilec::evict_first_policy();
  const int lane = threadIdx.x & 31;
  long long off = 0;
  int i = 0;
  for (; !__shfl_sync(0xffffffffu, *done, 0); ++i) {
    if (ahead >= 3) asm volatile("cp.async.wait_group 2;" ::: "memory");
    else if (ahead == 2) asm volatile("cp.async.wait_group 1;" ::: "memory");
    else asm volatile("cp.async.wait_group 0;" ::: "memory");
    char* dst = ring + (i % kStages) * kStageBytes + lane * 16;
    const char* src = mine + off + lane * 16;
#pragma unroll 8
    for (int q = 0; q < kStageBytes / 512; ++q)
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
                   ::"r"(tilec::smem_u32(dst + q * 512)), "l"(src + q * 512), "l"(policy) : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
    off = (off + kStageBytes) % per_sm;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  return (long long)i * kStageBytes;
}

// w[0, n) = pseudo-random bf16 values in [-0.5, 0.5), a hash of (i, seed).
__global__ void lab_fill_bf16(__nv_bfloat16* w, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    w[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f));
  }
}

// 8 bf16 weights (a 16-byte vector) times 8 float x values.
__device__ __forceinline__ float dot8(const uint4& w, const float* x) {
  const float4 a = reinterpret_cast<const float4*>(x)[0], b = reinterpret_cast<const float4*>(x)[1];
  return a.x * __uint_as_float(w.x << 16) + a.y * __uint_as_float(w.x & 0xffff0000u) +
         a.z * __uint_as_float(w.y << 16) + a.w * __uint_as_float(w.y & 0xffff0000u) +
         b.x * __uint_as_float(w.z << 16) + b.y * __uint_as_float(w.z & 0xffff0000u) +
         b.z * __uint_as_float(w.w << 16) + b.w * __uint_as_float(w.w & 0xffff0000u);
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
