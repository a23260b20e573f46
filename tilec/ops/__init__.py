"""The op registry: one module per op kind.

Each module defines one :class:`OpDef` subclass and registers it with :func:`register`.
An OpDef holds, for its op kind:

* ``operands(op)`` - the operand list in operand-table order: the op's input views,
  output views, then per-call scalars (:class:`tilec.ir.ScalarOperand`);
* ``tiles(op, opts)`` - the tiling rule: the tasks of the op, each a :class:`Tile`
  with the boxes (in operand-view coordinates) it reads and writes;
* ``params(op)`` - up to 9 (``tilec.plan.MAX_PARAMS``) static int32 parameters encoded in
  each descriptor (floats as float32 bits: :func:`f32_bits`);
* ``run_tile(t)`` - the CPU reference of one tile, working only from decoded
  descriptor fields and operand tensors built from the operand table;
* ``cost(op, tile)`` - bytes moved and flops of one tile (for the cost model).

Adding an op touches its own module (and, for the GPU, its device template).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from ..ir import Op, ScalarOperand, View

Box = tuple[tuple[int, int], ...]
WRITE, ACCUMULATE = "write", "accumulate"
# A write whose writer among the op's tiles is chosen at run time: by the decode position (the
# step's new KV-cache rows, appended by the split-KV attention tile whose positions hold them;
# tilec.passes.fold_kv_append), or by the order in which the tiles finish (the split-KV
# combine, run by the last partial tile of a head group to finish; tilec.passes.fold_combine).
# Every tile of the op declares the whole region it may write and each element is written once a
# step: the op's tiles do not conflict with one another over it (tilec.taskgraph), only with other
# ops, which see every tile of the op as its writer.
DYNAMIC = "dynamic"


@dataclass(frozen=True)
class Tile:
    """One task of an op.

    ``coords`` are up to 4 half-open ranges in the op's iteration space (encoded in the
    descriptor); ``reads``/``writes`` are ``(operand index, box)`` and
    ``(operand index, box, access)`` with ``access`` in ``{"write", "accumulate", "dynamic"}``
    (:data:`DYNAMIC`).
    ``variant`` distinguishes tile flavours of one op (e.g. split-K init vs partial).
    """

    coords: tuple[tuple[int, int], ...]
    reads: tuple[tuple[int, Box], ...]
    writes: tuple[tuple[int, Box, str], ...]
    variant: int = 0


@dataclass
class TileArgs:
    """What the CPU reference of one tile sees: decoded descriptor fields and operands."""

    coords: tuple[tuple[int, int], ...]
    params: tuple[int, ...]
    variant: int
    operands: list  # torch.Tensor views (in the operand's view shape) or int scalars
    # arrive(counter, count) -> bool: adds 1 to arrival counter ``counter`` (an index the plan
    # gave the tile, :attr:`OpDef.arrival_param`) and says whether this tile was the step's last
    # of ``count`` arrivals - the device's ``atom.add.acq_rel.gpu`` (None: the op has no counters)
    arrive: Callable[[int, int], bool] | None = None


class OpDef:
    """The rules of one op kind (see the module docstring), registered as a singleton with
    :func:`register`. ``kind`` names it in the IR and the registry, ``opcode`` is descriptor
    word 0 and selects the device template ``tilec::op_<kind>`` (0 and 1 are reserved: NoOp
    padding and normalization's empty tasks).

    A subclass implements :meth:`tiles` and :meth:`run_tile`; the defaults: operands = the op's
    inputs then outputs, no params, cost = bytes of every box read and written (element sizes
    from :func:`set_element_sizes`) and 0 flops, and no prefetch, weight streaming, staged x,
    arrival counters, shape class or shared-memory request.
    """

    kind: str = ""
    opcode: int = -1

    def operands(self, op: Op) -> list[View | ScalarOperand]:
        return [*op.inputs, *op.outputs]

    def tiles(self, op: Op, opts) -> list[Tile]:
        raise NotImplementedError

    def params(self, op: Op) -> list[int]:
        return []

    def run_tile(self, t: TileArgs) -> None:
        raise NotImplementedError

    def prefetch(self, op: Op, tile: Tile, graph) -> tuple[int, int, int] | None:
        """What the executor may start pulling into L2 before the tile's wait: ``(operand index,
        byte offset from the operand's address, bytes)`` of data that no tile writes (weights),
        or None. The CUDA executor issues one bulk L2 prefetch (``cp.async.bulk.prefetch``)
        while the tile waits for its producers, so weight streaming overlaps the wait."""
        return None

    staged_x_param: int | None = None  # the param index the plan sets to 1 when x is already staged

    def staged_x(self, op: Op, tile: Tile) -> tuple | None:
        """What a streamed tile stages in shared memory before it consumes its weights (its x rows
        with the prologue applied), as a hashable key, or None. When a worker's instruction follows
        one of the same key, the plan sets param :attr:`staged_x_param` and the device reuses the
        rows the previous instruction left in shared memory instead of staging them again (Q / K /
        V tiles of one layer on one worker, gate then up)."""
        return None

    def stream(self, op: Op, tile: Tile, graph, scratch: int) -> int:
        """The descriptor's ``stream`` word for a tile whose device code consumes its weights
        from the worker's shared-memory ring (``runtime/tilec/stream.cuh``), or 0. ``scratch``:
        the bytes of shared memory left to the tile beside the ring (``tilec.smem``)."""
        return 0

    arrival_param: int | None = None  # the param index the plan sets to the op's first arrival counter

    def arrivals(self, op: Op) -> int:
        """How many arrival counters the op's tiles count on (device ``atom.add``; the plan places them
        after the events and puts the first one's index into param :attr:`arrival_param`)."""
        return 0

    def arrival(self, op: Op, tile: Tile) -> tuple[int, int] | None:
        """``(counter, count)``: which of the op's arrival counters (0 .. arrivals - 1) ``tile`` adds
        to, and how many tiles arrive there a step - what the device and the CPU reference compute
        from the descriptor (``tilec.verify.verify_plan`` checks them against each other); None for
        a tile that counts no arrival."""
        return None

    def device_dtypes(self, op: Op, dtypes: list) -> list:
        """The dtypes (one per tensor operand, in operand order) that select the op's device
        template ``tilec::op_<kind><types...>``; ops with roles decided at run time narrow them."""
        return dtypes

    def shape_class(self, op: Op) -> int:
        """A small number (0..127) naming a shape property the device template is specialized on,
        passed as its last template argument (``tilec::op_<kind><types..., code>``) and part of
        the variant's dispatch signature; 0 for ops without one (and then no extra argument is
        passed unless :attr:`shape_classed`)."""
        return 0

    shape_classed = False  # the device template takes shape_class(op) as its last argument

    def smem_bytes(self, op: Op) -> int:
        """Dynamic shared memory (bytes) the device tiles of ``op`` can use; the CUDA executor
        sizes every CTA's for the largest over the plan (``tilec.cuda``). 0: no preference."""
        return 0

    def cost(self, op: Op, tile: Tile) -> tuple[int, int]:
        """(bytes, flops) of one tile: bytes of every box read and written."""
        ops = self.operands(op)
        nbytes = 0
        for idx, box in tile.reads:
            nbytes += box_numel(box) * _elem(ops[idx])
        for idx, box, _ in tile.writes:
            nbytes += box_numel(box) * _elem(ops[idx])
        return nbytes, 0


_ELEM_SIZES: dict[str, int] = {}


def _elem(v) -> int:
    return 4 if isinstance(v, ScalarOperand) else _ELEM_SIZES.get(v.buffer, 4)


def set_element_sizes(sizes: dict[str, int]) -> None:
    """Element sizes (bytes) by buffer name, used by ``OpDef.cost``; set by the task builder."""
    _ELEM_SIZES.clear()
    _ELEM_SIZES.update(sizes)


REGISTRY: dict[str, OpDef] = {}
BY_OPCODE: dict[int, OpDef] = {}
NOOP, EMPTY = 0, 1  # reserved opcodes: queue padding, and normalization's empty tasks


def register(cls):
    """Class decorator: registers one instance of the :class:`OpDef` subclass ``cls`` in
    :data:`REGISTRY` (by kind) and :data:`BY_OPCODE` (by opcode), and returns ``cls``.

    Raises:
        ValueError: the kind or opcode is already registered, or the opcode is reserved
            (:data:`NOOP` 0, :data:`EMPTY` 1).
    """
    inst = cls()
    if inst.kind in REGISTRY or inst.opcode in BY_OPCODE or inst.opcode in (NOOP, EMPTY):
        raise ValueError(f"duplicate op registration {inst.kind}/{inst.opcode}")
    REGISTRY[inst.kind] = inst
    BY_OPCODE[inst.opcode] = inst
    return cls


def opdef(kind: str) -> OpDef:
    """The registered :class:`OpDef` of op kind ``kind``.

    Raises:
        KeyError: an unregistered kind (``tilec.verify.verify_opgraph`` reports one as a
            VerificationError naming the op).
    """
    return REGISTRY[kind]


# ---- helpers shared by op modules -------------------------------------------------------

def f32_bits(x: float) -> int:
    """``x`` rounded to float32 (IEEE round to nearest: past float32's range, +-inf, as eager's float32
    arithmetic takes a Python scalar such as 1e39), as the int32 with the same bits (descriptor params
    are int32)."""
    try:
        return struct.unpack("<i", struct.pack("<f", float(x)))[0]
    except OverflowError:  # finite but past float32's largest value after rounding
        return struct.unpack("<i", struct.pack("<f", math.copysign(math.inf, x)))[0]


def bits_f32(i: int) -> float:
    """Inverse of :func:`f32_bits`: the float32 whose bits are the int32 ``i``, as a Python float."""
    return struct.unpack("<f", struct.pack("<i", int(i)))[0]


def full_box(shape: Sequence[int]) -> Box:
    """The box covering all of ``shape``: ``((0, shape[0]), (0, shape[1]), ...)``."""
    return tuple((0, s) for s in shape)


def box_numel(box: Box) -> int:
    """Elements of ``box``: the product of its ranges' lengths ``hi - lo`` (1 for the empty box ``()``)."""
    return math.prod(hi - lo for lo, hi in box)


def chunks(n: int, size: int) -> Iterable[tuple[int, int]]:
    """Half-open ranges ``(lo, hi)`` cutting ``[0, n)`` into consecutive pieces of ``size`` (the
    last one may be shorter); ``size`` is clamped to ``[1, n]``. Nothing for ``n = 0``."""
    size = max(1, min(size, n)) if n else 1
    for lo in range(0, n, size):
        yield lo, min(n, lo + size)


def weight_rows_prefetch(graph, w: View, operand: int, n0: int, n1: int, k0: int, k1: int):
    """The prefetch range of rows [n0, n1) x columns [k0, k1) of a weight view W [N, K] (see
    :meth:`OpDef.prefetch`): one contiguous byte range, or None when W is written by the
    program or the range would be mostly gaps."""
    buf = graph.buffers[w.buffer]
    if not graph.read_only(w.buffer) or w.strides[1] != 1:
        return None
    if n1 - n0 > 1 and w.strides[0] != k1 - k0:
        return None
    esize = buf.dtype.itemsize
    first, last = n0 * w.strides[0] + k0, (n1 - 1) * w.strides[0] + k1
    if (w.offset + first) * esize % 16:  # bulk copies need 16-byte aligned addresses
        return None
    return operand, first * esize, (last - first) * esize


# x rows at most of a CUDA-core ring-fed GEMV tile; 5..16 rows go to the tensor-core consumer
# (emitted into tilec_layout.h as TILEC_GEMV_RING_ROWS for runtime/tilec/ops.cuh linear_impl).
# 2..4 rows on the tensor-core consumer instead (1 here) were slower: Llama-3.2-1B batch 4 2.689
# against 2.097 ms a step (H200, forty-fourth session, one process, 5 rounds).
GEMV_RING_ROWS = 4
GEMV_RING_MMA_ROWS = 16  # x rows of a tensor-core ring-fed tile (ops.cuh gemv_bf16_ring_mma)
GEMV_RING_MMA_K = 4096  # its K range at most with x staged whole (longer: K blocks outer, below)
GEMV_KOUTER_COLS = 32  # output columns at most of a K-outer tile (ops.cuh gemv_bf16_ring_kouter: 4 groups of 8)
STREAM_K = 2048  # runtime/tilec/stream.cuh kStreamK: K elements per stage row
STREAM_KOUTER = 1 << 12  # stream word flag: items K block outer, column group inner
STREAM_BYTE = 1 << 13  # stream word flag: 1-byte (FP8) weight elements, 2 STREAM_K of them per stage row
STREAM_PAIRED = 1 << 14  # stream word flag: two column groups per item (K ranges of at most STREAM_K bytes)


def kouter_bytes(rows: int) -> int:
    """Shared memory (bytes) a K-outer ring-fed tile of ``rows`` x rows needs: row offsets and
    factors (2304), one K block of bf16 x rows at a padded pitch, the cross-warp sums (4096) and
    the device's margin (ops.cuh gemv_bf16_ring_kouter)."""
    return 2304 + 2 * rows * (STREAM_K + 32) + 4096 + 256


def mma_ring_rows(graph, x: View, rows: int) -> bool:
    """Whether a GEMV tile of ``rows`` rows of x goes to a tensor-core ring consumer (bf16 rows, more than
    :data:`GEMV_RING_ROWS` and at most :data:`GEMV_RING_MMA_ROWS`);
    over a K range longer than :data:`GEMV_RING_MMA_K` it streams K block outer."""
    return GEMV_RING_ROWS < rows <= GEMV_RING_MMA_ROWS and graph.buffers[x.buffer].dtype == torch.bfloat16


GEMV_STAGE_MAX = 96 * 1024  # bytes of float x rows a plain linear's tile stages whole at most (tilec.smem)


def kouter_rows(graph, x: View, rows: int, k: int, scratch: int | None = None) -> bool:
    """Whether a GEMV tile of ``rows`` bf16 rows of x over a K range of ``k`` streams K block outer
    (tensor cores, :func:`kouter_bytes` of shared memory): tensor-core rows over a K range longer
    than :data:`GEMV_RING_MMA_K`, and 2..:data:`GEMV_RING_ROWS` rows whose float rows do not fit
    ``scratch`` bytes (without ``scratch``: :data:`GEMV_STAGE_MAX`, the room a plan reserves).
    Before, such a tile (a Llama-3.1-8B batch-4 down projection, 4 x 14336, too wide to fuse;
    also a split-K slice of one) streamed nothing: the device read its weights on the unstreamed
    path, which ran 8 independent 4 x 14336 GEMVs at ~0.05 TB/s on an H200."""
    from .linear_fused import staged_bytes

    if graph.buffers[x.buffer].dtype != torch.bfloat16:
        return False
    if mma_ring_rows(graph, x, rows):
        return k > GEMV_RING_MMA_K
    return 1 < rows <= GEMV_RING_ROWS and staged_bytes(rows, k) > (GEMV_STAGE_MAX if scratch is None else scratch)


def gemv_stream_word(graph, x: View, w: View, operand: int, tile: Tile, scratch: int, prologue: bool = False) -> int:
    """The ``stream`` word (see :meth:`OpDef.stream`) of a GEMV tile whose coords are the out
    box, then the K range: ``operand + 1 | n-range index << 4 | k-range index << 8``
    (``| STREAM_KOUTER``: K blocks outer), or 0 unless the device can feed it from the weight ring -
    bf16 weights no op writes (:meth:`tilec.ir.OpGraph.read_only`: the loader reads them without waiting on
    events), unit K stride, K
    range a multiple of 8, and x rows that fit in ``scratch`` bytes:

    * at most :data:`GEMV_RING_ROWS` rows, staged whole (CUDA cores);
    * up to :data:`GEMV_RING_MMA_ROWS` bf16 rows over a K range of 32 to :data:`GEMV_RING_MMA_K`,
      staged whole, with room for the cross-warp sums (tensor cores);
    * up to :data:`GEMV_RING_MMA_ROWS` bf16 rows over a longer K range (2..:data:`GEMV_RING_ROWS`
      rows: a K range whose float rows exceed 96 KiB and ``scratch``; :func:`kouter_rows`), at most
      :data:`GEMV_KOUTER_COLS` columns and no prologue (``prologue``: the op applies one): one K
      block of x staged at a time, the stream ordered K block outer (tensor cores).

    The device also checks 16-byte alignment of the rows, loader and compute warps alike."""
    from .linear_fused import ring_staged_bytes, staged_bytes

    buf = graph.buffers[w.buffer]
    if not graph.read_only(w.buffer) or buf.dtype != torch.bfloat16 or w.strides[1] != 1:
        return 0
    rows = 1
    for lo, hi in tile.coords[:-2]:
        rows *= hi - lo
    (n0, n1), (k0, k1) = tile.coords[-2], tile.coords[-1]
    if (k1 - k0) % 8 or n1 <= n0:
        return 0
    nd = len(tile.coords) - 1
    word = (operand + 1) | ((nd - 1) << 4) | (nd << 8)
    mma_rows = mma_ring_rows(graph, x, rows)
    if kouter_rows(graph, x, rows, k1 - k0, scratch):
        fits = n1 - n0 <= GEMV_KOUTER_COLS and not prologue and kouter_bytes(rows) <= scratch
        return word | STREAM_KOUTER if fits else 0
    if staged_bytes(rows, k1 - k0) > scratch:
        return 0
    if rows > GEMV_RING_ROWS:
        mma = mma_rows and 32 <= k1 - k0 and ring_staged_bytes(rows, k1 - k0) <= scratch
        if not mma:
            return 0
    return word


GEMV_TILE_N_MAX = 1024  # columns of a linear / linear_fused tile (no device path sizes memory by them)


def gemv_tile_n(n: int, opts, max_cols: int = 128) -> int:
    """Output columns per GEMV/GEMM tile for an op with ``n`` output columns.

    ``opts.tile_n`` when set; otherwise (auto) the op's columns are spread over all
    ``opts.workers`` so a lone GEMV keeps every SM streaming: about ``n / workers``
    columns per tile, at most ``max_cols`` (ops whose device code sizes shared memory by the
    tile keep the default 128; linear and linear_fused take :data:`GEMV_TILE_N_MAX`), a multiple of 8
    (16-byte aligned bf16 weight rows stay whole per warp).

    One tile per worker where it fits: a Llama-3.2-1B LM head (128256 columns) as 1002 tiles of
    128 columns left 78 of 132 workers one tile (~20 µs) more than the rest, and restaged x
    per tile (H200 trace, 2026-12-01).
    """
    if opts.tile_n:
        return opts.tile_n
    per = -(-n // opts.workers)
    rounds = -(-per // max_cols)
    per = -(-n // (opts.workers * rounds))
    return max(8, -(-per // 8) * 8)


def gemv_col_ranges(op, opts) -> list[tuple[int, int]]:
    """Output-column ranges ``[n0, n1)`` of a linear / linear_fused op's tiles.

    With attr ``col_split = (block, k)`` (set by ``tilec.passes.gemv_groups``): the N columns
    in blocks of ``block``, each cut into ``k`` tiles whose widths are multiples of 8 and differ
    by at most 8 (the last one also takes ``block % 8``). Otherwise (or with ``opts.tile_n``
    set) chunks of :func:`gemv_tile_n` columns.
    """
    n = op.outputs[0].shape[-1]
    split = op.attr("col_split")
    if split is None or opts.tile_n:
        return list(chunks(n, gemv_tile_n(n, opts, GEMV_TILE_N_MAX)))
    block, k = split
    units, rem = divmod(block, 8)
    k = max(1, min(k, units))
    q, r = divmod(units, k)
    widths = [8 * (q + 1)] * r + [8 * q] * (k - r)
    widths[-1] += rem  # a block that is not a multiple of 8 (a whole N) ends in a wider tile
    ranges = []
    for lo in range(0, n, block):
        for w in widths:
            ranges.append((lo, lo + w))
            lo += w
    return ranges


def out_tiles(shape: Sequence[int], tile_rows: int, tile_cols: int | None = None,
              col_ranges: list[tuple[int, int]] | None = None) -> list[Box]:
    """Exact boxes tiling ``shape``: rows are split along the first leading dim of size > 1
    (about ``tile_rows`` rows per tile, inner leading dims whole), the last dim in chunks
    of ``tile_cols`` (whole when None) or in the given ``col_ranges``. Used as output boxes and
    descriptor coordinates.
    """
    if not shape:
        return [()]
    lead, cols = list(shape[:-1]), shape[-1]
    col_ranges = col_ranges or list(chunks(cols, tile_cols or cols))
    split = next((i for i, s in enumerate(lead) if s > 1), None)
    if split is None:
        lead_boxes = [tuple((0, s) for s in lead)]
    else:
        inner = math.prod(lead[split + 1:])
        per = max(1, tile_rows // max(inner, 1))
        lead_boxes = [
            tuple((0, s) for s in lead[:split]) + ((a, b),) + tuple((0, s) for s in lead[split + 1:])
            for a, b in chunks(lead[split], per)
        ]
    return [lb + (cr,) for lb in lead_boxes for cr in col_ranges]


def sub(t: torch.Tensor, box: Box) -> torch.Tensor:
    """``t[box]`` for a box over t's dims (a view, so writes land in ``t``)."""
    return t[tuple(slice(lo, hi) for lo, hi in box)]


def bcast_box(view_shape: Sequence[int], out_box: Box) -> Box:
    """The box an input of shape ``view_shape`` (broadcast to the output, right-aligned) reads."""
    k = len(out_box) - len(view_shape)
    return tuple((0, 1) if s == 1 else (lo, hi) for s, (lo, hi) in zip(view_shape, out_box[k:]))


def leading_rows(shape: Sequence[int]) -> int:
    """The product of ``shape``'s leading dims: the rows a row-wise or GEMM op's last dim runs over."""
    return math.prod(shape[:-1])


def box_rows(box: Box) -> int:
    """Rows of a box's leading ranges (every range but the last)."""
    return math.prod(hi - lo for lo, hi in box[:-1])


# the row bounds GEMV device instances are specialized for: ops.cuh's CUDA-core row-register
# instances (<1>, <4>; <8> for 5..8 rows without the ring), and the tensor-core consumer's 16 rows
# (ring-fed tiles of more than GEMV_RING_ROWS rows: the cap-8 instance carries it too)
ROW_CAPS = (1, 4, 8, GEMV_RING_MMA_ROWS)


def row_cap(op: Op) -> int:
    """The smallest of :data:`ROW_CAPS` holding ``op``'s rows (the product of its output's leading
    dims), or 0 when none does: the ``kRowCap`` template argument of ``op_linear`` /
    ``op_linear_fused`` (``runtime/tilec/ops.cuh`` linear_impl), which drops the code paths of
    wider tiles from the instance."""
    rows = leading_rows(op.outputs[0].shape)
    return next((c for c in ROW_CAPS if rows <= c), 0)


from . import (  # noqa: E402,F401  (registration side effects)
    attention,
    attention_split,
    bmm,
    cache_write,
    concat,
    copy,
    embedding,
    ewise,
    fp8_linear,
    fp8_quant,
    index_score,
    layernorm,
    linear,
    linear_fused,
    paged_cache_write,
    rmsnorm,
    rope,
    silu_mul,
    softmax,
)
