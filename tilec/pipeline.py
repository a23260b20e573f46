"""The compile pipeline, top to bottom, as one flat list of named stages.

    opgraph     OpGraph from the frontend                  (verify_opgraph)
    split_kv    split_kv: attention -> partial + combine   (verify_opgraph)
                (flash-decoding; the same graph when no op splits)
    fuse_gemv   fold_casts: a float32 op's output cast     (verify_opgraph)
                into the op (cast on store);
                fuse_gemv_chains: RMSNorm / SiLU-mul
                prologues and residual-add epilogues into GEMVs;
                fuse_fp8_quant: FP8 activation quantization
                into the FP8 GEMMs
    fold_cache  fold_cache_writes: rope -> cache_write      (verify_opgraph)
                becomes one rope writing the cache slot
    gemv_groups size_gemv_groups: sibling GEMVs (same     (verify_opgraph)
                input rows) sized by their total columns;
                then fold_rope: the queries' rope into the
                split-KV attention tiles (after the sizing:
                without coarsen_forks q keeps tiles cut
                for its per-head RoPE),
                and fold_kv_append: the keys' RoPE and the
                cache writes into those tiles; fold_combine:
                the split-KV combine into its partials (the
                last tile of a head group runs it)
    tasks       build_taskgraph: tiles + events by overlap (verify_taskgraph "tasks")
    fused       fuse_events; coarsen_forks: a tile's    (verify_taskgraph "fused")
                fan-out into one op's tiles becomes one event
    normalized  normalize                                  (verify_taskgraph "normalized")
    linearized  linearize                                  (verify_taskgraph "linearized")
    schedule    schedule into W queues
    plan        encode -> KernelPlan                       (verify_plan)

A hook ``hook(stage_name, ir, seconds)`` sees every stage (print, dump, time). Verifiers
run after every stage when ``Options.verify`` is on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .ir import OpGraph
from .options import Options
from .passes import (fold_cache_writes, fold_casts, fold_combine, fold_kv_append, fold_rope, fuse_events, fuse_fp8_quant,
                     fuse_gemv_chains, fuse_index_quant, linearize, normalize, schedule, size_gemv_groups, split_kv)
from .plan import KernelPlan, encode
from .stats import compile_stats
from .taskgraph import build_taskgraph
from .verify import verify_opgraph, verify_plan, verify_taskgraph

Hook = Callable[[str, object, float], None]


@dataclass
class Compiled:
    """Every stage's IR, by name, in pipeline order; ``plan`` and ``stats`` for convenience."""

    stages: dict[str, object] = field(default_factory=dict)
    plan: KernelPlan | None = None
    stats: dict = field(default_factory=dict)


def _fuse_gemv(graph: OpGraph, opts: Options) -> OpGraph:
    """The ``fuse_gemv`` stage: float32 ops' output casts folded into them (so that a norm cast back
    to bf16 can become a GEMV prologue), prologues / epilogues into bf16 GEMVs, then FP8 activation
    quantization into the FP8 GEMMs and the indexer score."""
    return fuse_index_quant(fuse_fp8_quant(fuse_gemv_chains(fold_casts(graph, opts), opts), opts), opts)


def _size_gemvs(graph: OpGraph, opts: Options) -> OpGraph:
    """The ``gemv_groups`` stage: sibling GEMVs sized together, then the queries' RoPE folded into
    the split-KV attention tiles. In this order the q projection keeps the tiles cut for the
    per-head RoPE op it fed (Llama-3.2-1B: q / k / v 64 + 32 + 32 tiles of 32 / 16 columns); sized
    after the fold, q's consumer would be the attention's 4-head tiles, and the sizing gave q 88
    tiles of ~24 columns and v 16 of 32 - v's cache write then ended the phase later than q's RoPE
    had (H200 trace, 2026-12-02, branch s14/fold-rope). Then the keys' RoPE and the step's cache
    writes move into the same tiles (``fold_kv_append``, which needs the queries' fold), and the
    combine into the partials (``fold_combine``)."""
    return fold_combine(fold_kv_append(fold_rope(size_gemv_groups(graph, opts), opts), opts), opts)


def compile_opgraph(graph: OpGraph, opts: Options | None = None, hook: Hook | None = None,
                    opgraph_seconds: float = 0.0) -> Compiled:
    """Runs the pipeline from an OpGraph to a verified KernelPlan.

    ``opgraph_seconds`` (capture + lowering time, measured by the caller) is reported to the
    hook with the ``opgraph`` stage.

    Raises:
        VerificationError: a stage broke an invariant (a compiler bug).
    """
    opts = opts or Options()
    out = Compiled()

    def stage(name: str, fn, *args):
        t0 = time.perf_counter()
        ir = fn(*args)
        dt = time.perf_counter() - t0
        out.stages[name] = ir
        if hook:
            hook(name, ir, dt)
        return ir

    if opts.verify:
        verify_opgraph(graph)
    out.stages["opgraph"] = graph
    if hook:
        hook("opgraph", graph, opgraph_seconds)
    graph = stage("split_kv", split_kv, graph, opts)
    if opts.verify:
        verify_opgraph(graph)
    graph = stage("fuse_gemv", _fuse_gemv, graph, opts)
    if opts.verify:
        verify_opgraph(graph)
    graph = stage("fold_cache", fold_cache_writes, graph, opts)
    if opts.verify:
        verify_opgraph(graph)
    graph = stage("gemv_groups", _size_gemvs, graph, opts)
    if opts.verify:
        verify_opgraph(graph)
    tg = stage("tasks", build_taskgraph, graph, opts)
    if opts.verify:
        verify_taskgraph(tg, "tasks", opts)
    tg = stage("fused", fuse_events, tg, opts.coarsen_forks)
    if opts.verify:
        verify_taskgraph(tg, "fused", opts)
    tg = stage("normalized", normalize, tg)
    if opts.verify:
        verify_taskgraph(tg, "normalized", opts)
    tg = stage("linearized", linearize, tg)
    if opts.verify:
        verify_taskgraph(tg, "linearized", opts)
    sched = stage("schedule", schedule, tg, opts.workers, opts.scheduler)
    plan = stage("plan", encode, tg, sched)
    if opts.verify:
        verify_plan(plan, tg)
    out.plan = plan
    out.stats = plan.stats = compile_stats(graph, tg, sched)
    return out
