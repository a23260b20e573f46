// tilec runtime: the GEMV weight stream. Each worker CTA has one loader warp besides its
// compute warps. The loader walks the worker's whole instruction queue on its own and, for
// every instruction whose descriptor names streamed weights (the `stream` word), copies the
// tile's weight rows into a ring of shared-memory stages with Hopper bulk copies
// (cp.async.bulk, completing on a "full" mbarrier per stage). The compute warps consume the
// stages in the same order and release each one on its "empty" mbarrier (every compute thread
// arrives: an arrive releases only the arriving thread's own reads). The loader waits on free
// stages and, past an instruction's first TILEC_HOLD_AHEAD items, on the compute warps having
// finished the last earlier instruction that signals (below) - never on events - so the next
// instructions' weights stream in while the compute warps wait for their producers or finish
// the current tile.
// (The producer/consumer ring follows the warp-specialized pipelines of CUTLASS and
// ThunderKittens; the loader running ahead across instructions follows Hazy Research's
// low-latency megakernel and Mirage MPK.)
//
// Item i of the stream is one stage: kWarps consecutive weight rows (output columns) x a
// block of kStreamK bf16 elements of K (2 kStreamK FP8 elements with the stream word's 1-byte
// flag, bit 13: op_fp8_linear_quant in ops_glm.cuh), row r at byte r * kRowPitch of the stage.
// With the paired flag (bit 14, K ranges of at most kStreamK bytes) an item holds two column
// groups, 2 kWarps rows: row r at byte (r % kWarps) * kRowPitch + (r / kWarps) * kStreamK, so a
// short-K tile still moves a whole stage per item.
// A tile covers columns [n0, n1) and K range [k0, k1): items (column group g, K block kb), kb
// fastest - or, with the stream word's K-outer flag (bit 12), g fastest (a consumer that stages
// x one K block at a time: gemv_bf16_ring_kouter in ops.cuh).
#pragma once
#include "common.cuh"
#include "ptx.cuh"

namespace tilec {

constexpr int kStreamK = 2048;                              // K elements per row per stage
// Rows sit kRowPitch bytes apart, 64 bytes of padding each: a 16-byte shared-memory load is
// served a quarter-warp at a time, and the tensor-core consumer's quarter-warp reads 64 bytes
// of each of two consecutive rows at one k - half a bank line apart, so conflict-free.
constexpr int kRowPitch = kStreamK * 2 + 64;
constexpr int kStageBytes = kWarps * kRowPitch;             // 32 KiB + 512 bytes
constexpr int kMaxStages = 8;

__device__ __forceinline__ void TileCtx::mark(int k) const {
  if (stamp && threadIdx.x == 0) stamp[1 + k] = (long long)global_timer();
}

// Waits for the phase of `parity` of `bar` to complete. Gives up (false) once *abort is set,
// or after timeout_ns, when it sets *abort to 2 (the host reports a stalled weight stream).
__device__ __forceinline__ bool mbar_wait(unsigned long long* bar, unsigned parity, int* abort, long long timeout_ns) {
  if (mbar_test(bar, parity)) return true;
  const unsigned long long start = global_timer();
  while (!mbar_test(bar, parity)) {
    if (*((volatile int*)abort)) return false;
    if ((long long)(global_timer() - start) > timeout_ns) {
      atomicCAS(abort, 0, 2);
      return false;
    }
  }
  return true;
}
// The streamed weight range of one instruction: rows [n0, n1) x K range [k0, k1) of bf16 W
// (row stride wn elements). Valid only when bulk copies can move it (16-byte aligned rows).
struct StreamTile {
  const char* w;
  long long wn;
  int n0, n1, k0, k1;
  bool kouter;  // items K block outer, column group inner
  bool paired;  // two column groups per item (2 kWarps rows of at most kStreamK bytes)
  int esz;      // bytes per weight element: 2 (bf16) or 1 (FP8)
  __device__ int kitem() const { return kStreamK * 2 / esz; }  // K elements of one item's row
  __device__ int kblocks() const { return (k1 - k0 + kitem() - 1) / kitem(); }
  __device__ int group_rows() const { return paired ? 2 * kWarps : kWarps; }  // weight rows of one item
  __device__ int groups() const { return (n1 - n0 + group_rows() - 1) / group_rows(); }
  __device__ int items() const { return groups() * kblocks(); }
};

// The streamed range of descriptor d given its weight operand's address w and row stride wn
// (elements); false when d streams nothing or bulk copies cannot move the rows (16-byte
// alignment). Loader and compute warps both decide through this, so they agree on the stream.
// the stream word's flags (tilec/ops/__init__.py)
constexpr int kStreamKouter = 1 << 12, kStreamByte = 1 << 13, kStreamPaired = 1 << 14;
__device__ __forceinline__ bool stream_range(const int* d, const char* w, long long wn, StreamTile& t) {
  const int s = d[TILEC_W_STREAM];
  const int nc = (s >> 4) & 15, kc = (s >> 8) & 15;
  t.w = w;
  t.wn = wn;
  t.n0 = d[TILEC_W_COORDS + 2 * nc];
  t.n1 = d[TILEC_W_COORDS + 2 * nc + 1];
  t.k0 = d[TILEC_W_COORDS + 2 * kc];
  t.k1 = d[TILEC_W_COORDS + 2 * kc + 1];
  t.kouter = (s & kStreamKouter) != 0;
  t.paired = (s & kStreamPaired) != 0;
  t.esz = (s & kStreamByte) ? 1 : 2;
  return s != 0 && (reinterpret_cast<unsigned long long>(w + (long long)t.esz * t.k0) & 15) == 0 &&
         (wn * t.esz) % 16 == 0 && ((t.k1 - t.k0) * t.esz) % 16 == 0 && t.n1 > t.n0 &&
         (!t.paired || (t.k1 - t.k0) * t.esz <= kStreamK);
}

// The loader's view: the weight operand decoded from the operand table at position p.
__device__ __forceinline__ bool stream_tile(const int* d, const long long* operands, long long position,
                                            StreamTile& t) {
  const int s = d[TILEC_W_STREAM];
  if (s == 0 || d[TILEC_W_OPCODE] == TILEC_OP_NOOP || d[TILEC_W_OPCODE] == TILEC_OP_EMPTY) return false;
  const long long* e = operands + ((size_t)d[TILEC_W_OPERAND_ROW] * TILEC_MAX_OPERANDS + (s & 15) - 1) * TILEC_OPERAND_FIELDS;
  return stream_range(d, reinterpret_cast<const char*>(e[TILEC_OF_ADDR] + position * e[TILEC_OF_POS_STEP]),
                      e[TILEC_OF_STRIDES], t);
}

// The shared-memory ring: `nstages` stages of kStageBytes, a full and an empty mbarrier each.
struct WeightRing {
  char* stages;
  unsigned long long* full;   // [nstages]: completes when a stage's bytes have landed
  unsigned long long* empty;  // [nstages]: completes when all kThreads compute threads released it
  int nstages;
  int* next;                  // shared: the compute warps' next stream item
  int* abort;                 // the error record's flag: set, every wait gives up
  long long timeout_ns;       // the watchdog bound of a compute warp's wait
  const int* done;            // shared: set when the compute warps have left the queue
  int* gave_up;               // shared: set by a compute thread whose wait gave up (the executor stops)
  __device__ unsigned parity(int item) const { return (unsigned)(item / nstages) & 1u; }  // of item's full phase
};

// Whether a waiting loader gives up: on an abort, or when the compute warps have left the queue
// while a streamed item is still unconsumed - loader and compute warps disagree: flag 2.
__device__ __forceinline__ bool loader_gives_up(const WeightRing& r) {
  if (*((volatile int*)r.abort)) return true;
  if (*((volatile const int*)r.done)) {
    atomicCAS(r.abort, 0, 2);
    return true;
  }
  return false;
}
// The loader's wait for a free stage. It has no time bound of its own: the compute warps it
// waits for are either working, waiting on an event (whose watchdog names the op), or waiting
// on this loader.
__device__ __forceinline__ bool loader_wait(unsigned long long* bar, unsigned parity, const WeightRing& r) {
  while (!mbar_test(bar, parity))
    if (loader_gives_up(r)) return false;
  return true;
}

// An instruction's release fence (the signal that ends it) waits for the SM's bulk copies in flight
// (benchmarks/RESULTS.md: fifteenth and twenty-fourth sessions), and the loader has by then usually
// queued the next instructions' first items. So the loader issues at most TILEC_HOLD_AHEAD items of
// an instruction before the last earlier instruction that signals an event has signaled: its fence
// waits for fewer copies, and the first items still stream while it finishes. Measured on H100s
// (benchmarks/lab/variants_ab.py, batch 1, context 1024, one process, logits bitwise equal; two
// leases of this code): Llama-3.2-1B 1.312 / 1.308 against 1.319 / 1.314 ms a step with 2 (1 item:
// 1.318), Llama-3.1-8B 6.173 against 6.211 (1 item: 6.144). A first version that held items behind
// any earlier instruction: with none ahead 1.333 against 1.312 (the fifteenth session's loader
// hold on an H200: no gain). The GEMV table's plans (no events, nothing held) were unchanged. A
// value >= the ring's stages holds nothing back.
#ifndef TILEC_HOLD_AHEAD
#define TILEC_HOLD_AHEAD 2
#endif
// The loader's wait until the compute warps have finished instruction `gate` (*consumed > gate;
// the executor's ctrl_consumed, read relaxed: the loader reads no data the compute warps publish,
// a stage's reuse is ordered by its empty mbarrier). Like loader_wait it has no time bound of its
// own and gives up on an abort, or when the compute warps have left the queue first. (Each poll
// also reads the abort flag in global memory, so the loader sees the count a fraction of an L2
// round trip late - as measured.)
__device__ __forceinline__ bool loader_hold(const int* consumed, int gate, const WeightRing& r) {
  while (*((volatile const int*)consumed) <= gate)
    if (loader_gives_up(r)) return false;
  return true;
}

// The loader warp's loop (lane 0 issues): all streamed weights of queue q, in queue order.
// Before it returns it waits for its last copies to land (they write this CTA's shared
// memory, which must outlive them), also after an abort.
__device__ __noinline__ void stream_weights(const int* q, int L, const long long* operands, long long position,
                                            const WeightRing& r, const int* consumed) {
  if ((threadIdx.x & 31) != 0) return;
  const unsigned long long policy = evict_first_policy();
  int item = 0, s = 0;  // the next item and its slot (item % nstages)
  unsigned ph = 0;      // its full barrier's phase parity (item / nstages & 1)
  bool ok = true;
  int last_sig = -1;    // the last instruction so far that signals an event
  for (int i = 0; i < L && ok; ++i) {
    const int* d = q + (size_t)i * TILEC_DESCRIPTOR_WORDS;
    if (d[TILEC_W_OPCODE] == TILEC_OP_NOOP) break;
    StreamTile t;
    const int gate = last_sig;  // the last instruction before i that signals an event (-1: none)
    if (d[TILEC_W_SIGNAL_EVENT] >= 0) last_sig = i;
    if (!stream_tile(d, operands, position, t)) continue;
    const int kblocks = t.kblocks(), groups = t.groups(), items = t.items();
#pragma unroll 1
    for (int j = 0; j < items && ok; ++j, ++item) {
      // slot s was last filled with item - nstages: wait for the compute warps to release it
      if (item >= r.nstages && !(ok = loader_wait(r.empty + s, ph ^ 1u, r))) break;
      // past the first TILEC_HOLD_AHEAD items, wait until instruction `gate` has signaled
      if (j >= TILEC_HOLD_AHEAD && !(ok = loader_hold(consumed, gate, r))) break;
      const int g = t.kouter ? j % groups : j / kblocks, kb = t.kouter ? j / groups : j % kblocks;
      const int c0 = t.n0 + g * t.group_rows(), rows = min(t.group_rows(), t.n1 - c0);
      const int kk = t.k0 + kb * t.kitem(), bytes = min(t.kitem(), t.k1 - kk) * t.esz;
      char* stage = r.stages + s * kStageBytes;
      mbar_expect_tx(r.full + s, (unsigned)(rows * bytes));
#pragma unroll 1
      for (int row = 0; row < rows; ++row)
        bulk_load(stage + (row % kWarps) * kRowPitch + (row / kWarps) * kStreamK,
                  t.w + ((long long)(c0 + row) * t.wn + kk) * t.esz, (unsigned)bytes, r.full + s, policy);
      if (++s == r.nstages) s = 0, ph ^= 1u;
    }
  }
  // drain: the copies of the last nstages items may still be landing (complete ones pass at once)
  for (int j = item > r.nstages ? item - r.nstages : 0; j < item; ++j)
    while (!mbar_test(r.full + j % r.nstages, r.parity(j))) {
    }
}

}  // namespace tilec
