"""Public entry points of the offline path."""
from __future__ import annotations

import torch

from .capture import export_graph
from .dump import with_dump
from .frontend import lower_graph
from .options import Options
from .pipeline import Hook, compile_opgraph
from .program import CompiledProgram


def compile_module(module: torch.nn.Module, args: tuple, *, positions=(), max_positions: int = 1,
                   options: Options | dict | None = None, hook: Hook | None = None) -> CompiledProgram:
    """Captures ``module(*args)`` with ``torch.export`` and compiles it to a KernelPlan.

    Args:
        module: the step to compile (e.g. :class:`tilec.hf.StaticCacheStep`).
        args: example arguments; their shapes and dtypes are planned for.
        positions: indices in ``args`` of int64 tensors holding the decode position p.
        max_positions: positions p to plan for (``0 <= p < max_positions``).
        options: :class:`Options` or a dict of option values.
        hook: called as ``hook(stage, ir, seconds)`` after every pipeline stage (after the
            dump hook of :mod:`tilec.dump` when ``options.dump_dir`` or ``$TILEC_DUMP_DIR`` is set).

    Raises:
        UnsupportedNodeError: the graph has ops tilec cannot lower (names node and source line).
        VerificationError: a stage broke an invariant (a tilec bug: please report it).
    """
    opts = options if isinstance(options, Options) else Options.from_dict(options)
    gm, binding = export_graph(module, args, set(positions))
    graph = lower_graph(gm, binding, max_positions)
    compiled = compile_opgraph(graph, opts, with_dump(hook, opts))
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    n_user = sum(1 for r in out_node.args[0] if getattr(r, "name", None) not in binding.mutations)
    return CompiledProgram(compiled, binding, single_output=n_user == 1, opts=opts,
                           example_args=args)
