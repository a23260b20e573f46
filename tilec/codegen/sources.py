"""Rendering of the generated sources (see the package docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch

from .. import __version__
from .. import ops as opreg
from ..errors import TilecError
from ..ir import ScalarOperand
from ..plan import (DESCRIPTOR, DESCRIPTOR_WORDS, MAX_DIMS, MAX_OPERANDS, OPERAND, OPERAND_FIELDS, SCALAR_OPERAND,
                    UNUSED_OPERAND, KernelPlan, variant_signature)

ABI_VERSION = 5  # 5: the counters array holds the arrival counters after the events (tilec.plan)
C_TYPES = {
    torch.float32: "float",
    torch.bfloat16: "__nv_bfloat16",
    torch.float16: "__half",
    torch.int64: "long long",
    torch.int32: "int",
    torch.bool: "bool",
    torch.float8_e4m3fn: "__nv_fp8_e4m3",  # <cuda_fp8.h>
}
_TEMPLATES = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_TEMPLATES),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass(frozen=True)
class Variant:
    """One device instantiation: ``tilec::{function}<{types}>`` (template arguments: dtypes, then a
    shape class for shape-classed ops) for ops of ``kind`` with dispatch signature ``sig``."""

    kind: str
    sig: int
    function: str
    types: tuple[str, ...]


def _ctype(dtype: torch.dtype, op_name: str) -> str:
    if dtype not in C_TYPES:
        raise TilecError(f"op {op_name}: dtype {dtype} has no CUDA implementation yet")
    return C_TYPES[dtype]


def variants(plan: KernelPlan) -> list[Variant]:
    """The (op kind, dispatch signature) variants used by ``plan``, in a stable order (the
    signature is the operands' dtypes and the op's shape class: ``tilec.plan.variant_signature``)."""
    g = plan.graph
    seen: dict[tuple[str, int], Variant] = {}
    for op in g.ops:
        operands = opreg.opdef(op.kind).operands(op)
        tensors = [v for v in operands if not isinstance(v, ScalarOperand)]
        dtypes = [g.buffers[v.buffer].dtype for v in tensors]
        if op.kind == "concat":
            if len(set(dtypes[:-1])) != 1:
                raise TilecError(f"op {op.name}: concat inputs of mixed dtypes {dtypes[:-1]}")
            dtypes = [dtypes[0], dtypes[-1]]
        od = opreg.opdef(op.kind)
        dtypes = od.device_dtypes(op, dtypes)
        if op.kind in ("unary", "binary") and not dtypes[-1].is_floating_point:  # (runtime/tilec/common.cuh from_f)
            what = str(dtypes[-1]).removeprefix("torch.")
            raise TilecError(f"op {op.name}: an elementwise op whose result is {what} has no CUDA implementation "
                             f"yet (the reference executor runs it; nvcc failed on it)")
        key = (op.kind, variant_signature(g, op))
        args = tuple(_ctype(d, op.name) for d in dtypes) + ((str(od.shape_class(op)),) if od.shape_classed else ())
        if key not in seen:
            seen[key] = Variant(op.kind, key[1], f"op_{op.kind}", args)
        elif seen[key].types != args:  # two instances behind one dispatch signature: a tilec bug
            raise TilecError(f"op {op.name}: dispatch signature {key[1]} of {op.kind} already selects "
                             f"<{', '.join(seen[key].types)}>, not <{', '.join(args)}>")
    return sorted(seen.values(), key=lambda v: (opreg.opdef(v.kind).opcode, v.sig))


def _render(name: str, **ctx) -> str:
    try:
        return _ENV.get_template(name).render(**ctx)
    except jinja2.TemplateNotFound as e:
        raise TilecError(f"codegen template {name} is missing from tilec's installation ({_TEMPLATES}): "
                         f"reinstall tilec") from e
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise TilecError(f"codegen template {name}{where}: {e}; context keys: {sorted(ctx)}") from e


def render(plan: KernelPlan) -> dict[str, str]:
    """Sources for ``plan``: ``{"tilec_layout.h": ..., "program.cu": ...}``."""
    layout = _render(
        "layout.h.j2",
        version=__version__,
        descriptor_words=DESCRIPTOR_WORDS,
        descriptor=DESCRIPTOR,
        max_operands=MAX_OPERANDS,
        max_dims=MAX_DIMS,
        operand_fields=OPERAND_FIELDS,
        operand=OPERAND,
        unused_operand=UNUSED_OPERAND,
        gemv_ring_rows=opreg.GEMV_RING_ROWS,
        scalar_operand=SCALAR_OPERAND,
        noop=opreg.NOOP,
        empty=opreg.EMPTY,
        opcodes=sorted((d.kind, d.opcode) for d in opreg.REGISTRY.values()),
    )
    program = _render("program.cu.j2", version=__version__, variants=variants(plan), abi_version=ABI_VERSION)
    return {"tilec_layout.h": layout, "program.cu": program}


def render_tables(plan: KernelPlan) -> str:
    """``tables.h``: the plan's instruction queues, event table and operand-table template as
    C++ constant arrays (readable, and buildable on their own with ``tilec_layout.h``)."""
    return _render("tables.h.j2", version=__version__, workers=plan.queues.shape[0], length=plan.queues.shape[1],
                   queues=plan.queues.tolist(), events=plan.events.tolist(), arrivals=plan.arrivals,
                   rows=len(plan.operands),
                   operands=plan.static_operands.tolist(), op_names=plan.op_names)
