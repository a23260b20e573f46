"""Graph capture for the offline path: ``torch.export`` -> functional aten graph + binding."""
from __future__ import annotations

import collections
import contextlib
import inspect
import io
import itertools
import logging
import os
import sys
import threading
import traceback
import warnings

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .errors import DataDependentError, ExampleInputError, InputError, TilecError, describe_exception
from .frontend import GraphBinding

log = logging.getLogger("tilec")


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

    attributes = tensor_attributes(module)
    _check_attribute_names(attributes)
    args = _detach_state_arguments(module, tuple(args))
    with torch.no_grad(), warnings.catch_warnings(), _quiet_fake_tensor_log(), _helper_frames_recorded(module):
        # torch's own pytree deprecation notice (LeafSpec), raised inside export: not the user's
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ep = torch.export.export(module, tuple(args), strict=False).run_decompositions({})
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # also a sys.exit() or a BaseException subclass of the user's forward
            _replay_stderr(err.getvalue(), e)
            _check_runs_eagerly(module, args)  # the user's own error, named as such
            _check_not_aliased(module, args, e)
            _check_data_dependent(e, [i for i in positions if isinstance(args[i], torch.Tensor) and args[i].dim() == 0])
            _check_meta_refused(e)
            raise
        _replay_stderr(err.getvalue(), None)
    _check_static_shapes(ep.graph_module)
    sig = ep.graph_signature
    state = dict(module.state_dict(keep_vars=True))
    state.update(dict(module.named_buffers(remove_duplicate=False)))
    binding = GraphBinding()
    held_ids, held_memory, unregistered = {}, {}, []
    unregistered_state = _unregistered_module_state(module)
    for path, t in attributes.items():
        held_ids.setdefault(id(t), path)
        held_memory.setdefault(_memory_key(t), path)  # (a Parameter in a list: export lifts a new tensor of it)
    user_idx = 0
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            binding.params[name] = state.get(spec.target, ep.state_dict.get(spec.target)).detach()
            binding.param_names[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            t = state.get(spec.target, ep.state_dict.get(spec.target) if spec.target in ep.state_dict
                          else ep.constants.get(spec.target))
            binding.consts[name] = t.detach().clone()  # a snapshot, as the plan folds their values
            binding.buffer_names[name] = spec.target
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            binding.consts[name] = ep.constants[spec.target]
            # a plain attribute by its name; one held in a list / tuple / dict is lifted_tensor_<n>, that very tensor
            # (not one forward made, which is lifted so too)
            t = binding.consts[name]
            held = spec.target if spec.target in attributes else held_ids.get(id(t)) or (
                held_memory.get(_memory_key(t)) if isinstance(t, torch.Tensor) else None)
            if spec.kind == InputKind.CONSTANT_TENSOR and held is not None:
                binding.attribute_names[name] = held
                binding.consts[name] = t.detach().clone()  # a snapshot, as of buffers
            elif spec.kind == InputKind.CONSTANT_TENSOR and isinstance(t, torch.Tensor):
                unregistered.append(unregistered_state.get(_memory_key(t)))
        elif spec.kind == InputKind.USER_INPUT:
            binding.user_inputs.append(name)
            if user_idx in positions:
                binding.positions.add(name)
            user_idx += 1
    unregistered = [u for u in unregistered if u]
    if unregistered:
        log.warning("tilec: %s%s: a module held in a list, tuple or dict attribute is not registered (use nn.ModuleList "
                    "or nn.ModuleDict), so the step takes its weights as constants when compiling - replacing or "
                    "editing them later is not seen", unregistered[0],
                    f" and {len(unregistered) - 1} more" if len(unregistered) > 1 else "")
    outs = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    n_mut = sum(spec.kind in (OutputKind.USER_INPUT_MUTATION, OutputKind.BUFFER_MUTATION) for spec in sig.output_specs)
    for i, n in enumerate(outs):
        if not isinstance(n, fx.Node):  # None, or a Python constant, among forward's results
            raise InputError(f"{_non_tensor_output(ep.call_spec.out_spec, i - n_mut, n)}: a compiled step returns "
                             f"tensors only (return just the tensors)")
    out_names = [n.name for n in outs]
    for i, (spec, node_name) in enumerate(zip(sig.output_specs, out_names)):
        if spec.kind in (OutputKind.USER_INPUT_MUTATION, OutputKind.BUFFER_MUTATION):
            if binding.mutation_outputs != i:  # torch.export lists in-place updates first
                raise TilecError(f"torch.export listed the in-place update of {spec.target} after a user output; "
                                 f"tilec expects them first (torch {torch.__version__})")
            target = spec.target
            placeholder = next((s.arg.name for s in sig.input_specs
                                if s.target == target or s.arg.name == target), target)
            binding.mutations[node_name] = placeholder
            binding.mutation_outputs += 1
    leaves = pytree.tree_leaves(tuple(args))
    if len(leaves) == len(binding.user_inputs):
        binding.examples = dict(zip(binding.user_inputs, leaves))
    binding.single_output = ep.call_spec.out_spec.is_leaf()
    binding.out_spec = ep.call_spec.out_spec
    binding.listed_positions = True
    return ep.graph_module, binding


def _non_tensor_output(spec, k: int, value) -> str:
    """What forward returned that is not a tensor: ``value``, leaf ``k`` of its flattened result (output
    structure ``spec``), named where it sits in the result as the user wrote it (``output 1`` of a tuple,
    ``forward's result[1]['a'][0]``; the outputs are the flattened structure, so a ``torch.Size`` returned
    as output 1 is several leaves), or by its flat index where the structure cannot be walked."""
    try:
        paths = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))[0]
        path = paths[k][0]
    except Exception:  # noqa: BLE001 - a container type without key paths: the flat index says where
        return (f"forward returns a non-tensor value ({value!r}) among its outputs (after flattening its "
                f"structure: output {k})")
    parent, s, j = None, spec, k
    while not s.is_leaf():  # the container holding leaf k
        parent = s.type
        # (TreeSpec.child is newer than children_specs, which warns where it is)
        for child in ([s.child(c) for c in range(s.num_children)] if hasattr(s, "child") else s.children_specs):
            if j < child.num_leaves:
                s = child
                break
            j -= child.num_leaves
    if not path:
        return f"forward returns {value!r}, not a tensor"
    if len(path) == 1 and isinstance(path[0], pytree.SequenceKey) and parent in (tuple, list):
        return f"output {path[0].idx} of forward is {value!r}, not a tensor"
    size = (" (an element of a torch.Size: a shape is fixed when compiling, so take it from the inputs outside "
            "the step)") if parent is torch.Size else ""
    return f"forward's result{pytree.keystr(path)} is {value!r}, not a tensor{size}"


def _names_read(code) -> set[str]:
    """The global and attribute names ``code`` and the functions nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names_read(const)
    return names


def _user_functions(module: torch.nn.Module) -> set[tuple[str, str]]:
    """``(file, name)`` of the functions forward may call as helpers: the methods of the module's and its
    submodules' classes (those not torch's), and the functions of their files that those methods name, and those
    functions in turn - not the rest of the file (a ``main()`` calling compile_module beside a class whose forward
    is torch's was named as the op's line: a reviewer's finding), nor a function running now."""
    running, frame = set(), sys._getframe()
    while frame is not None:
        running.add(frame.f_code)
        frame = frame.f_back
    found, seen, done = set(), set(), set()
    for m in module.modules():
        for cls in type(m).__mro__:
            if cls in seen or cls.__module__.split(".")[0] in ("torch", "builtins"):
                continue
            seen.add(cls)
            owner = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
            todo = list(vars(cls).values())
            while todo:
                value = todo.pop()
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                elif isinstance(value, property):
                    value = value.fget
                if not inspect.isfunction(value) or value.__module__ != cls.__module__:
                    continue
                code = inspect.unwrap(value).__code__  # (a decorated function's own)
                if code in done:
                    continue
                done.add(code)
                if code not in running:
                    found.add((code.co_filename, code.co_name))
                todo.extend(owner[name] for name in _names_read(code) if name in owner)
    return found


_ANCHORS_LOCK = threading.Lock()
_ANCHORS_HELD: collections.Counter = collections.Counter()  # entries tilec added, by the exports that need them


@contextlib.contextmanager
def _helper_frames_recorded(module: torch.nn.Module):
    """Has torch.export keep the frames of the module's helpers (:func:`_user_functions`) in each node's stack
    trace, so that :func:`tilec.fxgraph.source_of` names the line inside a helper forward calls: torch keeps only
    frames named ``forward`` and those registered in ``torch.fx.proxy._STACK_TRACE_ANCHORS`` (an op in
    ``self._mlp(x)`` was named by forward's line calling it). Registered for the export only, counted across
    threads exporting at once (torch's own entries are never removed); with a torch without that registry,
    forward's lines as before."""
    anchors = getattr(fx.proxy, "_STACK_TRACE_ANCHORS", None)
    if not isinstance(anchors, set):
        yield
        return
    wanted = _user_functions(module)
    with _ANCHORS_LOCK:
        mine = {a for a in wanted if a not in anchors or _ANCHORS_HELD[a] > 0}
        _ANCHORS_HELD.update(mine)
        anchors.update(mine)
    try:
        yield
    finally:
        with _ANCHORS_LOCK:
            _ANCHORS_HELD.subtract(mine)
            done = {a for a in mine if _ANCHORS_HELD[a] <= 0}
            for a in done:
                del _ANCHORS_HELD[a]
            anchors.difference_update(done)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """Mutes torch's fake-tensor logger, which logs a full traceback at ERROR level for an
    exception tilec then reports itself (once, with the user's source line), and its symbolic-shapes
    logger, which prints the partial graph (twice) when a forward branches on a tensor's value."""
    logs = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _replay_stderr(text: str, cause: BaseException | None) -> None:
    """Writes what the module and torch.export wrote to stderr during the export, less the partial
    graph that torch.export prints (twice, unconditionally) for an export error that carries one:
    tilec reports that error itself, with the user's source line."""
    graph = getattr(cause, "partial_fx_graph", None)
    if graph is not None:
        text = text.replace(f"{graph}\n", "")
    if text:
        sys.stderr.write(text)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # tilec's own frames are never the user's


def _raised_at(e: BaseException, skip: tuple[str, ...]) -> str:
    """`` at FILE:LINE (code)`` of the innermost frame of ``e``'s traceback outside tilec whose
    file path holds none of ``skip`` (e.g. ``"/torch/"``): the user's line that raised; ``""``
    without one (a failure inside torch's own modules)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not any(part in f.filename.replace("\\", "/") for part in skip)
              and not os.path.abspath(f.filename).startswith(_PACKAGE_DIR)]
    return f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""


def _check_data_dependent(cause: BaseException, zero_dim_positions: list[int] = ()) -> None:
    """After a failed export of a module that runs eagerly: raises :class:`DataDependentError` naming the
    user's source line when export failed on a value-dependent branch or size (torch's
    ``GuardOnDataDependentSymNode``, whose own message is about guards and symbols; or an ``IndexError`` for an index
    that is a symbol, ``cache[:, pos.item()] = k``: a fresh user's raw traceback), and when a
    position argument is a 0-d tensor (``cache[:, pos] = k`` then reads its value) saying to pass
    it with one dimension if that is the value read; returns otherwise."""
    from torch.fx.experimental import symbolic_shapes

    kind = getattr(symbolic_shapes, "GuardOnDataDependentSymNode", None)
    symint_index = isinstance(cause, IndexError) and "SymInt" in str(cause)  # cache[:, pos.item()] = k
    if not symint_index and (kind is None or not isinstance(cause, kind)):
        return
    where = _raised_at(cause, ("/torch/", "/tilec/"))
    # a 0-d position is one possible cause, not the only one (OPT slices position ids by the cache's
    # length, dynamic RoPE compares positions with its cached length): both are said
    zero_d = (f" If the value read there is position argument {zero_dim_positions[0]}, a 0-d tensor that indexing "
              f"reads as a number, pass it with one dimension, torch.tensor([p]) (or write the cache with "
              f"index_copy_).") if zero_dim_positions else ""
    raise DataDependentError(f"torch.export cannot capture the module: it depends on a tensor's value{where} (a "
                             f"branch, a loop count, a size or an index read from data; for a cache written at a "
                             f"position read with .item(), write cache.index_copy_(dim, pos, new)). tilec compiles "
                             f"one static graph per step: make the computation independent of tensor values (e.g. "
                             f"both branches selected with torch.where, a fixed loop count), decide outside forward, "
                             f"or compile with torch.compile(module, backend='tilec'), which runs such code eagerly.",
                             zero_d) from cause


def _check_static_shapes(gm: fx.GraphModule) -> None:
    """After a successful export: raises :class:`DataDependentError` naming the first node whose tensor has a size or
    a storage offset that torch.export could only write as a value read from a tensor (an unbacked symbol: shape
    ``[1, u0]``, or ``x[n.item()]``'s offset), and the node that read that value. tilec plans static shapes and
    offsets; the lowering of such a graph could fail inside torch (``GuardOnDataDependentSymNode``) or tilec (OPT
    sizes its position ids by ``.item()`` of the cache's length counter: a helper's finding), or compile an index
    read from data as the example's (``x[n.item()]``: a wrong result, a reviewer's finding)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from .fxgraph import source_of, target_name

    def where(m: fx.Node, same_as: str = "") -> str:
        src = source_of(m)
        return f"{m.name} ({target_name(m)})" + (" on the same line" if src and src == same_as else
                                                 f" at {src}" if src else "")

    readers: dict = {}  # unbacked symbol -> the first node whose value is (or holds) it: the .item() reading it
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        syms = free_unbacked_symbols(v) if v is not None else set()
        if not syms:
            continue
        if not isinstance(v, torch.Tensor):
            for sym in syms:
                readers.setdefault(sym, n)
            continue
        in_shape = set().union(*(free_unbacked_symbols(d) for d in v.shape))
        first = next((readers[sym] for sym in sorted(in_shape or syms, key=str) if sym in readers),
                     next(iter(readers.values()), None))  # (a symbol derived from the read: its first reader)
        read = f" ({where(first, source_of(n))} reads it at run time)" if first is not None else ""
        what = (f"the module's shapes depend on a tensor's value: {where(n)} has shape "
                f"[{', '.join(str(d) for d in v.shape)}], a size taken from data" if in_shape else
                f"the module's indexing depends on a tensor's value: {where(n)} reads its input at an offset taken "
                f"from data (an index read at run time, as x[n.item()])")
        raise DataDependentError(f"{what}{read}. tilec compiles one static graph per step: make the sizes and "
                                 f"indices independent of tensor values (Python ints, or a tensor's shape; a decode "
                                 f"position as a listed position argument), or compile with "
                                 f"torch.compile(module, backend='tilec'), which runs such code eagerly.")


def _check_meta_refused(cause: BaseException) -> None:
    """After a failed export of a module that runs eagerly: raises :class:`TilecError` naming the user's
    source line when torch's tracing kernels (``torch/_meta_registrations.py``, ``torch/_refs``,
    ``torch/_prims``) refused an op that eager runs - e.g. ``mask << 1`` of a bool tensor, whose meta
    check wants an integer dtype where eager promotes (torch 2.11-2.13); returns otherwise."""
    if not isinstance(cause, RuntimeError):
        return
    # the innermost frame of torch's own code below its torch._check helpers must be a tracing kernel's
    files = [f.filename.replace("\\", "/") for f in traceback.extract_tb(cause.__traceback__)]
    torch_frames = [f for f in files if "/torch/" in f and not f.endswith("/torch/__init__.py")]
    if not torch_frames or not any(part in torch_frames[-1] for part in
                                   ("/torch/_meta_registrations.py", "/torch/_refs/", "/torch/_prims/")):
        return
    how = ("- a shift of a bool mask as its product with 2**k, `mask * 2`, which tilec lowers (it has no shift op, "
           "and refuses integer arithmetic on integer tensors read at run time)" if "shift" in str(cause).lower()
           else "- e.g. with a bool tensor cast to another dtype first")
    raise TilecError(f"torch.export cannot trace the module{_raised_at(cause, ('/torch/', '/tilec/'))}: torch's "
                     f"tracing kernel refuses an op that eager PyTorch runs ({describe_exception(cause)}). Write it "
                     f"in a form both accept {how} (torch.compile's tracing refuses it too)") from cause


def _memory_key(t: torch.Tensor) -> tuple:
    """Where and how a tensor lays out its elements, hashable: two tensors of one key are one tensor's data (as
    ``paramwatch._same_memory`` compares them)."""
    if t.device.type == "meta" or t.layout != torch.strided or t.numel() == 0:
        return (id(t),)
    return t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride()


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes a non-empty tensor's elements span in its storage."""
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _argument_ranges(args) -> list[tuple[int, tuple[int, int]]]:
    """``(index, byte range)`` of each non-empty tensor argument."""
    return [(i, _byte_range(a)) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.numel() > 0]


def _state_overlaps(module: torch.nn.Module, args) -> list[tuple[int, str]]:
    """``(argument index, "parameter l.weight")`` for each tensor argument whose memory overlaps a parameter, buffer
    or plain tensor attribute of ``module``."""
    ranges = _argument_ranges(args)
    if not ranges:
        return []
    state = [(what, name, _byte_range(t)) for what, name, t in _module_state(module)
             if t.numel() > 0 and t.device.type != "meta"]
    return [(i, f"{what} {name}") for i, (lo_i, hi_i) in ranges for what, name, (lo, hi) in state
            if lo_i < hi and lo < hi_i]


def _module_state(module: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """``("parameter" | "buffer" | "tensor attribute", name, tensor)`` for each parameter, buffer and plain tensor
    attribute of ``module``."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return [("parameter" if name in params else "buffer", name, t)
            for name, t in itertools.chain(params.items(), module.named_buffers(remove_duplicate=False))
            if isinstance(t, torch.Tensor)] + [("tensor attribute", name, t)
                                               for name, t in tensor_attributes(module).items()]


_MODULE_OWN = frozenset(vars(torch.nn.Module()))  # nn.Module's own bookkeeping: _parameters, _buffers, hooks, ...
_HELD_DEPTH = 8  # containers within containers looked into for tensors: self.tabs = [[t]] is tabs[0][0]


def tensor_attributes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain tensor attributes of ``module`` and its submodules (``self.scale = torch.randn(4)``: neither a
    parameter nor a buffer, of this module or another), by dotted name; also the tensors held in a list, tuple or
    dict attribute, up to eight containers deep, named by their keys' reprs (``self.tabs = [t]``: ``tabs[0]``;
    ``self.d = {"a": t}``: ``d['a']``). torch.export lifts such a tensor to a constant (``lifted_tensor_0``) like a
    plain attribute's, so the step takes its values when compiling; these names let the parameter watch and ``tilec
    run --check`` find it again (:func:`attribute_paths`: a name is looked up there, never parsed)."""
    return {name: t for name, (t, _) in attribute_walk(module).items()}


def attribute_paths(module: torch.nn.Module) -> dict[str, tuple[str, str, tuple]]:
    """Each name of :func:`tensor_attributes` -> ``(owner submodule's name, attribute, container keys)``:
    ``l.tabs[0]['a']`` -> ``("l", "tabs", (0, "a"))``, for :func:`attribute_tensor` and :func:`set_attribute_tensor`."""
    return {name: path for name, (_, path) in attribute_walk(module).items()}


def attribute_walk(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, tuple[str, str, tuple]]]:
    """name -> (tensor, path) for :func:`tensor_attributes` and :func:`attribute_paths` (one walk for both)."""
    registered = {id(t) for t in (*module.parameters(), *module.buffers())}
    out = {}
    for name, t, path in _walk_held(module, torch.Tensor):
        if id(t) not in registered:
            out.setdefault(name, (t, path))
    return out


def _walk_held(module: torch.nn.Module, kind: type):
    """``(name, item, (owner submodule's name, attribute, container keys))`` for each ``kind`` an attribute of
    ``module`` or of a submodule holds, itself or in its lists, tuples and dicts (:func:`_held_tensors`); nn.Module's
    own bookkeeping (``_parameters``, ``_buffers``, hooks) is not looked into."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        for k, v in vars(m).items():
            if k in _MODULE_OWN:
                continue
            for keys, item in _held_tensors(v, _HELD_DEPTH, kind):
                yield (f"{prefix}.{k}" if prefix else k) + "".join(f"[{key!r}]" for key in keys), item, (prefix, k, keys)


def _held_tensors(value, depth: int, kind: type = torch.Tensor):
    """``(keys, item)`` for each ``kind`` (a tensor) in ``value`` as a list, tuple or dict (``value`` itself if one: no
    keys), ``depth`` containers deep at most."""
    if isinstance(value, kind):
        yield (), value
    elif depth and isinstance(value, (list, tuple)) and _may_hold(value, kind, depth):
        for i, item in enumerate(value):
            for keys, t in _held_tensors(item, depth - 1, kind):
                yield (i, *keys), t
    elif depth and isinstance(value, dict) and _may_hold(value.values(), kind, depth):
        for key, item in value.items():
            for keys, t in _held_tensors(item, depth - 1, kind):
                yield (key, *keys), t


_LOOK_AHEAD = 256  # items of a long container looked at before it is taken for data (a vocabulary, merges)


def _may_hold(items, kind: type, depth: int) -> bool:
    """Whether a container's ``items`` may hold a ``kind``: a short one may; a long one (over :data:`_LOOK_AHEAD`
    items) only where its first :data:`_LOOK_AHEAD` hold one - walking a 200 000-entry vocabulary dict or merges list
    took 0.25 s at every compile (a helper's finding)."""
    if len(items) <= _LOOK_AHEAD:
        return True
    return any(next(_held_tensors(x, depth - 1, kind), None) is not None for x in itertools.islice(items, _LOOK_AHEAD))


def _unregistered_module_state(module: torch.nn.Module) -> dict[tuple, str]:
    """The parameters and buffers of modules held in a list, tuple or dict attribute (``self.blocks = [nn.Linear(8,
    8)]``: PyTorch registers none of them), by memory (:func:`_memory_key`) -> ``"blocks[0] (Linear) weight"``."""
    out = {}
    for name, held, (_, _, keys) in _walk_held(module, torch.nn.Module):
        if keys:  # (in a container, not an attribute itself)
            for what, t in itertools.chain(held.named_parameters(), held.named_buffers()):
                out.setdefault(_memory_key(t), f"{name} ({type(held).__name__}) {what}")
    return out


def held_item(value, keys: tuple):
    """``value[k0][k1]...`` through lists, tuples and dicts only (a dict's missing key is not a defaultdict's
    insertion); None where a key is gone or a container is of another kind. Never raises."""
    for key in keys:
        try:
            if isinstance(value, dict):
                value = value[key] if key in value else None
            elif isinstance(value, (list, tuple)):
                value = value[key]
            else:
                return None
        except Exception:  # noqa: BLE001 - a user's container that raises: not the tensor compiled
            return None
    return value


def attribute_tensor(module: torch.nn.Module, path: tuple[str, str, tuple]):
    """What ``module`` holds now at ``path`` (of :func:`attribute_paths`); None where the owner, attribute or key is
    gone (or a container is now of another kind)."""
    owner, attr, keys = path
    try:
        value = vars(module.get_submodule(owner)).get(attr)
    except AttributeError:
        return None
    return held_item(value, keys)


def set_attribute_tensor(module: torch.nn.Module, path: tuple[str, str, tuple], new: torch.Tensor) -> None:
    """Puts ``new`` at ``path`` (of :func:`attribute_paths`) in ``module``: a list or dict item in place, a tuple
    rebuilt with it (a namedtuple by its ``_make``, a tuple subclass whose constructor takes other arguments as a plain
    tuple), and so its containers up to the attribute."""
    owner, attr, keys = path
    target = module.get_submodule(owner)

    def put(container, keys):
        if not keys:
            return new
        head, rest = keys[0], keys[1:]
        if isinstance(container, tuple):
            items = list(container)
            items[head] = put(items[head], rest)
            try:
                return container._make(items) if hasattr(container, "_make") else type(container)(items)
            except TypeError:
                return tuple(items)
        container[head] = put(container[head], rest)
        return container

    setattr(target, attr, put(getattr(target, attr), keys))


def _check_attribute_names(attributes: dict[str, torch.Tensor]) -> None:
    """Raises :class:`InputError` naming a plain tensor attribute (of :func:`tensor_attributes`) named like one of
    ``nn.Module``'s own (``self.half = t``): torch.export registers such a tensor under its name and fails with a raw
    KeyError ("attribute 'half' already exists"; a fresh user's finding)."""
    for path in attributes:
        name = path.rpartition(".")[2]
        if not name.endswith("]") and hasattr(torch.nn.Module, name):  # (one in a container is lifted_tensor_<n>)
            raise InputError(f"tensor attribute {path} is named like nn.Module.{name}: torch.export cannot capture "
                             f"it (it registers the tensor under that name); rename the attribute")


def _detach_state_arguments(module: torch.nn.Module, args: tuple) -> tuple:
    """``args`` with each argument that is a parameter, buffer or tensor attribute of the module itself replaced by a
    detached alias (the same memory, another tensor object). torch.export captured the module's own tensor passed as
    an argument (``compile_module(m, (x, m.w))``) and that tensor as one graph input, so where forward also reads
    ``self.w`` the compiled step read each call's argument in its place - a silently wrong result (a helper's
    finding); a detached alias is captured apart. (One that the step updates in place then fails the export, and
    :func:`_check_not_aliased` names it.)"""
    state = {id(t) for _, _, t in _module_state(module)}
    return tuple(a.detach() if id(a) in state else a for a in args)


def _check_not_aliased(module: torch.nn.Module, args, cause: Exception) -> None:
    """After a failed export: raises :class:`InputError` (bad example arguments) naming two tensor arguments, or an
    argument and a parameter, buffer or tensor attribute of the module, whose memory overlaps, when the export succeeds with
    the (second) argument cloned (``torch.export`` cannot capture an input updated in place that aliases
    another argument, nor an argument, read or updated, that shares memory with the module's state, and
    says so only obscurely: an IndexError, or an AttributeError from its guards); returns when nothing
    overlaps or the overlaps are not the cause. Exports once more with every overlapping argument cloned
    (which also tells the arguments the step updates in place), then once per overlap to name the one
    that matters."""
    def export_with_clones(idx):
        trial = [a.clone() if i in idx else a for i, a in enumerate(args)]
        try:
            return torch.export.export(module, tuple(trial), strict=False).run_decompositions({})
        except Exception:  # noqa: BLE001 - fails with these overlaps gone too: not (only) their cause
            return None

    ranges = _argument_ranges(args)
    pairs = []  # (argument to clone, the argument it overlaps)
    for x, (i, (lo_i, hi_i)) in enumerate(ranges):
        pairs += [(j, i) for j, (lo_j, hi_j) in ranges[x + 1:] if lo_i < hi_j and lo_j < hi_i]
    shared = _state_overlaps(module, args)
    if not pairs and not shared:
        return
    ep = export_with_clones({i for i, _ in (*pairs, *shared)})
    if ep is None:
        return
    updated = _updated_arguments(ep, len(args))
    overlaps = [(j, f"arguments {i} and {j} share memory (one tensor, or overlapping views of one): torch.export "
                    f"cannot capture them when one is updated in place; pass distinct tensors (e.g. a clone)")
                for j, i in pairs]
    overlaps += [(i, _state_alias_message(i, what, None if updated is None else i in updated))
                 for i, what in shared]
    for i, message in overlaps:
        if len(overlaps) == 1 or export_with_clones({i}) is not None:
            raise InputError(message) from cause
    raise InputError("; ".join(dict.fromkeys(m.split(":")[0] for _, m in overlaps)) +
                     ": torch.export cannot capture an argument that shares memory with the module's state, or "
                     "with another argument updated in place; pass tensors of their own (e.g. clones)") from cause


def _state_alias_message(i: int, state: str, updated: bool | None) -> str:
    """Why argument ``i``, sharing memory with the module's ``state`` (``parameter l.weight``), was refused;
    ``updated``: whether the step updates it in place (None: unknown)."""
    head = (f"argument {i} and the module's {state} share memory: torch.export cannot capture an argument that "
            f"shares memory with the module's state (its parameters, buffers and tensor attributes)")
    if updated is None:
        return f"{head}; pass a tensor of its own (e.g. x.clone())"
    if updated:
        return (f"{head}, and the step updates it in place; pass a tensor of its own (e.g. a .clone(), which the "
                f"step then updates instead of the module's {state.split()[0]})")
    return f"{head}, even one it only reads; pass a copy (e.g. x.clone())"


def _updated_arguments(ep, n_args: int) -> set[int] | None:
    """The indices of the arguments exported program ``ep`` updates in place; None when its user inputs are
    not the ``n_args`` arguments one for one (a container argument)."""
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    users = [spec.arg.name for spec in sig.input_specs if spec.kind == InputKind.USER_INPUT]
    if len(users) != n_args:
        return None
    written = {spec.target for spec in sig.output_specs if spec.kind == OutputKind.USER_INPUT_MUTATION}
    return {i for i, name in enumerate(users) if name in written}


def _check_runs_eagerly(module: torch.nn.Module, args) -> None:
    """Runs ``module(*args)`` eagerly (after a failed export) and raises
    :class:`ExampleInputError` naming the argument shapes and the user's failing source line (or
    the forward's signature, when they do not fit it) if it fails there too; returns if it runs
    (the failure is then tilec's or export's). It runs on copies of the tensor arguments, so a
    module that updates a cache in place leaves the caller's untouched."""
    try:
        with torch.no_grad():
            module(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    except (InputError, KeyboardInterrupt):  # tilec's own wrappers (tilec.hf.StaticCacheStep) name the problem
        raise
    except BaseException as e:  # noqa: BLE001 - any failure of the user's module on its own inputs, sys.exit too
        shapes = ", ".join(f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else repr(a) for a in args)
        _check_signature(module, args, shapes, e)
        where = _raised_at(e, ("/torch/",))
        raise ExampleInputError(f"the module fails on its example arguments [{shapes}]{where}: "
                                f"{describe_exception(e)}") from e


def _check_signature(module: torch.nn.Module, args, shapes: str, cause: Exception) -> None:
    """Raises :class:`ExampleInputError` naming ``module.forward`` (its parameters, file and line)
    when it cannot take ``args`` (too many or too few of them); returns when it can, or when
    the forward has no inspectable signature. ``cause`` is the eager failure that prompted it."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):  # no signature (a builtin): the eager failure says what is wrong
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
        plain = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)
        code = getattr(inspect.unwrap(module.forward), "__code__", None)  # a decorated forward: its own code
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
        raise ExampleInputError(f"the {len(args)} example argument(s) [{shapes}] do not fit "
                                f"{type(module).__name__}.forward{plain}{where}: {e}") from cause
