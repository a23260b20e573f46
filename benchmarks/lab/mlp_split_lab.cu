// Fused-MLP lab: is a Llama MLP faster as one split-K tile per worker than as gate/up, then down?
// Standalone (no tilec): 132 persistent CTAs (8 consumer warps + 1 loader warp, a ring of
// bulk-copy stages as in runtime/tilec/stream.cuh) run L layers of y = Wd (silu(Wg x) * (Wu x)),
// bf16 weights, one x row (batch 1), in one of five forms (measured: benchmarks/RESULTS.md, thirty-third session):
//   2P  today's plan: gate/up tiles (each CTA a slice of the I columns) write h to global memory;
//       every CTA waits for all of them (a counter), stages h, and computes a slice of the H
//       output rows of Wd [H, I] (full-K dot products).
//   R   fused, transposed down weight: CTA b computes h for its own columns Cb (8-column groups:
//       gate rows, up rows), then y += Wd^T[Cb, :]^T h_b from a transposed copy Wd^T [I, H] (rows
//       of H, streamed like any weight row), and adds its partial y with red.global.add.v4.f32. The
//       group's 8 h values need every warp's dot: a barrier per group.
//   C   fused, column slice: as R but reading Wd [H, I] columns Cb in place: an item is R rows of
//       |Cb| * 2 bytes, copied by the loader warp's 32 lanes (one bulk copy per row).
//   R2  as R, but all gate / up items first, then all Wd^T items (one block barrier between).
//   S   R2's stream with the Wd^T rows consumed as dot rows: the weight stream's rate alone.
// With dep = 1 a layer's consumers first wait until every CTA finished the previous layer (a
// release add / acquire poll on a counter) and stage x from its y - the dependency a decode step
// has between layers (the next layer's input is this layer's output). The loader never waits on
// it: the next weights stream while the consumers wait. Prints us per layer, TB/s of weight bytes,
// the max |y - y_2P| (all layers with dep = 1; layer 0 without) and layer 0's max error against the host's
// double-precision reference.
// Then R (dep = 1) again with tilec's runtime choices one at a time: 3 ring stages instead of 4, the ring
// waits of runtime/tilec/stream.cuh (abort flag and timer polled while waiting), x as bf16, a tenth warp
// polling a counter as the executor's controller warp does while the compute warps work.
// The split-K partial sums over CTAs are float32 atomics: their order (the last bit) varies run to run.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o mlp_split_lab mlp_split_lab.cu
#include <cuda_bf16.h>
#include <algorithm>
#include <vector>

#include "lab_stream.cuh"

using namespace tilec;

constexpr int kWarps = 8, kThreads = 256, kSK = 2048;  // K elements per row per item (tilec's kStreamK)
constexpr int kPitch = kSK * 2 + 64, kStage = kWarps * kPitch, kNst = 4;

struct Prob {
  int H, I, L, mode, dep;
  const __nv_bfloat16 *wg, *wu, *wd, *wdt;  // [L][I][H], [L][I][H], [L][H][I], [L][I][H]
  float* y;                                  // [L][H], zeroed
  const float* x0;                           // [H]
  float* hbuf;                               // [L][I] (2P)
  int* counter;                              // zeroed; CTAs add 1 per finished phase
  int nst = kNst;          // ring stages (2..kNst)
  int tw = 0;              // 1: the ring waits of runtime/tilec/stream.cuh (abort flag and timer polled while waiting)
  int bx = 0;              // 1: x staged as bf16 (as tilec's ring consumer reads it), else float
  int* abort = nullptr;    // tw: a global flag the waits poll (never set)
  int pw = 0;              // 1: a tenth warp polls a global counter as tilec's controller warp waits on an event
};

// dot8 against bf16 x (8 values, 16 bytes): both unpacked, as tilec's ring consumer reads bf16 rows
__device__ __forceinline__ float dot8b(const uint4& w, const __nv_bfloat16* x) {
  const uint4 xv = *reinterpret_cast<const uint4*>(x);
  const unsigned a[4] = {w.x, w.y, w.z, w.w}, b[4] = {xv.x, xv.y, xv.z, xv.w};
  float r = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    r += __uint_as_float(a[i] << 16) * __uint_as_float(b[i] << 16) +
         __uint_as_float(a[i] & 0xffff0000u) * __uint_as_float(b[i] & 0xffff0000u);
  return r;
}
__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ int ld_acq(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {  // sm_90 vector reduction
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Item kinds of a CTA's stream, in the order loader and consumers both walk.
enum { kGate, kUp, kDownT, kDownCol, kDownRow };
struct Item {
  int kind, g, kb;  // g: 8-row group (or colslice row block), kb: K block
};
struct Plan {  // per CTA per layer
  int c0, c1;         // h columns [c0, c1) (multiples of 8) for 2P phase A / R / C
  int n0, n1;         // 2P phase B output rows
  int kbh, kbi;       // K blocks of an H row and of an I row
  int crows, cpitch;  // colslice: rows per item, smem pitch
  int groups;         // 8-column groups of h: (c1 - c0) / 8
};
__device__ Plan plan_of(const Prob& p) {
  Plan q;
  const int G = p.I / 8, b = blockIdx.x, n = gridDim.x;
  q.c0 = (int)((long long)b * G / n) * 8, q.c1 = (int)((long long)(b + 1) * G / n) * 8;
  const int NG = p.H / 8;
  q.n0 = (int)((long long)b * NG / n) * 8, q.n1 = (int)((long long)(b + 1) * NG / n) * 8;
  q.kbh = (p.H + kSK - 1) / kSK, q.kbi = (p.I + kSK - 1) / kSK;
  q.cpitch = (q.c1 - q.c0) * 2 + 16;
  q.crows = min(256, (kStage / q.cpitch) & ~31);
  q.groups = (q.c1 - q.c0) / 8;
  return q;
}
// Item j of a layer (loader and consumer agree). Phase A (gate/up by group, kb fastest): for R the
// group's Wd^T items follow its up items. Then phase B: C's column-slice items, 2P's row items.
__device__ int layer_items(const Prob& p, const Plan& q) {
  if (p.mode == 1 || p.mode >= 3) return q.groups * 3 * q.kbh;
  if (p.mode == 2) return q.groups * 2 * q.kbh + (p.H + q.crows - 1) / q.crows;
  return q.groups * 2 * q.kbh + (q.n1 - q.n0) / 8 * q.kbi;
}
__device__ Item item_of(const Prob& p, const Plan& q, int j) {
  const int per = p.mode == 1 ? 3 * q.kbh : 2 * q.kbh, groups = q.groups;
  if (j < groups * per) {
    const int g = j / per, r = j % per;
    return Item{r / q.kbh == 0 ? kGate : r / q.kbh == 1 ? kUp : kDownT, g, r % q.kbh};
  }
  j -= groups * per;
  if (p.mode >= 3) return Item{p.mode == 3 ? kDownT : kGate, groups + j / q.kbh, j % q.kbh};  // g past the gate/up groups
  if (p.mode == 2) return Item{kDownCol, j, 0};
  return Item{kDownRow, j / q.kbi, j % q.kbi};
}

__global__ void __launch_bounds__(320, 1) kern(Prob p) {
  extern __shared__ float4 sm4[];
  char* ring = reinterpret_cast<char*>(sm4);
  unsigned long long* full = reinterpret_cast<unsigned long long*>(ring + kNst * kStage);
  unsigned long long* empty = full + kNst;
  float* xs = reinterpret_cast<float*>(empty + kNst);  // [max(H, I)] staged x (or h for 2P phase B)
  float* hs = xs + 16384;                              // [c1 - c0] this CTA's h (S: [2048..2056) junk)
  __nv_bfloat16* xbf = reinterpret_cast<__nv_bfloat16*>(hs + 2064);  // [H] bf16 x (bx)
  __shared__ int done;
  const Plan q = plan_of(p);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n = layer_items(p, q);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kNst; ++s) mbar_init(full + s, 1), mbar_init(empty + s, kThreads);
    done = 0;
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  if (warp == kWarps + 1) {  // executor.cuh wait_event's poll: relaxed counter load, error flag, 32 ns sleep
    if (lane == 0)
      while (!*((volatile int*)&done)) {
        int v;
        asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p.counter) : "memory");
        if (v < 0 || *((volatile int*)p.abort)) break;
        __nanosleep(32);
      }
    return;
  }
  if (warp == kWarps) {  // the loader
    const unsigned long long pol = evict_first_policy();
    int it = 0, s = 0;
    unsigned ph = 0;
    for (int l = 0; l < p.L; ++l)
      for (int j = 0; j < n; ++j, ++it) {
        if (it >= p.nst) {
          if (p.tw) {  // stream.cuh loader_wait: the abort flag (global) and the consumers' done flag (shared)
            while (!mbar_test(empty + s, ph ^ 1u)) {
              if (*((volatile int*)p.abort)) break;
              if (*((volatile int*)&done)) break;
            }
          } else {
            while (!mbar_test(empty + s, ph ^ 1u)) {
            }
          }
        }
        const Item m = item_of(p, q, j);
        char* st = ring + s * kStage;
        if (m.kind == kDownCol) {
          const int r0 = m.g * q.crows, rows = min(q.crows, p.H - r0), bytes = (q.c1 - q.c0) * 2;
          if (lane == 0) mbar_expect_tx(full + s, rows * bytes);
          __syncwarp();
          const __nv_bfloat16* src = p.wd + (size_t)l * p.H * p.I + (size_t)r0 * p.I + q.c0;
          for (int r = lane; r < rows; r += 32) bulk_load(st + r * q.cpitch, src + (size_t)r * p.I, bytes, full + s, pol);
        } else if (lane == 0) {
          const __nv_bfloat16* w;
          int row0, K;
          if (m.kind == kDownRow) w = p.wd + (size_t)l * p.H * p.I, row0 = q.n0 + m.g * 8, K = p.I;
          else {
            const bool late = m.g >= q.groups;  // R2 / S: the Wd^T items after all gate / up items
            w = (late || m.kind == kDownT ? p.wdt : m.kind == kGate ? p.wg : p.wu) + (size_t)l * p.I * p.H;
            row0 = q.c0 + (late ? m.g - q.groups : m.g) * 8, K = p.H;
          }
          const int k0 = m.kb * kSK, bytes = min(kSK, K - k0) * 2;
          mbar_expect_tx(full + s, 8 * bytes);
          for (int r = 0; r < 8; ++r) bulk_load(st + r * kPitch, w + (size_t)(row0 + r) * K + k0, bytes, full + s, pol);
        }
        __syncwarp();
        if (++s == p.nst) s = 0, ph ^= 1u;
      }
    if (lane == 0)
      for (int j = max(0, it - p.nst); j < it; ++j)
        while (!mbar_test(full + j % p.nst, (j / p.nst) & 1)) {
        }
    return;
  }
  // consumers
  int it = 0, s = 0;
  unsigned ph = 0;
  const int nH = (p.H + kSK - 1) / kSK, groups = q.groups;
  for (int l = 0; l < p.L; ++l) {
    if (p.dep && l > 0) {  // every CTA finished layer l - 1 (2P: both of its phases)
      if (threadIdx.x == 0)
        while (ld_acq(p.counter) < l * (p.mode == 0 ? 2 : 1) * (int)gridDim.x) {
        }
      cbar();
    }
    const float* x = p.dep && l > 0 ? p.y + (size_t)(l - 1) * p.H : p.x0;
    for (int k = threadIdx.x; k < p.H; k += kThreads) {
      xs[k] = __ldcg(x + k);
      xbf[k] = __float2bfloat16_rn(xs[k]);
    }
    cbar();
    float acc[2][8] = {};  // R: thread t's outputs kb * 2048 + 8 t + e (H <= 4096)
    float g = 0.f, dsum = 0.f;
    bool phase_b = false;
    for (int j = 0; j < n; ++j, ++it) {
      const Item m = item_of(p, q, j);
      if ((m.kind == kDownRow || m.kind == kDownCol || m.g >= groups) && !phase_b) {  // h complete in hs / hbuf
        phase_b = true;
        cbar();  // every warp's h of the last group is in hs
        if (p.mode == 0) {  // 2P: publish h, wait for every CTA's, stage all of h
          for (int c = threadIdx.x; c < q.c1 - q.c0; c += kThreads) p.hbuf[(size_t)l * p.I + q.c0 + c] = hs[c];
          cbar();
          if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(p.counter, 1);
            while (ld_acq(p.counter) < (2 * l + 1) * (int)gridDim.x) {
            }
          }
          cbar();
          for (int k = threadIdx.x; k < p.I; k += kThreads) xs[k] = __ldcg(p.hbuf + (size_t)l * p.I + k);
          cbar();
        }
      }
      if (p.tw) {  // stream.cuh mbar_wait: one test, then the timer and the abort flag polled with each test
        bool in = mbar_test(full + s, ph);
        if (!in) {
          const unsigned long long start = global_timer();
          while (!(in = mbar_test(full + s, ph))) {
            if (*((volatile int*)p.abort)) break;
            if ((long long)(global_timer() - start) > 2000000000ll) break;
          }
        }
        if (!__all_sync(0xffffffffu, in)) break;
      } else {
        while (!mbar_test(full + s, ph)) {
        }
      }
      const char* st = ring + s * kStage;
      if (m.kind == kGate || m.kind == kUp || m.kind == kDownRow) {
        const int K = m.kind == kDownRow ? p.I : p.H, len = min(kSK, K - m.kb * kSK);
        const uint4* row = reinterpret_cast<const uint4*>(st + warp * kPitch);
        float a = 0.f;
        if (p.bx && m.kind != kDownRow)
          for (int v = lane; v < len / 8; v += 32) a += dot8b(row[v], xbf + m.kb * kSK + v * 8);
        else
          for (int v = lane; v < len / 8; v += 32) a += dot8(row[v], xs + m.kb * kSK + v * 8);
        dsum += a;
        const int kbs = m.kind == kDownRow ? q.kbi : nH;
        if (m.kb == kbs - 1) {
          const float r = warp_sum(dsum);
          dsum = 0.f;
          if (m.g >= groups) {  // S: a Wd^T row as a dot row (stream rate only)
            if (lane == 0) hs[2048 + warp] = r;
          } else if (m.kind == kGate) g = r;
          else if (m.kind == kUp) {
            if (lane == 0) hs[m.g * 8 + warp] = g / (1.f + __expf(-g)) * r;
            if (p.mode == 1) cbar();  // R: the group's Wd^T items read all 8 h values
          } else if (lane == 0) {
            p.y[(size_t)l * p.H + q.n0 + m.g * 8 + warp] = r;
          }
        }
      } else if (m.kind == kDownT) {
        const int k0 = m.kb * kSK;
        auto axpy = [&](float (&a)[8]) {  // a compile-time accumulator set: registers, not local memory
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            const uint4 w = *reinterpret_cast<const uint4*>(st + r * kPitch + threadIdx.x * 16);
            const float h = hs[(m.g >= groups ? m.g - groups : m.g) * 8 + r];
            const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              a[2 * e] += h * __uint_as_float(u[e] << 16);
              a[2 * e + 1] += h * __uint_as_float(u[e] & 0xffff0000u);
            }
          }
        };
        if (k0 + threadIdx.x * 8 < p.H) {
          if (m.kb & 1) axpy(acc[1]);
          else axpy(acc[0]);
        }
      } else {  // kDownCol: thread t = row r0 + t, dot of |Cb| columns with h
        const int r0 = m.g * q.crows, rows = min(q.crows, p.H - r0), cols = q.c1 - q.c0;
        if ((int)threadIdx.x < rows) {
          const uint4* row = reinterpret_cast<const uint4*>(st + threadIdx.x * q.cpitch);
          float a = 0.f;
          for (int v = 0; v < cols / 8; ++v) a += dot8(row[v], hs + v * 8);
          atomicAdd(p.y + (size_t)l * p.H + r0 + threadIdx.x, a);
        }
      }
      mbar_arrive(empty + s);
      if (++s == p.nst) s = 0, ph ^= 1u;
    }
    if (p.mode == 1 || p.mode == 3)
#pragma unroll
      for (int kb = 0; kb < 2; ++kb)
        if (kb < nH && kb * kSK + threadIdx.x * 8 < p.H)
#pragma unroll
          for (int e = 0; e < 8; e += 4)
            red_add4(p.y + (size_t)l * p.H + kb * kSK + threadIdx.x * 8 + e, acc[kb][e], acc[kb][e + 1], acc[kb][e + 2], acc[kb][e + 3]);
    cbar();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(p.counter, 1);
    }
  }
  if (threadIdx.x == 0) done = 1;
}

__global__ void init_bf16(__nv_bfloat16* w, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    w[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * 0.06f);
  }
}
__global__ void transpose_layers(const __nv_bfloat16* wd, __nv_bfloat16* wdt, int H, int I, int L) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)L * H * I; i += (size_t)gridDim.x * blockDim.x) {
    const size_t l = i / ((size_t)H * I), r = i % ((size_t)H * I), h = r / I, c = r % I;
    wdt[l * H * I + c * H + h] = wd[i];
  }
}

int main() {
  int dev, sms, l2;
  lab_device(dev, sms, l2);
  const int shapes[][3] = {{2048, 8192, 16}, {4096, 14336, 8}};  // H, I, layers: Llama-3.2-1B, Llama-3.1-8B
  const int smem = kNst * kStage + 2 * kNst * 8 + 16384 * 4 + 2064 * 4 + 4096 * 2;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  printf("%-22s %4s %3s %10s %10s %8s %10s %10s\n", "shape (H, I, layers)", "form", "dep", "us/layer", "ideal us", "TB/s", "max|dy|",
         "layer0 err");
  for (auto& sh : shapes) {
    const int H = sh[0], I = sh[1], L = sh[2];
    const size_t per = (size_t)L * H * I;
    __nv_bfloat16 *wg, *wu, *wd, *wdt;
    float *y, *x0, *hbuf;
    int* counter;
    CK(cudaMalloc(&wg, per * 2));
    CK(cudaMalloc(&wu, per * 2));
    CK(cudaMalloc(&wd, per * 2));
    CK(cudaMalloc(&wdt, per * 2));
    CK(cudaMalloc(&y, (size_t)L * H * 4));
    CK(cudaMalloc(&x0, H * 4));
    CK(cudaMalloc(&hbuf, (size_t)L * I * 4));
    CK(cudaMalloc(&counter, 4));
    init_bf16<<<1024, 256>>>(wg, per, 1u);
    init_bf16<<<1024, 256>>>(wu, per, 2u);
    init_bf16<<<1024, 256>>>(wd, per, 3u);
    transpose_layers<<<1024, 256>>>(wd, wdt, H, I, L);
    std::vector<float> hx(H);
    for (int i = 0; i < H; ++i) hx[i] = ((i * 7919) % 1000) / 1000.f - 0.5f;
    CK(cudaMemcpy(x0, hx.data(), H * 4, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());
    const double bytes = 3.0 * H * I * 2;  // weight bytes per layer
    std::vector<float> y0(H);  // layer 0 on the host: y = Wd (silu(Wg x0) * (Wu x0)), double sums
    {
      std::vector<__nv_bfloat16> a((size_t)H * I), b((size_t)H * I), c((size_t)H * I);
      CK(cudaMemcpy(a.data(), wg, a.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), wu, b.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(c.data(), wd, c.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<double> h(I);
      for (int i = 0; i < I; ++i) {
        double gs = 0, us = 0;
        for (int k = 0; k < H; ++k)
          gs += (double)__bfloat162float(a[(size_t)i * H + k]) * hx[k], us += (double)__bfloat162float(b[(size_t)i * H + k]) * hx[k];
        h[i] = gs / (1 + exp(-gs)) * us;
      }
      for (int n = 0; n < H; ++n) {
        double t = 0;
        for (int i = 0; i < I; ++i) t += (double)__bfloat162float(c[(size_t)n * I + i]) * h[i];
        y0[n] = (float)t;
      }
    }
    std::vector<float> href((size_t)L * H), hy((size_t)L * H);
    int* abort_flag;
    CK(cudaMalloc(&abort_flag, 4));
    CK(cudaMemset(abort_flag, 0, 4));
    auto time_layer = [&](Prob p) {  // median us per layer over 10 launches (2 warm-up); y left in hy
      std::vector<float> ts;
      for (int r = 0; r < 12; ++r) {
        CK(cudaMemsetAsync(y, 0, (size_t)L * H * 4));
        CK(cudaMemsetAsync(counter, 0, 4));
        CK(cudaEventRecord(e0));
        kern<<<sms, p.pw ? 320 : 288, smem>>>(p);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) ts.push_back(ms);
      }
      std::sort(ts.begin(), ts.end());
      CK(cudaMemcpy(hy.data(), y, hy.size() * 4, cudaMemcpyDeviceToHost));
      return ts[ts.size() / 2] * 1000.0 / L;
    };
    auto layer0_err = [&]() {
      double e = 0;
      for (int i = 0; i < H; ++i) e = std::max(e, (double)fabsf(hy[i] - y0[i]));
      return e;
    };
    char name[64];
    snprintf(name, sizeof name, "%d, %d, %d", H, I, L);
    for (int dep : {1, 0})
      for (int mode : {0, 1, 2, 3, 4}) {
        if (mode == 0 && dep == 0) continue;  // 2P's down phase needs every h
        const double us = time_layer(Prob{H, I, L, mode, dep, wg, wu, wd, wdt, y, x0, hbuf, counter});
        if (mode == 0) href = hy;
        double err = 0, mag = 0;
        for (size_t i = 0; i < (dep ? hy.size() : (size_t)H); ++i) err = std::max(err, (double)fabsf(hy[i] - href[i])), mag = std::max(mag, (double)fabsf(href[i]));
        printf("%-22s %4s %3d %10.2f %10.2f %8.2f %10.2e %10.2e (|y| <= %.2e)\n", name, (const char*[]){"2P", "R", "C", "R2", "S"}[mode], dep, us,
               bytes / 4.0e6, bytes / us / 1e6, err, layer0_err(), mag);
      }
    // R (dep 1) moved towards tilec's runtime one step at a time: ring depth, its ring waits, bf16 x
    printf("%-22s %6s %6s %6s %6s %10s %8s %10s\n", "R, dep 1", "stages", "waits", "x", "poller", "us/layer", "TB/s",
           "layer0 err");
    const int vs[][4] = {{4, 0, 0, 0}, {3, 0, 0, 0}, {4, 1, 0, 0}, {4, 0, 1, 0}, {4, 0, 0, 1}, {3, 1, 1, 1}};
    for (auto& v : vs) {
      Prob p{H, I, L, 1, 1, wg, wu, wd, wdt, y, x0, hbuf, counter};
      p.nst = v[0], p.tw = v[1], p.bx = v[2], p.pw = v[3], p.abort = abort_flag;
      const double us = time_layer(p);
      printf("%-22s %6d %6s %6s %6s %10.2f %8.2f %10.2e\n", name, v[0], v[1] ? "tilec" : "plain", v[2] ? "bf16" : "float",
             v[3] ? "yes" : "no", us, bytes / us / 1e6, layer0_err());
    }
    CK(cudaFree(abort_flag));
    CK(cudaFree(wg));
    CK(cudaFree(wu));
    CK(cudaFree(wd));
    CK(cudaFree(wdt));
    CK(cudaFree(y));
    CK(cudaFree(x0));
    CK(cudaFree(hbuf));
    CK(cudaFree(counter));
  }
  return 0;
}
