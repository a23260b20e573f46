"""Size GEMV tiles by sibling group and align them to their consumers' tiles.

A decoder layer's q/k/v projections (and its gate/up projections) read the same normed rows,
so they become ready at the same event and stream their weights side by side. Sized one op
at a time (about N / workers columns each, ``tilec.ops.gemv_tile_n``), Llama-3.2-1B's q
(2048 columns), k and v (512 each) made 128 + 64 + 64 tiles: two instructions on most
workers, each paying the ~2.5 µs an instruction costs before its weights stream (H200
trace, 2026-12-01: q/k/v took 13 µs for 12.6 MB). Sized by the group's total columns
(3072 / 132 workers: about 24 columns) they fill the workers once.

A tile boundary that falls inside a consumer's tile costs a dependent stage, though: the GEMV
tile then feeds two consumer tiles, and normalization (one trigger event per task) relays it
through an empty task. So the columns are cut in *blocks* no consumer tile straddles (the gcd
of N and every column boundary of the tiles that read the output: 64 for q/k/v, whose RoPE
and cache-write tiles take one head of 64 at batch 1; 256 with ``tile_rows=4``), and each block
into ``k`` tiles of near-equal widths, multiples of 8: q/k/v become 64 + 32 + 32 = 128 tiles of
32 / 16 columns (132 of 24 / 16 in 256-column blocks), gate/up 66 + 66 of 120-128 columns. Blocks
that would make more tiles than the workers (and than per-op sizing) are not used: a lone GEMV
is then left as it is, a group sized by its total columns alone.

With ``Options.coarsen_forks`` (the default) a straddle of the one op reading an output costs
no relay - fusion merges the straddled tiles' events instead (``tilec.passes.fusion.coarsen_forks``)
- so the pass ignores that op's cuts: such a group is sized by its total columns alone
(Llama-3.2-1B's q/k/v: 88 + 22 + 22 tiles of 16-24 columns, the split-KV partials then waiting on
all of them), and such a lone GEMV is left as it is. Outputs that several ops read are still cut
in blocks.

The pass sets attr ``col_split = (block, k)`` on each ``linear`` / ``linear_fused`` op it
sizes (``tilec.ops.gemv_col_ranges`` cuts the tiles from it): members of a sibling group (two
or more such ops with equal kind, prologue, residual epilogue (or none: a ``silu`` epilogue reads
nothing more), staged input views and output row shape), and lone GEMVs whose per-op tiles would straddle a consumer's. Only tile boundaries
move: on the GPU each output column is one warp's full-K dot product (1..4 rows staged whole) or one
group of 8 columns' K slices summed over the warps in a fixed order (5..16 rows, tensor cores) whatever the
tile's width, so results are bitwise unchanged for the GEMVs of a decode step (Llama-3.2-1B's
batch-1 logits were, on an H200); the CPU reference executor computes a tile with one matmul whose summation
order may depend on the tile's width (last-bit differences). An explicit ``Options.tile_n``
overrides it; with ``Options.tile_n`` set, ``Options.gemv_groups``
off, or nothing to size, the graph is returned unchanged (the same object).
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from .. import ops as opreg
from ..ir import Op, OpGraph
from ..ops import GEMV_KOUTER_COLS, GEMV_TILE_N_MAX, gemv_col_ranges, kouter_rows, leading_rows
from ..ops.linear_fused import N_PROLOGUE_INPUTS
from ..taskgraph import map_box

GEMV_KINDS = ("linear", "linear_fused")


def _group_key(op: Op):
    """What siblings share: kind, prologue, residual epilogue, the views they stage, the output rows."""
    if op.kind == "linear":
        if len(op.inputs) != 2:  # a bias changes the tile's reads; keep it alone
            return None
        staged = op.inputs[:1]
    else:
        staged = op.inputs[:N_PROLOGUE_INPUTS[op.attr("prologue")]]
    # an "add" epilogue reads a residual (another producer); a "silu" epilogue reads nothing
    epilogue = op.attr("epilogue") if op.attr("epilogue") == "add" else "none"
    return (op.kind, op.attr("prologue"), epilogue, tuple(staged), op.outputs[0].shape[:-1])


def max_cols(graph: OpGraph, op: Op) -> int:
    """The widest tile ``op`` may get: :data:`~tilec.ops.GEMV_KOUTER_COLS` for a plain linear whose
    tiles stream K block outer (:func:`~tilec.ops.kouter_rows`; wider tiles stream nothing, and sized
    as siblings of one x they were 120-256 columns wide), else :data:`~tilec.ops.GEMV_TILE_N_MAX`."""
    if op.kind == "linear" and kouter_rows(graph, op.inputs[0], leading_rows(op.outputs[0].shape),
                                           op.inputs[0].shape[-1]):
        return GEMV_KOUTER_COLS
    return GEMV_TILE_N_MAX


def consumer_cuts(graph: OpGraph, op: Op, opts) -> set[int] | None:
    """The column bounds (0 < c < N) of the tiles of other ops that read ``op``'s output, or
    None when they are unknown (the output is not a whole contiguous buffer, or a reader's box
    maps to the buffer inexactly)."""
    out = op.outputs[0]
    buf = graph.buffers[out.buffer]
    n = out.shape[-1]
    if out.shape != buf.shape or out.offset or out.pos_stride or out.strides[-1] != 1:
        return None
    cuts = set()
    for c in graph.ops:
        if c is op or not any(v.buffer == out.buffer for v in c.inputs):
            continue
        d = opreg.opdef(c.kind)
        operands = d.operands(c)
        for tile in d.tiles(c, opts):
            for idx, box in tile.reads:
                v = operands[idx]
                if v.buffer != out.buffer:
                    continue
                bbox, exact = map_box(v, box, buf)
                if not exact:
                    return None
                cuts.update(b for b in bbox[-1] if 0 < b < n)
    return cuts


def readers(graph: OpGraph, op: Op) -> set[str]:
    """The names of the other ops that read ``op``'s output buffer."""
    buf = op.outputs[0].buffer
    return {c.name for c in graph.ops if c is not op and any(v.buffer == buf for v in c.inputs)}


def straddles(ranges, cuts: set[int]) -> bool:
    """Whether a cut falls strictly inside one of the column ranges."""
    return any(lo < c < hi for lo, hi in ranges for c in cuts)


def size_gemv_groups(graph: OpGraph, opts=None) -> OpGraph:
    """Returns ``graph`` with attr ``col_split = (block, k)`` on the GEMVs it sizes.

    Each sized op's N columns are cut into blocks of ``block`` (the gcd of N and the cuts of
    :func:`consumer_cuts`; N when that is not a multiple of 8), each block into ``k`` tiles: its
    share of ``opts.workers`` by columns, rounded down, then one more per block for the member
    with the widest tiles while the group's tiles still number at most ``opts.workers``. Returns
    ``graph`` itself when ``opts.tile_n`` is set, ``opts.gemv_groups`` is off, or nothing is sized.
    """
    if opts is None or opts.tile_n or not opts.gemv_groups:
        return graph
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, op in enumerate(graph.ops):
        if op.kind in GEMV_KINDS:
            key = _group_key(op)
            groups[key if key is not None else ("alone", i)].append(i)
    splits = {}
    for members in groups.values():
        ops = [graph.ops[i] for i in members]
        # with coarsen_forks a straddled tile of the one op reading an output costs no relay (its
        # events merge instead); readers of several ops would still get one
        cuts = [None if opts.coarsen_forks and len(readers(graph, op)) == 1 else consumer_cuts(graph, op, opts)
                for op in ops]
        per_op = [gemv_col_ranges(op, opts) for op in ops]
        if len(members) == 1 and (cuts[0] is None or not straddles(per_op[0], cuts[0])):
            continue  # a lone GEMV whose per-op tiles straddle no consumer tile: leave it as it is
        blocks = []
        for op, cs in zip(ops, cuts):  # blocks no consumer tile straddles: the gcd of N and the cuts
            n = op.outputs[0].shape[-1]
            block = math.gcd(n, *cs) if cs else n
            blocks.append(block if block % 8 == 0 else n)
        nblocks = [op.outputs[0].shape[-1] // b for op, b in zip(ops, blocks)]
        if sum(nblocks) > max(opts.workers, sum(len(r) for r in per_op)):
            # blocks this fine (an elementwise consumer's 1024-column tiles cut an LM head into
            # gcd(N, 1024)-column blocks) would cost more instructions than a straddle's relay
            if len(members) == 1:
                continue
            blocks, nblocks = [op.outputs[0].shape[-1] for op in ops], [1] * len(ops)
        total = sum(op.outputs[0].shape[-1] for op in ops)
        # each block's share of the workers, rounded down; then one more tile per block for the
        # member with the widest tiles while the group still fits the workers (tiles stay at most
        # max_cols wide)
        ks = [max(1, -(-b // max_cols(graph, op)), min(b // 8, opts.workers * b // total)) for op, b in zip(ops, blocks)]
        while True:
            grow = [j for j in range(len(ks)) if ks[j] < blocks[j] // 8
                    and sum(nb * k for nb, k in zip(nblocks, ks)) + nblocks[j] <= opts.workers]
            if not grow:
                break
            j = max(grow, key=lambda j: blocks[j] / ks[j])
            ks[j] += 1
        splits.update({i: (b, k) for i, b, k in zip(members, blocks, ks)})
    if not splits:
        return graph
    out = list(graph.ops)
    for i, split in splits.items():
        attrs = dict(out[i].attrs)
        attrs["col_split"] = split
        out[i] = dataclasses.replace(out[i], attrs=tuple(sorted(attrs.items())))
    return dataclasses.replace(graph, ops=tuple(out))
