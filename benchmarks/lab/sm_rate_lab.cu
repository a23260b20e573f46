// SM rate lab: do some SMs stream HBM slower than others, and do they stay slow?
// Standalone (no tilec). In the executor's 8-GEMV microbenchmark (benchmarks/lab/gemv_fixed.py, forty-seventh
// session, H100) every worker streamed an equal 2.03 MB share, and the last one ended 7.75 us after the median one:
// a static schedule of equal bytes waits for the slowest SM. This lab asks whether that slowness belongs to the SM
// (then a cost model could weigh workers by SM, if a worker's SM is known: blockIdx -> %smid must stay put) or to
// the memory a CTA reads, or is noise. One CTA per SM (132 x 64 threads; 120 KiB of shared memory requested, of
// which the ring uses 96, so that two do not fit an SM), thread 0 streams its share (`--mb`, 2 MB by default) with bulk copies through a 3-stage ring of
// 32 KiB stages (tilec's) and stamps %globaltimer at its start and end and its %smid. Each launch reads a buffer of
// 132 shares (4x the L2 or more); in "fixed" launches CTA b reads share b, in "rotated" ones share (b + 17 r) % 132,
// so a slow SM stays slow over rotations, a slow share moves with it.
// A third form, "claimed", streams the same bytes in units (`--unit-kb`, 64 by default) that CTAs claim from a
// global counter: what a dynamic schedule of the last bytes would gain over equal static shares.
// Prints per launch form: the median, p90 and max of the CTAs' stream times, the median of max - median over
// launches; whether blockIdx -> %smid was the same in every launch; per SM (sorted, slowest first) its median
// time over launches less the launch median, how often it was among the slowest 10 % of a launch; the kernel's
// time by events and its stamped span; for the static forms, the span if every CTA's share were sized to its
// own measured rate ("balanced"); for the fixed form every SM's median, in smid order.
// `--l2`: shares as given by --mb (0.16 for 21 MB in all), read again by every launch, so from the L2 after the
// warm-up launches: how fast one SM ingests bulk copies that hit (forty-ninth session, H200: 61 GB/s a CTA against
// 35 from HBM). -DLAB_STAGES=N builds an N-stage ring (3 by default, the executor's).
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o sm_rate_lab sm_rate_lab.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "lab_stream.cuh"  // CK, kStageBytes, kStages, lab_device (and runtime/tilec/ptx.cuh)

struct Stamp {
  unsigned long long start, end;
  unsigned smid, pad;
};

// Thread 0's ring: init the stages' full barriers; item i into stage i % kStages once the item kStages back
// has landed; wait for the last items (they write this CTA's shared memory).
__device__ void ring_init(unsigned long long* full) {
  for (int s = 0; s < kStages; ++s) tilec::mbar_init(full + s, 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ void ring_item(char* ring, unsigned long long* full, int i, const char* src, unsigned long long policy) {
  const int s = i % kStages;
  if (i >= kStages)  // stage s held item i - kStages: wait for it to land before refilling it
    while (!tilec::mbar_test(full + s, ((i - kStages) / kStages) & 1)) {
    }
  tilec::mbar_expect_tx(full + s, kStageBytes);
  for (int q = 0; q < kStageBytes / 4096; ++q)
    tilec::bulk_load(ring + s * kStageBytes + q * 4096, src + q * 4096, 4096, full + s, policy);
}
__device__ void ring_drain(unsigned long long* full, int items) {
  for (int j = items > kStages ? items - kStages : 0; j < items; ++j)
    while (!tilec::mbar_test(full + j % kStages, (j / kStages) & 1)) {
    }
}
__device__ unsigned smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__global__ void __launch_bounds__(64, 1) stream_share(const char* buf, long long share, int rotate, Stamp* out) {
  extern __shared__ __align__(128) char ring[];
  __shared__ unsigned long long full[kStages];
  if (threadIdx.x != 0) return;
  ring_init(full);
  const long long chunk = (blockIdx.x + (long long)rotate) % gridDim.x;
  const char* mine = buf + chunk * share;
  const unsigned long long policy = tilec::evict_first_policy();
  const int items = (int)(share / kStageBytes);
  const unsigned long long t0 = tilec::global_timer();
  for (int i = 0; i < items; ++i) ring_item(ring, full, i, mine + (long long)i * kStageBytes, policy);
  ring_drain(full, items);
  out[blockIdx.x] = Stamp{t0, tilec::global_timer(), smid(), 0};
}

// The "claimed" form: the same bytes in units of `unit` bytes claimed from a global counter (one claimed ahead, so
// the atomic's round trip overlaps the current unit's copies): a fast SM streams more units, and the launch ends
// when the last unit lands instead of when the slowest SM's equal share does.
__global__ void __launch_bounds__(64, 1) stream_claimed(const char* buf, int units, long long unit, int* counter,
                                                        Stamp* out) {
  extern __shared__ __align__(128) char ring[];
  __shared__ unsigned long long full[kStages];
  if (threadIdx.x != 0) return;
  ring_init(full);
  const unsigned long long policy = tilec::evict_first_policy();
  const int per_unit = (int)(unit / kStageBytes);
  const unsigned long long t0 = tilec::global_timer();
  int next = atomicAdd(counter, 1), i = 0, done = 0;
  while (next < units) {
    const long long cur = next;
    next = atomicAdd(counter, 1);
    for (int u = 0; u < per_unit; ++u, ++i)
      ring_item(ring, full, i, buf + cur * unit + (long long)u * kStageBytes, policy);
    ++done;
  }
  ring_drain(full, i);
  out[blockIdx.x] = Stamp{t0, tilec::global_timer(), smid(), (unsigned)done};
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int main(int argc, char** argv) {
  double mb = 2.0;
  int launches = 30, unit_kb = 64;
  bool l2_resident = false;  // --l2: shares as given (--mb), read again every launch: the L2's rate, not HBM's
  for (int i = 1; i < argc; i += 2) {
    if (!strcmp(argv[i], "--l2")) {
      l2_resident = true, --i;
      continue;
    }
    if (i + 1 >= argc) break;
    if (!strcmp(argv[i], "--mb")) mb = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--unit-kb")) unit_kb = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--launches")) launches = atoi(argv[i + 1]);
  }
  int dev, sms, l2;
  lab_device(dev, sms, l2);
  // the claimed form's unit: whole ring stages; every share a whole number of units, so all forms read the same bytes
  const long long unit = std::max(1, unit_kb * 1024 / kStageBytes) * (long long)kStageBytes;
  long long share = (long long)(mb * 1e6) / unit * unit;
  if (!l2_resident) share = std::max(share, (long long)(4LL * l2 / sms) / unit * unit + unit);  // past the L2
  else if (share * sms > l2 / 2) printf("warning: %.1f MB of shares may not stay in the L2 (%.1f MB)\n", share * sms / 1e6, l2 / 1e6);
  // > half an SM's 228 KiB: one CTA an SM (the ring uses kStages * kStageBytes)
  const int smem = std::max(120 * 1024, kStages * kStageBytes);
  static_assert(kStages * kStageBytes <= 227 * 1024, "the ring fits a CTA");
  CK(cudaFuncSetAttribute(stream_share, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  char* buf;
  CK(cudaMalloc(&buf, share * sms));
  CK(cudaMemset(buf, 1, share * sms));
  Stamp* d_out;
  CK(cudaMalloc(&d_out, sizeof(Stamp) * sms));
  CK(cudaFuncSetAttribute(stream_claimed, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int units = (int)(share * sms / unit);
  int* d_counter;
  CK(cudaMalloc(&d_counter, sizeof(int)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<Stamp> h(sms);
  printf("%s: %d CTAs, %.3f MB each (%.1f MB in all, %s), %d-stage ring, %d launches a form; us\n", prop.name, sms,
         share / 1e6, share * sms / 1e6, l2_resident ? "read from the L2 after the warm-up launches" : "past the L2",
         kStages, launches);
  for (int form = 0; form < 3; ++form) {
    const char* name = form == 2 ? "claimed" : form ? "rotated" : "fixed";
    std::vector<double> spans, kernel_us, balanced;
    unsigned fewest = ~0u, most = 0;  // units a CTA claimed (the claimed form)
    std::vector<std::vector<double>> per_sm(1024);      // smid -> time less its launch's median
    std::vector<int> slow_count(1024, 0), seen(1024, 0);
    std::vector<unsigned> map0(sms);
    bool stable = true;
    std::vector<double> meds, p90s, maxs, tails;
    for (int r = -3; r < launches; ++r) {  // 3 warm-up launches
      CK(cudaMemset(d_counter, 0, sizeof(int)));
      CK(cudaEventRecord(e0));
      if (form == 2)
        stream_claimed<<<sms, 64, smem>>>(buf, units, unit, d_counter, d_out);
      else
        stream_share<<<sms, 64, smem>>>(buf, share, form ? 17 * (r < 0 ? 0 : r) : 0, d_out);
      CK(cudaGetLastError());
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      CK(cudaMemcpy(h.data(), d_out, sizeof(Stamp) * sms, cudaMemcpyDeviceToHost));
      if (r < 0) continue;
      std::vector<double> t(sms);
      unsigned long long first = ~0ull, last = 0;
      double rate = 0;  // shares a microsecond, summed over the CTAs (the fixed forms)
      for (int b = 0; b < sms; ++b) {
        t[b] = (h[b].end - h[b].start) / 1e3;
        first = std::min(first, h[b].start), last = std::max(last, h[b].end);
        rate += 1.0 / t[b];
        fewest = std::min(fewest, h[b].pad), most = std::max(most, h[b].pad);
      }
      spans.push_back((last - first) / 1e3), kernel_us.push_back(ms * 1e3), balanced.push_back(sms / rate);
      std::vector<double> sorted = t;
      std::sort(sorted.begin(), sorted.end());
      const double med = sorted[sms / 2], p90 = sorted[sms * 9 / 10], mx = sorted[sms - 1];
      meds.push_back(med), p90s.push_back(p90), maxs.push_back(mx), tails.push_back(mx - med);
      for (int b = 0; b < sms; ++b) {
        const unsigned id = h[b].smid % 1024;
        per_sm[id].push_back(t[b] - med);
        seen[id]++;
        if (t[b] >= p90) slow_count[id]++;
        if (r == 0) map0[b] = h[b].smid;
        else if (map0[b] != h[b].smid) stable = false;
      }
    }
    std::vector<unsigned> ids(map0);
    std::sort(ids.begin(), ids.end());
    const int distinct = (int)(std::unique(ids.begin(), ids.end()) - ids.begin());
    if (distinct != sms) printf("\nwarning: the %d CTAs ran on %d distinct SMs\n", sms, distinct);
    printf("\n%s: stream time median %.2f, p90 %.2f, max %.2f (medians over launches); max - median %.2f (median), "
           "%.2f (largest); blockIdx -> smid %s every launch\n", name, median(meds), median(p90s), median(maxs),
           median(tails), *std::max_element(tails.begin(), tails.end()), stable ? "the same" : "NOT the same");
    std::vector<std::pair<double, int>> order;
    for (int id = 0; id < 1024; ++id)
      if (seen[id]) order.push_back({median(per_sm[id]), id});
    std::sort(order.rbegin(), order.rend());
    printf("  slowest SMs (smid: median time less the launch median, launches among the slowest 10 %%):");
    for (int k = 0; k < 12 && k < (int)order.size(); ++k)
      printf(" %d: %+.2f %d/%d;", order[k].second, order[k].first, slow_count[order[k].second], seen[order[k].second]);
    printf("\n  fastest:");
    for (int k = (int)order.size() - 1; k >= (int)order.size() - 4 && k >= 0; --k)
      printf(" %d: %+.2f;", order[k].second, order[k].first);
    printf("\n  launch (median): kernel %.2f by events, stamped span %.2f (first start to last end): %.2f TB/s; a CTA's "
           "median stream %.1f GB/s", median(kernel_us), median(spans), share * sms / median(spans) / 1e6,
           form < 2 ? share / median(meds) / 1e3 : 0.0);
    if (form < 2)
      printf("; equal shares at each CTA's own rate, balanced: %.2f", median(balanced));
    else
      printf("; %d units of %lld KiB, %u to %u a CTA", units, unit / 1024, fewest, most);
    printf("\n");
    if (form == 0) {
      printf("  every SM (smid:median time less the launch median):");
      for (int id = 0; id < 1024; ++id)
        if (seen[id]) printf("%s%d:%+.1f", id % 16 ? " " : "\n   ", id, median(per_sm[id]));
      printf("\n");
    }
  }
  CK(cudaFree(buf));
  CK(cudaFree(d_out));
  CK(cudaFree(d_counter));
  return 0;
}
