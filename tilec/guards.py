"""Call-time guards: what a compiled step assumes about a run-time input, checked on every call.

HF ``generate()`` hands each decode step its attention mask as a run-time tensor (built outside
the model, or inside it from the 2-d ``attention_mask`` and ``cache_position``). With no padding
that mask is the causal mask over the static KV cache at the step's position, which tilec's
attention builds in. So the frontend plans such attention as causal and records a guard (the
aten node that computes the mask, :attr:`tilec.ir.OpGraph.mask_guards`); before each run the
program evaluates the mask from the call's own arguments and compares it with the causal mask
at the call's position. A call whose mask differs (a padded batch, a sliding window) raises
:class:`GuardError`, which the ``torch.compile`` backend answers by running that call eagerly.

A mask is a hard mask: ``bool`` (True where a key may be attended) or floating point with 0 where
allowed and at most :data:`MASKED_BELOW` where not (HF fills with ``finfo.min``; ``-inf`` too).
A float mask holding any other value (a soft bias such as ALiBi) is never the causal mask.
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.fx as fx

from .errors import TilecError

MASKED_BELOW = -1.0e4  # a float mask entry at or below this masks its key (exp underflows to 0 in fp32)


class GuardError(TilecError):
    """A call's run-time attention mask is not the causal mask the step was planned for (e.g. a
    padded batch): the message names the argument the mask is computed from and the position."""


_LAGS: dict[tuple, torch.Tensor] = {}
_LAGS_CACHED = 1 << 17  # elements (1 MiB) at most of a cached grid: a decode step's rows, not a prefill's


def _lags(device: torch.device, sq: int, s: int) -> torch.Tensor:
    """int64 [sq, s]: column minus row, so that row i of the causal mask at position p is
    ``lags[i] <= p``. Small grids are cached (16 at most): one kernel a decode call's check instead
    of four on a GPU, where each costs host time between HF generate()'s steps."""
    key = (device, sq, s)
    lags = _LAGS.get(key)
    if lags is None:
        lags = torch.arange(s, device=device).view(1, s) - torch.arange(sq, device=device).view(sq, 1)
        if sq * s <= _LAGS_CACHED:
            if len(_LAGS) >= 16:
                _LAGS.clear()
            _LAGS[key] = lags
    return lags


def causal_mismatch(mask: torch.Tensor, p: int | torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """A 0-d bool tensor (on ``mask``'s device, no host sync): True unless ``mask`` is the causal
    mask at decode position ``p`` over a static cache.

    Args:
        mask: bool, or float additive, broadcastable to ``shape`` = (batch, heads, query rows sq,
            cache length s); row i allows cache columns ``<= p + i``. A float entry is allowed
            when exactly 0 and masked when at most :data:`MASKED_BELOW` (NaN is neither).
        p: the decode position of the step's first query row: an int, or a 0-d integer tensor
            (read on the device: no host sync).
    """
    if isinstance(p, torch.Tensor):
        p = p.to(mask.device)
    want = _lags(mask.device, shape[2], shape[3]) <= p
    if mask.dtype == torch.bool:
        bad = mask != want
    else:
        bad = torch.where(want, mask != 0, ~(mask <= MASKED_BELOW))
    full = torch.broadcast_shapes(bad.shape, shape)  # raises when the mask does not broadcast
    # any() over the broadcast equals any() over bad unless the broadcast is empty; reducing the
    # expanded view instead took ~1.6 ms a position on the CPU (a 1088-position check: 1.7 s of compiling)
    return bad.any() if math.prod(full) else torch.zeros((), dtype=torch.bool, device=mask.device)


def _scalar(a) -> float | None:
    """The value of a Python number or of an ``aten.scalar_tensor`` node, else None."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a)
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target is torch.ops.aten.scalar_tensor.default:
        return _scalar(a.args[0])
    return None


def _bool_source(node: fx.Node) -> fx.Node:
    """``c`` when ``node`` is ``where(c, 0, m)`` of a bool ``c`` and an ``m`` at most
    :data:`MASKED_BELOW` (HF turns its bool mask into an additive one so), else ``node``: that float
    mask is causal exactly when ``c`` is, and checking ``c`` takes 3 kernels a call instead of 9."""
    if node.op == "call_function" and node.target in (torch.ops.aten.where.self, torch.ops.aten.where.ScalarSelf,
                                                      torch.ops.aten.where.ScalarOther, torch.ops.aten.where.Scalar):
        c, a, b = node.args[:3]
        val = c.meta.get("val") if isinstance(c, fx.Node) else None
        ma, mb = _scalar(a), _scalar(b)
        if isinstance(val, torch.Tensor) and val.dtype == torch.bool and ma == 0.0 and mb is not None \
                and mb <= MASKED_BELOW:
            return c
    return node


class MaskGuard:
    """Evaluates one run-time attention mask from a call's arguments and checks it is causal.

    Built from the aten graph the step was lowered from: the mask node's ancestors are copied into
    a small graph whose inputs are the user arguments they read (module constants are bound now).
    ``key`` describes that graph canonically: HF's layers each compute the same mask from the
    same argument (one ``where`` per layer), and guards with equal keys are checked once.

    Args:
        gm: the aten graph (``meta["val"]`` on every node).
        user_inputs: its placeholders that are call arguments, in call order (``GraphBinding``).
        consts: placeholder name -> constant tensor, for the mask's constant inputs.
        node: the mask node's name (an entry of ``OpGraph.mask_guards``).
        shape: (batch, heads, query rows, cache length) of the attention it masks.

    Raises:
        TilecError: ``node`` is not in ``gm``, or reads a placeholder that is neither an argument
            nor a constant (a plan and graph that disagree: a tilec bug).
    """

    def __init__(self, gm: fx.GraphModule, user_inputs: list[str], consts: dict[str, torch.Tensor], node: str,
                 shape: tuple[int, int, int, int]):
        nodes = {n.name: n for n in gm.graph.nodes}
        if node not in nodes:
            raise TilecError(f"the plan checks attention mask {node!r}, which its graph does not hold (a tilec bug)")
        self.name, self.shape = node, tuple(shape)
        keep, todo = set(), [_bool_source(nodes[node])]
        while todo:
            n = todo.pop()
            if n not in keep:
                keep.add(n)
                todo.extend(n.all_input_nodes)
        root = torch.nn.Module()
        graph, env, self.arg_index, self.arg_types = fx.Graph(), {}, [], []
        index: dict[fx.Node, int] = {}
        key = [self.shape]

        def ref(a):
            return ("node", index[a]) if isinstance(a, fx.Node) else repr(a)

        for n in gm.graph.nodes:
            if n not in keep:
                continue
            index[n] = len(index)
            if n.op == "placeholder" and n.name in user_inputs:
                i = user_inputs.index(n.name)
                val = n.meta.get("val")
                self.arg_index.append(i)
                self.arg_types.append((tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None)
                env[n] = graph.placeholder(n.name)
                key.append(("arg", i))
            elif n.op in ("placeholder", "get_attr"):
                value = consts.get(n.name) if n.op == "placeholder" else getattr(gm, n.target)
                if not isinstance(value, torch.Tensor):
                    raise TilecError(f"attention mask {node!r} reads {n.name}, neither an argument nor a constant "
                                     f"(a tilec bug)")
                attr = f"_const{len(env)}"
                root.register_buffer(attr, value)
                env[n] = graph.get_attr(attr)
                raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # 0-d too; any dtype
                digest = hashlib.sha1(raw.numpy().tobytes()).hexdigest()
                key.append(("const", tuple(value.shape), str(value.dtype), digest))
            else:
                env[n] = graph.node_copy(n, lambda a: env[a])
                key.append((str(n.target), fx.node.map_aggregate(n.args, ref), fx.node.map_aggregate(n.kwargs, ref)))
        graph.output(env[_bool_source(nodes[node])])
        self.module = fx.GraphModule(root, graph)
        self.key = tuple(key)

    def mismatch(self, args, p: int | torch.Tensor, labels=None) -> torch.Tensor:
        """:func:`causal_mismatch` of the mask computed from ``args`` (the step's call arguments;
        ``labels`` names them) at decode position ``p``: a 0-d bool tensor, no host sync.

        Raises:
            TilecError: an argument the mask reads is not a tensor of the shape and dtype it was
                compiled for.
        """
        for i, want in zip(self.arg_index, self.arg_types):
            a = args[i]
            if want is not None and not (isinstance(a, torch.Tensor) and (tuple(a.shape), a.dtype) == want):
                got = f"{a.dtype}{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                label = labels[i] if labels else f"argument {i}"
                raise TilecError(f"{label}: expected {want[1]}{list(want[0])} (the attention mask is computed from "
                                 f"it), got {got}")
        return causal_mismatch(self.module(*(args[i] for i in self.arg_index)), p, self.shape)

    def error(self, p: int, labels=None) -> GuardError:
        """The :class:`GuardError` for a mismatch at position ``p``."""
        reads = ", ".join(labels[i] if labels else f"argument {i}" for i in self.arg_index) or "constants"
        node = "" if reads.endswith(f"({self.name})") else f" (node {self.name})"  # (the argument itself)
        return GuardError(f"the attention mask computed from {reads}{node} is not the causal mask over "
                          f"the static cache at position {p} (e.g. a padded batch, a sliding window, or bidirectional "
                          f"attention): tilec planned this attention as causal")


def mismatches(guards: list[MaskGuard], args, p, labels=None) -> torch.Tensor:
    """bool [len(guards)] on the masks' device, no host sync: each guard's :meth:`MaskGuard.mismatch`
    at decode position ``p`` (an int, or a 0-d integer tensor on the masks' device)."""
    flags = [g.mismatch(args, p, labels) for g in guards]
    return flags[0].view(1) if len(flags) == 1 else torch.stack(flags)  # (HF's layers share one mask)


def raise_first_mismatch(guards: list[MaskGuard], flags: list[bool], p: int, labels=None) -> None:
    """Raises the :class:`GuardError` of the first guard whose flag (of :func:`mismatches`) is set."""
    for g, bad in zip(guards, flags):
        if bad:
            raise g.error(p, labels)


def check_mask_guards(guards: list[MaskGuard], args, p: int, labels=None) -> None:
    """Raises the first failing guard's :class:`GuardError` unless every mask computed from
    ``args`` is causal at position ``p`` (one host sync for all of them; TilecError for an
    argument of the wrong shape or dtype)."""
    if guards:
        raise_first_mismatch(guards, mismatches(guards, args, p, labels).tolist(), p, labels)


def build_mask_guards(gm: fx.GraphModule, binding, mask_guards) -> list[MaskGuard]:
    """The :class:`MaskGuard` of each ``(node, shape)`` in ``mask_guards`` (an OpGraph's), over
    ``gm`` bound by ``binding`` (a :class:`tilec.frontend.GraphBinding`), one per distinct mask
    computation (see :attr:`MaskGuard.key`)."""
    guards: dict[tuple, MaskGuard] = {}
    for name, shape in mask_guards:
        g = MaskGuard(gm, binding.user_inputs, binding.consts, name, shape)
        guards.setdefault(g.key, g)
    return list(guards.values())
