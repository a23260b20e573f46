"""Fold the split-KV combine into the partials: the last partial tile of a head group combines it.

``split_kv`` leaves every decode attention as

    P = attention_partial(q, K, V, ...) -> o_part, ml
    C = attention_combine(o_part, ml) -> out

and the output projection waits for C's tiles, which wait for P's: a dependent stage (a hop and a
~2.7 us tile on an H200, trace of 2026-12-02) for a few KiB. The combine of a (batch, KV head)
group needs only that group's partials, so the group's last partial tile to finish can run it
itself - the "last block" reduction of the CUDA samples' threadFenceReduction and of serial split-K
(each tile adds one to a counter with acquire-release semantics after storing its partials; the
one that brings it to the step's count sees every other tile's partials and combines them):

    P = attention_partial(q, K, V, ...; combine) -> o_part, ml, out

keeping P's name and provenance; C is dropped (its buffers stay: P writes and reads them). Which
tile combines depends on the order in which they finish, so every tile declares the group's out
rows as :data:`~tilec.ops.DYNAMIC` writes (its consumers wait for all of the op's tiles). The
counters are the plan's arrival counters (``tilec.plan``), monotonic like the events, so a step
needs no reset. The rewrite applies when

(a) C reads exactly P's o_part and ml (whole views), C comes after P, and no other op reads or
    writes those buffers; P has no ``combine`` yet;
(b) C's out has P's queries' dtype and o_part / ml are float32 (the device instance reads out as
    the queries' type, the partials as ``split_kv`` makes them), C's ``kv_heads`` is P's;
(c) no op between P and C touches out's buffer (the combine now runs at P's place), and P
    itself neither reads nor writes it (a group's combine would run while other groups' tiles
    still read their inputs: the task graph orders no op's tiles over their own dynamic writes).

Results are bitwise those of the unfolded plan: the same ``attention_combine`` arithmetic
(``combine_rows`` in runtime/tilec/ops_attention.cuh; ``_combine_rows`` on the CPU) over the same
partials. A graph with nothing to fold (or ``opts.fold_combine`` off) is returned unchanged (the
same object).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..ir import Op, OpGraph, View
from ._fold import dtype_of, rebuilt, touching


def _whole(v: View, graph: OpGraph) -> bool:
    buf = graph.buffers[v.buffer]
    return v == View.whole(buf)


def fold_combine(graph: OpGraph, opts=None) -> OpGraph:
    """Folds each ``attention_partial -> attention_combine`` pair of ``graph`` into the partial.

    Returns:
        A new OpGraph in which each qualifying partial also writes the combine's out (attr
        ``combine``) and the combine op is gone; or ``graph`` itself when nothing folds or
        ``opts.fold_combine`` is off.

    Raises:
        Nothing of its own: a pair that does not qualify (module docstring, (a)-(c)) is kept.
    """
    if opts is not None and not getattr(opts, "fold_combine", True):
        return graph
    ops: list[Op | None] = list(graph.ops)
    dtype = functools.partial(dtype_of, graph)
    for i, part in enumerate(ops):
        if part is None or part.kind != "attention_partial" or part.attr("combine"):
            continue
        o_part, ml = part.outputs[:2]
        readers = touching(ops, o_part.buffer, "inputs")
        if len(readers) != 1 or touching(ops, ml.buffer, "inputs") != readers or readers[0] <= i:
            continue
        j = readers[0]
        comb = ops[j]
        if comb.kind != "attention_combine" or comb.inputs != (o_part, ml) or len(comb.outputs) != 1:
            continue
        if touching(ops, o_part.buffer, "outputs") != [i] or touching(ops, ml.buffer, "outputs") != [i]:
            continue
        if not (_whole(o_part, graph) and _whole(ml, graph)):
            continue
        (out,) = comb.outputs
        q, k = part.inputs[:2]
        if dtype(out) != dtype(q) or dtype(o_part) != torch.float32 or dtype(ml) != torch.float32:
            continue
        if comb.attr("kv_heads") != k.shape[1]:
            continue
        if any(ops[m] is not None and any(v.buffer == out.buffer for v in ops[m].inputs + ops[m].outputs)
               for m in range(i, j)):
            continue
        attrs = tuple(sorted(part.attrs + (("combine", True),)))
        ops[i] = dataclasses.replace(part, outputs=(*part.outputs, out), attrs=attrs)
        ops[j] = None
    return rebuilt(graph, ops, set())
