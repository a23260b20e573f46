"""FX (aten) graph -> OpGraph.

One lowering for both entry points: the offline path hands over a functionalized
``torch.export`` graph, the ``torch.compile`` path an AOTAutograd graph; both are aten
graphs whose placeholders are classified by a :class:`GraphBinding`.

Lowering is demand driven from the graph outputs (and the in-place state writes), so
sub-graphs absorbed by a pattern (RMSNorm's pow/mean/rsqrt, RoPE's slice/neg/cat, GQA's
expand/clone) are never lowered on their own. Values that depend only on constants are
folded; values that depend only on the decode position ``p`` (RoPE cos/sin, causal
masks, cache indices) are tabulated for every ``p < max_positions`` and become position
tables read through a view that moves with ``p`` - or, for masks and cache indices,
are checked against the causal / slot semantics and absorbed into the ops.
"""
from __future__ import annotations

import heapq
import math
import operator
import sys
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .errors import EagerFailsError, InputError, UnsupportedNodeError
from .frontend_dsa import DsaLowering
from .frontend_forms import FormsLowering
from .guards import MaskGuard, causal_mismatch
from .fxgraph import (BINARY, CASTS, CLAMPS, IDENTITY, INDEX_WRITES, RESHAPES, SDPA_ARGS, SKIP, SPLITS, UNARY, VIEW_OPS,
                      Positional, Static, alpha_of, aten, is_call, is_random, source_of, target_name, upcast_source,
                      val_of)
from .ir import (DTYPE_CODES, Buffer, BufferKind, Op, OpGraph, Provenance, View, contiguous_strides, dtype_name,
                 is_integer)
from .ops.ewise import BINARY_FNS, UNARY_FNS

POSITION, IGNORED = "<position>", "<ignored>"
BUFFER_STATE_WHY = "kept in the module rather than passed to forward"  # (an in-place update of a module buffer)



ELEMENTWISE = ("copy", "unary", "binary")  # kinds whose every operand is expanded to the output's shape


# ops of mixture-of-experts routing (which experts a token takes is known only at run time)
ROUTING = {getattr(aten, name).default for name in ("topk", "sort", "argsort", "one_hot", "nonzero", "bincount", "histc")
           if hasattr(aten, name)}
ROUTING_WHY = ("a data-dependent choice (top-k / sort, as mixture-of-experts routing does): tilec plans every tile "
               "before the step runs; mixture-of-experts layers are not supported yet")
SCANS = {getattr(aten, name).default for name in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp")
         if hasattr(aten, name)}
SCAN_WHY = ("a scan along a dim (each element depends on every earlier one): tilec has no scan op; its tiles compute "
            "elementwise ops, GEMV / GEMM, softmax and norms (its only row reductions), RoPE, attention and copies")


def dtype_why(dtype: torch.dtype) -> str:
    """Why a value of ``dtype`` (not in ``DTYPE_CODES``) cannot be lowered."""
    return f"dtype {dtype} is not supported by tilec (supported: {sorted(map(str, DTYPE_CODES))})"


MEAN_WHY = ("no tilec op computes a mean alone: a row mean is lowered only as part of a norm tilec recognizes - "
            "F.rms_norm / nn.RMSNorm, F.layer_norm / nn.LayerNorm, or one written out over the last dim with "
            "torch.rsqrt: RMSNorm x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), LayerNorm (x - u) * "
            "torch.rsqrt((x - u).pow(2).mean(-1, keepdim=True) + eps) with u = x.mean(-1, keepdim=True), either "
            "times a [D] weight (tilec/frontend_forms.py has the forms; the README's \"What works\")")
MEAN_OTHER_WHY = "; this one is not part of such a form (its rounding or its shapes differ)"
MEAN_DIVISION_WHY = ("; this one feeds a division by a square root, x / torch.sqrt(... + eps), which is not one of "
                     "them: write it as x * torch.rsqrt(... + eps) (tilec does not rewrite it so itself, as a product "
                     "by rsqrt rounds differently from eager's division)")
NO_OP_WHY = "no tilec op computes it (the README's \"What works\" lists what tilec lowers)"


def _divides_by_its_sqrt(mean: fx.Node, depth: int = 6) -> bool:
    """Whether the value of ``mean`` reaches, within ``depth`` ops, a ``sqrt`` that divides something (the
    divisor of a ``div``, or a ``reciprocal``): a norm written as ``x / torch.sqrt(mean(..) + eps)``, whose
    ``* torch.rsqrt`` form tilec recognizes (a LayerNorm's first mean reaches it through the centered rows)."""
    seen, frontier = set(), [mean]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if is_call(n, aten.sqrt.default) and (is_call(u, aten.reciprocal.default) or (
                        is_call(u, aten.div.Tensor) and len(u.args) > 1 and u.args[1] is n)):
                    return True
                if u not in seen:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


def _upstream(node: fx.Node):
    """``node`` and every node it reads, directly or not, each once (depth first)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        todo.extend(n.all_input_nodes)


def _matmul4(n):
    """``matmul(a, b)`` of 4-d a and b, or what AOTAutograd decomposes it into (the ``torch.compile``
    path): ``view(bmm(view(expand(a)), view(expand(b))), [B, H, M, N])`` with expands that change no
    shape -> (a, b); None for anything else."""
    if is_call(n, aten.matmul.default):
        return (n.args[0], n.args[1]) if len(val_of(n).shape) == 4 and len(val_of(n.args[1]).shape) == 4 else None
    if not (is_call(n, *RESHAPES) and len(val_of(n).shape) == 4 and is_call(n.args[0], aten.bmm.default)):
        return None
    lead = tuple(val_of(n).shape[:2])
    out = []
    for arg in n.args[0].args[:2]:
        src = arg.args[0] if is_call(arg, *RESHAPES) else None
        if is_call(src, aten.expand.default) and tuple(val_of(src).shape) == tuple(val_of(src.args[0]).shape):
            src = src.args[0]
        if src is None or len(val_of(src).shape) != 4 or tuple(val_of(src).shape[:2]) != lead \
                or tuple(val_of(arg).shape) != (lead[0] * lead[1],) + tuple(val_of(src).shape[2:]):
            return None
        out.append(src)
    return tuple(out)


def fold_dims(shape, views):
    """The same elementwise computation over fewer dims: ``shape``'s size-1 dims dropped and each
    pair of neighbouring dims merged where every view in ``views`` (each of ``shape``, broadcast
    dims with stride 0) steps through them as one dim (``stride[d] == stride[d + 1] * size[d + 1]``);
    the output, a new contiguous buffer of ``shape``, always does.

    Returns ``(folded shape, folded views)`` when that has at most 4 dims (what tilec ops take), else
    None. An HF 5-d intermediate (Falcon's grouped q/k/v, ``repeat_kv``'s expand of a
    [B, KV, 1, S, D] view) then lowers as a 2- to 4-d copy or elementwise op on the same memory.
    """
    keep = [d for d, n in enumerate(shape) if n != 1] or [len(shape) - 1]
    groups: list[list[int]] = []
    for d in keep:
        if groups and all(v.strides[groups[-1][-1]] == v.strides[d] * v.shape[d] for v in views):
            groups[-1].append(d)
        else:
            groups.append([d])
    if len(groups) > 4:
        return None
    new_shape = tuple(math.prod(shape[d] for d in g) for g in groups)
    new_views = [View(v.buffer, new_shape, tuple(v.strides[g[-1]] for g in groups), v.offset, v.pos_stride)
                 for v in views]
    return new_shape, new_views


def _exact_on_bools(attrs: dict, dtype: torch.dtype) -> bool:
    """Whether a unary elementwise op (``attrs``: its ``fn`` and ``scalar``) of a bool operand gives, for both 0 and
    1, the same ``dtype`` values in float32 (how the ops compute) as in eager's int64 math. A binary op of bools
    (values 0..2) is exact."""
    if "scalar" not in attrs:
        return True
    scalar = attrs["scalar"]  # (the lowering's float64: an integer scalar past 2**53 may be rounded already)
    if not float(scalar).is_integer() or abs(float(scalar)) >= 2 ** 53:
        return False
    fn, bools = UNARY_FNS[attrs["fn"]], torch.tensor([0, 1])
    try:
        want = fn(bools, int(scalar))
    except (RuntimeError, OverflowError):  # e.g. an integer tensor to a negative power
        return False
    got = fn(bools.float(), float(torch.tensor(float(scalar), dtype=torch.float32))).to(dtype)
    return torch.equal(got, want.to(dtype))


# The most decode positions a plan covers: every position-dependent value (RoPE rows, masks, cache indices) is
# tabulated per position in Python and kept as a table, so time and memory grow with max_positions (a 1M-position
# embedding step took 7.6 s and 1.2 GB to plan; 10**9 ran until killed). 2**20 covers a million-token context.
MAX_POSITIONS = 1 << 20


@dataclass
class GraphBinding:
    """How an aten graph's placeholders bind.

    params: placeholder name -> tensor bound once (weights; never folded).
    consts: placeholder name -> tensor that may be folded (lifted constants, RoPE inv_freq).
    user_inputs: placeholder names of the user's arguments, in call order.
    positions: the subset of user_inputs that hold the decode position (int tensors).
    mutations: output node name -> placeholder name it updates in place.
    mutation_outputs: how many of the graph's outputs, first in order, are those in-place updates
        (``torch.export`` lists them before the user's outputs); the rest are the user's outputs,
        which may be the very same nodes (a module that returns the cache it updated).
    single_output: whether the module returns one tensor rather than a tuple (from the export's
        output spec: ``(y,)`` is a tuple of one); None when the capture does not say.
    out_spec: the export's pytree spec of the user's outputs (a dict, nesting), or None.
    listed_positions: ``positions`` came from the caller's list (``compile_module``), so an error may
        point at one the caller did not list.
    labels: placeholder name -> how the user knows that argument (the ``torch.compile`` backend's
        ``past_key_values.layers[0].keys``), for errors; else ``argument i (name)``.
    param_names: placeholder name of a parameter -> the module's name for it
        (``layers.0.self_attn.k_proj.weight``), for errors; else the placeholder's name.
    buffer_names: the same for the module's buffers (``cache``, not ``b_cache``).
    attribute_names: the same for the module's plain tensor attributes (``self.scale = torch.randn(4)``, not
        registered: constants of the plan), so that ``tilec run --check`` can give eager the artifact's values.
    examples: placeholder name -> the example value of a user input (a real tensor or a Python
        value), when the caller has them: a run-time attention mask that is not causal on them is
        refused when compiling (else every call would fail its check, :mod:`tilec.guards`).
    strides_guarded: every call's arguments have the examples' strides (``torch.compile``'s guards hold
        them), so a cache written in place whose example is not contiguous could never run (a call binds
        contiguous caches only): its write is refused as unsupported (the backend runs it eagerly).
        ``compile_module`` leaves it False: its plan binds any contiguous cache of the example's shape.
    """

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    consts: dict[str, torch.Tensor] = field(default_factory=dict)
    user_inputs: list[str] = field(default_factory=list)
    positions: set[str] = field(default_factory=set)
    mutations: dict[str, str] = field(default_factory=dict)
    mutation_outputs: int = 0
    single_output: bool | None = None
    out_spec: object | None = None
    labels: dict[str, str] = field(default_factory=dict)
    param_names: dict[str, str] = field(default_factory=dict)
    buffer_names: dict[str, str] = field(default_factory=dict)
    attribute_names: dict[str, str] = field(default_factory=dict)
    listed_positions: bool = False
    examples: dict[str, object] = field(default_factory=dict)
    strides_guarded: bool = False

    def label(self, name: str) -> str:
        """How the user knows placeholder ``name``: its label (``past_key_values.layers[0].keys``),
        ``argument 2 (state_0)``, ``parameter k_proj.weight``, ``buffer cache``, ``tensor attribute scale``, or
        ``buffer NAME``."""
        if name in self.labels:
            return self.labels[name]
        if name in self.user_inputs:
            return f"argument {self.user_inputs.index(name)} ({name})"
        if name in self.params:
            return f"parameter {self.param_names.get(name, name)}"
        if name in self.attribute_names:
            return f"tensor attribute {self.attribute_names[name]}"
        return f"buffer {self.buffer_names.get(name, name)}"


def const_name(node_name: str) -> str:
    """The buffer name of the constant a node folds to (a module buffer the plan keeps as it is:
    ``const_<placeholder>``, which ``tilec run --check`` loads back into the eager module)."""
    return f"const_{node_name}"


def _data_dependent_shape(node: fx.Node) -> bool:
    """Whether ``node``'s tensor has a size that is a symbol (torch.export's unbacked ``u0`` for a size read
    from data), not a number."""
    v = val_of(node)
    return v is not None and not all(isinstance(d, int) for d in v.shape)


class _OperandError(TypeError):
    """An operand that is not a tensor value (e.g. the output of a node probe mode skipped)."""


class Lowering(FormsLowering, DsaLowering):
    """Lowers one aten graph; see the module docstring. Use :func:`lower_graph`."""

    def __init__(self, gm: fx.GraphModule, binding: GraphBinding, max_positions: int, probe: bool = False):
        self.gm, self.b, self.max_positions = gm, binding, max_positions
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.buffers: dict[str, Buffer] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.ops: list[Op] = []
        self.env: dict[fx.Node, object] = {}
        self.state_writes: set[str] = set()
        self._names: dict[str, int] = {}
        # names _name never gives: the placeholders' buffers take their node names as they are (an argument
        # `clamp_maximum` or `const_clamp` shared a generated buffer: a wrong result, the caller's input overwritten)
        self._taken: set[str] = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
        self._static_cache: dict = {}
        self._pos_caches: dict[int, dict] = {}
        # as_view's cache, by id(value): each value is kept with its view, so that its id is not reused (a freed
        # temporary's id came back and another constant's view with it: a clamp read another clamp's bound)
        self._views: dict[int, tuple[object, View]] = {}
        self._mask_checks: dict[tuple, int] = {}  # _check_causal_mask's verdicts: the first bad position, or -1
        self.mask_guards: dict[str, tuple] = {}  # run-time mask node -> (batch, heads, rows, cache length)
        self._example_verdicts: dict[tuple, int | None] = {}  # MaskGuard.key -> _example_not_causal's answer
        self.position_updates: dict[str, torch.Tensor] = {}
        self.probe = probe
        self.unsupported: list[tuple[str, str, str, str]] = []
        self.eager_fails: set[str] = set()  # probe mode: nodes eager PyTorch cannot run either (EagerFailsError)
        self._opaque_buffers: set[str] = set()  # probe mode: buffers standing in for values that run eagerly
        self.cls = self._classify()

    # ---- classification: static / positional / runtime --------------------------------
    def _classify(self) -> dict[fx.Node, str]:
        cls: dict[fx.Node, str] = {}
        mutated = set(self.b.mutations.values())
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                if n.name in self.b.positions:
                    cls[n] = "pos"
                elif n.name in self.b.consts and n.name not in mutated:
                    cls[n] = "static"
                else:
                    cls[n] = "runtime"
            elif n.op == "get_attr":
                cls[n] = "static"
            elif n.op == "call_function":
                kinds = {cls[a] for a in n.all_input_nodes}
                if n.target in INDEX_WRITES or n.target in (aten.copy_.default,):
                    cls[n] = "runtime"
                elif is_random(n):
                    # a random op (randn, randint, normal_, bernoulli, ...) draws anew on every call: never
                    # folded into a constant or a per-position table, so it is lowered (none is: refused, or
                    # run eagerly by torch.compile's fallback) like any op on run-time values
                    cls[n] = "runtime"
                elif "runtime" in kinds:
                    cls[n] = "runtime"
                elif "pos" in kinds:
                    cls[n] = "pos"
                else:
                    cls[n] = "static"
            else:
                cls[n] = "runtime"
        return cls

    def _evaluate(self, node: fx.Node, p: int | None, cache: dict) -> object:
        """Evaluates a static/positional node with real tensors at position p."""
        if node in cache:
            return cache[node]
        if node.op == "placeholder":
            if node.name in self.b.positions:
                ex = val_of(node)
                out = torch.full(tuple(ex.shape), p, dtype=ex.dtype)
            else:
                out = self.b.consts[node.name].cpu()
        elif node.op == "get_attr":
            out = getattr(self.gm, node.target).cpu()
        else:
            args = fx.node.map_arg(node.args, lambda a: self._evaluate(a, p, cache))
            kwargs = fx.node.map_arg(node.kwargs, lambda a: self._evaluate(a, p, cache))
            if "device" in kwargs:
                kwargs = dict(kwargs, device="cpu")
            out = node.target(*args, **kwargs)
        cache[node] = out
        return out

    def _fold(self, node: fx.Node):
        if self.cls[node] == "static":
            return Static(self._evaluate(node, None, self._static_cache))
        if self.max_positions > MAX_POSITIONS:  # (a cache's own length check came first: check_cache_writes)
            where = source_of(node)
            what = self._argument(node.name) if node.op == "placeholder" else f"{node.name} ({target_name(node)})"
            raise InputError(f"{what}{f' at {where}' if where else ''} depends on the "
                             f"decode position, so tilec tabulates it for every planned position: "
                             f"max_positions={self.max_positions} is more than the {MAX_POSITIONS} it plans - use "
                             f"the model's context length")
        caches = self._pos_caches
        tables = []
        for p in range(self.max_positions):
            try:
                tables.append(self._evaluate(node, p, caches.setdefault(p, dict(self._static_cache))))
            except (IndexError, RuntimeError, ValueError) as e:  # e.g. a table of 64 rows indexed by p
                where = source_of(node)
                raise InputError(f"{node.name} ({target_name(node)}){f' at {where}' if where else ''} fails at decode "
                                 f"position {p}: {type(e).__name__}: {e}; max_positions={self.max_positions} plans "
                                 f"positions the module cannot take - use max_positions <= {p}") from e
        # a Python number (.item() of a position, x * pos.item()) as a float32 one-element table: eager computes with
        # such a scalar unrounded, in float32 (it crashed torch.stack: a reviewer's finding)
        return Positional(torch.stack([t if isinstance(t, torch.Tensor) else torch.tensor(float(t)) for t in tables]))

    # ---- helpers ---------------------------------------------------------------------
    def _name(self, base: str) -> str:
        """A name not given before (to an op or a buffer): ``base``, else ``base_k`` for the next free k (a
        constant of node ``clamp``'s second use, ``const_clamp_1``, is also node ``clamp_1``'s constant's base:
        the second overwrote the first's buffer and value, a fresh user's wrong result)."""
        base = base.replace(".", "_")
        k = self._names.get(base, 0)
        name = base if k == 0 else f"{base}_{k}"
        while name in self._taken or name in self.buffers:
            k += 1
            name = f"{base}_{k}"
        self._names[base] = k + 1
        self._taken.add(name)
        return name

    def _prov(self, node: fx.Node) -> Provenance:
        return Provenance(node.name, target_name(node), source_of(node))

    def _argument(self, name: str) -> str:
        """How the user knows placeholder ``name`` (:meth:`GraphBinding.label`)."""
        return self.b.label(name)

    def _unsupported(self, node: fx.Node, reason: str | None = None, eager_fails: bool = False):
        """Raises UnsupportedNodeError for ``node`` with ``reason`` (:class:`EagerFailsError` when
        ``eager_fails``: eager PyTorch raises on the node too); without one, the hint about an unlisted
        decode-position argument where it applies, else the dtype an input has that tilec has no code for
        (:func:`dtype_why`), else ``MEAN_WHY`` for a row mean (saying so when it feeds a division by its square root,
        :func:`_divides_by_its_sqrt`), else ``NO_OP_WHY``."""
        if reason is None and self.b.listed_positions:  # a decode position argument the caller did not list?
            for a in node.all_input_nodes:
                v = val_of(a)
                if a.op == "placeholder" and a.name in self.b.user_inputs and a.name not in self.b.positions \
                        and v is not None and v.numel() == 1 and is_integer(v.dtype):
                    reason = (f"it reads {self._argument(a.name)}, a one-element integer input; if that holds the "
                              f"decode position, mark it as one (compile_module's "
                              f"positions=[{self.b.user_inputs.index(a.name)}])")
                    break
        if reason is None:  # an input of a dtype tilec has no code for says more than "no op computes it" (a
            # float64 mean); an op that makes such a value from supported ones (an FFT) has no op, whatever the dtype
            for v in (val_of(a) for a in node.all_input_nodes):
                if isinstance(v, torch.Tensor) and v.dtype not in DTYPE_CODES:
                    reason = dtype_why(v.dtype)
                    break
        if reason is None and node.target is aten.mean.dim:
            reason = MEAN_WHY + (MEAN_DIVISION_WHY if _divides_by_its_sqrt(node) else MEAN_OTHER_WHY)
        cls = EagerFailsError if eager_fails else UnsupportedNodeError
        raise cls([(node.name, target_name(node), source_of(node))], reason or NO_OP_WHY)

    def _new_buffer(self, name: str, shape, dtype, kind=BufferKind.TEMP, node: fx.Node | None = None) -> Buffer:
        """A new buffer for ``node``'s value (errors name the node, its target and source line)."""
        who = [(node.name, target_name(node), source_of(node))] if node is not None else [(name, "buffer", "")]
        if 0 in tuple(shape):
            raise UnsupportedNodeError(who, f"zero-size tensor of shape {list(shape)}: "
                                            f"tilec plans need at least one element per dim")
        if dtype not in DTYPE_CODES:
            raise UnsupportedNodeError(who, dtype_why(dtype))
        buf = Buffer(self._name(name), tuple(int(s) for s in shape), dtype, kind)
        self.buffers[buf.name] = buf
        return buf

    def _opaque(self, node: fx.Node) -> View:
        """Probe mode: an input standing in for ``node``'s value, whatever its shape and dtype (the
        node itself is reported), so that lowering goes on to find every unsupported node - also
        the consumers of a value of a dtype tilec has no code for (a float64 model, a complex FFT),
        which must run eagerly too."""
        val = val_of(node)
        buf = Buffer(self._name(f"opaque_{node.name}"), tuple(int(s) for s in val.shape), val.dtype, BufferKind.INPUT)
        self.buffers[buf.name] = buf
        self._opaque_buffers.add(buf.name)
        return View.whole(buf)

    def _emit(self, node: fx.Node, kind: str, inputs, out_shape=None, out_dtype=None, attrs=(), name=None) -> View:
        val = val_of(node)
        shape = tuple(val.shape) if out_shape is None else tuple(out_shape)
        dtype = val.dtype if out_dtype is None else out_dtype
        folded = None
        if kind in ELEMENTWISE and (len(shape) > 4 or any(len(v.shape) > 4 for v in inputs)):
            folded = fold_dims(shape, inputs)
            if folded is not None:
                inputs = folded[1]
        for v in inputs:
            if len(v.shape) > 4:
                known = v.buffer in self.b.labels or v.buffer in self.b.user_inputs
                what = f"{self._argument(v.buffer)} viewed as {list(v.shape)}" if known else v.render()
                self._unsupported(node, f"operand {what} has more than 4 dims (tilec ops take at most 4)")
        if len(shape) > 4 and folded is None:
            self._unsupported(node, f"output of shape {list(shape)} has more than 4 dims")
        if kind in ("unary", "binary") and is_integer(dtype):
            self._check_integer_arithmetic(node, dtype, inputs, attrs)
        # a folded op's output buffer takes the folded shape, so that every output tile is a box of it (a tile of
        # merged dims need not be one of the unfolded shape: [2, 1, 3, 4, 64] as [1536] in tiles of 1024); its
        # readers see the unfolded shape through a view
        buf = self._new_buffer(name or node.name, shape if folded is None else folded[0], dtype, node=node)
        written = View.whole(buf)
        out = written if folded is None else View(buf.name, shape, contiguous_strides(shape))
        self.ops.append(Op(self._name(f"{kind}_{node.name}" if name is None else name), kind, tuple(inputs), (written,),
                           tuple(sorted(attrs)), self._prov(node)))
        return out

    def _check_integer_arithmetic(self, node: fx.Node, dtype: torch.dtype, inputs, attrs) -> None:
        """Refuses an elementwise op with an integer result that float32 (what the ops compute in) may not hold
        exactly: any integer operand read at run time, or a bool one whose op with its scalar gives, for 0 or 1,
        another value in float32 than eager's integer math (``mask + 16777217`` gave 16777216: a fuzzer's finding;
        ``mask * 16777216`` is exact and compiles)."""
        dtypes = [self.buffers[v.buffer].dtype for v in inputs]
        if any(map(is_integer, dtypes)):
            what = "values read at run time"
        elif torch.bool in dtypes and not _exact_on_bools(dict(attrs), dtype):
            what = f"a bool tensor read at run time and the scalar {float(dict(attrs)['scalar']):.0f}"
        else:
            return
        self._unsupported(node, f"integer arithmetic on {what} ({dtype_name(dtype)} result): tilec's elementwise "
                                f"ops compute in float32, exact only up to 2**24, where eager computes in integers "
                                f"(arithmetic on the decode position alone is computed when compiling, exactly)")

    def as_view(self, value, node: fx.Node | None = None) -> View:
        """A view for an operand: runtime views pass through; constants and position tables get buffers."""
        if isinstance(value, View):
            return value
        if id(value) in self._views:
            return self._views[id(value)][1]
        view = self._materialize(value, node)
        self._views[id(value)] = (value, view)
        return view

    def _materialize(self, value, node: fx.Node | None) -> View:
        if isinstance(value, Static):
            t = value.value.contiguous()
            buf = self._new_buffer(const_name(node.name if node is not None else "c"), tuple(t.shape), t.dtype,
                                   BufferKind.CONST, node=node)
            self.constants[buf.name] = t
            return View.whole(buf)
        if isinstance(value, Positional):
            t = value.table.contiguous()
            buf = self._new_buffer(f"table_{node.name if node is not None else 't'}", tuple(t.shape), t.dtype,
                                   BufferKind.TABLE, node=node)  # errors name the node (a complex RoPE table)
            self.constants[buf.name] = t
            row = tuple(t.shape[1:])
            return View(buf.name, row, contiguous_strides(row), 0, int(t[0].numel()))
        raise _OperandError(f"an operand ({node.name if node is not None else value!r}) is not a tensor tilec "
                            f"produced")

    def record(self, e: UnsupportedNodeError) -> None:
        """Probe mode: notes ``e``'s node and reason in ``unsupported`` (lowering goes on), and the node in
        ``eager_fails`` for an :class:`EagerFailsError`."""
        self.unsupported.append(e.nodes[0] + (e.reason,))
        if isinstance(e, EagerFailsError):
            self.eager_fails.add(e.nodes[0][0])

    # ---- demand-driven lowering ------------------------------------------------------
    def value(self, node):
        if not isinstance(node, fx.Node):
            return node
        if node in self.env:
            return self.env[node]
        if self.cls[node] in ("static", "pos"):
            out = self._fold(node)
        elif node.op == "placeholder":
            try:
                out = self._placeholder(node)
            except UnsupportedNodeError as e:  # an input of a dtype / shape tilec has no code for
                if not self.probe:
                    raise
                self.record(e)
                out = self._opaque(node)
        elif self.probe:
            try:
                out = self._lower(node)
            except (UnsupportedNodeError, _OperandError) as e:
                # probe mode: note the node, stand in an input of its shape, keep going
                if isinstance(e, UnsupportedNodeError):
                    self.record(e)
                elif node.target is not operator.getitem:  # an element of an unsupported tuple is not news
                    self.unsupported.append((node.name, target_name(node), source_of(node), str(e)))
                for inp in node.all_input_nodes:  # find unsupported ancestors too (the backend's partitioner
                    self.value(inp)  # runs them eagerly: a refused attention's repeat_kv clones among them)
                out = None if val_of(node) is None or _data_dependent_shape(node) else self._opaque(node)
        else:
            out = self._lower(node)
        self.env[node] = out
        return out

    def view_of(self, node) -> View:
        return self.as_view(self.value(node), node)

    def _placeholder(self, node: fx.Node) -> View:
        val = val_of(node)
        if node.name in self.b.params:
            kind = BufferKind.PARAM
        elif node.name in self.b.consts:
            kind = BufferKind.STATE  # a mutated buffer
        elif node.name in set(self.b.mutations.values()):
            kind = BufferKind.STATE
        else:
            kind = BufferKind.INPUT
        if 0 in tuple(val.shape) or val.dtype not in DTYPE_CODES:
            role = {BufferKind.PARAM: "parameter", BufferKind.STATE: "state tensor"}.get(kind, "input")
            self._unsupported(node, f"zero-size {role} of shape {list(val.shape)} is not supported"
                              if 0 in tuple(val.shape) else dtype_why(val.dtype))
        buf = Buffer(node.name, tuple(val.shape), val.dtype, kind)
        self.buffers[buf.name] = buf
        return View.whole(buf)

    def _lower(self, node: fx.Node):
        t = node.target
        if t in SKIP:
            return None
        if _data_dependent_shape(node):
            self._unsupported(node, f"its shape {list(val_of(node).shape)} depends on a tensor's value read at run "
                                    f"time (.item(), nonzero, a mask's count): tilec plans every shape when it "
                                    f"compiles")
        if t is operator.getitem:
            src = self.value(node.args[0])
            if not isinstance(src, (tuple, list)):
                raise _OperandError(f"{node.args[0].name} has no lowered tuple value")
            return src[node.args[1]]
        # LayerNorm first: the RMSNorm of a centered value (x - mean(x) held in one variable) is a LayerNorm
        for pattern in (self._layernorm_decomposed, self._rmsnorm, self._silu_mul, self._rope_rotate_half, self._rope_interleaved,
                        self._rope_pairwise, self._eager_attention,
                        self._fp8_quant, self._fp8_quant_scale, self._fp8_linear, self._einsum,
                        self._paged_cache_write, self._paged_index_score):
            out = pattern(node)
            if out is not None:
                return out
        if t in VIEW_OPS:
            return self._view(node)
        if t is aten.index.Tensor and (view := self._index_view(node)) is not None:
            return view
        if t is aten.repeat_interleave.self_int:
            return self._repeat_interleave(node)
        if t in SPLITS:
            return self._split(node)
        if t in IDENTITY:
            src = self.value(node.args[0])
            if isinstance(src, View) and t is not aten.clone.default and t is not aten.contiguous.default:
                return src
            if isinstance(src, View) and src.is_contiguous():
                return src
            return self._emit(node, "copy", [self.as_view(src, node.args[0])])
        if t in CASTS or t is aten.type_as.default:
            src = self.view_of(node.args[0])
            want = val_of(node).dtype if t is aten.type_as.default else (node.kwargs.get("dtype") or val_of(node).dtype)
            if self.buffers[src.buffer].dtype == want:
                return src
            if is_integer(self.buffers[src.buffer].dtype) and is_integer(want):
                return self._emit(node, "copy", [src])  # exact (the unary ops compute in float32)
            return self._emit(node, "unary", [src], attrs=(("fn", "cast"), ("scalar", 0.0)))
        if t in (aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default):
            return self._linear(node)
        if t in SDPA_ARGS:
            return self._attention(node)
        if t in INDEX_WRITES:
            return self._index_write(node)
        if t is aten.copy_.default:
            return self._copy_(node)
        if t is aten.embedding.default:
            w, ids = self.view_of(node.args[0]), self.view_of(node.args[1])
            return self._emit(node, "embedding", [w, ids])
        if t in (aten._softmax.default, aten.softmax.int):
            dim = node.args[1]
            if dim not in (-1, len(val_of(node).shape) - 1):
                self._unsupported(node, "softmax over a dim other than the last")
            return self._emit(node, "softmax", [self.view_of(node.args[0])])
        if t in (aten.layer_norm.default, aten.native_layer_norm.default):
            return self._layernorm(node)
        if t is aten.rms_norm.default:
            return self._rms_norm_op(node)
        if t is aten.cat.default:
            return self._cat(node)
        if t in UNARY:
            return self._emit(node, "unary", [self._bcast(node.args[0], node)], attrs=(("fn", UNARY[t]), ("scalar", 0.0)))
        if t is aten.gelu.default:
            fn = "gelu_tanh" if node.kwargs.get("approximate", "none") == "tanh" else "gelu"
            return self._emit(node, "unary", [self._bcast(node.args[0], node)], attrs=(("fn", fn), ("scalar", 0.0)))
        if t is aten.pow.Tensor_Scalar or t is aten.square.default:  # square: ReLU^2 MLPs (Nemotron, Arcee)
            power = node.args[1] if t is aten.pow.Tensor_Scalar else 2.0
            if isinstance(power, fx.Node):  # a number read from a tensor: a constant one (a buffer's .item()) folds
                if self.cls[power] != "static":  # (float() of the node was a TypeError: a fresh user's finding)
                    self._unsupported(node, "its exponent is read at run time (x ** pos.item()): tilec computes a "
                                            "power by a number known when compiling")
                power = self.value(power).value
            power = float(power)
            return self._emit(node, "unary", [self._bcast(node.args[0], node)],
                              attrs=(("fn", "pow_scalar"), ("scalar", power)))
        if t in BINARY or t in (aten.add.Scalar, aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.rsub.Scalar,
                                aten.rsub.Tensor):
            return self._binary(node)
        if t in CLAMPS:
            return self._clamp(node)
        self._unsupported(node, ROUTING_WHY if t in ROUTING else SCAN_WHY if t in SCANS else None)

    # ---- generic lowerings -----------------------------------------------------------
    def _view(self, node: fx.Node):
        src = self.value(node.args[0])
        if not isinstance(src, View):
            self._unsupported(node, "view of a non-tensor value")
        buf = self.buffers[src.buffer]
        meta = torch.empty(buf.numel, dtype=buf.dtype, device="meta").as_strided(src.shape, src.strides, src.offset)
        args = [meta, *node.args[1:]]
        try:
            if node.target in RESHAPES:
                out = meta.view(val_of(node).shape)
            else:
                out = node.target(*args, **node.kwargs)
        except (RuntimeError, ValueError):  # torch's meta view raises either, by version
            # not expressible as a strided view: materialize a contiguous copy, then view it
            copy = self._emit(node, "copy", [src], out_shape=src.shape, out_dtype=buf.dtype, name=f"{node.name}_contig")
            return View(copy.buffer, tuple(val_of(node).shape), contiguous_strides(tuple(val_of(node).shape)))
        return View(src.buffer, tuple(out.shape), tuple(out.stride()), out.storage_offset(), src.pos_stride)

    def _index_view(self, node: fx.Node) -> View | None:
        """``x[..., [i, i + k, ...], ...]``: one constant 1-D integer index list, an arithmetic progression
        (Falcon's ``qkv[:, :, :, [-2]]`` in transformers <= 5.17), read as the strided view it equals;
        None for any other ``aten.index``."""
        src, idx = self.value(node.args[0]), node.args[1]
        dims = [d for d, i in enumerate(idx) if i is not None]
        if not isinstance(src, View) or len(dims) != 1:
            return None
        d = dims[0]
        c = self.value(idx[d])
        if not isinstance(c, Static) or c.value.dim() != 1 or c.value.numel() == 0 or c.value.is_floating_point():
            return None
        n = src.shape[d]
        vals = [int(i) for i in c.value.tolist()]
        if any(not -n <= i < n for i in vals):
            return None  # eager raises: the node is left to the unsupported-node error
        vals = [i % n for i in vals]
        step = vals[1] - vals[0] if len(vals) > 1 else 1
        if step < 1 or any(b - a != step for a, b in zip(vals, vals[1:])):
            return None
        shape, strides = list(src.shape), list(src.strides)
        shape[d], strides[d] = len(vals), strides[d] * step
        if tuple(shape) != tuple(val_of(node).shape):
            return None
        return View(src.buffer, tuple(shape), tuple(strides), src.offset + vals[0] * src.strides[d], src.pos_stride)

    def _repeat_interleave(self, node: fx.Node) -> View:
        """``repeat_interleave(x, r, dim)`` with an int ``r``: a copy of x read with a stride-0 dim after
        ``dim`` (x.unsqueeze(dim + 1).expand(r)), viewed as the result (GLM-4's halved cos / sin)."""
        src = self.view_of(node.args[0])
        args = list(node.args) + [None] * (3 - len(node.args))
        reps, dim = args[1], args[2] if args[2] is not None else node.kwargs.get("dim")
        if not isinstance(reps, int) or dim is None or node.kwargs.get("output_size") not in (None, reps * src.shape[dim]):
            self._unsupported(node, "repeat_interleave other than an int count along one dim")
        dim %= len(src.shape)
        shape = src.shape[:dim + 1] + (reps,) + src.shape[dim + 1:]
        wide = View(src.buffer, shape, src.strides[:dim + 1] + (0,) + src.strides[dim + 1:], src.offset, src.pos_stride)
        out = self._emit(node, "copy", [wide], out_shape=shape, out_dtype=self.buffers[src.buffer].dtype)
        return View(out.buffer, tuple(val_of(node).shape), contiguous_strides(tuple(val_of(node).shape)))

    def _split(self, node: fx.Node) -> tuple[View, ...]:
        """``split`` / ``chunk`` / ``unbind``: a tuple of zero-copy views (read by ``getitem``)."""
        src = self.value(node.args[0])
        if not isinstance(src, View):
            self._unsupported(node, "split of a non-tensor value")
        buf = self.buffers[src.buffer]
        meta = torch.empty(buf.numel, dtype=buf.dtype, device="meta").as_strided(src.shape, src.strides, src.offset)
        outs = node.target(meta, *node.args[1:], **node.kwargs)
        return tuple(View(src.buffer, tuple(o.shape), tuple(o.stride()), o.storage_offset(), src.pos_stride)
                     for o in outs)

    def _bcast(self, arg, node: fx.Node) -> View:
        """An operand expanded (stride 0) to the output shape of ``node``."""
        v = self.as_view(self.value(arg), arg if isinstance(arg, fx.Node) else None)
        shape = tuple(val_of(node).shape)
        if v.shape == shape:
            return v
        k = len(shape) - len(v.shape)
        strides = [0] * k + [0 if s == 1 and o != 1 else st for s, o, st in zip(v.shape, shape[k:], v.strides)]
        return View(v.buffer, shape, tuple(strides), v.offset, v.pos_stride)

    def _binary(self, node: fx.Node):
        t = node.target
        a, b = node.args[0], node.args[1]
        if alpha_of(node) != 1:
            self._unsupported(node, "alpha != 1")
        fn = BINARY.get(t) or {aten.add.Scalar: "add", aten.mul.Scalar: "mul", aten.sub.Scalar: "sub",
                                aten.div.Scalar: "div", aten.rsub.Scalar: "rsub", aten.rsub.Tensor: "rsub"}[t]
        def static_scalar(x):
            """``x``'s value when it is a number known when compiling: a Python number, a static one-element tensor,
            or a static number (``buffer.item()``, a float, not a tensor)."""
            if not isinstance(x, fx.Node):
                return x
            if self.cls[x] != "static":
                return None
            v = self.value(x).value
            if isinstance(v, torch.Tensor):
                return v.item() if v.numel() == 1 else None
            return v if isinstance(v, (bool, int, float)) else None

        scalars = [static_scalar(x) for x in (a, b)]
        out_dtype = val_of(node).dtype

        def operand(x, i: int) -> View:
            """Operand ``x`` expanded to the output's shape; an integer tensor in bf16 / fp16 arithmetic is
            first rounded to that dtype, as eager (CUDA) converts it to the result's dtype before the op -
            the elementwise ops read every operand as float32, so the rounding is a copy before them. So is a
            float32 one-element tensor on a GPU (a 0-dim argument: ``x * s``), which CUDA eager converts too (the
            constant one-element case: ``scalar`` below)."""
            v = self._bcast(x, node)
            src, d = self.buffers[v.buffer].dtype, val_of(x) if isinstance(x, fx.Node) else None
            on_gpu = isinstance(d, torch.Tensor) and d.device.type != "cpu"
            if out_dtype in (torch.bfloat16, torch.float16) and (is_integer(src) or (on_gpu and src != out_dtype)):
                v = self._emit(node, "copy", [v], out_dtype=out_dtype, name=f"{node.name}_{dtype_name(out_dtype)}{i}")
            return v

        def scalar(x, value) -> float:
            """The scalar operand as eager computes with it: a one-element tensor on a GPU in bf16 / fp16
            arithmetic rounded to that dtype first, as CUDA eager converts it (a float32 0-dim buffer's 3.7 is
            3.703125 in bf16); a Python number, or a tensor on the CPU, as the value (CPU eager reads it unrounded
            in x * s and x / s, and rounds it to x's dtype in other forms - x + s, s - x, s * x: the README's
            rounding note)."""
            d = val_of(x)
            if d is None or d.device.type == "cpu" or out_dtype not in (torch.bfloat16, torch.float16):
                return float(value)
            return float(self.value(x).value.reshape(()).to(out_dtype).item())

        if scalars[1] is not None and fn in ("add", "sub", "mul", "div", "rsub"):
            s = scalar(b, scalars[1])
            # a divisor eager treats as a CPU scalar divides as CUDA eager does, by the float reciprocal; one on
            # x's device (a 0-dim buffer) divides exactly (tilec/ops/ewise.py)
            fn2, s = {"add": ("add_scalar", s), "sub": ("add_scalar", -s), "mul": ("mul_scalar", s),
                      "div": ("div_scalar" if self._eager_cpu_scalar(b) else "div_exact_scalar", s), "rsub": ("rsub_scalar", s)}[fn]
            return self._emit(node, "unary", [operand(a, 0)], attrs=(("fn", fn2), ("scalar", s)))
        if scalars[0] is not None and fn in ("add", "mul", "sub", "rsub"):
            s = scalar(a, scalars[0])
            fn2, s = {"add": ("add_scalar", s), "mul": ("mul_scalar", s), "sub": ("rsub_scalar", s),
                      "rsub": ("add_scalar", -s)}[fn]
            return self._emit(node, "unary", [operand(b, 1)], attrs=(("fn", fn2), ("scalar", s)))
        if fn == "rsub":  # torch.rsub(x, y) of two tensors: y - x
            return self._emit(node, "binary", [operand(b, 1), operand(a, 0)], attrs=(("fn", "sub"),))
        if fn not in BINARY_FNS:
            self._unsupported(node)
        return self._emit(node, "binary", [operand(a, 0), operand(b, 1)], attrs=(("fn", fn),))

    def _clamp(self, node: fx.Node) -> View:
        """``torch.clamp`` (and ``torch.clip``, ``clamp_min`` / ``clamp_max``, ``F.relu6``, ``F.hardtanh``) as a
        ``maximum`` with the lower bound, then a ``minimum`` with the upper, each bound a tensor operand or a number
        (a constant in the result's dtype, as eager converts it; a finite number that overflows that dtype is an
        :class:`EagerFailsError`, as eager raises). Equal to eager's: each op's result is one of its operands, and
        rounding to the result's dtype is monotonic, so it commutes with both; NaN propagates (tilec/ops/ewise.py).
        The sign of a zero result may differ (``max(-0., 0.)``: even CPU eager's differs between its scalar and
        vector loops)."""
        t, args, kw = node.target, node.args, node.kwargs

        def arg(i, name, default=None):
            return args[i] if len(args) > i else kw.get(name, default)

        if t in (aten.clamp.default, aten.clamp.Tensor, aten.clip.default, aten.clip.Tensor):
            lo, hi = arg(1, "min"), arg(2, "max")
        elif t in (aten.clamp_min.default, aten.clamp_min.Tensor):
            lo, hi = arg(1, "min"), None
        elif t in (aten.clamp_max.default, aten.clamp_max.Tensor):
            lo, hi = None, arg(1, "max")
        elif t is aten.relu6.default:
            lo, hi = 0, 6
        else:  # hardtanh
            lo, hi = arg(1, "min_val", -1.0), arg(2, "max_val", 1.0)
        out_dtype, shape = val_of(node).dtype, tuple(val_of(node).shape)
        v = self._bcast(args[0], node)
        bounds = [(fn, b) for fn, b in (("maximum", lo), ("minimum", hi)) if b is not None]
        for i, (fn, b) in enumerate(bounds):
            if isinstance(b, fx.Node):
                bv = self._bcast(b, node)
            else:
                info = torch.finfo(out_dtype) if out_dtype.is_floating_point else torch.iinfo(out_dtype) \
                    if out_dtype != torch.bool else None
                if info is not None and math.isfinite(b) and not info.min <= b <= info.max:  # as c10's overflows()
                    self._unsupported(node, f"its bound {b!r} overflows {str(out_dtype).removeprefix('torch.')} "
                                            f"(eager PyTorch raises: the value cannot be converted to the tensor's "
                                            f"dtype without overflow)", eager_fails=True)
                c = self.as_view(Static(torch.tensor(b, dtype=out_dtype)), node)
                bv = View(c.buffer, shape, (0,) * len(shape))
            last = i == len(bounds) - 1
            v = self._emit(node, "binary", [v, bv], attrs=(("fn", fn),), name=None if last else f"{node.name}_{fn}")
        return v

    def _eager_cpu_scalar(self, x) -> bool:
        """Whether eager reads operand ``x`` of an elementwise op as a CPU scalar - a Python number, or a 0-dim
        tensor on the CPU that is not (made from) a parameter or buffer, which move with the module (e.g.
        ``torch.tensor(448.)`` made in forward) - whatever device the module runs on: CUDA eager then divides by
        it as a product with its float reciprocal, and reads it as a float32 value (ATen's div_true_kernel_cuda,
        gpu_kernel_with_scalars)."""
        d = val_of(x)
        if d is None:
            return True
        if d.dim() != 0 or d.device.type != "cpu":
            return False
        return not any(n.op == "placeholder" and (n.name in self.b.params or n.name in self.b.buffer_names)
                       for n in _upstream(x))

    def _linear(self, node: fx.Node):
        t = node.target
        if t is aten.linear.default:
            x, w = self.view_of(node.args[0]), self.view_of(node.args[1])
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if len(w.shape) != 2:  # (F.linear(x, v) of a vector v, a dot product, was an internal IndexError)
                self._unsupported(node, f"linear with a weight of shape {list(w.shape)} (tilec plans a weight [N, K]: "
                                        f"write a vector v as a [1, K] matrix, v.unsqueeze(0), and squeeze the result)")
        else:
            if t is aten.addmm.default and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
                self._unsupported(node, "addmm with beta or alpha != 1")
            args = node.args[1:] if t is aten.addmm.default else node.args
            bias = node.args[0] if t is aten.addmm.default else None
            x, wt = self.view_of(args[0]), self.view_of(args[1])
            if len(wt.shape) == 1:
                self._unsupported(node, f"matmul with a vector right operand ({list(wt.shape)}; tilec plans a weight "
                                        f"[K, N]: write it as a [K, 1] matrix, v.unsqueeze(-1), and squeeze the result)")
            if len(wt.shape) != 2:
                self._unsupported(node, "matmul with a batched right operand (tilec plans a weight [K, N]; a batched "
                                        "matmul only inside attention written out as matmul(softmax(matmul(q, "
                                        "k.transpose(2, 3)) * scale + mask, -1), v), with a constant scale and a float "
                                        "mask - or the scores masked by masked_fill(masked, fill) or torch.where("
                                        "allowed, scores, fill), the fill -inf or a finfo.min (at most -65504: it "
                                        "replaces the scores) - that is causal over the static cache)")
            w = View(wt.buffer, (wt.shape[1], wt.shape[0]), (wt.strides[1], wt.strides[0]), wt.offset, wt.pos_stride)
        inputs = [x, w]
        if bias is not None:
            bv = self.view_of(bias)
            if len(bv.shape) != 1:
                self._unsupported(node, "bias that is not 1-D")
            inputs.append(bv)
        dtypes = [self.buffers[v.buffer].dtype for v in inputs]
        if len(set(dtypes)) > 1:  # eager raises ("expected m1 and m2 to have the same dtype")
            names = ["input", "weight", "bias"]
            got = ", ".join(f"{n} {str(d).removeprefix('torch.')}" for n, d in zip(names, dtypes))
            self._unsupported(node, f"linear of mixed dtypes ({got}): eager PyTorch requires one dtype (cast the "
                                    f"input to the weight's dtype)", eager_fails=True)
        return self._emit(node, "linear", inputs)

    def _layernorm(self, node: fx.Node):
        x = self.view_of(node.args[0])
        shape = node.args[1]
        if len(shape) != 1:
            self._unsupported(node, "layer_norm over more than the last dim")
        args = list(node.args) + [None] * (5 - len(node.args))
        w, b, eps = args[2], args[3], args[4] if args[4] is not None else node.kwargs.get("eps", 1e-5)
        val = val_of(node) if node.target is aten.layer_norm.default else node.meta["val"][0]
        inputs = [x, self.view_of(w) if w is not None else self.as_view(Static(torch.ones(shape[0], dtype=val.dtype)), node)]
        if b is not None:
            inputs.append(self.view_of(b))
        out = self._emit(node, "layernorm", inputs, out_shape=val.shape, out_dtype=val.dtype, attrs=(("eps", float(eps)),))
        return out if node.target is aten.layer_norm.default else (out, None, None)

    def _rms_norm_op(self, node: fx.Node):
        """``torch.nn.functional.rms_norm`` / ``nn.RMSNorm`` (aten.rms_norm) over the last dim."""
        args = list(node.args) + [None] * (4 - len(node.args))
        x, shape, w = args[0], args[1], args[2]
        eps = args[3] if args[3] is not None else node.kwargs.get("eps")
        val = val_of(node)
        if len(shape) != 1:
            self._unsupported(node, "rms_norm over more than the last dim")
        if eps is None:  # torch's default: the epsilon of the op's float32 math (float64 for float64 input)
            eps = torch.finfo(torch.float64 if val.dtype == torch.float64 else torch.float32).eps
        wv = self.view_of(w) if w is not None else self.as_view(Static(torch.ones(shape[0], dtype=val.dtype)), node)
        xv = self.view_of(x)
        if self.buffers[xv.buffer].dtype != torch.float32:  # torch normalizes in float32 with no rounding before
            xv = self._upcast(node, xv)  # the weight; the op rounds to its x's dtype
        return self._emit(node, "rmsnorm", [xv, wv], attrs=(("eps", float(eps)),))

    def _upcast(self, node: fx.Node, v: View) -> View:
        """A float32 copy of ``v`` (a cast op of ``node``'s): for an op that rounds to its input's dtype
        where eager computes in float32."""
        return self._emit(node, "unary", [v], out_shape=v.shape, out_dtype=torch.float32,
                          attrs=(("fn", "cast"), ("scalar", 0.0)), name=f"{node.name}_upcast")

    def _cat(self, node: fx.Node):
        # empty parts add nothing (eager skips them, a 1-D empty tensor of any other rank too); kept, their
        # views and tiles were empty boxes that the executors refused at every call (Phi's RoPE with
        # partial_rotary_factor 1.0 concatenates an empty pass-through part)
        if not val_of(node).numel():
            self._unsupported(node, "a concatenation with an empty result")
        parts = [self.view_of(a) for a in node.args[0] if val_of(a).numel()]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim = dim % len(val_of(node).shape)
        return self._emit(node, "concat", parts, attrs=(("dim", dim),))

    # ---- attention and cache writes --------------------------------------------------
    def _gqa_source(self, n):
        """``reshape(clone(expand(unsqueeze(kv, 2))))`` (HF ``repeat_kv``) -> (kv node, group) or (n, 1)."""
        m = n
        if is_call(m, *RESHAPES):
            m = m.args[0]
            if is_call(m, aten.clone.default):
                m = m.args[0]
            if is_call(m, aten.expand.default) and is_call(m.args[0], aten.unsqueeze.default) and m.args[0].args[1] == 2:
                src = m.args[0].args[0]
                return src, val_of(m).shape[2]
        return n, 1

    def _attention(self, node: fx.Node):
        q_n, k_n, v_n = node.args[:3]
        rest = dict(zip(SDPA_ARGS[node.target], node.args[3:]))
        rest.update(node.kwargs)
        if "attn_bias" in rest:
            rest["attn_mask"] = rest.pop("attn_bias")
        if rest.get("dropout_p", 0.0) not in (0, 0.0):
            self._unsupported(node, "dropout in attention")
        if rest.get("is_causal"):
            self._unsupported(node, "is_causal=True (prefill attention) is not a decode step")
        out = self._plan_attention(node, q_n, k_n, v_n, rest.get("attn_mask"), rest.get("scale"))
        if node.target is aten.scaled_dot_product_attention.default:
            return out
        return (out,) + (None,) * 8  # fused variants return (out, logsumexp, ...); only out may be used

    def _plan_attention(self, node: fx.Node, q_n, k_n, v_n, mask, scale, out_dtype=None) -> View:
        """The ``attention`` op of ``node`` (SDPA, or an eager attention written out): queries
        [B, Hq, Sq, D], keys / values [B, Hkv, S, D] (HF ``repeat_kv`` read through), ``mask`` None
        or a node that must be causal over the static cache, ``scale`` None for ``D ** -0.5``."""
        q = self.view_of(q_n)
        (k_src, _), (v_src, _) = self._gqa_source(k_n), self._gqa_source(v_n)
        k, v = self.view_of(k_src), self.view_of(v_src)
        if not len(q.shape) == len(k.shape) == len(v.shape) == 4:
            self._unsupported(node, f"attention over {len(q.shape)}-d queries, {len(k.shape)}-d keys and "
                                    f"{len(v.shape)}-d values (tilec plans [batch, heads, tokens, head_dim])")
        bsz, hq, sq, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        if not (k.shape[0] == v.shape[0] == bsz and v.shape[1] == hkv and v.shape[2] == s and k.shape[3] == d):
            self._unsupported(node, f"attention of queries {list(q.shape)} over keys {list(k.shape)} and values "
                                    f"{list(v.shape)}: tilec plans keys and values of the queries' batch, with one head "
                                    f"count and length, and the queries' head dim")
        if hq % hkv:
            self._unsupported(node, f"{hq} query heads not a multiple of {hkv} KV heads")
        scale = d ** -0.5 if scale is None else scale  # scale=0.0 is a scale
        causal = False
        if mask is not None:
            self._check_causal_mask(node, mask, bsz, hq, sq, s)
            causal = True
        return self._emit(node, "attention", [q, k, v], out_shape=q.shape[:3] + (v.shape[3],),
                          out_dtype=self.buffers[q.buffer].dtype if out_dtype is None else out_dtype,
                          attrs=(("scale", float(scale)), ("causal", causal)))

    def _scalar_of(self, a) -> float | None:
        """A Python number, or a one-element constant tensor (GPT-J's ``scale_attn``), as a float."""
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return float(a)
        v = self.value(a) if isinstance(a, fx.Node) and self.cls[a] == "static" else None
        return float(v.value.reshape(-1)[0]) if isinstance(v, Static) and v.value.numel() == 1 else None

    def _eager_attention(self, node: fx.Node):
        """``matmul(softmax(matmul(q, k^T) * scale (+ mask), -1), v)`` - attention written out in
        torch ops (HF ``eager_attention_forward``, GPT-2's and GPT-J's ``_attn``; casts around the
        softmax and a float32 upcast of q and k allowed) - planned as the ``attention`` op (float32
        scores, as SDPA's kernels compute them; eager rounds bf16 scores, within the bf16 noise)."""
        mm = _matmul4(node)
        if mm is None:
            return None
        pr, v_n = mm
        # the probabilities' casts (to a float dtype: the device rounds them to V's) and eval-mode dropout (a clone)
        while is_call(pr, aten.clone.default, aten.alias.default) or \
                (is_call(pr, *CASTS) and val_of(pr).dtype.is_floating_point):
            pr = pr.args[0]
        if not is_call(pr, aten._softmax.default, aten.softmax.int) or pr.args[1] not in (-1, 3):
            return None
        sc, mask, selected = upcast_source(pr.args[0]), None, False
        if is_call(sc, aten.add.Tensor):
            for a, m in ((sc.args[0], sc.args[1]), (sc.args[1], sc.args[0])):
                if isinstance(m, fx.Node) and self._scaled_scores(a) is not None:
                    sc, mask = a, m
                    break
            else:
                return None
        elif is_call(sc, *_WHERES):
            # where(allowed, scores, fill): the bool mask is checked as causal (masked_fill(scores, masked, fill) was
            # rewritten so: masked_fill_as_where)
            allowed, a, fill = sc.args[:3]
            fill = fill_value(fill, self.gm, self.b.consts)
            if not (isinstance(allowed, fx.Node) and val_of(allowed) is not None and val_of(allowed).dtype == torch.bool
                    and fill is not None and fill <= MASKED_REPLACED_BELOW):
                return None
            sc, mask, selected = a, allowed, True
        found = self._scaled_scores(sc)
        if found is None:
            return None
        qk, scale = found
        q_n, kt = (upcast_source(a) for a in qk)
        if not is_call(kt, aten.transpose.int) or sorted(d % 4 for d in kt.args[1:]) != [2, 3]:
            return None
        k_n = upcast_source(kt.args[0])
        if mask is not None and not selected and not val_of(mask).dtype.is_floating_point:
            name = dtype_name(val_of(mask).dtype)
            what = self._argument(mask.name) if mask.op == "placeholder" else f"node {mask.name}"
            self._unsupported(node, f"a{'n' if name[0] in 'aeiou' else ''} {name} mask added to attention scores "
                                    f"({what}): "
                                    f"eager adds its values, 0 or 1 - a mask to add is float, 0 where allowed and a "
                                    f"large negative number where masked")
        if mask is not None and is_call(mask, aten.slice.Tensor) and tuple(val_of(mask).shape) == tuple(val_of(mask.args[0]).shape):
            mask = mask.args[0]  # HF's attention_mask[:, :, :, :key_len], the whole mask
        out = self._plan_attention(node, q_n, k_n, v_n, mask, scale, out_dtype=val_of(node).dtype)
        if tuple(out.shape) != tuple(val_of(node).shape):  # a mask broadcasting the scores wider
            self._unsupported(node, f"attention whose mask widens its result to {list(val_of(node).shape)} (the queries "
                                    f"give {list(out.shape)})")
        return out

    def _scaled_scores(self, n):
        """``matmul(q, k^T)`` times / divided by constants (float32 upcasts between) -> ((q, k^T), the
        product of the scales), or None."""
        scale = 1.0
        n = upcast_source(n)
        while is_call(n, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            c = self._scalar_of(n.args[1])
            if c is None or c == 0:
                return None
            scale = scale * c if is_call(n, aten.mul.Tensor, aten.mul.Scalar) else scale / c
            n = upcast_source(n.args[0])
        mm = _matmul4(n)
        return None if mm is None else (mm, scale)

    def _check_causal_mask(self, node, mask, bsz, hq, sq, s):
        """Raises unless ``mask`` is, at every planned position p, the causal mask over the static
        cache (row i allows columns ``<= p + i``). The mask is evaluated one position at a time
        and not tabulated (the attention op needs no table): a [P, ..., L] table grew as L^2 - a
        16384-row cache took 5.5 GB of host memory to compile. One verdict per mask node (the
        layers share HF's mask)."""
        if not isinstance(mask, fx.Node):
            self._unsupported(node, f"attention mask {mask!r} that is not a tensor")
        if self.cls[mask] == "runtime":
            why = self._unguardable(mask)
            if why:
                self._unsupported(node, f"attention mask computed from run-time inputs that tilec cannot check on "
                                        f"each call: {why}")
            p = self._example_not_causal(mask, (bsz, hq, sq, s))
            if p is not None:
                self._unsupported(node, f"attention mask computed from run-time inputs that is not the causal mask "
                                        f"over the static cache for the example arguments (at position {p}): tilec "
                                        f"plans decode attention as causal (a padded batch, a sliding window or "
                                        f"bidirectional attention is not)")
            self.mask_guards.setdefault(mask.name, (bsz, hq, sq, s))  # checked per call (tilec.guards)
            return
        if self.cls[mask] == "static":
            self._unsupported(node, "attention mask that is a constant, the same at every decode position (HF's "
                                    "sliding-window layers build theirs from a Python int, e.g. Mistral's "
                                    "sliding_window): tilec needs the causal mask over the static cache")
        n = min(self.max_positions, s - sq + 1)
        key = (mask, n, bsz, hq, sq, s)
        bad = self._mask_checks.get(key)
        if bad is None:
            bad = -1
            for p in range(n):
                try:
                    m = self._evaluate(mask, p, dict(self._static_cache))  # a throwaway cache per position
                except (IndexError, RuntimeError, ValueError) as e:  # e.g. a mask table of 64 rows indexed by p
                    where = source_of(mask)
                    raise InputError(f"the attention mask {mask.name} ({target_name(mask)})"
                                     f"{f' at {where}' if where else ''} fails at decode position {p}: "
                                     f"{type(e).__name__}: {e}; max_positions={self.max_positions} plans positions "
                                     f"the module cannot take - use max_positions <= {p}") from e
                if causal_mismatch(m, p, (bsz, hq, sq, s)):
                    bad = p
                    break
            self._mask_checks[key] = bad
        if bad >= 0:
            self._unsupported(node, f"attention mask at decode position {bad} is not the causal mask over the static "
                                    f"cache (tilec plans positions 0 to {n - 1} - max_positions={self.max_positions}, "
                                    f"a cache of {s} - and checks the mask at each)")

    def _example_not_causal(self, mask: fx.Node, shape: tuple) -> int | None:
        """The example position at which the run-time ``mask``, computed from the example arguments
        (``GraphBinding.examples``), is not causal; None when it is, or when the examples are not
        all known."""
        ex = self.b.examples
        if not ex:
            return None
        args = [ex.get(name) for name in self.b.user_inputs]
        guard = MaskGuard(self.gm, self.b.user_inputs, self.b.consts, mask.name, shape)
        if guard.key in self._example_verdicts:  # the layers' equal mask computations: evaluated once
            return self._example_verdicts[guard.key]
        if any(not isinstance(args[i], torch.Tensor) for i in guard.arg_index):
            return None
        p = next((int(v.reshape(-1)[0]) if isinstance(v, torch.Tensor) else int(v)
                  for name in self.b.user_inputs if name in self.b.positions
                  for v in (ex.get(name),) if isinstance(v, (torch.Tensor, int))), 0)
        try:
            bad = p if bool(guard.mismatch(args, p)) else None
        except (RuntimeError, TypeError, ValueError):  # the sub-graph fails on the examples: each call says so
            bad = None
        self._example_verdicts[guard.key] = bad
        return bad

    def _unguardable(self, mask: fx.Node) -> str:
        """Why a run-time ``mask`` cannot be checked per call by a :class:`tilec.guards.MaskGuard`
        (its value must follow from the call's arguments alone), or ``""`` when it can."""
        mutated = set(self.b.mutations.values())
        for n in _upstream(mask):
            if n.op == "placeholder" and n.name in mutated:
                return f"it reads {self._argument(n.name)}, which the step updates in place"
            if n.op == "call_function" and (n.target in INDEX_WRITES or n.target is aten.copy_.default):
                return f"it reads {n.name} ({target_name(n)}), an in-place write"
            if is_random(n):
                return f"it reads {n.name} ({target_name(n)}), a random op (drawn anew on every call)"
            if n.op not in ("placeholder", "get_attr", "call_function"):
                return f"it reads {n.name}, a {n.op} node"
        return ""

    def _check_slot_index(self, node, idx_node, sq, cache: View):
        val = self.value(idx_node)
        if not isinstance(val, Positional):
            if isinstance(idx_node, fx.Node):
                self._check_positions_listed(idx_node, cache)
            self._unsupported(node, "cache write at an index that is not the decode position (tilec plans writes "
                                    "at the step's positions: cache.index_copy_(dim, pos, new) or "
                                    "cache[..., pos, ...] = new, with pos an argument listed in positions)")
        for p in range(self.max_positions):
            if not torch.equal(val.table[p].flatten(), torch.arange(sq) + p):
                self._unsupported(node, f"the cache write's index is not the step's position: at decode position {p} "
                                        f"it is {val.table[p].tolist()}, not {list(range(p, p + sq))}; tilec plans "
                                        f"writes at exactly the step's positions (cache.index_copy_(dim, pos, new) or "
                                        f"cache[..., pos, ...] = new"
                                        + (f"; for {sq} tokens, pos + torch.arange({sq})" if sq > 1 else "") + ")")

    def _check_cache_length(self, cache: View, dim: int, sq: int) -> None:
        """Raises :class:`InputError` when the steps at ``p < max_positions``, each writing rows
        ``p..p+sq-1`` of ``cache`` along ``dim``, run past its end: max_positions is larger than
        the cache, or the example arguments carry more tokens than a step should."""
        length, last = cache.shape[dim], self.max_positions + sq - 2
        if last < length:
            return
        buf = self.buffers[cache.buffer]
        what = (f"the KV cache length {length} of {self._argument(buf.name)} "
                f"{str(buf.dtype).removeprefix('torch.')}{list(buf.shape)} (dim {dim})")
        if sq > length:
            raise InputError(f"a step writes {sq} rows, more than {what}: check the example arguments' token count")
        if sq == 1:
            raise InputError(f"max_positions {self.max_positions} exceeds {what}: use max_positions <= {length}")
        raise InputError(f"max_positions {self.max_positions} with {sq} tokens per step writes cache rows up to "
                         f"{last}, past {what}: check the example arguments' token count, or use "
                         f"max_positions <= {length - sq + 1}")

    def check_cache_writes(self) -> None:
        """Runs :meth:`_check_cache_length` on every ``index_copy`` into a graph input before any
        value is tabulated per position, so a ``max_positions`` far past the cache fails at once
        rather than after ``max_positions`` evaluations."""
        for n in self.gm.graph.nodes:
            if n.op == "call_function" and n.target in (aten.index_copy.default, aten.index_copy_.default) \
                    and n.args[0].op == "placeholder" and val_of(n.args[3]) is not None:
                dst = self.view_of(n.args[0])
                dim = n.args[1] % len(dst.shape)
                self._check_cache_length(dst, dim, val_of(n.args[3]).shape[dim])

    def _index_write(self, node: fx.Node):
        t = node.target
        dst_node = node.args[0]
        if dst_node.op != "placeholder":
            root = dst_node
            while root.op == "call_function" and root.target in INDEX_WRITES:
                root = root.args[0]
            if root is not dst_node and root.op == "placeholder":  # a write into an earlier write's result
                self._unsupported(node, f"a second write into {self._argument(root.name)} in one step (tilec plans one "
                                        f"in-place write per cache and step: write all of the step's rows at once)")
            base = dst_node
            while is_call(base, *RESHAPES):
                base = base.args[0]
            if base.op == "placeholder":  # cache.view(-1, D)[...] = new, not the paged write tilec plans
                self._unsupported(node, f"index write into a view of {self._argument(base.name)}: tilec plans such a "
                                        f"write as a paged cache write only (cache.view(-1, D)[slots] = new, or "
                                        f"index_copy_ along dim 0, without accumulate, with slots an integer "
                                        f"argument of the step - not a buffer, constant or decode position); a write "
                                        f"at the decode position goes into the cache itself "
                                        f"(cache.index_copy_(dim, pos, new))")
            self._unsupported(node, "index write into a tensor that is not a graph input (static cache)")
        dst = self.view_of(dst_node)
        if t in (aten.index_copy.default, aten.index_copy_.default):
            dim, idx, src_n = node.args[1], node.args[2], node.args[3]
        else:
            indices, src_n = node.args[1], node.args[2]
            dims = [i for i, ix in enumerate(indices) if ix is not None]
            if len(dims) != 1 or node.args[3:4] == (True,):
                self._unsupported(node, "index_put with more than one index tensor or accumulate=True")
            dim, idx = dims[0], indices[dims[0]]
        dim = dim % len(dst.shape)
        if self.b.strides_guarded and not val_of(dst_node).is_contiguous():  # (no call could run: _bind_each)
            cache = val_of(dst_node)
            self._unsupported(node, f"cache write into {self._argument(dst_node.name)}, which is not contiguous "
                                    f"(strides {list(cache.stride())} for shape {list(cache.shape)}): tilec updates a "
                                    f"cache in place as a contiguous tensor; keep the cache contiguous in the layout "
                                    f"forward reads it (e.g. allocate it [B, H, L, D] rather than transposing a "
                                    f"[B, L, H, D] one)")
        if val_of(src_n).dtype != val_of(dst_node).dtype:  # eager raises ("source and destination dtypes match")
            self._unsupported(node, f"cache write of a {str(val_of(src_n).dtype).removeprefix('torch.')} value into "
                                    f"a {str(val_of(dst_node).dtype).removeprefix('torch.')} cache: eager PyTorch "
                                    f"requires the same dtype (cast the value to the cache's dtype)",
                              eager_fails=True)
        src = self.view_of(src_n)
        pad = len(dst.shape) - len(src.shape)
        if pad > 0:  # index_put's value broadcasts from the right: torch.export drops its leading unit dims
            src = View(src.buffer, (1,) * pad + src.shape, (0,) * pad + src.strides, src.offset, src.pos_stride)
        if len(src.shape) != len(dst.shape) or any(a != b for i, (a, b) in enumerate(zip(src.shape, dst.shape))
                                                   if i != dim):
            self._unsupported(node, f"cache write of a value of shape {list(val_of(src_n).shape)} into "
                                    f"{list(dst.shape)} at dim {dim}: the value must have the cache's shape "
                                    f"outside dim {dim} (no broadcasting)")
        sq = src.shape[dim]
        self._check_cache_length(dst, dim, sq)
        self._check_slot_index(node, idx, sq, dst)
        shape = list(dst.shape)
        shape[dim] = sq
        slot = View(dst.buffer, tuple(shape), dst.strides, dst.offset, dst.strides[dim])
        self.ops.append(Op(self._name(f"cache_write_{node.name}"), "cache_write", (src,), (slot,), (),
                           self._prov(node)))
        self.state_writes.add(dst.buffer)
        return dst

    def _copy_(self, node: fx.Node):
        """AOTAutograd's ``copy_(input, new_value)`` epilogue for an in-place cache update."""
        dst_n, src_n = node.args[0], node.args[1]
        if dst_n.op == "placeholder" and dst_n.name in self.b.positions:
            return self.position_update(node, dst_n.name, src_n)
        src = self.value(src_n)
        if isinstance(src, View) and dst_n.op == "placeholder" and src.buffer == dst_n.name:
            return src
        if isinstance(src, View) and src.buffer in self._opaque_buffers and dst_n.op == "placeholder":
            # probe mode: the write-back of a value that runs eagerly (a second cache write) runs with it
            self._unsupported(node, f"writes {src_n.name}'s value back into {self._argument(dst_n.name)}, and "
                                    f"{src_n.name} runs eagerly (above)")
        self._unsupported(node, "copy_ into a graph input that is not an in-place cache write")

    def position_update(self, node: fx.Node, target: str, value_node) -> None:
        """A position input updated in place (HF's ``cumulative_length += 1``): its new value is
        tabulated over p and written back by the program after each step."""
        val = self.value(value_node)
        if not isinstance(val, Positional):
            self._unsupported(node, f"in-place update of position {self._argument(target)} with a value that does "
                                    f"not depend only on the position")
        self.position_updates[target] = val.table


def find_unsupported(gm: fx.GraphModule, binding: GraphBinding, max_positions: int = 1,
                     eager_fails: set[str] | None = None) -> list[tuple[str, str, str, str]]:
    """Every node the lowering cannot handle: ``(node, target, source line, reason)``; adds to
    ``eager_fails``, when given, the names of those eager PyTorch cannot run either (a linear of mixed dtypes).

    Runs the lowering in probe mode, where an unsupported node is recorded and replaced by
    an input of its shape, so one pass finds them all (not just the first). Raises
    :class:`InputError` as :func:`lower_graph` does (the inputs do not fit the module).
    """
    first = {}
    low = _lower(gm, binding, max_positions, probe=True)
    if eager_fails is not None:
        eager_fails |= low.eager_fails
    for n in low.unsupported:
        if n[0] not in first or first[n[0]][3] in ("", NO_OP_WHY):  # once per node: its first specific reason
            first[n[0]] = n
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}  # in graph order: a cause before its consumers
    return sorted(first.values(), key=lambda n: order.get(n[0], len(order)))


def lower_graph(gm: fx.GraphModule, binding: GraphBinding, max_positions: int = 1) -> OpGraph:
    """Lowers an aten graph to an :class:`OpGraph`.

    Args:
        gm: an aten-level FX graph with FakeTensor ``meta["val"]`` on every node.
        binding: how its placeholders bind (see :class:`GraphBinding`).
        max_positions: decode positions p to plan for (position tables have this many rows;
            the KV-cache length for an HF static cache).

    Raises:
        UnsupportedNodeError: naming the FX node, its target and source line.
        InputError: a KV-cache write runs past the cache for some p < max_positions, or its
            index comes from an integer argument that ``binding.positions`` leaves out.
    """
    low = _lower(gm, binding, max_positions)
    outputs = low.outputs
    # outputs owned by the program become OUTPUT buffers
    buffers = dict(low.buffers)
    for v in outputs:
        b = buffers[v.buffer]
        if b.kind is BufferKind.TEMP:
            buffers[v.buffer] = Buffer(b.name, b.shape, b.dtype, BufferKind.OUTPUT)
    inputs = []
    used = {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.users}
    for name in binding.user_inputs:
        if name in binding.positions:
            inputs.append(POSITION if name in used else IGNORED)
        elif name in buffers:
            inputs.append(name)
        else:
            inputs.append(IGNORED)
    updates = tuple((binding.user_inputs.index(name), table) for name, table in low.position_updates.items())
    ops = _order_state_accesses(low.ops, buffers, low.nodes)
    return OpGraph(tuple(ops), buffers, tuple(inputs), tuple(outputs), max_positions, low.constants, updates,
                   tuple(sorted(low.mask_guards.items())))


def _order_state_accesses(ops: list[Op], buffers: dict[str, Buffer], nodes: dict[str, fx.Node]) -> list[Op]:
    """Orders the ops so every read of a state buffer's *old* value precedes the op writing it
    in place, and every read of the written value follows it.

    The captured graph is functional: ``st2 = index_copy(st, ...)`` leaves readers of ``st``
    and of ``st2`` unordered, but tilec updates ``st`` in place (KV caches), so a read of the
    old value placed after the write would silently see the new one. A reader whose FX node
    descends from the writer's node reads the new value; any other reader of the same buffer
    reads the old one. Other ops keep their (demand-driven) order where the constraints allow.

    Raises:
        UnsupportedNodeError: one op would need both the old and the new value of a state buffer.
    """
    state = {name for name, b in buffers.items() if b.kind is BufferKind.STATE}
    writer_of: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        for v in op.outputs:
            writer_of.setdefault(v.buffer, []).append(i)
    if not any(b in state for b in writer_of):
        return ops
    descendants: dict[int, set[str]] = {}
    for b, ws in writer_of.items():
        if b not in state:
            continue
        for i in ws:
            prov = ops[i].provenance
            seen: set[str] = set()
            stack = [nodes[prov.node]] if prov is not None and prov.node in nodes else []
            while stack:
                for u in stack.pop().users:
                    if u.name not in seen:
                        seen.add(u.name)
                        stack.append(u)
            descendants[i] = seen
    preds: list[set[int]] = [set() for _ in ops]
    for j, op in enumerate(ops):
        for v in op.inputs:
            for i in writer_of.get(v.buffer, ()):
                if i == j:
                    continue
                if v.buffer not in state:
                    preds[j].add(i)
                elif op.provenance is not None and op.provenance.node in descendants[i]:
                    preds[j].add(i)  # reads the value the write produced
                elif op.provenance is None:
                    preds[max(i, j)].add(min(i, j))
                else:
                    preds[i].add(j)  # reads the old value: before the in-place write
    for b, ws in writer_of.items():
        for a, c in zip(ws, ws[1:]):
            preds[c].add(a)
    order, ready = [], [i for i in range(len(ops)) if not preds[i]]
    heapq.heapify(ready)
    succs: list[list[int]] = [[] for _ in ops]
    for j, ps in enumerate(preds):
        for i in ps:
            succs[i].append(j)
    missing = [len(ps) for ps in preds]
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succs[i]:
            missing[j] -= 1
            if missing[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(ops):
        stuck = next(ops[i] for i in range(len(ops)) if missing[i] > 0)
        prov = stuck.provenance
        raise UnsupportedNodeError([(prov.node if prov else stuck.name, prov.target if prov else stuck.kind,
                                     prov.source if prov else "")],
                                   "it reads both the old and the updated value of an in-place state buffer")
    return [ops[i] for i in order]


_MASKED_FILLS = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
_WHERES = (aten.where.self, aten.where.ScalarOther)


MASKED_REPLACED_BELOW = -65504.0  # a fill replacing masked scores at or below this masks them (fp16's finfo.min)


def masked_fill_as_where(gm: fx.GraphModule, consts: dict | None = None) -> int:
    """Rewrites, in place, each ``masked_fill(scores, masked, fill)`` of a bool ``masked`` and a constant ``fill`` of at
    most :data:`MASKED_REPLACED_BELOW` (``-inf``, a ``finfo.min``) that a softmax reads (through casts) as
    ``where(logical_not(masked), scores, fill)`` - the same values, and the form attention written by hand with
    ``torch.where(allowed, scores, fill)`` takes, whose bool ``allowed`` the attention lowering checks as its causal
    mask (:meth:`Lowering._eager_attention`). The node keeps its name and source line (its target and arguments
    change); a fill the scores' dtype cannot hold (fp16 scores filled with -1e30), which eager refuses, is left alone.
    ``consts``: placeholder name -> tensor, for a fill given as a constant tensor. Returns how many it rewrote (0 when
    run again)."""
    rewritten = 0
    for n in list(gm.graph.nodes):
        if not is_call(n, *_MASKED_FILLS) or len(n.args) != 3 or n.kwargs:
            continue
        scores, masked, fill = n.args
        m, s, value = val_of(masked), val_of(scores), fill_value(fill, gm, consts)
        if m is None or m.dtype != torch.bool or s is None or not s.dtype.is_floating_point or value is None \
                or not value <= MASKED_REPLACED_BELOW or (math.isfinite(value) and -value > torch.finfo(s.dtype).max):
            continue
        if not _attention_scores(scores):  # (another masked_fill stays as the user wrote it)
            continue
        reader = n
        while len(_readers(reader)) == 1 and is_call(_readers(reader)[0], *CASTS):
            reader = _readers(reader)[0]
        if not any(is_call(u, aten._softmax.default, aten.softmax.int) for u in _readers(reader)):
            continue
        with gm.graph.inserting_before(n):
            allowed = gm.graph.create_node("call_function", aten.logical_not.default, (masked,),
                                           name=f"{n.name}_allowed")  # (errors name the mask so)
        allowed.meta.update({k: n.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack")
                             if k in n.meta})  # (its source line)
        allowed.meta["val"] = torch.ops.aten.logical_not.default(m)
        n.meta["tilec_written_as"] = n.target  # (errors name the op the user wrote: fxgraph.target_name)
        n.target, n.args = aten.where.ScalarOther, (allowed, scores, value)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _attention_scores(n) -> bool:
    """Whether ``n`` is ``matmul(q, k^T)`` times / divided by anything (float32 upcasts between): attention scores."""
    n = upcast_source(n)
    while is_call(n, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        n = upcast_source(n.args[0])
    return _matmul4(n) is not None


def _readers(n: fx.Node) -> list[fx.Node]:
    """The nodes reading ``n``, less torch.export's metadata checks (``_assert_tensor_metadata`` after a cast)."""
    return [u for u in n.users if u.target is not aten._assert_tensor_metadata.default]


def fill_value(fill, gm: fx.GraphModule | None = None, consts: dict | None = None) -> float | None:
    """A masked_fill's or where's fill as a float: a Python number, a 0-dim ``scalar_tensor`` / ``full`` node, or a
    one-element constant tensor (a placeholder in ``consts``, a ``get_attr`` of ``gm``, through ``lift_fresh_copy``
    and casts: ``torch.tensor(finfo.min)`` in forward); else None."""
    if isinstance(fill, (int, float)) and not isinstance(fill, bool):
        return float(fill)
    if not isinstance(fill, fx.Node) or val_of(fill) is None or val_of(fill).numel() != 1 \
            or not val_of(fill).dtype.is_floating_point:
        return None
    if is_call(fill, aten.scalar_tensor.default, aten.full.default):
        value = fill.args[0] if fill.target is aten.scalar_tensor.default else fill.args[1]
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if is_call(fill, aten.lift_fresh_copy.default, aten.clone.default, *CASTS):
        return fill_value(fill.args[0], gm, consts)
    t = (consts or {}).get(fill.name) if fill.op == "placeholder" else \
        getattr(gm, fill.target, None) if fill.op == "get_attr" and gm is not None else None
    return float(t.reshape(-1)[0]) if isinstance(t, torch.Tensor) and t.numel() == 1 else None


def _lower(gm: fx.GraphModule, binding: GraphBinding, max_positions: int, probe: bool = False) -> Lowering:
    masked_fill_as_where(gm, binding.consts)
    low = Lowering(gm, binding, max_positions, probe)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    results = out_node.args[0]
    results = list(results) if isinstance(results, (tuple, list)) else [results]
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 20000))
    try:
        low.check_cache_writes()
        outputs = []
        for i, r in enumerate(results):
            if i < binding.mutation_outputs:
                target = binding.mutations[r.name]
                try:
                    if target in binding.positions:
                        low.position_update(r, target, r)
                        continue
                    if target in binding.consts:  # no argument binds it, so the program could never run
                        low._unsupported(r, f"in-place update of {low._argument(target)}, {BUFFER_STATE_WHY}: tilec "
                                            f"updates state its caller passes in (a KV "
                                            f"cache argument, as HF's StaticCache layers are); pass the tensor to "
                                            f"forward instead of keeping it as a module buffer")
                    v = low.value(r)
                    if not (isinstance(v, View) and v.buffer == target and target in low.state_writes):
                        low._unsupported(r, f"in-place update of {low._argument(target)} that is not a KV-cache write "
                                            f"(tilec plans writes at the decode position: cache.index_copy_(dim, "
                                            f"pos, new) or cache[..., pos, ...] = new with pos a position argument)")
                except UnsupportedNodeError as e:
                    if not probe:
                        raise
                    low.record(e)  # probe mode: keep going, as value() does
                continue
            v = low.value(r)
            try:
                outputs.append(low.as_view(v, r) if not isinstance(v, View) else v)
            except _OperandError:  # an output probe mode stood nothing in for (no tensor value)
                if not probe:
                    raise
                if isinstance(r, fx.Node) and all(u[0] != r.name for u in low.unsupported):
                    low.unsupported.append((r.name, target_name(r), source_of(r),
                                            "a graph output whose value comes from nodes that run eagerly"))
        for n in gm.graph.nodes:  # side-effecting in-place writes nobody reads
            if n.op == "call_function" and n.target in (aten.index_copy_.default, aten.index_put_.default,
                                                        aten.copy_.default):
                low.value(n)
    finally:
        sys.setrecursionlimit(old)
    low.outputs = outputs
    return low
