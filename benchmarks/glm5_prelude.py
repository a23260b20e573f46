"""GLM-5 DSA attention prelude benchmark on a CUDA GPU (issue 5; the seed's workload): one table.

The prelude of ``examples/glm5_dsa_prelude.py`` (M = 16 tokens = 2 requests x 8, 8192 cached
positions per request, paged caches), full GLM-5 sizes. Rows, each the median of CUDA-event
timings after warm-up, with L2 flushed before every timed call (the FP8 weights would
otherwise fit in the H200's L2):

* eager bf16; the same under one CUDA graph;
* one CUDA graph with the three independent branches (QKV-A and what follows it, head gate,
  indexer K) on separate streams (the seed's multistream baseline, without PDL);
* Inductor (``torch.compile``) captured in one CUDA graph;
* tilec bf16 and tilec FP8: the step as called (binding + launch + output copies), the same
  replayed from a CUDA graph (as the baselines are: no host work per step), and the persistent
  kernel alone (a pre-bound operand table);
* the HBM rooflines for the bf16 and FP8 bytes: weights read (kv_b_proj's key half only) plus
  the indexer key cache read, over the measured read bandwidth.

``--check`` (default on) compares tilec's outputs and caches with the example's oracle
(relative L2; the top-2048 positions by score against the FP8 oracle's and the bf16 oracle's).

    python benchmarks/glm5_prelude.py [--reduced] [--iters 200] [--workers 132] [--skip-inductor] [--no-check]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import glm5_dsa_prelude as glm  # noqa: E402
from tilec.api import compile_module  # noqa: E402
from tilec.timing import cuda_graph, need_gpu  # noqa: E402
from tilec.trace import kind_table, measured_trace, write_trace  # noqa: E402

TOPK = 2048


# ---- timing helpers (as benchmarks/decode.py) ---------------------------------------------------

_FLUSH: torch.Tensor | None = None


def flush_l2() -> None:
    """Evicts L2 by writing a 256 MiB buffer (several times the H200's L2)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    _FLUSH.zero_()


def time_cuda(fn, iters: int, warmup: int = 5, flush: bool = True) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, each between two CUDA events
    (the L2 flush, when on, runs before the first event)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush:
            flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def read_bandwidth() -> float:
    """Measured HBM read bandwidth in bytes/s: a sum over 4 GiB (read-bound)."""
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda").uniform_()
    ms = time_cuda(lambda: x.sum(), 20, flush=False)
    return x.numel() * 4 / (ms * 1e-3)


# ---- the workload --------------------------------------------------------------------------------

def step_bytes(mod: glm.GlmDsaPrelude) -> int:
    """Bytes one step must read: every weight used (FP8 values and scales, or bf16), of kv_b_proj
    only the W_UK rows, plus the indexer key cache (and its scales) of every request."""
    c = mod.cfg
    nbytes = 0
    for name, p in mod.named_parameters():
        n = p.numel() * p.element_size()
        if name.startswith("kv_b_proj."):  # the absorption reads the key half only
            n = n * c.qk_nope_head_dim // (c.qk_nope_head_dim + c.v_head_dim)
        nbytes += n
    key = 1 if mod.fp8 else 2
    nbytes += c.requests * c.context * (c.index_head_dim * key + (4 if mod.fp8 else 0))
    return nbytes


def multistream_step(mod: glm.GlmDsaPrelude, streams):
    """The prelude with its three independent branches on separate streams (same module code)."""
    s_gate, s_key = streams

    def step(hidden_in, residual, positions, block_tables, slot_mapping, kv_cache, index_k_cache,
             index_k_scale_cache=None):
        main = torch.cuda.current_stream()  # the capturing stream under torch.cuda.graph
        dtype = hidden_in.dtype
        residual, x, xa, cos, sin = mod.stem(hidden_in, residual, positions)
        s_gate.wait_stream(main)
        s_key.wait_stream(main)
        with torch.cuda.stream(s_gate):
            w = mod.head_gate(x)
        with torch.cuda.stream(s_key):
            mod.index_key(xa, cos, sin, slot_mapping, index_k_cache, index_k_scale_cache, dtype)
        q_mla, qi = mod.queries_and_latent(xa, cos, sin, slot_mapping, kv_cache, dtype)
        main.wait_stream(s_gate)
        main.wait_stream(s_key)
        score = mod.scores(qi, w, positions, block_tables, index_k_cache, index_k_scale_cache)
        return residual, q_mla, score

    return step


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("nan")
    return float((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30))


def topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int = TOPK) -> float:
    """Mean over tokens of |top-k(a) & top-k(b)| / k (positions by score)."""
    k = min(k, a.shape[-1])
    ia, ib = a.float().cpu().topk(k, -1).indices, b.float().cpu().topk(k, -1).indices
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(ia, ib)) / (k * a.shape[0])


def check(name, prog, mod, inputs, reference_scores=None) -> torch.Tensor:
    """tilec's outputs and caches against the oracle (computed on the CPU from copies)."""
    cpu_mod = copy.deepcopy(mod).cpu()
    cpu_inputs = tuple(t.cpu() for t in inputs)
    want = glm.oracle(cpu_mod, *cpu_inputs)
    got = tuple(prog(*inputs)) + tuple(inputs[5:])
    names = ["residual", "q_mla", "scores", "kv_cache", "index_k_cache", "index_k_scale_cache"]
    errs = ", ".join(f"{n} {rel_l2(g, w):.2e}" for n, g, w in zip(names, got, want))
    line = f"check {name}: relative L2 {errs}; top-{TOPK} overlap with its oracle {topk_overlap(got[2], want[2]):.4f}"
    if reference_scores is not None:
        line += f", with the bf16 oracle {topk_overlap(got[2], reference_scores):.4f}"
    print(line, flush=True)
    return want[2]


# ---- main ------------------------------------------------------------------------------------------

def profile(prog, mod, inputs, args, out: Path) -> None:
    """Runs the step once more compiled with per-instruction stamps; writes the timeline to
    ``out`` and prints the time per op kind."""
    prof = compile_module(mod, inputs, options={**args.extra, "workers": args.workers, "check": False, "profile": True})
    for _ in range(3):
        prof(*inputs)
    tg = prof.compiled.stages["linearized"]
    trace = measured_trace(prof.plan, prof.executor.stamps.cpu(), tg)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(out, trace)
    print(f"{out.stem}: {kind_table(trace, tg)}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reduced", action="store_true", help="the CI configuration instead of GLM-5's sizes")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--workers", type=int, default=132)
    ap.add_argument("--skip-inductor", action="store_true")
    ap.add_argument("--options", default="{}",
                    help='tilec compile options as JSON (default tile_rows 4, ring_stages 2), e.g. \'{"tile_rows": 1}\'')
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between timed calls")
    ap.add_argument("--profile", metavar="DIR", help="also write each tilec variant's measured timeline to DIR "
                    "(Perfetto JSON) and print its time per op kind")
    args = ap.parse_args()
    # 4-row tiles for the row-wise ops (RMSNorm, LayerNorm, quantization, cache writes) of its 16
    # tokens: on an H200 (tenth session, call 6) the persistent kernel took 310.9 us in bf16 and
    # 585.5 in FP8 with them, 364.8 and 599.8 with the default single-row tiles. A 2-stage weight
    # ring: FP8 348.4 us against 378.6 with 3 (eleventh session, glm5_variants_ab.py --stages 2),
    # 270.2 against 302.5 (twelfth session); tile_rows 1 / 2 then: 292.2 / 273.2 us
    extra = json.loads(args.options)
    if not isinstance(extra, dict):
        ap.error(f"--options: a JSON object of compile options, got {args.options!r}")
    args.extra = {"tile_rows": 4, "ring_stages": 2, **extra}
    need_gpu("glm5_prelude.py")
    warnings.simplefilter("ignore")
    cfg = glm.REDUCED if args.reduced else glm.FULL
    dev, bf16 = "cuda", torch.bfloat16
    flush = not args.no_flush
    rows = []

    def timed(label, fn):
        ms = time_cuda(fn, args.iters, flush=flush)
        rows.append((label, ms))
        print(f"{label:<52} {ms * 1e3:9.1f} us", flush=True)

    mods = {fp8: glm.make_prelude(cfg, fp8, bf16, dev) for fp8 in (False, True)}
    inputs = {fp8: glm.make_inputs(cfg, fp8, bf16, dev) for fp8 in (False, True)}
    mod, inp = mods[False], inputs[False]

    def eager():
        with torch.no_grad():
            return mod(*inp)

    timed("eager bf16", eager)
    timed("CUDA graph (eager bf16)", cuda_graph(eager).replay)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    ms_step = multistream_step(mod, streams)

    def multistream():
        with torch.no_grad():
            return ms_step(*inp)

    timed("CUDA graph, 3 branches on 3 streams (bf16)", cuda_graph(multistream).replay)
    for fp8 in (False, True) if not args.skip_inductor else ():
        label = "Inductor in a CUDA graph (" + ("FP8 as dequantize+matmul" if fp8 else "bf16") + ")"
        t0 = time.time()
        compiled = torch.compile(mods[fp8], fullgraph=True, dynamic=False)

        def inductor(compiled=compiled, fp8=fp8):
            with torch.no_grad():
                return compiled(*inputs[fp8])

        try:
            g = cuda_graph(inductor)
        except Exception as e:  # noqa: BLE001 - report and keep the other rows
            print(f"{label}: not captured ({type(e).__name__}: {e})", flush=True)
            continue
        print(f"inductor compile + capture {time.time() - t0:.1f}s", flush=True)
        timed(label, g.replay)

    bf16_scores = None
    for fp8 in (False, True):
        name = "tilec FP8" if fp8 else "tilec bf16"
        t0 = time.time()
        prog = compile_module(mods[fp8], inputs[fp8], options={**args.extra, "workers": args.workers, "check": False})
        print(f"{name}: compile {time.time() - t0:.1f}s; {prog.stats}", flush=True)
        prog(*inputs[fp8])
        prog.executor.check()
        if not args.no_check:
            scores = check(name, prog, mods[fp8], inputs[fp8], bf16_scores)
            bf16_scores = scores if not fp8 else bf16_scores
        timed(f"{name} (step call)", lambda prog=prog, fp8=fp8: prog(*inputs[fp8]))
        try:  # the step call replayed from a CUDA graph, as the baselines are (no host work per step)
            g = cuda_graph(lambda prog=prog, fp8=fp8: prog(*inputs[fp8]))
        except Exception as e:  # noqa: BLE001 - report and keep the other rows
            print(f"{name} (step call in a CUDA graph): not captured ({type(e).__name__}: {e})", flush=True)
        else:
            timed(f"{name} (step call in a CUDA graph)", g.replay)
        tensors, p = prog.bind_args(inputs[fp8])
        table = prog.plan.bind(tensors, p)
        timed(f"{name} (persistent kernel)", lambda prog=prog, t=tensors, tb=table: prog.executor.run(t, tb))
        print(f"{name}: predicted makespan {prog.stats.get('predicted_step_us')} us", flush=True)
        if args.profile:
            profile(prog, mods[fp8], inputs[fp8], args, Path(args.profile) / f"glm5_{'fp8' if fp8 else 'bf16'}.json")

    bw = read_bandwidth()
    for fp8 in (False, True):
        nbytes = step_bytes(mods[fp8])
        rows.append((f"roofline {'FP8' if fp8 else 'bf16'} ({nbytes / 1e6:.1f} MB at {bw / 1e12:.2f} TB/s)",
                     nbytes / bw * 1e3))
    roof = rows[-1][1]
    print(f"\nGLM-5 DSA prelude, {cfg.requests} requests x {cfg.tokens_per_request} tokens, KV {cfg.context}, "
          f"{torch.cuda.get_device_name()}{'' if flush else ' (L2 not flushed)'}")
    print(f"{'variant':<60} {'us':>9} {'x FP8 roofline':>15}")
    for label, ms in rows:
        print(f"{label:<60} {ms * 1e3:>9.1f} {ms / roof:>15.2f}")


if __name__ == "__main__":
    main()
