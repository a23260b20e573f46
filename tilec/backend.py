"""``torch.compile(model, backend="tilec", options={...})``.

Registered through the ``torch_dynamo_backends`` entry point, so it works in a fresh
process after ``pip install`` without importing tilec. Dynamo's graph goes through
AOTAutograd (inference, input mutations kept in the graph as ``copy_``) to the same aten
lowering as the offline path. Placeholders are classified from Dynamo's sources: module
parameters are bound by reference, module buffers (e.g. RoPE ``inv_freq``) are constants,
integer inputs with at most one element (``cache_position``, HF's ``cumulative_length``)
hold the decode position, everything else is a per-call input.

Unsupported nodes are partitioned out and run eagerly, with one log line per reason and
source line naming the nodes (once per process); with ``fallback=False`` one error lists them all. Plans are
cached in memory and on disk (``tilec.plancache``) by graph hash, options, tilec version
and target arch; the built CUDA libraries are cached on disk by the nvcc build cache. Without CUDA the reference executor
runs, with a one-time warning.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import operator
import re
import threading
import weakref

import torch
import torch.fx as fx

from . import __version__, plancache
from .dump import check_dump_root, dump_root, with_dump
from .errors import OptionsError, PositionError, TilecError, UnsupportedNodeError
from .frontend import MAX_POSITIONS, GraphBinding, find_unsupported, lower_graph
from .fxgraph import is_call, is_random, source_of, val_of
from .guards import GuardError, build_mask_guards
from .ir import DTYPE_CODES, contiguous_strides, is_integer
from .options import Options, unknown_options_message
from .pipeline import compile_opgraph
from .plan import PLAN_FORMAT
from .program import CompiledProgram, tensor_version

log = logging.getLogger("tilec")

BACKEND_KEYS = ("fallback", "max_positions")
_PLAN_CACHE: dict[str, object] = {}
CACHE_STATS = {"memory_hits": 0, "disk_hits": 0, "compiles": 0}
_warned_cpu = False
_warned_long_cache = False  # _cache_length clamped a cache past MAX_POSITIONS (said once)
_REGIONS: "weakref.WeakSet[_Region]" = weakref.WeakSet()  # live compiled regions, for check_errors()
_warned_dynamic = False  # the symbolic-shapes warning was given (once per process)
_warned_grad = False  # the no-autograd warning was given (once per process)


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """Backend options: every :class:`tilec.options.Options` field plus

    fallback: run unsupported nodes eagerly (True, default) or raise one error listing them.
    max_positions: decode positions to plan for; default: those whose step fits the static KV
        cache found in the graph (the size of the dim the cache writes index, less the step's
        rows - 1), or 1 without a cache.

    ``check`` defaults to ``"deferred"`` here (``Options``: True): a step's recorded error is raised
    at a later call, so a decode loop's host does not wait for each step.
    """

    compile: Options
    fallback: bool = True
    max_positions: int | None = None

    @staticmethod
    def as_dict(options) -> dict:
        """``torch.compile``'s ``options`` as a dict: a dict, an :class:`Options` (its fields) or None.
        Raises ``OptionsError`` (a ``ValueError``) for anything else."""
        if isinstance(options, Options):
            return {f.name: getattr(options, f.name) for f in dataclasses.fields(Options)}
        if options is not None and not isinstance(options, dict):
            raise OptionsError(f"tilec options: expected a dict or a tilec.options.Options, got {type(options).__name__}")
        return dict(options or {})

    @classmethod
    def from_dict(cls, d: dict | None) -> "BackendOptions":
        """Raises ``OptionsError`` (a ``ValueError``) naming an unknown key (with a "did you mean") or a bad value."""
        d = dict(d or {})
        d.setdefault("check", "deferred")  # a decode loop's host does not wait for each step (Options.check)
        extra = {k: d.pop(k) for k in BACKEND_KEYS if k in d}
        try:
            opts = Options.from_dict(d)
        except ValueError as e:
            if "unknown tilec option" in str(e):
                valid = [f.name for f in dataclasses.fields(Options)] + list(BACKEND_KEYS)
                raise OptionsError(unknown_options_message(sorted(set(d) - set(valid)), valid)) from None
            raise
        if not isinstance(extra.get("fallback", True), bool):
            raise OptionsError(f"tilec option fallback={extra['fallback']!r}: must be True or False")
        mp = extra.get("max_positions")
        if mp is not None and (not isinstance(mp, int) or isinstance(mp, bool) or not 1 <= mp <= MAX_POSITIONS):
            raise OptionsError(f"tilec option max_positions={mp!r}: must be an int in 1..{MAX_POSITIONS} (the most "
                               f"positions tilec tabulates) or None (the static cache's length)")
        return cls(opts, **extra)


def _source_name(node: fx.Node) -> str:
    ga = node.meta.get("grapharg")
    src = getattr(ga, "source", None)
    return src.name() if callable(getattr(src, "name", None)) else str(getattr(src, "name", "") or "")


def _user_label(node: fx.Node, module_first: bool = False) -> str:
    """The user's name of a Dynamo graph input, for errors: its source written as Python
    (``L['kwargs']['past_key_values'].layers[0].keys`` -> ``past_key_values.layers[0].keys``,
    ``L['args'][0]._modules['layers']._modules['0']._parameters['weight']`` -> ``self.layers[0].weight``),
    else the node's name. ``module_first``: Dynamo's ``L['args'][0]`` is the compiled module (its
    parameters come from there), so ``L['args'][k]`` is forward's positional argument k - 1."""
    src = _source_name(node)
    if not src:
        return f"graph input {node.name}"
    k = re.fullmatch(r"L\['args'\]\[(\d+)\]", src)
    if module_first and k and int(k[1]) >= 1:
        return f"forward's positional argument {int(k[1]) - 1}"
    # the compiled module itself (Dynamo passes it as the first argument of its call)
    src = re.sub(r"^L\['(?:fn|self)'\]|^L\['args'\]\[0\](?=\._(?:modules|parameters|buffers)\[)", "self", src)
    src = re.sub(r"\._modules\['(\d+)'\]", r"[\1]", src)  # a ModuleList entry
    src = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", src)
    src = re.sub(r"^L\['kwargs'\]\['([^']*)'\]", r"\1", src)
    return re.sub(r"^L\['([^']*)'\]", r"\1", src)


def _classify(dynamo_gm: fx.GraphModule, example_inputs) -> list[str]:
    """'param' | 'const' | 'position' | 'input' for each Dynamo input."""
    kinds = []
    placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    for node, t in zip(placeholders, example_inputs):
        src = _source_name(node)
        if not isinstance(t, torch.Tensor):
            kinds.append("input")
        elif "_parameters[" in src or isinstance(t, torch.nn.Parameter):
            kinds.append("param")
        elif "_buffers[" in src:
            kinds.append("const")
        elif is_integer(t.dtype) and t.numel() <= 1:
            kinds.append("position")  # cache_position, HF's cumulative_length (token ids are re-checked later)
        else:
            kinds.append("input")
    return kinds


def _cache_length(gm: fx.GraphModule) -> int:
    """The decode positions to plan for (1 when there is none): for the longest cache an
    ``index_copy`` / ``index_put`` (one index tensor) writes along its indexed dim, the positions p
    whose step still fits, ``length - rows + 1`` for a step that writes ``rows`` rows (the cache
    length itself for one token; a multi-token step once hit the cache-length error by default)."""
    aten = torch.ops.aten
    best = 1
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in (aten.index_copy.default, aten.index_copy_.default):
            length, index = int(n.args[0].meta["val"].shape[n.args[1]]), n.args[2]
        elif n.target in (aten.index_put.default, aten.index_put_.default):
            dims = [i for i, ix in enumerate(n.args[1]) if ix is not None]
            if len(dims) != 1:
                continue
            length, index = int(n.args[0].meta["val"].shape[dims[0]]), n.args[1][dims[0]]
        else:
            continue
        val = index.meta.get("val") if isinstance(index, fx.Node) else None
        rows = int(val.numel()) if isinstance(val, torch.Tensor) else 1
        best = max(best, length - rows + 1)
    if best > MAX_POSITIONS:  # planned positions are tabulated one by one: the rest run eagerly (PositionError)
        global _warned_long_cache
        if not _warned_long_cache:
            _warned_long_cache = True
            log.warning("tilec: a KV cache of %d positions: tilec plans the first %d (the most it tabulates); "
                        "steps at later positions run eagerly", best, MAX_POSITIONS)
        best = MAX_POSITIONS
    return best


def _writes_cache(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` writes a static cache (an ``index_copy`` / ``index_put``)."""
    aten = torch.ops.aten
    return any(is_call(n, aten.index_copy.default, aten.index_copy_.default, aten.index_put.default,
                       aten.index_put_.default) for n in gm.graph.nodes)


def _grown_caches(gm: fx.GraphModule, kinds: list[str]) -> list[fx.Node]:
    """The graph's outputs that are a concatenation onto a per-call graph input (not a parameter or
    constant) or onto an empty tensor, which the graph also reads: a cache grown by concatenation (HF's
    default dynamic cache, whose attention reads the grown keys; its first step concatenates onto an
    empty one). Each step of such a cache has new shapes, so is a new graph. None when the graph also
    writes a static cache (``index_copy`` / ``index_put``). A concatenation only returned
    (``torch.cat([x, y])`` of a plain function) is none: it ran eagerly with a hint about HF's caches (a
    fresh user's case)."""
    if _writes_cache(gm):
        return []
    aten = torch.ops.aten
    inputs = {n for n, kind in zip((n for n in gm.graph.nodes if n.op == "placeholder"), kinds) if kind == "input"}
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grown = []
    for n in out.all_input_nodes:
        if is_call(n, aten.cat.default) and any(u.op != "output" for u in n.users) and any(
                a in inputs or (isinstance(a, fx.Node) and (v := val_of(a)) is not None and v.numel() == 0)
                for a in n.args[0]):
            grown.append(n)
    return grown


def _growing_cache(gm: fx.GraphModule, kinds: list[str], tokens: tuple[int, fx.Node] | None) -> bool:
    """True, with one warning a process, for a decode step (one token a sequence: ``tokens`` as
    ``_tokens_per_sequence`` gives them) that returns a cache grown by concatenation
    (``_grown_caches``): its program would be planned and built (an nvcc build on a GPU) for the one
    call of that cache length."""
    grown = _grown_caches(gm, kinds) if tokens is None or tokens[0] <= 1 else []
    if not grown:
        return False
    key = _logged_key("position", "", "no static cache")
    if key not in _LOGGED_GROUPS:
        _LOGGED_GROUPS.add(key)
        log.warning("tilec: a decode graph returning %s, a concatenation onto its input (a cache grown by "
                    "concatenation, as HF's default one: a new graph each step), runs eagerly, as do later such "
                    "graphs. tilec compiles decode steps over a static KV cache: with HF generate(), pass "
                    "cache_implementation=\"static\"", grown[0].name)
    return True


def _graph_key(gm: fx.GraphModule, kinds, opts: BackendOptions) -> str:
    """The plan cache's key of ``gm``: its code, its inputs' shapes and dtypes, the values of the tensors it
    holds itself (``get_attr``: a ``torch.tensor([...])`` written in forward is one, which the plan bakes in; two
    instances with other literals shared a plan: a fresh user's finding), and the options."""
    h = hashlib.sha256(gm.code.encode())
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            h.update(f"{n.name}:{tuple(v.shape)}:{v.dtype}:{v.device.type}".encode())
        elif n.op == "get_attr":
            held = operator.attrgetter(n.target)(gm)
            if isinstance(held, torch.Tensor):
                h.update(n.target.encode())
                _hash_values(h, held)
    plan_opts = dataclasses.replace(opts, compile=dataclasses.replace(opts.compile, dump_dir=None))  # not the plan's
    h.update(repr((kinds, plan_opts, __version__, plancache.code_digest(), PLAN_FORMAT)).encode())
    return h.hexdigest()


def _consts_digest(flat_args, kinds) -> str:
    """Hash of the values of the module buffers folded as constants (RoPE inv_freq, ...)."""
    h = hashlib.sha256()
    for t, k in zip(flat_args, kinds):
        if k == "const" and isinstance(t, torch.Tensor):
            _hash_values(h, t)
    return h.hexdigest()


def _hash_values(h, t: torch.Tensor) -> None:
    """Adds ``t``'s dtype, shape and bytes to the hash ``h``."""
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _reaches(node: fx.Node, is_use, hops: int = 8) -> bool:
    """Whether ``node``'s value reaches, within ``hops`` ops (``ids.clamp(...)``, ``pos + arange``,
    views), a use ``is_use(user, value)`` accepts."""
    frontier, seen = [node], {node}
    for _ in range(hops):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.op != "call_function" or u in seen:
                    continue
                if is_use(u, n):
                    return True
                seen.add(u)
                nxt.append(u)
        frontier = nxt
    return False


def _embedding_index(u: fx.Node, n: fx.Node) -> bool:
    """``u`` is an embedding that ``n`` gives the indices of."""
    return u.target is torch.ops.aten.embedding.default and len(u.args) > 1 and u.args[1] is n


def _cache_write_index(u: fx.Node, n: fx.Node) -> bool:
    """``u`` is an ``index_copy`` / ``index_put`` whose index ``n`` is."""
    aten = torch.ops.aten
    if u.target in (aten.index_copy.default, aten.index_copy_.default):
        return len(u.args) > 2 and u.args[2] is n
    if u.target in (aten.index_put.default, aten.index_put_.default):
        return len(u.args) > 1 and any(ix is n for ix in u.args[1])
    return False


def _token_ids(node: fx.Node) -> bool:
    """A one-element integer input that indexes an embedding but no cache write holds token ids (a
    batch-1 step's), not a decode position; a learned positional embedding's index (GPT-2, OPT) that
    also places the cache write is a position."""
    return _reaches(node, _embedding_index) and not _reaches(node, _cache_write_index)


def _region_binding(gm: fx.GraphModule, flat_args, kinds, labels: list[str], snapshot: bool = False) -> GraphBinding:
    """The :class:`GraphBinding` of a region graph whose placeholders bind to ``flat_args``
    (classified by ``kinds``): constants bound (copied when ``snapshot``: a plan is keyed by their
    values), the rest call inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    binding = GraphBinding(labels=dict(zip((n.name for n in placeholders), labels)),
                           examples=dict(zip((n.name for n in placeholders), flat_args)), strides_guarded=True)
    for node, t, kind in zip(placeholders, flat_args, kinds):
        if kind == "const":
            binding.consts[node.name] = t.detach().clone() if snapshot else t
        else:
            binding.user_inputs.append(node.name)
            if kind == "position":
                binding.positions.add(node.name)
    return binding


def _compile_region(gm: fx.GraphModule, flat_args, kinds, opts: BackendOptions, labels: list[str], consts: str):
    """Compiles one aten graph whose placeholders bind to ``flat_args`` (classified by ``kinds``;
    ``labels`` name them in errors; ``consts`` is the constants' :func:`_consts_digest`)."""
    global _warned_cpu
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    binding = _region_binding(gm, flat_args, kinds, labels, snapshot=True)
    max_positions = opts.max_positions or _cache_length(gm)
    key = _graph_key(gm, kinds, opts) + f":{max_positions}:{opts.compile.arch}:{consts}"
    key = hashlib.sha256(key.encode()).hexdigest()[:32]
    dumping = dump_root(opts.compile) is not None  # then every compile writes its dump: no cache is read
    if dumping:
        check_dump_root(opts.compile)  # (one inside an artifact is refused, as compile_module refuses it)
    compiled = None if dumping else _PLAN_CACHE.get(key)
    if compiled is not None:
        CACHE_STATS["memory_hits"] += 1
    else:
        compiled = None if dumping else plancache.load(key)
        if compiled is not None:
            CACHE_STATS["disk_hits"] += 1
        else:
            CACHE_STATS["compiles"] += 1
            graph = lower_graph(gm, binding, max_positions)
            compiled = compile_opgraph(graph, opts.compile, with_dump(None, opts.compile, binding.labels))
            plancache.store(key, compiled)
        _PLAN_CACHE[key] = compiled
    user_args = [t for t, k in zip(flat_args, kinds) if k != "const"]
    program = CompiledProgram(compiled, binding, single_output=False, opts=opts.compile, example_args=user_args,
                              arg_labels=[label for label, k in zip(labels, kinds) if k != "const"],
                              guards=build_mask_guards(gm, binding, compiled.plan.graph.mask_guards),
                              in_place={n.name for n, k in zip(placeholders, kinds) if k == "param"},
                              trusted={n.name for n, k in zip(placeholders, kinds) if k != "computed"})
    if program.executor_kind == "reference" and not _warned_cpu:
        _warned_cpu = True
        log.warning("tilec: no CUDA device; running the CPU reference executor (for validation, not speed)")
    # parameters are per-call inputs: Dynamo reuses a graph for another module of the same
    # class and passes that module's weights, so they must never be bound at compile time
    user_idx = [i for i, k in enumerate(kinds) if k != "const"]
    return program, user_idx


MAX_CONSTANT_SETS = 8  # plans a graph region compiles for other values of its buffers; past it, eager


class _Region:
    """A compiled graph region as Dynamo calls it (every graph argument, constants included).

    Module buffers are compiled in as constants (folded, e.g. RoPE ``inv_freq`` into cos/sin
    tables), but Dynamo reuses a graph for another module of the same class (each layer of a
    regionally compiled stack, another model), passing that module's buffers, and a buffer may be
    edited in place. So each call compares the constant arguments with the last call's by identity,
    version counter and data pointer (no reads; an edit through ``.data`` or a numpy view, which
    bumps no version counter, is not seen). Other ones are looked up among the tensors seen before
    (held, so their ids stay theirs), else their values are hashed; the call then takes the plan
    for those values, compiled once. Past :data:`MAX_CONSTANT_SETS` sets of values, calls with new
    ones run eagerly, with one warning. A call whose decode position does not fit the plan (past
    ``max_positions``, or two one-element integer inputs that disagree), or whose run-time attention
    mask is not causal (:mod:`tilec.guards`), runs eagerly too, with one warning each (an error with
    ``fallback`` off).

    Outputs keep the strides the traced graph gave them (``meta["val"]``): an eager node after the
    region may rely on them (CUDA memory-efficient SDPA takes the attention mask as a slice of a
    padded one, with a row stride that is a multiple of 4; tilec writes its outputs contiguous).
    Outputs that are views of one tensor in the traced graph (``a, a.t(), a[:, 2:5]``) are views of
    one storage again, so an in-place edit of one shows in the others, as in eager.
    """

    def __init__(self, gm: fx.GraphModule, flat, kinds, labels, opts: BackendOptions):
        self.gm, self.kinds, self.labels, self.opts = gm, kinds, labels, opts
        outs, self.single = _outputs(gm)
        self.n_out = len(outs)
        self.layouts = [_traced_layout(n) for n in outs]
        self.aliases = _alias_groups(gm, outs)
        self.input_views = _input_views(gm, outs)
        for _, members in self.aliases:  # copied into their shared storage: not restrided first
            for i, *_ in members:
                self.layouts[i] = None
        self.writes_cache = _writes_cache(gm)
        self.const_idx = [i for i, k in enumerate(kinds) if k == "const" and isinstance(flat[i], torch.Tensor)]
        self.warned: set[str] = set()
        self.programs: dict[str, tuple[CompiledProgram, list[int]]] = {}
        self.known: dict[tuple, tuple[str, list[torch.Tensor]]] = {}  # identity key -> (digest, the tensors)
        self.key = None
        self._lock = threading.Lock()
        self._use(flat, self._identity(flat))
        _REGIONS.add(self)

    def _identity(self, args) -> tuple:
        """The constants' identities: object, version and address (a buffer made under ``torch.inference_mode``
        keeps no version counter - reading one raised, a helper's finding - so its in-place edits, allowed only in
        inference mode, are not seen, as the README says of edits through ``.data``)."""
        return tuple((id(args[i]), tensor_version(args[i]), args[i].data_ptr()) for i in self.const_idx)

    def _use(self, args, key: tuple) -> bool:
        """Takes the plan for ``args``' constants (``key``: their :meth:`_identity`); False when there is
        none and none may be compiled."""
        if key not in self.known:
            if len(self.known) >= 4 * MAX_CONSTANT_SETS:
                # the current key's tensors stay held: were they freed, a new tensor could take their id, version
                # and address, and run the current plan with stale constants (a helper's reading)
                current = self.known.get(self.key)
                self.known.clear()
                if current is not None:
                    self.known[self.key] = current
            self.known[key] = (_consts_digest(args, self.kinds), [args[i] for i in self.const_idx])
        digest = self.known[key][0]
        if digest not in self.programs:
            if len(self.programs) >= MAX_CONSTANT_SETS:
                self._warn("sets", f"tilec: a graph's module buffers took more than {MAX_CONSTANT_SETS} sets of "
                                   f"values; calls with new ones run eagerly (buffers are constants to tilec: pass "
                                   f"values that change as forward arguments)")
                return False
            self.programs[digest] = _compile_region(self.gm, args, self.kinds, self.opts, self.labels, digest)
        self.program, self.user_idx = self.programs[digest]
        self.key = key
        return True

    def _warn(self, what: str, message: str) -> None:
        if what not in self.warned:
            self.warned.add(what)
            log.warning(message)

    def _cacheless_position(self, args) -> str | None:
        """The error for a call whose one-element integer inputs hold values past 0 where this graph writes no
        cache and plans the value 0 alone (HF's dynamic RoPE: ``seq_len``, ``max(position_ids) + 1``, passed to
        the graph after a break), or None for a graph planned for more: such an input is no decode position the
        graph knows of, so the error names it as what it is (it was "seq_len holds decode position 5")."""
        if self.program.graph.max_positions != 1 or self.writes_cache:
            return None
        held = [f"{self.labels[i]} holds {int(args[i].reshape(-1)[0])}" for i, k in enumerate(self.kinds)
                if k == "position" and isinstance(args[i], torch.Tensor) and args[i].numel() == 1
                and int(args[i].reshape(-1)[0]) != 0]
        return (f"{', '.join(held)}: tilec reads a graph's one-element integer inputs as a decode position, computing "
                f"what depends on them when compiling, for each value it plans; this graph writes no KV cache, so it "
                f"plans the value 0 alone") if held else None

    def __call__(self, *args):
        # one call at a time: a call may switch self.program to another module's constants (two models of one
        # class decoded from two threads ran one model's call on the other's program: false deadlock errors)
        with self._lock:
            return self._call(args)

    def _call(self, args):
        key = self._identity(args)
        if key != self.key and not self._use(args, key):
            return self.gm(*args)
        try:
            outs = self.program(*(args[i] for i in self.user_idx))
        except PositionError as e:  # e.g. a default max_positions of 1 where the graph writes no cache
            said = None if "position" in self.warned else self._cacheless_position(args)
            if not self.opts.fallback:
                if said:
                    raise PositionError(said) from e
                raise
            self._warn("position", f"tilec: {said or e}; such calls run eagerly")
            return self.gm(*args)
        except GuardError as e:  # e.g. generate() on a padded batch
            if not self.opts.fallback:
                raise
            self._warn("mask", f"tilec: {e}; such calls run eagerly")
            return self.gm(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        assert len(outs) == self.n_out
        outs = [_restrided(t, lay) for t, lay in zip(outs, self.layouts)]
        for numel, members in self.aliases:
            store = torch.empty(numel, dtype=outs[members[0][0]].dtype, device=outs[members[0][0]].device)
            for i, shape, stride, offset in members:
                view = store.as_strided(shape, stride, offset)
                view.copy_(outs[i])
                outs[i] = view
        for i, j, shape, stride, delta, in_stride in self.input_views:  # as traced, when the input is
            a = args[j]
            if isinstance(a, torch.Tensor) and a.stride() == in_stride and a.dtype == outs[i].dtype:
                outs[i] = a.as_strided(shape, stride, a.storage_offset() + delta)
        outs = tuple(outs)
        return outs[0] if self.single else outs


def check_errors() -> None:
    """Raises what a decode step of any live ``torch.compile(backend="tilec")`` graph recorded and no
    call has raised yet (``check="deferred"``, the backend's default: a step's error is otherwise raised
    at that graph's next call), waiting for those records; e.g. after ``generate()``. Nothing on the
    CPU, whose reference executor raises as it runs.

    Raises:
        WatchdogError / TilecError: as the step would have with ``check=True``, prefixed "a step
            before this call".
    """
    for region in list(_REGIONS):
        for program, _ in list(region.programs.values()):
            program.check_errors()


def _traced_val(node):
    """An FX node's traced tensor (``meta["val"]``) when its shape, strides and storage offset are
    plain ints, else None."""
    v = val_of(node)
    if v is None:
        return None
    return None if any(isinstance(x, torch.SymInt) for x in (*v.shape, *v.stride(), v.storage_offset())) else v


def _storage_key(v) -> int:
    """Identifies a traced tensor's storage: views of one tensor share it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(v.untyped_storage()).cdata


def _traced_layout(node) -> tuple | None:
    """(shape, strides) of an output node's traced tensor when its strides are not a contiguous
    tensor's, else None (the output is used as tilec writes it). Compared literally: a kernel may
    check the stride of a dim of size 1 or of a broadcast (memory-efficient SDPA checks the heads'
    stride of its mask, which eager passes expanded, stride 0). None also when dims that are not
    broadcast share memory."""
    val = _traced_val(node)
    if val is None:
        return None
    shape, stride = tuple(val.shape), tuple(val.stride())
    if val.numel() <= 1 or stride == contiguous_strides(shape):
        return None
    kept = [(n, st) for n, st in zip(shape, stride) if st != 0]  # broadcast dims: rebuilt by expanding
    if not _distinct_elements([n for n, _ in kept], [st for _, st in kept]):
        return None
    return shape, stride


def _alias_groups(gm: fx.GraphModule, outs) -> list[tuple[int, list[tuple]]]:
    """Outputs that share a storage in the traced graph (``meta["val"]``), not a graph input's:
    per storage, its size in elements and ``(output index, shape, strides, storage offset)`` of each
    output on it. A storage is left out when a layout is symbolic or has elements sharing memory (an
    expanded view cannot be written), or the outputs on it differ in dtype."""
    inputs = {_storage_key(val_of(n)) for n in gm.graph.nodes if n.op == "placeholder" and val_of(n) is not None}
    by_storage: dict[int, list] = {}
    for i, n in enumerate(outs):
        v = val_of(n)
        if v is not None and v.numel() > 0:
            by_storage.setdefault(_storage_key(v), []).append((i, _traced_val(n)))
    groups = []
    for key, members in by_storage.items():
        if len(members) < 2 or key in inputs or any(v is None for _, v in members) \
                or len({v.dtype for _, v in members}) > 1:
            continue
        layouts = [(i, tuple(v.shape), tuple(v.stride()), v.storage_offset()) for i, v in members]
        if any(not _distinct_elements(shape, stride) for _, shape, stride, _ in layouts):
            continue
        groups.append((members[0][1].untyped_storage().nbytes() // members[0][1].element_size(), layouts))
    return groups


def _input_views(gm: fx.GraphModule, outs) -> list[tuple]:
    """Outputs that view a graph input in the traced graph (``meta["val"]`` on the input's storage;
    in a graph partly run eagerly, a region's input is a value an eager node or another region
    made): ``(output index, input index, shape, strides, storage offset from the input's, the
    input's strides)`` each, so a call returns them as views of the input it is given."""
    placeholders = [_traced_val(n) for n in gm.graph.nodes if n.op == "placeholder"]
    where = {_storage_key(v): j for j, v in enumerate(placeholders) if v is not None}
    views = []
    for i, n in enumerate(outs):
        v = _traced_val(n)
        if v is None or v.numel() == 0:
            continue
        j = where.get(_storage_key(v))
        if j is None or placeholders[j].dtype != v.dtype:
            continue
        views.append((i, j, tuple(v.shape), tuple(v.stride()), v.storage_offset() - placeholders[j].storage_offset(),
                      tuple(placeholders[j].stride())))
    return views


def _distinct_elements(shape, stride) -> bool:
    """Whether no two elements of a (shape, strides) layout share memory (dims of size 1 aside)."""
    span = 1
    for st, n in sorted((st, n) for n, st in zip(shape, stride) if n > 1):
        if st < span:  # each dim steps past all the smaller ones, or two elements share memory
            return False
        span = st * n
    return True


def _restrided(t, layout):
    """``t`` copied into a tensor of ``layout``'s (shape, strides) when its own strides differ; a
    broadcast dim (stride 0) takes ``t``'s first entry along it, expanded."""
    if layout is None or not isinstance(t, torch.Tensor) or tuple(t.shape) != layout[0] or t.stride() == layout[1]:
        return t
    shape, stride = layout
    base = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in stride)]
    out = torch.empty_strided(base.shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(base)
    return out.expand(shape)


def _outputs(gm: fx.GraphModule):
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return (list(out), False) if isinstance(out, (tuple, list)) else ([out], True)


def _has_symbolic_shapes(example_inputs) -> bool:
    for t in example_inputs:
        if isinstance(t, torch.SymInt):
            return True
        if isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in t.shape):
            return True
    return False


def tilec_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """The Dynamo backend entry point. Raises ``ValueError`` for unknown options,
    :class:`UnsupportedNodeError` (listing every unsupported node) when ``fallback=False``,
    :class:`tilec.errors.TilecError` for a shape-generic (dynamic) graph when ``fallback=False``, and
    :class:`tilec.errors.InputError` when a graph's cache writes do not fit its inputs (e.g. a
    ``max_positions`` option past the cache length), and :class:`tilec.dump.DumpError` for a dump
    directory (option ``dump_dir`` or ``$TILEC_DUMP_DIR``) that cannot be made or written, before
    tracing, whether or not the graph then compiles (Dynamo wraps each in ``BackendCompilerFailed``)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    opts = BackendOptions.from_dict({**BackendOptions.as_dict(options), **kwargs})
    check_dump_root(opts.compile)  # a bad dump directory is refused as a bad option is: at once, for every graph
    if _has_symbolic_shapes(example_inputs):
        # Dynamo made the graph shape-generic after a shape changed ("automatic dynamic");
        # a tilec plan is static, so this graph runs eagerly rather than failing (with fallback on).
        # Said once per process: a Python int argument brings a new graph per value, each one symbolic.
        if not opts.fallback:
            raise TilecError("tilec: torch.compile passed symbolic (dynamic) shapes and fallback is off, so this graph "
                             "cannot run eagerly either: tilec plans static shapes. Use torch.compile(..., dynamic=False), "
                             "which recompiles per shape.")
        global _warned_dynamic
        if _warned_dynamic:
            return gm.forward
        _warned_dynamic = True
        ints = any(isinstance(t, torch.SymInt) for t in example_inputs)
        log.warning("tilec: torch.compile passed symbolic (dynamic) shapes; tilec plans static shapes, so "
                    "this graph runs eagerly. Use torch.compile(..., dynamic=False) to recompile per shape."
                    + (" A Python int argument (e.g. a decode position) makes a graph per value: pass it as an "
                       "integer tensor of one element, which tilec reads as the decode position." if ints else ""))
        return gm.forward
    global _warned_grad
    if not _warned_grad and torch.is_grad_enabled() and any(
            t.requires_grad for t in (*gm.parameters(), *(a for a in example_inputs if isinstance(a, torch.Tensor)))):
        _warned_grad = True
        log.warning("tilec: compiling an inference graph: its outputs carry no autograd history (backward() will "
                    "fail on them). Call the model under torch.no_grad() or torch.inference_mode(); tilec does not "
                    "train")
    kinds = [*("param" for _ in gm.parameters()), *("const" for _ in gm.buffers()), *_classify(gm, example_inputs)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    module_first = any(_source_name(n).startswith("L['args'][0]._") for n in placeholders)
    labels = [*(name for name, _ in gm.named_parameters()), *(name for name, _ in gm.named_buffers()),
              *(_user_label(n, module_first) for n in placeholders)]

    def fw_compiler(aot_gm: fx.GraphModule, aot_inputs):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # tabulation and planning use real tensors
            return _compile_aot(aot_gm)

    def _compile_aot(aot_gm: fx.GraphModule):
        flat = [*gm.parameters(), *gm.buffers(), *example_inputs]
        placeholders = [n for n in aot_gm.graph.nodes if n.op == "placeholder"]
        if len(flat) != len(placeholders):
            # inputs that view one tensor, one of them written in place: AOTAutograd passes their
            # base instead of them (a "synthetic base"), which tilec's binding cannot follow
            why = "graph inputs that view one tensor, one of them written in place (e.g. a slice edited after a " \
                  "graph break)"
            if not opts.fallback:
                raise TilecError(f"tilec cannot compile a graph with {why} (options={{'fallback': False}})")
            log.warning("tilec: a graph with %s runs eagerly", why)
            return aot_gm
        written = {n.args[0] for n in aot_gm.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.copy_.default}
        for i, node in enumerate(placeholders):  # token ids of batch 1 look like a position: they index an embedding
            if kinds[i] == "position" and _token_ids(node):
                kinds[i] = "input"
            if kinds[i] in ("const", "param") and node in written:  # forward updates it: a per-call input
                kinds[i] = "input"
        binding = GraphBinding(user_inputs=[n.name for n in placeholders],
                               labels=dict(zip((n.name for n in placeholders), labels)),
                               examples=dict(zip((n.name for n in placeholders), flat)), strides_guarded=True)
        for node, kind, t in zip(placeholders, kinds, flat):
            if kind == "position":
                binding.positions.add(node.name)
            elif kind == "const":
                binding.consts[node.name] = t
        max_positions = opts.max_positions or _cache_length(aot_gm)
        tokens = _tokens_per_sequence(aot_gm)
        if opts.fallback and max_positions == 1 and _growing_cache(aot_gm, kinds, tokens):
            return aot_gm
        bad = find_unsupported(aot_gm, binding, max_positions)
        if not bad:
            return _Region(aot_gm, flat, kinds, labels, opts)
        label_of = {n.name: label for n, label in zip(placeholders, labels)}
        if not opts.fallback:
            named = [(label_of[b[0]], "graph input", *b[2:]) if b[0] in label_of else b for b in bad]
            raise UnsupportedNodeError(named, "fallback is off (options={'fallback': False})")
        first = _from_position_zero(aot_gm, flat, tokens, kinds)
        if first is not None or (tokens is not None and tokens[0] > PREFILL_TOKENS):
            _log_prefill(tokens, first, [b for b in bad if b[0] not in label_of] or bad, label_of)
            return aot_gm
        _log_fallback(bad, label_of)
        return _partitioned(aot_gm, flat, kinds, labels, opts, {b[0] for b in bad} | _foreign_dtype_nodes(aot_gm))

    # tilec compiles inference: trace under no_grad so AOTAutograd makes an inference graph
    # (outputs carry no autograd history, also when called with grad mode on)
    with torch.no_grad():
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler,
                                     keep_inference_input_mutations=True)


# A graph that must be split (some nodes run eagerly) and takes more tokens a sequence than this is a prefill: it
# runs eagerly whole. Llama-3.2-1B's 1024-token prefill under generate() split into 34 regions between its eager
# attention and cache writes, each planned and built as a program of its own; that outlasted a 300 s GPU call
# (forty-third session), and at 256 tokens on the CPU it took 155 s. Decode steps of a few tokens a sequence
# (speculative verification) stay below it. A graph that starts at position 0 (_from_position_zero) is a prefill
# at any length: a prompt of a few tokens made 4 programs of its regions, an nvcc build each on a GPU.
PREFILL_TOKENS = 16


def _tokens_per_sequence(gm: fx.GraphModule) -> tuple[int, fx.Node] | None:
    """``(tokens, node)``: the most tokens a sequence that ``gm`` processes, with the node that shows it - an
    embedding lookup of token ids passed in with at least 2 dims (their last dim), an attention's queries
    (``scaled_dot_product_attention`` and its kernels: dim -2), or a static cache's write (``index_copy``
    along a dim other than the first: its index's length); None without any. Flattened rows (batch x tokens),
    1-d ids, computed indices (a relative-position bias's buckets) and writes along the first dim (a paged
    cache's slots) would count a decode batch or a cache length as tokens."""
    aten = torch.ops.aten
    counts = []  # (tokens, node)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if is_call(n, aten.embedding.default) and len(n.args) > 1 and getattr(n.args[1], "op", None) == "placeholder" \
                and (v := val_of(n.args[1])) is not None and v.dim() >= 2:
            counts.append((v.shape[-1], n))  # token ids [..., tokens] passed in (not computed: a bias's buckets)
        elif "scaled_dot_product" in getattr(n.target, "__name__", "") and n.args \
                and (v := val_of(n.args[0])) is not None and v.dim() >= 2:
            counts.append((v.shape[-2], n))
        elif is_call(n, aten.index_copy.default, aten.index_copy_.default) and len(n.args) > 2 \
                and (dst := val_of(n.args[0])) is not None and isinstance(n.args[1], int) \
                and n.args[1] % max(dst.dim(), 1) != 0 and (v := val_of(n.args[2])) is not None:
            counts.append((v.numel(), n))  # a static cache's write along its position dim (paged: slots, dim 0)
    return max(((int(c), n) for c, n in counts), key=lambda cn: cn[0], default=None)


def _log_prefill(tokens: tuple[int, fx.Node] | None, first: tuple[int, fx.Node, str] | None, nodes: list[tuple],
                 label_of: dict[str, str]) -> None:
    """Says (once a process, then at DEBUG: each new prompt length is a new graph) that a prefill graph
    runs eagerly whole: ``tokens`` as ``_tokens_per_sequence`` gives it, ``first`` as ``_from_position_zero``
    does (or None), ``nodes`` those tilec cannot take, ``label_of`` the user's names of graph inputs."""
    count, node, how = first or (*tokens, None)
    src = source_of(node)
    key = _logged_key("prefill", "", src or node.name, str(how))
    level = logging.DEBUG if key in _LOGGED_GROUPS else logging.WARNING
    _LOGGED_GROUPS.add(key)
    at = f" at {src}" if src else ""
    name = label_of.get(node.name, node.name)
    if how == "positions":  # the prompt's positions: generate()'s prefill
        what = f"{count} tokens a sequence from position 0: {name} holds 0 .. {count - 1}"
    elif how == "mask":
        what = f"{count} tokens a sequence from position 0: the mask {name} covers no earlier position"
    elif how == "write":  # the prompt's own cache rows
        what = f"{count} tokens a sequence, written into the cache from position 0 by {node.name}{at}"
    else:
        what = f"{count} tokens a sequence: {node.name}{at}"
    log.log(level, "tilec: a prefill graph (%s) runs eagerly whole: tilec cannot take %d of its nodes (the first, "
            "%s: %s), and split around them it would make a tilec program of each region between them; tilec "
            "compiles decode steps", what, len(nodes), nodes[0][0], nodes[0][3] or "unsupported")


def _from_position_zero(gm: fx.GraphModule, flat: list, tokens: tuple[int, fx.Node] | None, kinds: list[str]
                        ) -> tuple[int, fx.Node, str] | None:
    """``(P, node, how)`` (how: "write", "positions" or "mask") when the example call of ``gm`` is a
    prefill from position 0 of P > 1 tokens a sequence (HF's, padded or not; a speculative-decoding
    verification step starts further on): a static cache write (``index_copy`` along a dim other than
    the first) at positions ``0 .. P - 1`` (node: the write; its index evaluated from the example
    arguments when it depends on a few small graph inputs only - newer HF versions add a per-layer
    counter to an ``arange``), or, where the graph takes P tokens a sequence (``tokens``, as
    ``_tokens_per_sequence`` says) and returns a cache grown by concatenation (``_grown_caches``, with
    ``kinds`` the placeholders' kinds: HF's default cache; a model with no cache - a BERT's mask or
    token types - is no prefill), an integer input ``[P]`` or ``[B, P]`` holding ``0 .. P - 1`` (in
    each row; HF's ``cache_position`` or ``position_ids``) or a 2-d integer attention mask ``[B, P]``
    of 0 / 1 ending in 1 (HF's covers every position so far: P columns are the step's own, no past; a
    padded batch) - node: the input. Else None. The decision holds for every later call of the graph
    (its values are not guarded; HF's prefill and verification steps are different graphs)."""
    def counts_from_zero(v, rows: bool = False) -> bool:  # 0 .. P - 1 (rows: in each row of its last dim)
        if not isinstance(v, torch.Tensor) or not is_integer(v.dtype):
            return False
        n = v.shape[-1] if rows and v.dim() else v.numel()
        return n > 1 and bool((v.reshape(-1, n).cpu() == torch.arange(n, dtype=v.dtype)).all())

    aten = torch.ops.aten
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if not (is_call(n, aten.index_copy.default, aten.index_copy_.default) and len(n.args) > 2
                and isinstance(n.args[1], int) and isinstance(n.args[2], fx.Node)):
            continue
        dst, idx = val_of(n.args[0]), val_of(n.args[2])
        if dst is None or idx is None or n.args[1] % max(dst.dim(), 1) == 0 or idx.numel() < 2:
            continue
        value = _example_value(n.args[2], placeholders, order, flat)
        if counts_from_zero(value):
            return value.numel(), n, "write"

    def mask_of_only(v) -> bool:  # an HF 2-d attention mask [B, P] (0 / 1, left padded) of the step's tokens alone
        return v.dim() == 2 and is_integer(v.dtype) and bool(((v == 0) | (v == 1)).all()) and bool((v[:, -1] == 1).all())

    if tokens is not None and tokens[0] > 1 and _grown_caches(gm, kinds):
        for n, i in placeholders.items():
            v = flat[i]
            if isinstance(v, torch.Tensor) and 1 <= v.dim() <= 2 and v.shape[-1] == tokens[0] and v.numel() <= 4096:
                if counts_from_zero(v, rows=True):
                    return tokens[0], n, "positions"
                if mask_of_only(v):
                    return tokens[0], n, "mask"
    return None


def _example_value(node: fx.Node, placeholders: dict, order: dict, flat: list, limit: int = 32):
    """``node``'s value in the example call (``flat``: the graph inputs' values, ``placeholders`` and
    ``order`` the graph's placeholder and node indices), evaluated from the graph inputs it depends on
    when those are small (at most 4096 elements each) and its ancestors few (``limit``); else None."""
    needed, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            v = flat[placeholders[n]]
            if not isinstance(v, torch.Tensor) or v.numel() > 4096:
                return None
        elif n.op != "call_function" or len(seen) > limit or getattr(getattr(n.target, "_schema", None),
                                                                     "is_mutable", True) \
                or is_random(n):
            return None  # (an in-place or random op, or a Python function: not evaluated here)
        needed.append(n)
        stack.extend(n.all_input_nodes)
    env = {}
    try:
        for n in sorted(needed, key=order.__getitem__):
            if n.op == "placeholder":
                env[n] = flat[placeholders[n]]
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = n.target(*args, **kwargs)
    except Exception:  # an op that fails on these inputs: not a known prefill
        return None
    return env[node]


FALLBACK_LINES = 4  # graph inputs or groups of nodes run eagerly for one reason that are logged one line each
_LOGGED_GROUPS: set[tuple] = set()  # what _log_fallback and _log_prefill logged in this process (_logged_key)


def _log_fallback(bad: list[tuple], label_of: dict[str, str]) -> None:
    """Logs what runs eagerly: the graph inputs tilec cannot take (by the user's names) and the
    nodes, grouped by reason and source line, or target without one (the same line in every layer
    of a model is one line: "running 32 nodes eagerly at ..."), one line a group up to
    FALLBACK_LINES per reason, then one line for the rest (a float64 model once logged every weight
    and every node of its graph). What was logged in this process for an earlier graph (of this
    model or another: each new prompt length of ``generate()`` is a new graph) goes to DEBUG, with
    one WARNING line counting it; reasons are compared without their numbers (a position)."""
    inputs: dict[str, list[str]] = {}
    nodes: dict[str, dict[str, list[tuple]]] = {}  # reason -> source line -> [(name, target)]
    for name, target, src, reason in bad:
        if name in label_of:  # an input is not run: what reads it is (listed too)
            inputs.setdefault(reason, []).append(label_of[name])
        else:
            nodes.setdefault(reason, {}).setdefault(src or f"<{target}>", []).append((name, target))
    old_inputs = old_nodes = 0
    for reason, labels in inputs.items():
        if reason.startswith("dtype torch.float64"):  # also what a Python float argument becomes
            reason += ("; cast the model and its inputs to float32, bfloat16 or float16 to compile them (a "
                       "Python float argument becomes a float64 input too: pass it as a tensor)")
        fresh = [label for label in labels if _logged_key("input", reason, label) not in _LOGGED_GROUPS]
        old_inputs += len(labels) - len(fresh)
        for label in fresh[:FALLBACK_LINES]:
            _LOGGED_GROUPS.add(_logged_key("input", reason, label))
            log.warning("tilec: graph input %s: %s; the nodes reading it run eagerly", label, reason)
        if len(fresh) > FALLBACK_LINES:  # (not remembered: a later graph names them)
            log.warning("tilec: %d more graph input(s): %s; the nodes reading them run eagerly",
                        len(fresh) - FALLBACK_LINES, reason)
    for reason, groups in nodes.items():
        why = f": {reason}" if reason else ""
        fresh = []
        for src, group in groups.items():
            key = _logged_key("nodes", reason, src, ", ".join(sorted({t for _, t in group})))
            at = "" if src.startswith("<") else f" at {src}"
            if key in _LOGGED_GROUPS:
                old_nodes += len(group)
                log.debug("tilec: running %d node(s) eagerly%s%s (%s)", len(group), at, why,
                          _names(n for n, _ in group))
            else:
                fresh.append((key, at, group))
        for key, at, group in fresh[:FALLBACK_LINES]:
            _LOGGED_GROUPS.add(key)
            if len(group) == 1:
                log.warning("tilec: running %s (%s) eagerly%s%s", *group[0], at, why)
            else:
                log.warning("tilec: running %d nodes (%s: %s) eagerly%s%s", len(group), key[-1],
                            _names(n for n, _ in group), at, why)
        rest = [n for _, _, group in fresh[FALLBACK_LINES:] for n, _ in group]
        if rest:  # (not remembered: a later graph shows their lines)
            log.warning("tilec: running %d more node(s) eagerly%s: %s", len(rest), why, _names(rest))
    if old_inputs or old_nodes:
        said = " and ".join(f"{n} {what}" for n, what in ((old_nodes, "node(s) run eagerly"),
                                                         (old_inputs, "graph input(s) not taken")) if n)
        log.warning("tilec: %s for reasons already logged in this process (the logger 'tilec' at DEBUG lists "
                    "them)", said)


def _logged_key(kind: str, reason: str, *parts: str) -> tuple:
    """A key of ``_LOGGED_GROUPS``: numbers in the reason (a position) do not tell lines apart; in
    the other parts (source lines, names) they do."""
    return (kind, re.sub(r"\d+", "#", reason), *parts)


def _names(names, shown: int = 8) -> str:
    """Up to ``shown`` node names, comma-separated, then ", ..." for the rest."""
    names = list(names)
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def _foreign_dtype_nodes(gm: fx.GraphModule) -> set[str]:
    """The call nodes that read or produce a tensor of a dtype tilec has no code for (a float64
    model): they run eagerly too, so that no tilec region gets such a tensor at its boundary (an
    unsupported input is refused by the region's lowering, not run eagerly)."""
    def foreign(n) -> bool:
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else (vals,)
        return any(isinstance(v, torch.Tensor) and v.dtype not in DTYPE_CODES for v in vals)

    return {n.name for n in gm.graph.nodes if n.op == "call_function"
            and (foreign(n) or any(foreign(a) for a in n.all_input_nodes))}


def _partitioned(aot_gm: fx.GraphModule, flat, kinds, labels, opts: BackendOptions, bad: set[str]):
    """Splits the graph: supported regions become tilec programs, the rest runs eagerly.

    A region can refuse nodes the whole graph lowered: functionalization puts each static cache's
    write-back ``copy_`` at the graph's end, in the last region, while the ``index_copy`` it copies
    lands in an earlier one when an eager node (a padded batch's attention) splits the graph there.
    Each region is probed before any is compiled; nodes a region refuses then run eagerly and the
    graph is split again (a few rounds at most), so the rest of that region - the last layer's GEMVs
    and the LM head - still compiles."""
    for _ in range(4):
        split = _partition_once(aot_gm, flat, kinds, labels, opts, bad)
        if not isinstance(split, set):
            return split
        bad = bad | split
    return _partition_once(aot_gm, flat, kinds, labels, opts, bad, last=True)


def _partition_once(aot_gm: fx.GraphModule, flat, kinds, labels, opts: BackendOptions, bad: set[str],
                    last: bool = False):
    """One split of :func:`_partitioned`: its forward, or (unless ``last``) the names of graph nodes
    its regions refuse that the whole graph had lowered (then nothing is compiled)."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    class Support(OperatorSupportBase):
        def is_node_supported(self, submodules, node: fx.Node) -> bool:
            return node.op == "call_function" and node.name not in bad

    # every region plans the positions the whole graph's caches hold (a region whose cache write
    # runs eagerly - a float64 model's - would otherwise plan position 0 only)
    opts = dataclasses.replace(opts, max_positions=opts.max_positions or _cache_length(aot_gm))
    gm = fx.GraphModule(aot_gm, copy.deepcopy(aot_gm.graph))  # (the partitioner rewrites the graph it is given)
    part = CapabilityBasedPartitioner(gm, Support(), allows_single_node_partition=True)
    fused = part.fuse_partitions(part.propose_partitions())
    outer_ph = [n for n in fused.graph.nodes if n.op == "placeholder"]
    kind_of = {n.name: k for n, k in zip(outer_ph, kinds)}
    label_of = {n.name: label for n, label in zip(outer_ph, labels)}
    value_of = {n.name: t for n, t in zip(outer_ph, flat)}
    # run the split graph once on (copies of) the example inputs to learn each region's arguments
    recorded: dict[str, list] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            recorded[target] = list(args)
            return super().call_module(target, args, kwargs)

    # (on copies of the inputs - among them the buffers and weights forward updates, whose update
    # this run once applied a second time; weights and constant buffers are passed as they are)
    with torch.no_grad():
        Recorder(fused).run(*[t.clone() if isinstance(t, torch.Tensor) and kind_of[n.name] not in ("param", "const")
                              else t for n, t in zip(outer_ph, flat)])
    regions = []
    for node in fused.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(fused, node.target)
        sub_kinds, sub_labels = [], []
        for a in node.args:
            if isinstance(a, fx.Node) and a.op == "placeholder":
                sub_kinds.append(kind_of[a.name])
                sub_labels.append(label_of[a.name])
            else:  # an input Dynamo's guards do not cover
                sub_kinds.append("computed")
                sub_labels.append(f"the value of node {getattr(a, 'name', a)} (computed eagerly)")
        args = [value_of.get(a.name) if isinstance(a, fx.Node) and a.op == "placeholder" else r
                for a, r in zip(node.args, recorded.get(node.target, []))]
        regions.append((node.target, sub, args, sub_kinds, sub_labels))
    recorded.clear()  # (the Recorder class keeps the dict, and its clones of the inputs, until collected)
    if not last:  # probe every region (a pass over each finds all it refuses) before compiling any
        names = {n.name for n in aot_gm.graph.nodes if n.op == "call_function"}
        refused = set()
        for _, sub, args, sub_kinds, sub_labels in regions:
            own = {n.name for n in sub.graph.nodes if n.op == "placeholder"}
            try:
                found = find_unsupported(sub, _region_binding(sub, args, sub_kinds, sub_labels), opts.max_positions)
            except TilecError:
                continue  # (compiling it below says why)
            refused |= {b[0] for b in found} & names - bad - own
        if refused:
            return refused
    for target, sub, args, sub_kinds, sub_labels in regions:
        try:
            runner = _Region(sub, args, sub_kinds, sub_labels, opts)
        except UnsupportedNodeError as e:
            log.warning("tilec: region %s runs eagerly: %s", target, " ".join(str(e).split()))
            continue
        setattr(fused, target, _Callable(runner))
    fused.recompile()
    return fused.forward


class _Callable(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _register_without_install() -> bool:
    """Registers ``backend="tilec"`` with Dynamo when tilec runs from a source tree (``PYTHONPATH``,
    no ``pip install``, hence no ``torch_dynamo_backends`` entry point): there, importing this module
    (``import tilec.backend``) before ``torch.compile`` is enough. After an install Dynamo loads this
    module through the entry point and registers it itself, so nothing is done (registering twice
    raises in Dynamo). Returns whether it registered."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "tilec" in _COMPILER_FNS or "tilec" in entry_points(group="torch_dynamo_backends").names:
        return False
    register_backend(tilec_backend, name="tilec")
    return True


_register_without_install()
