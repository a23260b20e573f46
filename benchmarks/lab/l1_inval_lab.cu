// L1 invalidation lab: does another warp's acquire poll (ld.acquire.gpu, whose SASS carries
// CCTL.IVALL) evict the SM's L1 lines that a compute warp's local memory (its stack: spills, a
// TileCtx passed by reference to a noinline op) and L1-cached global loads live in?
// Standalone (no tilec). One CTA of 64 threads on one SM: warp 0 runs a dependent chain of loads
// (local memory, global through L1 with ld.ca, shared memory) and thread 0 reports the mean
// cycles per load; warp 1 meanwhile does nothing (mode 0) or polls a global word in a loop with
// __nanosleep(32) between polls, as the executor's controller warp does: ld.relaxed.gpu (1),
// ld.acquire.gpu (2), ld.relaxed.gpu + fence.acq_rel.gpu (3).
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o l1_inval_lab l1_inval_lab.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int kN = 256;      // chain entries (ints): 1 KiB, 8 L1 lines
constexpr int kSteps = 4096;  // dependent loads timed

__device__ int g_stop;

__global__ void lab(int mode, const int* gchain, long long* out, unsigned long long* flag) {
  __shared__ int schain[kN];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 1) {
    if (mode == 0) return;
    unsigned long long sink = 0;
    while (!*((volatile int*)&g_stop)) {
      unsigned long long v;
      if (mode == 2) asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
      else asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
      if (mode == 3) asm volatile("fence.acq_rel.gpu;" ::: "memory");
      sink += v;
      __nanosleep(32);
    }
    if (sink == 12345) out[15] = 1;
    return;
  }
  int lchain[kN];  // dynamically indexed: local memory
  for (int i = 0; i < kN; ++i) lchain[i] = (i * 37 + 11) % kN, schain[i] = (i * 37 + 11) % kN;
  __syncwarp();
  // give the poller time to start
  const long long t00 = clock64();
  while (clock64() - t00 < 20000) {
  }
  int j = lane;
  for (int rep = 0; rep < 2; ++rep) {  // rep 0 warms up
    long long t0 = clock64();
    for (int s = 0; s < kSteps; ++s) j = lchain[j];
    long long t1 = clock64();
    for (int s = 0; s < kSteps; ++s) {
      int v;
      asm volatile("ld.global.ca.s32 %0, [%1];" : "=r"(v) : "l"(gchain + j) : "memory");
      j = v;
    }
    long long t2 = clock64();
    for (int s = 0; s < kSteps; ++s) j = *((volatile int*)&schain[j]);
    long long t3 = clock64();
    if (lane == 0 && rep == 1) {
      out[0] = (t1 - t0);
      out[1] = (t2 - t1);
      out[2] = (t3 - t2);
      out[3] = j;
    }
  }
  if (lane == 0) atomicExch(&g_stop, 1);
}

int main() {
  int h[kN];
  for (int i = 0; i < kN; ++i) h[i] = (i * 37 + 11) % kN;
  int* g;
  long long* out;
  unsigned long long* flag;
  CK(cudaMalloc(&g, sizeof h));
  CK(cudaMemcpy(g, h, sizeof h, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&out, 16 * sizeof(long long)));
  CK(cudaMalloc(&flag, 8));
  CK(cudaMemset(flag, 0, 8));
  const char* names[] = {"no poller", "ld.relaxed.gpu polls", "ld.acquire.gpu polls", "relaxed + fence.acq_rel.gpu"};
  printf("%-30s %12s %12s %12s   (cycles per dependent load, %d loads)\n", "other warp", "local", "global .ca",
         "shared", kSteps);
  for (int round = 0; round < 3; ++round)
    for (int mode = 0; mode < 4; ++mode) {
      int zero = 0;
      CK(cudaMemcpyToSymbol(g_stop, &zero, sizeof zero));
      lab<<<1, 64>>>(mode, g, out, flag);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      long long r[16];
      CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
      printf("%-30s %12.1f %12.1f %12.1f\n", names[mode], (double)r[0] / kSteps, (double)r[1] / kSteps,
             (double)r[2] / kSteps);
    }
  return 0;
}
