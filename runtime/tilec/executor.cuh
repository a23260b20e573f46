// tilec runtime: the persistent executor. One CTA per worker queue; all CTAs co-resident
// (cooperative launch). Each CTA is kWarps compute warps, one loader warp and one controller warp.
// The loader warp streams the queue's GEMV weights into the shared-memory ring ahead of the
// compute warps (stream.cuh). The controller warp runs one instruction ahead of the compute
// warps (control() below): it loads instruction i's 32-int descriptor into slot i & 1, decodes
// its operands, sets up a GEMV (row offsets, stream range), then waits on its event (device
// watchdog) while the compute warps still run instruction i - 1. The compute warps walk the queue:
//   copy the decoded operands -> barrier -> wait for the controller's "event done" (one thread,
//   shared memory) -> barrier -> run the tile op -> barrier -> one thread: red.release.gpu.
// A GEMV (linear, linear_fused) is dispatched before its wait and calls it itself
// (TileCtx::wait) once its setup is done, so that setup overlaps the wait; so are
// attention_partial (its call) and fp8_linear_quant.
// Event counters are monotonic: step `epoch` waits for epoch * count, so no reset between
// steps. The epoch lives on the device (state[0] = steps completed), so a launch replayed from
// a CUDA graph advances it too: each CTA's controller and compute warps read it at start, and the
// last CTA to finish the step (state[1] counts finished CTAs) publishes epoch + 1. A wait past
// `timeout_ns` writes an ErrorRecord, raises the abort flag (which the controller's and the
// loader's waits and the ring waits poll) and exits; the controller then hands the compute warps
// "gave up" (ctrl_ready = -1), so a bad plan never hangs the GPU.
#pragma once
#include "common.cuh"
#include "stream.cuh"

namespace tilec {

__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void signal_release(unsigned long long* p) {
  asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(p) : "memory");
}

// Decodes one operand-table entry for decode position p (address or scalar + p * pos_step).
__device__ __forceinline__ void decode_operand(const long long* e, Operand& o, long long position) {
  o.dtype = (int)e[TILEC_OF_DTYPE];
  const long long addr = e[TILEC_OF_ADDR] + position * e[TILEC_OF_POS_STEP];
  o.ptr = reinterpret_cast<char*>(addr);
  o.scalar = addr;
  o.ndim = (int)e[TILEC_OF_NDIM];
#pragma unroll
  for (int k = 0; k < TILEC_MAX_DIMS; ++k) {
    o.sizes[k] = (int)e[TILEC_OF_SIZES + k];
    o.strides[k] = e[TILEC_OF_STRIDES + k];
  }
}

__device__ __forceinline__ unsigned long long ld_relaxed(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_acquire_cta(const int* p) {
  int v;
  asm volatile("ld.acquire.cta.shared::cta.s32 %0, [%1];" : "=r"(v) : "r"(smem_u32(p)) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_cta(int* p, int v) {
  asm volatile("st.release.cta.shared::cta.s32 [%0], %1;" ::"r"(smem_u32(p)), "r"(v) : "memory");
}

// The controller warp's hand-off to the compute warps (all counts of instructions, 0 at start):
// ctrl_decoded = i + 1 once instruction i's descriptor (slot i & 1) and operands (ctrl_ops[i & 1])
// are in shared memory, ctrl_ready = i + 1 once its event is done (-1: the wait gave up), and from
// the compute warps ctrl_consumed = i + 1 once they have finished instruction i (its slot is then
// free for instruction i + 2). Stored with st.release.cta, read with ld.acquire.cta (the loader
// warp polls ctrl_consumed relaxed: loader_hold in stream.cuh).
__shared__ int ctrl_decoded, ctrl_ready, ctrl_consumed;
__shared__ Operand ctrl_ops[2][TILEC_MAX_OPERANDS];
static_assert(sizeof(Operand) % 4 == 0 && sizeof(tilec_ops) <= 4 * kThreads,
              "the compute threads copy the decoded operands one word each");

// The controller's wait for instruction instr's event: returns false if it was abandoned
// (watchdog: writes the error record, or another CTA's abort). While the compute warps still run
// instruction instr - 1 it polls with relaxed loads: an acquire load (ld.acquire.gpu) invalidates
// the SM's L1 under them (with acquire polls there the Llama-3.2-1B step took 1.158 against 1.147
// ms on an H200, benchmarks/lab/variants_ab.py); once the count is there one acquire load
// synchronizes with the producers' release adds. Once they are done with instr - 1 it polls with
// acquire loads (no second round trip on the critical path).
__device__ bool wait_event(unsigned long long* counters, int e, unsigned long long target, ErrorRecord* err,
                           long long timeout_ns, int worker, int instr, const int* d) {
  unsigned long long start = global_timer();
  while (true) {
    const bool idle = *((volatile int*)&ctrl_consumed) >= instr;
    unsigned long long v = idle ? ld_acquire(counters + e) : ld_relaxed(counters + e);
    if (v >= target && (idle || ld_acquire(counters + e) >= target)) return true;
    if (*((volatile int*)&err->flag)) return false;
    if ((long long)(global_timer() - start) > timeout_ns) {
      if (atomicCAS(&err->flag, 0, 1) == 0) {
        err->worker = worker;
        err->instruction = instr;
        err->event = e;
        err->task = d[TILEC_W_TASK];
        err->op = d[TILEC_W_OP];
        err->seen = (long long)v;
        err->target = (long long)target;
        __threadfence_system();
      }
      return false;
    }
    __nanosleep(32);  // a load's round trip (~0.5 us) dominates the poll interval
  }
}

// The controller warp's loop (see the top of this file). Slot i & 1 is free for instruction i once
// the compute warps have finished instruction i - 2. Decoding (one lane per operand) and a GEMV's
// row offsets and stream range happen while the compute warps run instruction i - 1, so none of
// them sits between one instruction's signal and the next one's start. Measured on an H200
// (benchmarks/lab/variants_ab.py, batch 1, context 1024; the previous runtime in its own process
// of the same lease): Llama-3.2-1B 1.137 against 1.153 ms a step, Llama-3.1-8B 4.915 against
// 4.984; a GEMV tile whose worker's own last instruction completed its event started 1.50 instead
// of 2.53 us after it (median, benchmarks/lab/gap_table.py).
__device__ __noinline__ void control(int (*desc)[TILEC_DESCRIPTOR_WORDS], const int* q, int L,
                                     const long long* operands, long long position, unsigned long long* counters,
                                     unsigned long long epoch, ErrorRecord* err, long long timeout_ns,
                                     const int* compute_done) {
  const int lane = threadIdx.x & 31;
  for (int i = 0; i < L; ++i) {
    const int slot = i & 1;
    int* d = desc[slot];
    if (i >= 2) {
      if (lane == 0)
        while (ld_acquire_cta(&ctrl_consumed) < i - 1 && !*((volatile const int*)compute_done)) __nanosleep(64);
      __syncwarp();
      if (*((volatile const int*)compute_done)) return;  // the compute warps left the queue (abort)
    }
    d[lane] = q[(size_t)i * TILEC_DESCRIPTOR_WORDS + lane];
    __syncwarp();
    const int opcode = d[TILEC_W_OPCODE];
    if (opcode != TILEC_OP_NOOP && opcode != TILEC_OP_EMPTY && lane < TILEC_MAX_OPERANDS)
      decode_operand(operands + ((size_t)d[TILEC_W_OPERAND_ROW] * TILEC_MAX_OPERANDS + lane) * TILEC_OPERAND_FIELDS,
                     ctrl_ops[slot][lane], position);
    __syncwarp();
    if (opcode == TILEC_OP_LINEAR || opcode == TILEC_OP_LINEAR_FUSED) {
      gemv_prepare(d, ctrl_ops[slot], slot);
      __syncwarp();
    }
    if (lane == 0) {
      st_release_cta(&ctrl_decoded, i + 1);
      const int e = d[TILEC_W_WAIT_EVENT];
      const bool ok = opcode == TILEC_OP_NOOP || e < 0 ||
                      wait_event(counters, e, epoch * (unsigned long long)d[TILEC_W_WAIT_COUNT], err, timeout_ns,
                                 blockIdx.x, i, d);
      st_release_cta(&ctrl_ready, ok ? i + 1 : -1);
    }
    __syncwarp();
    if (opcode == TILEC_OP_NOOP || *((volatile int*)&ctrl_ready) < 0) return;
  }
}

__device__ bool TileCtx::wait() {
  if (waited) return *go != 0;  // a later row chunk of the same GEMV
  waited = true;
  if (threadIdx.x == 0) {
    int ok = 1;
    if (wait_e >= 0) {
      // The controller's acquire load that saw the count synchronizes with the producers' release
      // adds; its st.release.cta of ctrl_ready and this ld.acquire.cta extend that to this thread
      // (causality order is transitive), and the barrier below to every compute thread. No fence:
      // a __threadfence() after the wait (MEMBAR.SC.GPU) cost ~0.4 us per instruction on an H200
      // (1.396 against 1.435 ms a Llama-3.2-1B step, variants_ab.py).
      int v;
      while ((v = ld_acquire_cta(&ctrl_ready)) >= 0 && v <= instr) {
      }
      ok = v > instr;
    }
    *go = ok;
    if (stamp) stamp[0] = (long long)global_timer();
  }
  block_sync();
  return *go != 0;
}

// The add releases the CTA's stores that the barrier ordered before it (cumulativity, as for the
// event signal) and acquires those of every earlier arrival (the adds form one release sequence).
__device__ bool TileCtx::arrive(int k, unsigned long long count) {
  block_sync();
  if (threadIdx.x == 0) {
    unsigned long long old;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(counters + k) : "memory");
    *last = old + 1 == epoch * count;
  }
  block_sync();
  return *last != 0;
}

template <void (*Dispatch)(TileCtx&, int, int)>
__device__ void run_queue(const int* __restrict__ queues, int L, const long long* __restrict__ operands,
                          unsigned long long* counters, unsigned long long* state, ErrorRecord* err, long long timeout_ns,
                          int smem_bytes, int ring_stages, long long* stamps, long long position) {
  extern __shared__ float4 dyn_smem4[];
  __shared__ int desc[2][TILEC_DESCRIPTOR_WORDS];
  __shared__ int go, ring_next, ring_gave_up, compute_done, arrived_last;
  __shared__ unsigned long long ring_full[kMaxStages], ring_empty[kMaxStages];
  __shared__ WeightRing ring;
  __shared__ unsigned long long epoch;
  __shared__ int x_staged;  // 1: the last instruction left a GEMV's bf16 x rows in the scratch
  const int worker = blockIdx.x;
  const int* q = queues + (size_t)worker * L * TILEC_DESCRIPTOR_WORDS;
  if (threadIdx.x == 0) {
    ring = WeightRing{reinterpret_cast<char*>(dyn_smem4), ring_full, ring_empty, ring_stages, &ring_next, &err->flag,
                      timeout_ns, &compute_done, &ring_gave_up};
    ring_next = 0;
    tilec_ring_stages = ring_stages;
    ctrl_decoded = ctrl_ready = ctrl_consumed = 0;
    ring_gave_up = 0;
    x_staged = 0;
    compute_done = 0;
    for (int s = 0; s < ring_stages; ++s) {
      mbar_init(ring_full + s, 1);
      mbar_init(ring_empty + s, kThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the only barrier the loader and controller warps join
  // The epoch is read after that barrier, by the controller and the compute warps each: the loader,
  // which never needs it, starts its first bulk copies without waiting for that load's round trip.
  // Both reads agree: state[0] changes only once every CTA of the step has arrived at the end, and
  // this CTA's compute warps arrive after their own read and after the controller's (it decodes
  // instruction 0, st.release of ctrl_decoded, only after its load, and they wait for that).
  // Measured on an H100 (benchmarks/lab/variants_ab.py, batch 1, context 1024, one process, logits
  // bitwise equal; the epoch read by thread 0 before the barrier as the other variant): Llama-3.2-1B
  // 1.319 against 1.334 ms a step (5 rounds), Llama-3.1-8B 6.215 against 6.295 (3 rounds) - more than
  // the one round trip it moves; the GEMV plans did not change. nvcc compiled the inlined ops otherwise
  // too (the kernel's stack frame 880 against 928 bytes, other GEMV loop code and addresses), which may
  // be where the rest comes from - and which a later change can move again (benchmarks/RESULTS.md).
  if (threadIdx.x >= kThreads + 32) {
    unsigned long long e = 0;
    if ((threadIdx.x & 31) == 0) e = ld_acquire(state) + 1;
    control(desc, q, L, operands, position, counters, __shfl_sync(0xffffffffu, e, 0), err, timeout_ns, &compute_done);
    return;
  }
  if (threadIdx.x >= kThreads) {
    if (ring_stages > 0) stream_weights(q, L, operands, position, ring, &ctrl_consumed);
    return;
  }
  if (threadIdx.x == 0) epoch = ld_acquire(state) + 1;
  block_sync();
  float* scratch = reinterpret_cast<float*>(reinterpret_cast<char*>(dyn_smem4) + (size_t)ring_stages * kStageBytes);
  const int smem_floats = (smem_bytes - ring_stages * kStageBytes) / 4;
  bool ok = true;  // the same in every compute thread: each decision is read after a barrier
  for (int i = 0; i < L; ++i) {
    const int* d = desc[i & 1];
    while (ld_acquire_cta(&ctrl_decoded) <= i) {  // the controller is one instruction ahead: rarely spins
    }
    const int opcode = d[TILEC_W_OPCODE], wait_e = d[TILEC_W_WAIT_EVENT], wait_c = d[TILEC_W_WAIT_COUNT];
    const int signal_e = d[TILEC_W_SIGNAL_EVENT], sig = d[TILEC_W_DTYPE_SIG];
    if (opcode == TILEC_OP_NOOP) break;
    if (opcode != TILEC_OP_EMPTY && threadIdx.x < (int)(sizeof(tilec_ops) / 4))
      reinterpret_cast<int*>(tilec_ops)[threadIdx.x] = reinterpret_cast<const int*>(ctrl_ops[i & 1])[threadIdx.x];
    // The tile's weights start streaming into L2 while it sets up and waits. Issued here rather than
    // by the controller an instruction earlier: Llama-3.1-8B 4.875 against 4.906 ms a step (H200,
    // variants_ab.py; Llama-3.2-1B 1.130 against 1.127).
    if (opcode != TILEC_OP_EMPTY && threadIdx.x >= 32 && threadIdx.x < 32 + TILEC_MAX_OPERANDS) {
      const int k = threadIdx.x - 32;
      const unsigned pf = (unsigned)d[TILEC_W_PREFETCH];
      if (pf != 0u && (int)(pf >> 28) == k)
        prefetch_l2(ctrl_ops[i & 1][k].ptr + (long long)d[TILEC_W_PREFETCH + 1] * 16, (pf & 0x0fffffffu) * 16u);
    }
    // profiling: %globaltimer when the instruction starts running (its wait satisfied) and ends
    long long* stamp = stamps ? stamps + ((size_t)worker * L + i) * 4 : nullptr;
    TileCtx c{d, scratch, smem_floats, &ring, stamp, false, false, counters,
              epoch * (unsigned long long)wait_c, wait_e, i, err, timeout_ns, &go, false, epoch, &arrived_last};
    // A GEMV sets itself up (staging checks; its row offsets and stream range come from the
    // controller) before its wait, which it then calls itself
    // (TileCtx::wait); once the operands are copied (the barrier) it may read them.
    // attention_partial is dispatched before its wait too (its call overlaps the wait).
    // Every other op runs after the wait. Measured on an
    // H200 (benchmarks/lab/variants_ab.py, Llama-3.2-1B batch 1, context 1024, same process):
    // 1.689 ms a step with the GEMV setup before the wait, 1.792 ms after it.
    const bool early = opcode == TILEC_OP_LINEAR_FUSED || opcode == TILEC_OP_LINEAR ||
                       opcode == TILEC_OP_ATTENTION_PARTIAL || opcode == TILEC_OP_FP8_LINEAR_QUANT;
    if (early) block_sync();
    else if (!c.wait()) {
      ok = false;
      break;
    }
    c.x_staged_in = x_staged != 0;  // written by thread 0 after the last instruction: read after a barrier
    bool staged_out = false;
    if (opcode != TILEC_OP_EMPTY) {
      Dispatch(c, opcode, sig);
      staged_out = c.x_staged_out;
    }
    if (!c.waited) c.wait();  // an op that left before its wait (a failed check) still waits
    if (!go) {
      ok = false;
      break;
    }
    block_sync();
    if (threadIdx.x == 0) x_staged = staged_out;  // read by every thread after the next instruction's first barrier
    if (ring_gave_up) {  // a ring wait gave up (abort): leave the queue
      ok = false;
      break;
    }
    if (threadIdx.x == 0 && signal_e >= 0)  // release at gpu scope: cumulative over the CTA's writes ordered
      signal_release(counters + signal_e);    // before it by the barrier (PTX memory model), so no extra fence
    if (stamp && threadIdx.x == 0) stamp[1] = (long long)global_timer();
    if (threadIdx.x == 0) st_release_cta(&ctrl_consumed, i + 1);  // slot i & 1 is free for instruction i + 2
  }
  if (threadIdx.x == 0) compute_done = 1;  // a loader still waiting for a stage now gives up
  if (!ok) return;
  if (threadIdx.x == 0) {  // the step's last CTA to finish publishes the epoch (every CTA has read it)
    __threadfence();
    if (atomicAdd(state + 1, 1ull) + 1 == epoch * gridDim.x)
      asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(state), "l"(epoch) : "memory");
  }
}

}  // namespace tilec
