// Launch lab: what a persistent executor's launch costs before any work, per launch, back to back.
// Standalone (no tilec). A grid of 132 CTAs x 320 threads (tilec's kCtaThreads) with 0 or 223 KiB of
// dynamic shared memory (tilec's largest) runs a kernel that does nothing but, in the "epoch" forms, what
// tilec's executor does at its start and end (runtime/tilec/executor.cuh run_queue): every CTA reads the
// step counter with ld.acquire.gpu, and at the end adds to a finished-CTA counter, the last CTA
// publishing the next epoch with st.release.gpu. Each form is launched N times back to back on one
// stream, timed by two events around the N launches (µs per launch), plainly, as a CUDA graph of N
// launches, and with programmatic dependent launch (PDL: cudaLaunchAttributeProgrammaticStreamSerialization;
// the kernel issues griddepcontrol.launch_dependents at its start and griddepcontrol.wait before reading
// the counter, so the next grid's CTAs may be placed while this one ends).
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o launch_lab launch_lab.cu
#include <cuda_runtime.h>
#include <stdio.h>

#include "lab_stream.cuh"  // CK

constexpr int kCtas = 132, kThreads = 320, kBigSmem = 223 * 1024;

template <bool Epoch, bool Pdl>
__global__ void __launch_bounds__(kThreads, 1) step(unsigned long long* state) {
  extern __shared__ int smem[];
  __shared__ unsigned long long epoch;
  if (Pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (Pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (Epoch && threadIdx.x == 0) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(state) : "memory");
    epoch = v + 1;
    smem[0] = (int)v;
  }
  __syncthreads();
  if (Epoch && threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(state + 1, 1ull) + 1 == epoch * gridDim.x)
      asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(state), "l"(epoch) : "memory");
  }
}

template <bool Epoch, bool Pdl>
cudaError_t launch(unsigned long long* state, int smem, bool coop, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kCtas);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (coop) {
    attr[n].id = cudaLaunchAttributeCooperative;
    attr[n++].val.cooperative = 1;
  }
  if (Pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, step<Epoch, Pdl>, state);
}

template <bool Epoch, bool Pdl>
int measure(const char* name, unsigned long long* state, int smem, bool coop, bool graph, int n) {
  CK(cudaFuncSetAttribute(step<Epoch, Pdl>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBigSmem));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; ++i) CK((launch<Epoch, Pdl>(state, smem, coop, s)));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&exec, g, 0));
    CK(cudaGraphDestroy(g));
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float best = 1e30f, sum = 0.f;
  const int reps = 7;
  for (int r = 0; r < reps + 1; ++r) {  // the first repetition warms up
    CK(cudaEventRecord(a, s));
    if (graph) CK(cudaGraphLaunch(exec, s));
    else
      for (int i = 0; i < n; ++i) CK((launch<Epoch, Pdl>(state, smem, coop, s)));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r) best = ms < best ? ms : best, sum += ms;
  }
  printf("%-44s %9.2f %9.2f\n", name, best * 1e3f / n, sum * 1e3f / reps / n);
  if (exec) CK(cudaGraphExecDestroy(exec));
  CK(cudaStreamDestroy(s));
  return 0;
}

int main() {
  unsigned long long* state;
  if (cudaMalloc(&state, 16) != cudaSuccess || cudaMemset(state, 0, 16) != cudaSuccess) return 1;
  const int n = 200;
  printf("%d launches back to back, %d CTAs x %d threads; us per launch: best and mean of 7\n", n, kCtas, kThreads);
  printf("%-44s %9s %9s\n", "form", "best", "mean");
  int rc = 0;
  rc |= measure<false, false>("empty, no smem, stream", state, 0, false, false, n);
  rc |= measure<false, false>("empty, 223 KiB, stream", state, kBigSmem, false, false, n);
  rc |= measure<false, false>("empty, 223 KiB, cooperative, stream", state, kBigSmem, true, false, n);
  rc |= measure<false, false>("empty, 223 KiB, cooperative, graph", state, kBigSmem, true, true, n);
  rc |= measure<true, false>("epoch, 223 KiB, cooperative, stream", state, kBigSmem, true, false, n);
  rc |= measure<true, false>("epoch, 223 KiB, cooperative, graph", state, kBigSmem, true, true, n);
  rc |= measure<true, true>("epoch, 223 KiB, cooperative + PDL, stream", state, kBigSmem, true, false, n);
  rc |= measure<true, true>("epoch, 223 KiB, cooperative + PDL, graph", state, kBigSmem, true, true, n);
  rc |= measure<true, true>("epoch, 223 KiB, PDL (not cooperative), graph", state, kBigSmem, false, true, n);
  unsigned long long host[2];
  if (cudaMemcpy(host, state, 16, cudaMemcpyDeviceToHost) != cudaSuccess) return 1;
  printf("epochs published: %llu (CTAs finished %llu)\n", host[0], host[1]);
  return rc;
}
