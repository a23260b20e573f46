"""Public entry points of the offline path."""
from __future__ import annotations

import inspect
import time

import torch
import torch.utils._pytree as pytree

from .capture import export_graph
from .dump import check_dump_root, with_dump
from .errors import EagerFailsError, InputError, OptionsError, UnsupportedNodeError
from .frontend import BUFFER_STATE_WHY, find_unsupported, lower_graph
from .guards import build_mask_guards
from .options import Options
from .pipeline import Hook, compile_opgraph
from .ir import is_integer
from .program import CompiledProgram, layout_error, not_dense


def check_hook(hook) -> None:
    """Raises OptionsError unless ``hook`` is None or can be called as ``hook(stage, ir, seconds)``: a bad one
    failed with Python's own TypeError after the whole capture (a fresh user's case)."""
    if hook is None:
        return
    if not callable(hook):
        raise OptionsError(f"hook={hook!r}: must be a callable hook(stage, ir, seconds), or None")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin or an extension type: no signature to check
        return
    try:
        sig.bind("opgraph", None, 0.0)
    except TypeError as e:
        raise OptionsError(f"hook {getattr(hook, '__qualname__', hook)!r}{sig}: it is called as "
                           f"hook(stage, ir, seconds) ({e})") from None


def compile_module(module: torch.nn.Module, args: tuple, *, positions=(), max_positions: int = 1,
                   options: Options | dict | None = None, hook: Hook | None = None) -> CompiledProgram:
    """Captures ``module(*args)`` with ``torch.export`` and compiles it to a KernelPlan.

    Args:
        module: the step to compile (e.g. :class:`tilec.hf.StaticCacheStep`). Its parameters are
            bound by reference (later in-place edits are seen; of a non-contiguous parameter, read
            through a contiguous copy, all but those through ``.data``); a parameter replaced later
            (``load_state_dict(..., assign=True)``, a new Parameter or submodule, ``module.to(...)``) is
            bound at the next call, or refused there when its shape, dtype or device changed
            (:mod:`tilec.paramwatch`); its buffers are constants taken
            now (folded, e.g. RoPE ``inv_freq`` into tables): recompile after editing one.
        args: example arguments (tensors, Python numbers or None; not containers of them); their shapes
            and dtypes are planned for.
        positions: indices in ``args`` of int64 tensors holding the decode position p.
        max_positions: positions p to plan for (``0 <= p < max_positions``).
        options: :class:`Options` or a dict of option values.
        hook: called as ``hook(stage, ir, seconds)`` after every pipeline stage (after the
            dump hook of :mod:`tilec.dump` when ``options.dump_dir`` or ``$TILEC_DUMP_DIR`` is set).

    Raises:
        UnsupportedNodeError: the graph has ops tilec cannot lower (names node and source line);
            :class:`EagerFailsError` (also an ``InputError``) naming the nodes eager PyTorch cannot run
            either (a linear of mixed dtypes, a cache write of another dtype), when there are any.
        InputError: meta-device weights or arguments; parameters that require grad made under
            ``torch.inference_mode``, when compiling outside it; a container argument (a dict or tuple of
            tensors) or a sparse or MKLDNN one; ``args``, ``positions`` or ``max_positions`` do not
            fit the module (naming the argument and the shapes or values);
            :class:`ExampleInputError` when it fails on ``args``.
        DumpError: the dump directory cannot be made or written, or is (or lies inside) a tilec artifact.
        VerificationError: a stage broke an invariant (a tilec bug: please report it).
    """
    opts = options if isinstance(options, Options) else Options.from_dict(options)
    check_hook(hook)
    check_dump_root(opts)  # a bad dump directory fails before the compile
    check_call(module, args, positions)
    meta = meta_tensors(module, args)
    if meta:
        raise InputError(f"{', '.join(meta[:3])}{f' and {len(meta) - 3} more' if len(meta) > 3 else ''}: "
                         f"meta-device tensor(s) with no data; tilec needs real weights and inputs")
    check_positions(args, positions, max_positions)
    made = [] if torch.is_inference_mode_enabled() else \
        [n for n, p in module.named_parameters() if p.is_inference() and p.requires_grad]
    if made:  # torch.export raised "Setting requires_grad=True on inference tensor outside InferenceMode"
        raise InputError(f"parameter {made[0]}{f' and {len(made) - 1} more' if len(made) > 1 else ''} of the module "
                         f"was made under torch.inference_mode and requires grad, which torch.export cannot trace "
                         f"outside inference mode: compile inside `with torch.inference_mode():`, or call "
                         f"module.requires_grad_(False) first")
    t0 = time.perf_counter()
    gm, binding = export_graph(module, args, set(positions))
    try:
        graph = lower_graph(gm, binding, max_positions)
    except UnsupportedNodeError as first:
        eager_fails: set[str] = set()
        every = find_unsupported(gm, binding, max_positions, eager_fails)  # report all of them, not just the first
        if isinstance(first, EagerFailsError) or eager_fails:  # the module or its example arguments are wrong:
            bad = [n for n in every if n[0] in eager_fails] or [(*first.nodes[0], first.reason)]  # eager raises too
            nodes, reason = ([bad[0][:3]], bad[0][3]) if len(bad) == 1 else (bad, "")
            raise EagerFailsError(nodes, reason, "eager PyTorch raises on this node too: fix the module or its "
                                  "example arguments (no compile of it can run)") from first
        nodes = every if len(every) > 1 else [(*first.nodes[0], first.why[0])]
        inputs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}  # named as the user knows them
        nodes = [(binding.label(n[0]), _value_text(inputs[n[0]]), *n[2:]) if n[0] in inputs else n for n in nodes]
        whys = [first.reason, *(n[-1] for n in nodes if isinstance(n[-1], str))]
        dropout = module.training and any("dropout" in str(n[1]) for n in nodes)
        raise UnsupportedNodeError(nodes, first.reason if len(every) <= 1 else "", _hint(args, whys, dropout)) \
            from first
    compiled = compile_opgraph(graph, opts, with_dump(hook, opts), opgraph_seconds=time.perf_counter() - t0)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    n_user = len(out_node.args[0]) - binding.mutation_outputs
    single = n_user == 1 if binding.single_output is None else binding.single_output and n_user == 1
    return CompiledProgram(compiled, binding, single_output=single, opts=opts, example_args=args,
                           out_spec=binding.out_spec, guards=build_mask_guards(gm, binding, graph.mask_guards),
                           module=module)


def _value_text(node) -> str:
    """``torch.float64[4, 4]``: a graph input's dtype and shape, for an error naming it."""
    v = node.meta.get("val")
    return f"{v.dtype}{list(v.shape)}" if isinstance(v, torch.Tensor) else "graph input"


def _hint(args, whys=(), dropout: bool = False) -> str:
    """What a user can do about ops tilec cannot lower (the end of compile_module's error); ``whys``:
    the reasons given, to say so when a dtype is the cause; ``dropout``: a dropout of a module left in
    training mode is among them (``module.eval()`` removes it)."""
    if dropout:
        return ("The module is in training mode, where dropout draws random masks: call module.eval() before "
                "compiling (tilec compiles inference steps).")
    cast = ("tilec has no float64 kernels: cast the module and its inputs to float32 or bfloat16 (module.float(), "
            "x.float()). ") if any("torch.float64" in (w or "") for w in whys) else ""
    ints = [i for i, a in enumerate(args) if isinstance(a, int) and not isinstance(a, bool)]
    baked = (f"argument{'s' if len(ints) > 1 else ''} {', '.join(map(str, ints))} "
             f"{'are Python ints' if len(ints) > 1 else 'is a Python int'}, baked into the graph as a constant: a "
             f"decode position must be an integer tensor (torch.tensor([p])) listed in positions. ") if ints else ""
    general = ("Move such ops out of the compiled module, or compile it with torch.compile(module, backend='tilec'), "
               "which runs them eagerly.")
    if any(BUFFER_STATE_WHY in (w or "") for w in whys):
        # (under torch.compile a module's buffers are graph inputs: their cache writes compile whole)
        others = any(w and BUFFER_STATE_WHY not in w for w in whys)
        return (cast + baked + "Pass the cache to forward, or compile the module with torch.compile(module, "
                "backend='tilec'), which takes its buffers as the graph's inputs and compiles such cache writes."
                + (" For the other ops: " + general if others else ""))
    return cast + baked + general


def meta_tensors(module: torch.nn.Module, args, label: str = "argument") -> list[str]:
    """The names of ``module``'s parameters and buffers and the ``args`` (``"{label} {i}"``) that are
    meta-device tensors (shapes without data), in that order."""
    meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    return meta + [f"{label} {i}" for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_meta]


def check_call(module, args, positions) -> None:
    """Raises :class:`InputError` unless ``module`` is a ``torch.nn.Module``, ``args`` a tuple or list
    of example arguments (a bare tensor would be iterated row by row), none of them a container
    (:func:`check_flat`) or a sparse or MKLDNN tensor (:func:`check_dense`), and ``positions`` a list
    or tuple of argument indices."""
    if not isinstance(module, torch.nn.Module):
        raise InputError(f"compile_module needs a torch.nn.Module, got a {type(module).__name__} (wrap a function "
                         f"in a Module's forward)")
    if not isinstance(args, (tuple, list)):
        hint = " (wrap a single tensor as (x,))" if isinstance(args, torch.Tensor) else ""
        raise InputError(f"args must be a tuple of example arguments, got a {type(args).__name__}{hint}")
    check_flat(args)
    check_dense(args)
    if not isinstance(positions, (tuple, list)):
        raise InputError(f"positions={positions!r} must be a list of argument indices, e.g. [1]")


def check_flat(args) -> None:
    """Raises :class:`InputError` naming the first of ``args`` that is a container of values (a dict,
    list, tuple or another pytree node, even an empty one): ``torch.export`` flattens it into graph
    inputs of their own, while the compiled step, ``positions``, baked Python values, error labels
    and the artifact format all index the top-level arguments, so its program could not be called
    with the arguments it was compiled for. ``None`` is a plain (ignored) argument."""
    for i, a in enumerate(args):
        if a is not None and not pytree.tree_is_leaf(a):
            n = len(pytree.tree_leaves(a))
            raise InputError(f"argument {i} is a {type(a).__name__} (of {n} value{'' if n == 1 else 's'}): "
                             f"compile_module takes tensors, Python numbers or None as arguments, not containers; "
                             f"pass the tensors it holds as separate arguments (forward(self, x, a, b) rather than "
                             f"forward(self, x, pair) called with (a, b))")


def check_dense(args) -> None:
    """Raises :class:`InputError` naming the first of ``args`` that is a tensor of a layout other than
    strided (a sparse or MKLDNN tensor) or a nested tensor: a compiled step binds dense tensors through their data
    pointers and strides, so its own call with that example would fail inside torch (a raw
    ``RuntimeError`` from a copy or a data pointer)."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and not_dense(a):
            raise InputError(layout_error(f"argument {i}", a))


def check_positions(args: tuple, positions, max_positions: int) -> None:
    """Raises :class:`InputError` (a ``ValueError``) unless ``max_positions >= 1`` and every index
    in ``positions`` names an integer tensor argument whose elements all hold one value: tilec plans
    each element of a position argument as the step's position p (``tilec.frontend``), so a tensor
    of per-token positions ``[p, p + 1, ...]`` would silently become ``[p, p, ...]``; that value
    must lie in ``[0, max_positions)`` and be the same in every listed argument (none empty), or the
    step could not run at its own example."""
    if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 1:
        raise InputError(f"max_positions={max_positions!r}: must be an int >= 1")
    for i in positions:
        if not isinstance(i, int) or not 0 <= i < len(args):
            raise InputError(f"positions: {i!r} is not an argument index (the module takes {len(args)} "
                             f"argument{'' if len(args) == 1 else 's'})")
        a = args[i]
        if not isinstance(a, torch.Tensor) or not is_integer(a.dtype):
            got = f"{a.dtype} tensor" if isinstance(a, torch.Tensor) else type(a).__name__
            raise InputError(f"positions: argument {i} must be an integer tensor holding the decode position, "
                             f"got a {got}")
        if not a.numel():
            raise InputError(f"positions: argument {i} ({str(a.dtype).removeprefix('torch.')}{list(a.shape)}) is "
                             f"empty: it must hold the decode position")
        if a.numel() > 1 and bool((a != a.reshape(-1)[0]).any()):
            shown = a.reshape(-1)[:8].tolist()
            raise InputError(f"positions: argument {i} ({str(a.dtype).removeprefix('torch.')}{list(a.shape)}) holds "
                             f"{shown}{' ...' if a.numel() > 8 else ''}, not one value: tilec plans every element "
                             f"of a position argument as the step's position p, so pass the position alone (e.g. "
                             f"[p]) and compute per-token positions p, p + 1, ... inside the module")
        if not 0 <= int(a.reshape(-1)[0]) < max_positions:
            raise InputError(f"positions: argument {i} holds position {int(a.reshape(-1)[0])}, outside the planned "
                             f"range [0, {max_positions}) of max_positions={max_positions}: the compiled step could "
                             f"never run at its own example (raise max_positions, or pass an example position "
                             f"inside it)")
    held = {i: int(args[i].reshape(-1)[0]) for i in positions}
    if len(set(held.values())) > 1:
        said = ", ".join(f"argument {i} holds {p}" for i, p in sorted(held.items()))
        raise InputError(f"positions: the decode position arguments disagree ({said}): every argument listed in "
                         f"positions holds the one decode position p of the step")
