"""FX (aten) graph helpers shared by the lowerings (:mod:`tilec.frontend`, :mod:`tilec.frontend_forms`
and :mod:`tilec.frontend_dsa`): the aten op families they recognize, a node's value and source
line, and the folded / position-tabulated value kinds."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from .errors import with_article

aten = torch.ops.aten

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def source_of(node: fx.Node) -> str:
    """The innermost user source line recorded in ``node.meta["stack_trace"]``.

    Frames inside torch itself (``nn.Module`` library code such as ``nn.GroupNorm.forward``)
    are skipped when a frame outside torch exists: the user's line is the one calling them. When
    only torch's frames were recorded (a compiled ``nn.Linear`` or ``nn.Sequential`` of torch's
    modules: no line of the user's ran it), the innermost one is given with the module that ran
    it (``node.meta["nn_module_stack"]``): ``... linear.py", line 134, in forward: ... (in 0, a
    Linear)``, or ``(in the compiled module, a Linear)``. A line of the user's is left alone: the
    backend groups the nodes it runs eagerly by it, one line for every layer of a model.
    """
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    frames = []
    for i, ln in enumerate(lines):
        if ln.startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            m = re.match(r'File "([^"]+)"', ln)
            in_torch = bool(m) and os.path.abspath(m.group(1)).startswith(_TORCH_DIR)
            frames.append((in_torch, f"{ln.removeprefix('File ')}: {code}".strip()))
    user = next((text for in_torch, text in reversed(frames) if not in_torch), None)
    text = user if user is not None else frames[-1][1] if frames else ""
    path, cls = module_of(node)
    if user is None and text and cls:
        text += f" (in {path or 'the compiled module'}, {with_article(cls)})"
    return text


def module_of(node: fx.Node) -> tuple[str, str]:
    """``(path, class name)`` of the innermost module that ran ``node`` (``node.meta["nn_module_stack"]``:
    path ``""`` for the compiled module itself), or ``("", "")`` when none was recorded. Dynamo's paths
    (``L['self'].layers[0].mlp``, ``L['self']._modules['fc1']``) become the module's own (``layers.0.mlp``, ``fc1``)."""
    stack = node.meta.get("nn_module_stack")
    if not isinstance(stack, dict) or not stack:
        return "", ""
    entry = list(stack.values())[-1]
    if not (isinstance(entry, tuple) and len(entry) == 2):
        return "", ""
    path, cls = entry
    cls = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    path = str(path)
    path = re.sub(r"^[LG]\['[^']*'\]\.?|^L__self__[._]?", "", path)  # Dynamo's name of the module (local, global)
    path = re.sub(r"\.?_modules\['([^']*)'\]|\['([^']*)'\]", lambda m: "." + (m.group(1) or m.group(2)), path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip("."), cls.rsplit(".", 1)[-1]


def target_name(node: fx.Node) -> str:
    """The printable name of the op ``node`` calls (as the user's graph had it, where a pass rewrote it:
    ``meta["tilec_written_as"]``)."""
    t = node.meta.get("tilec_written_as", node.target)
    return getattr(t, "__name__", None) or str(t) if not isinstance(t, torch._ops.OpOverload) else str(t)


@dataclass(frozen=True)
class Static:
    """A folded constant value."""

    value: torch.Tensor


@dataclass(frozen=True)
class Positional:
    """A position-dependent value tabulated over p: ``table[p]`` is its value at position p."""

    table: torch.Tensor


VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
    aten.permute.default, aten.t.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.alias.default,
    aten.detach.default, aten.narrow.default,
}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
IDENTITY = {aten.alias.default, aten.detach.default, aten.clone.default, aten.contiguous.default,
             aten.lift_fresh_copy.default}
CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device}
SKIP = {aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}
UNARY = {
    aten.neg.default: "neg", aten.silu.default: "silu", aten.relu.default: "relu", aten.sigmoid.default: "sigmoid",
    aten.tanh.default: "tanh", aten.exp.default: "exp", aten.rsqrt.default: "rsqrt", aten.sqrt.default: "sqrt",
    aten.cos.default: "cos", aten.sin.default: "sin", aten.abs.default: "abs", aten.reciprocal.default: "reciprocal",
}
# clamp and its forms (clip, relu6, hardtanh): maximum with the lower bound, then minimum with the upper
# (tilec/frontend.py)
CLAMPS = {aten.clamp.default, aten.clamp.Tensor, aten.clip.default, aten.clip.Tensor, aten.clamp_min.default,
          aten.clamp_min.Tensor, aten.clamp_max.default, aten.clamp_max.Tensor, aten.relu6.default,
          aten.hardtanh.default}
BINARY = {
    aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul", aten.div.Tensor: "div",
    aten.true_divide.Tensor: "div",  # torch.true_divide, div's alias (export keeps its name)
    aten.maximum.default: "maximum", aten.minimum.default: "minimum",
}
# positional argument names of SDPA and of the fused variants AOTAutograd dispatches it to
SDPA_ARGS = {
    aten.scaled_dot_product_attention.default: ("attn_mask", "dropout_p", "is_causal"),
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("dropout_p", "is_causal"),
    aten._scaled_dot_product_efficient_attention.default: ("attn_mask", "compute_log_sumexp", "dropout_p",
                                                           "is_causal"),
    aten._scaled_dot_product_flash_attention.default: ("dropout_p", "is_causal", "return_debug_mask"),
    aten._scaled_dot_product_cudnn_attention.default: ("attn_mask", "compute_log_sumexp", "dropout_p", "is_causal",
                                                       "return_debug_mask"),
}
INDEX_WRITES = {aten.index_copy.default, aten.index_copy_.default, aten.index_put.default, aten.index_put_.default}


def val_of(node) -> torch.Tensor | None:
    """The tensor ``node`` computes (its ``meta["val"]``), or None for a non-tensor or a non-node."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def is_call(node, *targets) -> bool:
    """Whether ``node`` is a call of one of ``targets`` (aten overloads); an add or sub only with
    alpha 1 (a pattern's ``x + y`` is not ``x + alpha * y``)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets):
        return False
    return alpha_of(node) == 1


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` calls a random op (``randn``, ``normal_``, ``bernoulli``, ...: aten's
    ``nondeterministic_seeded`` tag), which draws anew on every call and so is never evaluated when compiling."""
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


_SCALAR_ALPHA = (aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar)  # alpha positional: add.Scalar(self, other, alpha)


def alpha_of(node: fx.Node):
    """The ``alpha`` of an add / sub / rsub call (keyword, or positional in the Scalar overloads); 1 otherwise."""
    positional = node.args[2] if node.target in _SCALAR_ALPHA and len(node.args) > 2 else 1
    return node.kwargs.get("alpha", positional)


def upcast_source(n):
    """``n`` with its float32 upcasts stripped (casts to float32 of bf16, fp16 or float32 values): the
    value an op computing in float32 may read instead, with the same values. Any other cast stays."""
    while is_call(n, *CASTS) and val_of(n).dtype == torch.float32 and val_of(n.args[0]) is not None \
            and val_of(n.args[0]).dtype in (torch.bfloat16, torch.float16, torch.float32):
        n = n.args[0]
    return n
