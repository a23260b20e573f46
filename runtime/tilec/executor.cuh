// tilec runtime: the persistent executor. One CTA per worker queue; all CTAs co-resident
// (cooperative launch). Each CTA walks its queue of 32-int descriptors:
//   fetch descriptor i+1 (second instruction slot) -> decode operands -> wait on the event
//   (one thread, ld.acquire.gpu + __nanosleep backoff, device watchdog) -> block barrier ->
//   run the tile op -> block barrier -> one thread: fence + atom.add.release.gpu.
// Event counters are monotonic: step `epoch` waits for epoch * count, so no reset between
// steps. A wait past `timeout_ns` writes an ErrorRecord, raises the abort flag (which every
// spinning CTA polls) and exits, so a bad plan never hangs the GPU.
#pragma once
#include "common.cuh"

namespace tilec {

struct ErrorRecord {
  int flag;        // 0 = ok; 1 = watchdog timeout
  int worker;
  int instruction;
  int event;
  int task;
  int op;
  long long seen;
  long long target;
};

__device__ __forceinline__ unsigned long long global_timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
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

// Starts pulling [p, p + bytes) from HBM into L2 (Hopper bulk prefetch; a hint, no completion).
__device__ __forceinline__ void prefetch_l2(const char* p, unsigned bytes) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(p) & ~15ull;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(bytes) : "memory");
}

// Returns false if the wait was abandoned (watchdog or another CTA's abort).
__device__ bool wait_event(unsigned long long* counters, int e, unsigned long long target, ErrorRecord* err,
                           long long timeout_ns, int worker, int instr, const int* d) {
  unsigned long long start = global_timer();
  unsigned ns = 32;
  while (true) {
    unsigned long long v = ld_acquire(counters + e);
    if (v >= target) return true;
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
    __nanosleep(ns);
    if (ns < 256) ns <<= 1;
  }
}

template <void (*Dispatch)(TileCtx&, int, int)>
__device__ void run_queue(const int* __restrict__ queues, int L, const long long* __restrict__ operands,
                          unsigned long long* counters, long long epoch, ErrorRecord* err, long long timeout_ns,
                          int smem_floats, long long* stamps, long long position) {
  extern __shared__ float4 dyn_smem4[];
  __shared__ int desc[2][TILEC_DESCRIPTOR_WORDS];
  __shared__ Operand ops[TILEC_MAX_OPERANDS];
  __shared__ int go;
  const int worker = blockIdx.x;
  const int* q = queues + (size_t)worker * L * TILEC_DESCRIPTOR_WORDS;
  if (threadIdx.x < TILEC_DESCRIPTOR_WORDS) desc[0][threadIdx.x] = q[threadIdx.x];
  __syncthreads();
  for (int i = 0; i < L; ++i) {
    const int* d = desc[i & 1];
    const int opcode = d[TILEC_W_OPCODE], wait_e = d[TILEC_W_WAIT_EVENT], wait_c = d[TILEC_W_WAIT_COUNT];
    const int signal_e = d[TILEC_W_SIGNAL_EVENT], row = d[TILEC_W_OPERAND_ROW], sig = d[TILEC_W_DTYPE_SIG];
    if (opcode == TILEC_OP_NOOP) break;
    // slot 2: fetch the next descriptor while this one waits and runs
    if (threadIdx.x < TILEC_DESCRIPTOR_WORDS && i + 1 < L)
      desc[(i + 1) & 1][threadIdx.x] = q[(size_t)(i + 1) * TILEC_DESCRIPTOR_WORDS + threadIdx.x];
    if (opcode != TILEC_OP_EMPTY && threadIdx.x >= 32 && threadIdx.x < 32 + TILEC_MAX_OPERANDS) {
      const int k = threadIdx.x - 32;
      decode_operand(operands + ((size_t)row * TILEC_MAX_OPERANDS + k) * TILEC_OPERAND_FIELDS, ops[k], position);
      // the tile's weights start streaming into L2 while thread 0 waits for its producers
      const unsigned pf = (unsigned)d[TILEC_W_PREFETCH];
      if (pf != 0u && (int)(pf >> 28) == k)
        prefetch_l2(ops[k].ptr + (long long)d[TILEC_W_PREFETCH + 1] * 16, (pf & 0x0fffffffu) * 16u);
    }
    if (threadIdx.x == 0) {
      go = 1;
      if (wait_e >= 0) {
        go = wait_event(counters, wait_e, (unsigned long long)epoch * (unsigned long long)wait_c, err, timeout_ns,
                        worker, i, d);
        __threadfence();
      }
    }
    __syncthreads();
    if (!go) return;
    // profiling: %globaltimer when the instruction starts running (its wait satisfied) and ends
    long long* stamp = stamps ? stamps + ((size_t)worker * L + i) * 2 : nullptr;
    if (stamp && threadIdx.x == 0) stamp[0] = (long long)global_timer();
    if (opcode != TILEC_OP_EMPTY) {
      TileCtx c{d, ops, reinterpret_cast<float*>(dyn_smem4), smem_floats};
      Dispatch(c, opcode, sig);
    }
    __syncthreads();
    if (threadIdx.x == 0 && signal_e >= 0) {
      __threadfence();
      signal_release(counters + signal_e);
    }
    if (stamp && threadIdx.x == 0) stamp[1] = (long long)global_timer();
  }
}

}  // namespace tilec
