"""Graph capture for the offline path: ``torch.export`` -> functional aten graph + binding."""
from __future__ import annotations

import warnings

import torch

from .frontend import GraphBinding


def export_graph(module: torch.nn.Module, args: tuple, positions: set[int] = frozenset()):
    """Exports ``module(*args)`` and classifies the placeholders.

    Args:
        module: the module to capture; its parameters are bound by reference (not copied).
        args: example positional arguments (real tensors; the shapes are planned for).
        positions: indices in ``args`` of int64 tensors holding the decode position.

    Returns:
        ``(graph_module, GraphBinding)`` of the functionalized aten graph
        (``ExportedProgram.run_decompositions({})``: SDPA and linear stay whole).
    """
    from torch.export.graph_signature import InputKind, OutputKind

    with torch.no_grad(), warnings.catch_warnings():
        # torch's own pytree deprecation notice (LeafSpec), raised inside export: not the user's
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        ep = torch.export.export(module, tuple(args), strict=False)
        ep = ep.run_decompositions({})
    sig = ep.graph_signature
    state = dict(module.state_dict(keep_vars=True))
    state.update(dict(module.named_buffers(remove_duplicate=False)))
    binding = GraphBinding()
    user_idx = 0
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            binding.params[name] = state.get(spec.target, ep.state_dict.get(spec.target)).detach()
        elif spec.kind == InputKind.BUFFER:
            t = state.get(spec.target, ep.state_dict.get(spec.target) if spec.target in ep.state_dict
                          else ep.constants.get(spec.target))
            binding.consts[name] = t.detach()
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            binding.consts[name] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            binding.user_inputs.append(name)
            if user_idx in positions:
                binding.positions.add(name)
            user_idx += 1
    out_names = [n.name for n in next(n for n in ep.graph.nodes if n.op == "output").args[0]]
    for spec, node_name in zip(sig.output_specs, out_names):
        if spec.kind in (OutputKind.USER_INPUT_MUTATION, OutputKind.BUFFER_MUTATION):
            target = spec.target
            placeholder = next((s.arg.name for s in sig.input_specs
                                if s.target == target or s.arg.name == target), target)
            binding.mutations[node_name] = placeholder
    return ep.graph_module, binding
