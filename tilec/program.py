"""A compiled program: the KernelPlan plus the tensors it binds, callable like the module."""
from __future__ import annotations

import bisect
import math
import numbers
import operator
import threading

import torch
import torch.utils._pytree as pytree

from .errors import InputError, PositionError, TilecError
from .frontend import IGNORED, POSITION, GraphBinding, const_name
from .guards import check_mask_guards, mismatches, raise_first_mismatch
from .ir import BufferKind, is_integer
from .options import Options
from .paramwatch import ParamWatch
from .pipeline import Compiled
from .refexec import ReferenceExecutor


STAGE_INPUT_BYTES = 64 * 1024  # read-only inputs up to this size are copied, larger ones bound in place
_STRIDED = torch.strided  # the one layout a step binds (sparse, MKLDNN tensors are refused: layout_error)
_WHICH = ("the step's position arguments (those listed in compile_module's positions; under torch.compile, its "
          "one-element integer inputs)")  # what errors call the arguments read as the decode position
_TENSOR, _POSITION, _IGNORED = range(3)  # what an argument of the compiled step is (CompiledProgram._arg_specs)


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (it moves at every in-place update), or None where torch keeps none (a tensor
    made under ``torch.inference_mode``; one detached from it reads a version 0 that never moves)."""
    return None if t.is_inference() else t._version


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that the step reads in its place (a non-contiguous parameter's: written again at
    a call after an update, also outside inference mode when compiled in it)."""
    with torch.inference_mode(False):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def not_dense(a: torch.Tensor) -> bool:
    """Whether tensor ``a`` is one a step cannot bind: a layout other than strided (sparse, MKLDNN) or a
    nested tensor (a strided nested tensor has no sizes; a jagged one has no plain strides)."""
    return a.layout is not _STRIDED or a.is_nested


def layout_error(label: str, a: torch.Tensor) -> str:
    """The error for tensor argument ``a`` (named ``label``) that is :func:`not_dense` (a sparse, MKLDNN or
    nested tensor): tilec's steps read dense tensors through their data pointers and strides."""
    if a.is_nested:
        return (f"{label} is a nested tensor ({a.dtype}, {a.layout} layout): a compiled step reads dense tensors "
                f"of the example's shape only; pass it padded to that shape (x.to_padded_tensor(0.0))")
    return (f"{label} is a {a.layout} tensor ({a.dtype}{list(a.shape)}): a compiled step reads dense (strided) "
            f"tensors only; pass it as a dense tensor (x.to_dense())")


def _position_of(label: str, a, shape: tuple | None = None) -> int:
    """The decode position argument ``a`` (named ``label`` in errors) holds: an integer, or an
    integer tensor of one element. Raises TilecError for anything else (a float, a bool, several
    elements), which eager PyTorch would refuse as an index too; ``shape``: the example's, when it held
    several elements (then named as what is expected)."""
    if isinstance(a, torch.Tensor):
        if not_dense(a):
            raise TilecError(layout_error(label, a))
        if a.numel() == 1 and is_integer(a.dtype):
            return int(a.reshape(-1)[0])
        got = f"{a.dtype}{list(a.shape)}"
    elif isinstance(a, numbers.Integral) and not isinstance(a, bool):
        return int(a)
    else:
        got = type(a).__name__
    want = "an int or an integer tensor of one element" if shape is None or math.prod(shape) == 1 else \
        f"an integer tensor of shape {list(shape)} (the example's)"
    raise TilecError(f"{label} holds the decode position: expected {want}, got {got}")


def _no_tensors(buffers: dict) -> tuple:
    """The tensors of a step that binds no buffer from its arguments (:attr:`CompiledProgram._arg_tensors`)."""
    return ()


class _OneTensor:
    """``(buffers[name],)``: ``operator.itemgetter`` of one name, as a tuple as it gives for several
    (:attr:`CompiledProgram._arg_tensors`; a class, not a lambda, so that a pickle can hold it)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, buffers: dict) -> tuple:
        return (buffers[self.name],)


class OneCallAtATime:
    """Copying for an object whose calls hold ``self._lock`` (a ``threading.Lock``): a shallow copy shares the
    object's state, and so the lock; a deep copy or a pickle, with state of its own, gets a lock of its own (a lock
    cannot be copied) and the attributes named in ``_fresh_on_copy`` reset to None."""

    _fresh_on_copy: tuple[str, ...] = ()

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_lock"]
        state.update(dict.fromkeys(self._fresh_on_copy))
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


class CompiledProgram(OneCallAtATime):
    """Calls the compiled step: ``program(*args)`` with the same arguments as the captured module.

    Parameters are bound by reference (the module's own tensors; a non-contiguous one through a
    contiguous copy, copied again at a call after an in-place update of it). Module buffers are constants
    taken when compiling (folded: an in-place edit of one later is not seen; recompile after it).
    Buffers marked STATE (KV caches) are the caller's tensors, updated in place. Intermediates are owned by the program
    and poisoned with NaN before each reference run, so an unwritten element cannot pass a test.
    Returns the outputs as new tensors (a tuple, or one tensor when the module returns one).
    ``library``: a prebuilt shared library of this plan for the CUDA executor (else built with nvcc).
    ``out_spec``: the module's output structure (a pytree spec from the capture): the outputs
    come back as the module returns them - a dict, nested tuples - else as a tuple.
    ``guards``: :func:`tilec.guards.build_mask_guards` of the plan's ``mask_guards`` (run-time
    attention masks planned as causal), checked before every run.
    ``in_place``: input buffer names bound where they live even when small, if their example is
    contiguous (read-only inputs of up to :data:`STAGE_INPUT_BYTES` are otherwise copied into the
    program's own buffer every call, so that new tensors each call - token ids - keep the operand
    table): the ``torch.compile`` backend's module parameters, the same tensors every call (copying
    a 16-layer model's 33 norm weights took ~60 µs of host time a call on the CPU, a kernel launch
    each on a GPU).
    ``trusted``: input buffer names whose shape, dtype, device and strides the caller's own checks
    hold (the ``torch.compile`` backend's graph inputs, under Dynamo's guards; not values a
    partitioned graph computes eagerly): if their example is contiguous they are bound without
    this program's per-tensor checks (about 0.5 µs an argument; a 16-layer model's step takes ~180
    tensor arguments). Positions are checked either way.
    ``arg_labels``: how errors name each argument (default ``argument i (its buffer)``, a position or baked Python
    value ``argument i (forward's parameter name)``); the
    ``torch.compile`` backend passes the user's names, e.g. ``past_key_values.layers[0].keys``.

    Raises:
        TilecError: an argument has the wrong shape/dtype/layout, positions disagree, or a Python value
            (baked into the step when compiling) differs from the example's; the module changed after
            compiling in a way the traced step cannot take - a parameter replaced by one of another shape,
            dtype or device or by a tensor subclass, tied parameters untied, a folded buffer replaced by other
            values, a parameter or buffer added, a submodule of another class (:meth:`sync_params`,
            :mod:`tilec.paramwatch`).
        GuardError: a run-time attention mask is not the causal mask at the call's position (nothing ran).
    """

    _fresh_on_copy = ("_last_stream",)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._tables = {}  # (the original's operand tables hold its buffers' addresses: a deep copy binds its own)

    def __init__(self, compiled: Compiled, binding: GraphBinding, single_output: bool, opts: Options | None = None,
                 progress=None, example_args=(), library=None, arg_labels=None, out_spec=None, guards=(),
                 in_place=(), trusted=(), module=None):
        self.opts = opts = opts or Options()
        self.compiled = compiled
        self.plan = compiled.plan
        self.graph = self.plan.graph
        self.guards = list(guards)
        if self.graph.mask_guards and not self.guards:
            raise TilecError(f"this plan checks {len(self.graph.mask_guards)} run-time attention mask(s) on every call "
                             f"({', '.join(name for name, _ in self.graph.mask_guards)}) and needs the graph that "
                             f"computes them (tilec.guards.build_mask_guards); it was given none")
        self.single_output = single_output
        self.out_spec = out_spec
        tensors_seen = (*binding.params.values(), *binding.consts.values(),
                        *(a for a in example_args if isinstance(a, torch.Tensor)))
        devices = {t.device for t in tensors_seen}
        self.device = next((d for d in devices if d.type == "cuda"), torch.device("cpu"))
        kind = opts.executor
        if kind == "auto":
            kind = "cuda" if self.device.type == "cuda" else "reference"
        if kind == "cuda" and self.device.type != "cuda":
            raise TilecError("executor='cuda' needs the model on a CUDA device (its parameters are on the CPU)")
        self.executor_kind = kind
        self.tensors: dict[str, torch.Tensor] = {}
        self._param_names = dict(binding.param_names)  # for errors: the module's names of its parameters
        self._buffer_names = dict(binding.buffer_names)  # module buffers: placeholder -> the module's name
        self._attribute_names = dict(binding.attribute_names)  # plain tensor attributes, likewise
        written = self.graph.written
        example = list(example_args) if len(example_args) == len(self.graph.inputs) else [None] * len(self.graph.inputs)
        contiguous = {name for name, ex in zip(self.graph.inputs, example)
                      if isinstance(ex, torch.Tensor) and ex.is_contiguous()}  # examples bound as they are
        # small read-only inputs (token ids, ...) are copied into program-owned buffers, so new
        # input tensors every step keep the same operand table (nothing to rebind or upload)
        self.staged_inputs = {name for name, b in self.graph.buffers.items()
                              if b.kind is BufferKind.INPUT and name not in written and b.nbytes <= STAGE_INPUT_BYTES
                              and not (name in in_place and name in contiguous)}
        # parameters that are not contiguous are bound through a contiguous copy, refreshed at a call when the
        # parameter was updated in place since (its version counter moved): (name, parameter, version or None)
        self._param_copies: list[list] = []
        for name, b in self.graph.buffers.items():
            if b.kind is BufferKind.PARAM:
                t = binding.params[name]
                if not t.is_contiguous():
                    self._param_copies.append([name, t, tensor_version(t)])
            elif b.kind in (BufferKind.CONST, BufferKind.TABLE):
                t = self.graph.constants[name].to(self.device)
            elif b.kind in (BufferKind.TEMP, BufferKind.OUTPUT) or name in self.staged_inputs:
                with torch.inference_mode(False):  # written at each call, also outside inference mode
                    t = torch.empty(b.shape, dtype=b.dtype, device=self.device)
            else:
                continue
            self.tensors[name] = t if t.is_contiguous() else _contiguous_copy(t)
        # the module's parameters, looked up again when they may have been replaced (compile_module's
        # programs: a torch.compile region's parameters are guarded arguments, an artifact's its own)
        params = {name: binding.param_names.get(name, name) for name, b in self.graph.buffers.items()
                  if b.kind is BufferKind.PARAM}
        folded = {name: (target, binding.consts[name]) for name, target in binding.buffer_names.items()
                  if name in binding.consts and name not in written}
        attributes = {name: (target, binding.consts[name]) for name, target in binding.attribute_names.items()
                      if name in binding.consts}
        self._watch = ParamWatch(module, params, folded, attributes) \
            if module is not None and (params or folded or attributes) else None
        # module buffers and plain tensor attributes the plan folded into other values or does not read (not kept as
        # constants, not written): an artifact stores their values for tilec run --check's eager module
        self._folded_state = {name: binding.consts[name] for name in (*binding.buffer_names, *binding.attribute_names)
                              if name in binding.consts and name not in written
                              and const_name(name) not in self.graph.constants}
        # per argument: (kind, buffer name, shape, dtype, staged, updated in place)
        # (a position tensor's example shape: another shape can broadcast to other output shapes in eager)
        self._arg_specs = [(_POSITION if name == POSITION else _IGNORED, name,
                            tuple(ex.shape) if name == POSITION and isinstance(ex, torch.Tensor) else None,
                            None, False, False)
                           if name in (POSITION, IGNORED) else
                           (_TENSOR, name, self.graph.buffers[name].shape, self.graph.buffers[name].dtype,
                            name in self.staged_inputs,
                            self.graph.buffers[name].kind is BufferKind.STATE or name in written)
                           for name, ex in zip(self.graph.inputs, example)]
        user = binding.user_inputs if len(binding.user_inputs) == len(self.graph.inputs) else [""] * len(self.graph.inputs)
        self._labels = list(arg_labels) if arg_labels is not None and len(arg_labels) == len(self.graph.inputs) else \
            [f"argument {i}" + (f" ({name})" if name not in (POSITION, IGNORED) else f" ({user[i]})" if user[i] else "")
             for i, name in enumerate(self.graph.inputs)]
        # Python values among the example arguments (a float scale, an int count): torch.export
        # baked them into the graph, so a call must pass the same values
        self._baked = {i: a for i, (a, name) in enumerate(zip(example_args, self.graph.inputs))
                       if name == IGNORED and not isinstance(a, torch.Tensor)} \
            if len(example_args) == len(self.graph.inputs) else {}
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        if self._device_index is None:
            self._device_index = torch.cuda.current_device()
        # the call's hot loop walks these instead of every argument's spec
        self._tensor_args = [(i, name, torch.Size(shape), dtype, staged, inplace)
                             for i, (kind, name, shape, dtype, staged, inplace) in enumerate(self._arg_specs)
                             if kind == _TENSOR]
        self._position_args = [(i, shape) for i, (kind, _, shape, *_) in enumerate(self._arg_specs) if kind == _POSITION]
        # elements a call's position tensor holds (its example's: a call of another shape is refused), 1 without one
        self._position_sizes = {i: 1 if shape is None else math.prod(shape) for i, shape in self._position_args}
        # position tensors by example shape (HF: position_ids [b, 1], then a 0-d counter per layer), each group
        # read with one stack (2 torch calls a group instead of 2 a tensor); None once a stack has failed
        groups: dict[tuple | None, list[int]] = {}
        for i, shape in self._position_args:
            groups.setdefault(shape, []).append(i)
        self._position_groups: list[list[int]] | None = list(groups.values())
        # check="deferred" is for decode steps, called in a loop: a program without a decode position is
        # checked as it returns (a one-off call's bad index would otherwise go unreported)
        check = getattr(opts, "check", True)
        self._check = True if check == "deferred" and not self._position_args else None
        # position arguments the mask guards read (clamped into the plan before they do: _positions)
        self._guard_positions = sorted({i for g in self.guards for i in g.arg_index}
                                       & {i for i, _ in self._position_args})
        # trusted arguments whose example was contiguous are bound unchecked (their strides are
        # guarded, so they stay contiguous); the rest are checked (_bind_each)
        trusted = [spec for spec in self._tensor_args if spec[1] in trusted and spec[1] in contiguous]
        self._t_checked = [spec for spec in self._tensor_args if spec not in trusted]
        self._t_staged = [(i, name) for i, name, _, _, staged, _ in trusted if staged]
        self._t_bound_index = [i for i, _, _, _, staged, _ in trusted if not staged]
        self._t_bound_names = [name for _, name, _, _, staged, _ in trusted if not staged]
        # arguments that may be bound through a copy (staged, or strided): the operand table's key
        # does not see their memory
        self._maybe_copied = [(i, name) for i, name in self._t_staged] + [(i, name) for i, name, *_ in self._t_checked]
        # position updates: the tables on the step's device, so writing them is one device copy, no upload
        # (a counter holds one element, so when the tables share a dtype - HF's per-layer cache counters - they
        # are kept side by side, [max_positions, updates]: a call indexes one row instead of each table)
        tables = [table for _, table in self.graph.position_updates]
        self._update_rows = torch.stack([t.reshape(len(t)) for t in tables], 1).to(self.device) \
            if tables and all(t[0].numel() == 1 and t.dtype == tables[0].dtype for t in tables) else None
        self._updates = [(idx, None if self._update_rows is not None else table.to(self.device))
                         for idx, table in self.graph.position_updates]
        # buffers bound from the call's arguments (the rest are bound once, above)
        self._arg_buffers = [n for n in self.graph.inputs if n in self.graph.buffers and n not in self.tensors]
        # their tensors out of a call's buffer dict as a tuple, gathered by itemgetter (one C call; for one
        # name it returns the bare tensor, so that case is wrapped; callables a pickle can hold, not lambdas)
        n = len(self._arg_buffers)
        self._arg_tensors = operator.itemgetter(*self._arg_buffers) if n > 1 else \
            _OneTensor(self._arg_buffers[0]) if n == 1 else _no_tensors
        self._tables: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._last_stream = None  # the CUDA stream of the last call (_order_after_last_call)
        with torch.inference_mode(False):  # its buffers (counters, operand table) are written at each call
            if kind == "cuda":
                from .cuda import CudaExecutor

                self.executor = CudaExecutor(self.plan, opts, self.device, progress, library)
            else:
                self.executor = ReferenceExecutor(self.plan)
        # a run-time error names the arguments its op reads (a token id outside the table: argument 0 (input_ids))
        self.name_arguments(self._labels)

    def name_arguments(self, labels: list[str]) -> None:
        """Sets how errors name the arguments (one label per argument, e.g. ``cache.layers[0].keys``), for a
        caller that passes the step arguments its user knows by other names (:class:`tilec.hf.HFDecodeStep`).

        Raises:
            ValueError: not one label per argument.
        """
        if len(labels) != len(self.graph.inputs):
            raise ValueError(f"name_arguments: {len(labels)} labels for {len(self.graph.inputs)} arguments")
        self._labels = list(labels)
        self.executor.input_labels = {name: label for name, label in zip(self.graph.inputs, self._labels)
                                      if name not in (POSITION, IGNORED)}

    @property
    def position_args(self) -> tuple[int, ...]:
        """The indices of the arguments the step reads as its decode position: the ``positions`` it was
        compiled with, less any its graph does not read (those it cannot tell from other ignored arguments)."""
        return tuple(i for i, _ in self._position_args)

    @property
    def stats(self) -> dict:
        return self.compiled.stats

    def check_errors(self) -> None:
        """Raises what a step run with ``check="deferred"`` recorded and no call has raised yet,
        waiting for that record (``CudaExecutor.check_deferred``); nothing on the reference
        executor, which raises as it runs. Raises WatchdogError / TilecError as the step would have."""
        if self.executor_kind == "cuda":
            self.executor.check_deferred(wait=True)

    def check_example(self, args) -> None:
        """Checks ``args`` against the step's arguments without binding them: their count, each tensor's
        shape, dtype and layout, each baked Python value, the decode position arguments (as a call reads them: a
        device tensor costs a sync). Raises InputError naming the first that does not fit (what
        :func:`tilec.artifact.save` does with its example inputs, which ``tilec run`` passes later)."""
        try:
            self._check_fixed(args)
            for i, (kind, name, shape, dtype, _, _) in enumerate(self._arg_specs):
                a = args[i]
                if kind == _TENSOR and isinstance(a, torch.Tensor) and not_dense(a):
                    raise InputError(layout_error(self._labels[i], a))
                if kind == _TENSOR and not (isinstance(a, torch.Tensor) and tuple(a.shape) == tuple(shape)
                                            and a.dtype == dtype):
                    got = f"{a.dtype}{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                    raise InputError(f"{self._labels[i]}: the step takes {dtype}{list(shape)}, got {got}")
            self._one_position(self._positions(args, [])[0])
        except TilecError as e:  # (a PositionError, or the call's own TilecError)
            raise InputError(str(e)) from None

    def _check_fixed(self, args) -> None:
        """Raises TilecError unless ``args`` has the step's number of arguments and each baked Python value."""
        if len(args) != len(self._arg_specs):
            n = len(self._arg_specs)
            raise TilecError(f"compiled step takes {n} argument{'' if n == 1 else 's'}, got {len(args)}")
        for i, v in self._baked.items():
            a = args[i]
            # (a tensor first: `a == v` of a tensor of several elements is no bool; floats by repr: -0.0 != 0.0)
            same = type(a) is type(v) and (repr(a) == repr(v) if isinstance(v, float) else (a == v or repr(a) == repr(v)))
            if not same:
                given = f"a tensor ({a.dtype}{list(a.shape)})" if isinstance(a, torch.Tensor) else repr(a)
                raise TilecError(f"{self._labels[i]} is {given}, but the step was compiled for {v!r}: a Python "
                                 f"value is baked into the compiled step (compile with a tensor as that "
                                 f"example argument to vary it, or compile for this value)")

    def _one_position(self, positions: dict[int, int]) -> int:
        """The decode position ``positions`` (argument index -> value, :meth:`_positions`) hold, 0 without any.
        Raises PositionError when they disagree."""
        held = set(positions.values())
        if len(held) > 1:
            said = ", ".join(f"{self._labels[i]} holds {p}" for i, p in sorted(positions.items()))
            raise PositionError(f"the decode position arguments disagree ({said}): {_WHICH} all hold the one "
                                f"decode position")
        return held.pop() if held else 0

    def bind_args(self, args) -> tuple[dict[str, torch.Tensor], int]:
        """Checks the call arguments and returns (buffer tensors, decode position). Position
        tensors are read with one copy to the host for all of them (HF's static cache passes one
        counter per layer: on a GPU, reading each on its own was a sync each)."""
        tensors, p, _ = self._bind(args, [])
        return tensors, p

    def _bind(self, args, guards: list) -> tuple[dict[str, torch.Tensor], int, list[bool] | None]:
        """:meth:`bind_args`, and the mismatch flag of each of ``guards`` (``tilec.guards.MaskGuard``)
        when they were read with the positions, else None."""
        self._check_fixed(args)
        positions, flags = self._positions(args, guards)
        self.sync_params()
        tensors = dict(self.tensors)
        # (trusted: torch.compile's guards already hold shapes, dtypes, devices and strides)
        tensors.update(zip(self._t_bound_names, map(args.__getitem__, self._t_bound_index)))
        for i, name in self._t_staged:
            tensors[name].copy_(args[i])  # a small read-only input: into the program's own buffer
        self._bind_each(args, tensors)
        return tensors, self._one_position(positions), flags

    def sync_params(self) -> None:
        """Brings the bound parameters up to date with the module's (every call does this first; so does
        :func:`tilec.artifact.save`): binds parameters replaced since (:meth:`_rebind_params`) and copies
        non-contiguous ones updated in place into the buffers the step reads. Raises TilecError as
        :meth:`_rebind_params`."""
        if self._watch is not None and self._watch.moved():
            self._rebind_params()
        if self._param_copies:
            self._refresh_param_copies()

    def _rebind_params(self) -> None:
        """Binds the parameters the module now holds in place of those compiled with (``load_state_dict(...,
        assign=True)``, a new Parameter or submodule, ``model.to(...)``: :mod:`tilec.paramwatch`). Raises
        TilecError naming the first whose shape, dtype, device or layout the plan cannot take (nothing is
        rebound then, and every later call raises the same until the step is compiled again)."""
        changed = self._watch.changed()
        for name, (target, p) in changed.items():
            b = self.graph.buffers[name]
            if not_dense(p) or tuple(p.shape) != b.shape or p.dtype != b.dtype or p.device != self.tensors[name].device:
                now = f"a {p.layout} tensor" if not_dense(p) else f"{p.dtype}{list(p.shape)} on {p.device}"
                raise TilecError(f"parameter {target} was replaced after compiling and is now {now}; the step was "
                                 f"compiled for {b.dtype}{list(b.shape)} on {self.tensors[name].device}: compile "
                                 f"the step again")
        self._watch.check_buffers()
        for name, (_, p) in changed.items():
            t = p.detach()
            self._param_copies = [e for e in self._param_copies if e[0] != name]
            if t.is_contiguous():
                self.tensors[name] = t
            else:  # read through a copy, refreshed at a call after an in-place update, as when compiled
                self.tensors[name] = _contiguous_copy(t)
                self._param_copies.append([name, t, tensor_version(t)])
            self._watch.accept(name, p)
        if changed:
            self._tables.clear()  # operand tables (and alias checks) of the old parameters' memory
        self._watch.settle()

    def _refresh_param_copies(self) -> None:
        """Copies each non-contiguous parameter again into the contiguous buffer the step reads, when it was
        updated in place (``load_state_dict``, ``mul_``) since the last copy; every call when its version is
        not tracked (a tensor made under ``torch.inference_mode``)."""
        for entry in self._param_copies:
            name, src, seen = entry
            now = tensor_version(src)
            if now is None or now != seen:
                with torch.no_grad():
                    self.tensors[name].copy_(src)
                entry[2] = now

    def _bind_each(self, args, tensors: dict) -> None:
        """Checks and binds the tensor arguments that are not trusted, naming the first bad one."""
        dev = self._device_index
        for i, name, shape, dtype, staged, inplace in self._t_checked:
            a = args[i]
            try:
                bad = not isinstance(a, torch.Tensor) or a.shape != shape or a.dtype != dtype
            except RuntimeError:  # a strided nested tensor has no sizes (read off the common path)
                raise TilecError(layout_error(self._labels[i], a)) from None
            if bad:
                got = f"{a.dtype}{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                raise TilecError(f"{self._labels[i]}: expected {dtype}{list(shape)}, got {got}")
            if not (a.is_cuda and a.get_device() == dev if dev >= 0 else a.is_cpu):
                raise TilecError(f"{self._labels[i]} is on {a.device}, the compiled step runs on {self.device}")
            # (the layout is read off the common path: a sparse COO tensor is not contiguous, a compressed one has
            # no strides; an MKLDNN one says it is contiguous, but lives on the CPU only)
            try:
                plain = not staged and a.is_contiguous() and (dev >= 0 or a.layout is _STRIDED)
            except RuntimeError:  # sparse CSR / CSC / BSR
                plain = False
            if not plain and a.layout is not _STRIDED:
                raise TilecError(layout_error(self._labels[i], a))
            if staged:
                tensors[name].copy_(a)  # a small read-only input: into the program's own buffer
                continue
            if not plain:
                if inplace:
                    raise TilecError(f"{self._labels[i]} is updated in place and must be contiguous (got strides "
                                     f"{list(a.stride())} for shape {list(a.shape)}; the step was planned for any "
                                     f"contiguous tensor of that shape, whatever the example's strides): a "
                                     f".contiguous() copy would be updated instead of yours")
                a = a.contiguous()  # a read-only input: a contiguous copy is equivalent
            tensors[name] = a

    def _positions(self, args, guards: list) -> tuple[dict[int, int], list[bool] | None]:
        """(argument index -> the decode position it holds, each checked; the mismatch flags of
        ``guards``, or None). Position tensors and the guards' flags come to the host in one copy,
        the guards evaluated at the first position tensor's value on the device (a GPU call had
        synchronized twice). Raises PositionError: a shape other than the example's, a tensor of several
        elements that differ, or a position outside ``[0, max_positions)``; TilecError: neither an int nor a
        dense integer tensor."""
        out, tensors = {}, []
        sizes = self._position_sizes
        for i, shape in self._position_args:
            a = args[i]
            if not (isinstance(a, torch.Tensor) and is_integer(a.dtype) and a.layout is _STRIDED and
                    not a.is_nested and (a.numel() == 1 or sizes[i] > 1)):
                out[i] = a if type(a) is int else _position_of(self._labels[i], a, shape)  # TilecError unless an int
                continue
            if shape is not None and a.shape != shape:
                raise PositionError(f"{self._labels[i]}: expected an integer tensor of shape {list(shape)} (the "
                                    f"example's; another shape can change the output's), got "
                                    f"{a.dtype}{list(a.shape)}")
            tensors.append(i)
        flags = None
        if tensors:
            dev = args[tensors[0]].device
            read = None
            groups = self._position_groups
            if groups is not None and len(tensors) == len(self._position_args):  # (no int among them)
                try:  # (group 0 holds the first position argument, first: the guards read it)
                    stacked = [torch.stack([args[i] for i in g]) if len(g) > 1 else args[g[0]] for g in groups]
                    read = [t.reshape(-1).to(dev, torch.int64) for t in stacked]
                    tensors = [i for g in groups for i in g]
                except RuntimeError:  # devices, shapes (no example) or dtypes (uint32) that do not stack
                    self._position_groups = read = None  # one by one from now on
            if read is None:
                read = [args[i].reshape(-1).to(dev, torch.int64) for i in tensors]
            bad = None
            if guards:
                # evaluated before the range check below: a mask indexed by a position must not read past
                # its table (a device assert), so the positions the masks read are clamped into the range
                top = self.graph.max_positions - 1
                clamped = list(args) if self._guard_positions else args
                for i in self._guard_positions:
                    if isinstance(args[i], torch.Tensor):
                        clamped[i] = args[i].clamp(0, top)
                bad = mismatches(guards, clamped, read[0][0], self._labels)  # (p out of range: raised below)
                if bad.device == dev:
                    read.append(bad)  # (cat promotes the flags to int64)
            values = torch.cat(read).tolist()
            k = 0
            for i in tensors:  # (a position tensor of several elements: all hold p, as its example did)
                n = sizes[i]  # (its shape is the example's)
                if n > 1 and values[k:k + n].count(values[k]) != n:
                    raise PositionError(f"{self._labels[i]} holds {values[k:k + min(n, 8)]}{' ...' if n > 8 else ''} "
                                        f"({args[i].dtype}{list(args[i].shape)}), not one value: "
                                        f"every element of a decode position argument holds the step's position")
                out[i] = values[k]
                k += n
            flags = [bool(v) for v in values[k:]] if len(values) > k else None if bad is None else bad.tolist()
        for i, p in sorted(out.items()):  # (the first out of range in call order)
            if not 0 <= p < self.graph.max_positions:
                raise PositionError(f"{self._labels[i]} holds decode position {p}, outside the planned range "
                                    f"[0, {self.graph.max_positions}) ({_WHICH} hold the decode position; a larger "
                                    f"max_positions plans more, as far as the module's caches hold positions)")
        return out, flags

    def _table(self, tensors: dict[str, torch.Tensor], args) -> torch.Tensor:
        """The operand table for this call's tensors: only buffers bound from the call's arguments
        (state, large inputs) can change between calls, so they alone key the cache. The arguments
        are checked not to alias a tensor the step writes (:meth:`_check_disjoint`): all of them with
        a new table, else those bound through a copy (small inputs, strided ones), whose own memory
        the key does not see."""
        key = tuple(map(torch.Tensor.data_ptr, self._arg_tensors(tensors)))
        entry = self._tables.get(key)
        if entry is None:
            if len(self._tables) > 8:
                self._tables.clear()
            entry = self._tables[key] = (self.plan.bind_base(tensors), self._check_disjoint(args))
        else:
            self._check_disjoint(args, entry[1], [i for i, name in self._maybe_copied if tensors[name] is not args[i]])
        return entry[0]

    def _check_disjoint(self, args, written: list | None = None, only: list[int] | None = None) -> list:
        """Raises TilecError when a tensor argument the step writes (a KV cache) shares memory (their
        byte ranges overlap) with another argument or a module parameter the step reads: the plan
        reads each buffer as its own (a weight it reads is streamed early, without waiting on the
        writes; a small or strided argument is read through a copy), so eager's result for aliased
        arguments cannot be matched. Tensors that share memory only to read it (tied weights) are
        fine. Checks every pair, or only arguments ``only`` against the spans ``written`` an earlier
        check returned; returns the written arguments' spans (first byte, byte past the last,
        label), sorted."""
        def span(t: torch.Tensor, label: str, writes: bool) -> tuple:
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
            return t.data_ptr(), t.data_ptr() + extent * t.element_size(), label, writes

        def clash(a: tuple, b: tuple):
            w = a if a[3] else b
            raise TilecError(f"{a[2]} and {b[2]} share memory, and the step writes {w[2]}: pass tensors that do "
                             f"not overlap (tilec reads each argument as a tensor of its own)")

        if only is not None:  # (the written spans are disjoint and sorted: the one starting last before hi)
            for i in only:
                a = args[i]
                if isinstance(a, torch.Tensor) and a.numel():
                    lo, hi, label, _ = span(a, self._labels[i], False)
                    k = bisect.bisect_left(written, (hi,)) - 1
                    if k >= 0 and written[k][1] > lo:
                        clash(written[k], (lo, hi, label, False))
            return written
        graph_written = self.graph.written
        spans = [span(args[i], self._labels[i], name in graph_written) for i, name, *_ in self._tensor_args
                 if isinstance(args[i], torch.Tensor) and args[i].numel()]
        spans += [span(t, f"parameter {self._param_names.get(name, name)}", False) for name, t in self.tensors.items()
                  if self.graph.buffers[name].kind is BufferKind.PARAM and t.numel()]
        spans.sort(key=lambda s: s[:2])
        end, last = -1, None
        for cur in spans:
            if cur[0] < end and (cur[3] or last[3]):
                clash(last, cur)
            if cur[1] > end:
                end, last = cur[1], cur
        return [s for s in spans if s[3]]

    def __call__(self, *args, **kwargs):
        # one call at a time: calls share the step's temporaries and the executor's event counters (two threads
        # calling at once raised false deadlock errors, and later calls returned NaNs; a fresh user's finding)
        with self._lock:
            return self._call(args, kwargs)

    def _order_after_last_call(self) -> None:
        """On a GPU, a call on another CUDA stream than the last call's (threads each with their own stream) first
        waits for the work queued on that stream: the lock orders the host side only, and the two launches would
        otherwise share the executor's counters, operand table and temporaries on the device at once. Not while a
        CUDA graph is being captured (a wait on a stream outside the capture is refused there; the graph's replays
        are ordered by the stream that replays them, and torch.cuda.graph's capture stream waits for the current one)."""
        if torch.cuda.is_current_stream_capturing():
            self._last_stream = None
            return
        stream = torch.cuda.current_stream(self.device)
        if self._last_stream is not None and self._last_stream != stream:
            stream.wait_stream(self._last_stream)
        self._last_stream = stream

    def _call(self, args, kwargs):
        if kwargs:
            raise TilecError(f"a compiled step takes its arguments by position, in the order of the example "
                             f"arguments it was compiled with; got keyword argument(s) {', '.join(sorted(kwargs))}")
        if self.executor_kind == "cuda":  # (before the binding's own device work: parameter copies, position reads)
            self._order_after_last_call()
        tensors, p, flags = self._bind(args, self.guards)
        if flags is None:
            check_mask_guards(self.guards, args, p, self._labels)
        else:
            raise_first_mismatch(self.guards, flags, p, self._labels)
        if self.executor_kind == "reference":
            for name, b in self.graph.buffers.items():
                if b.kind in (BufferKind.TEMP, BufferKind.OUTPUT) and b.dtype.is_floating_point:
                    tensors[name].fill_(float("nan"))
        self.executor.run(tensors, self._table(tensors, args), position=p, check=self._check)
        # one tensor passed for several arguments gets only its last update (they all write a value
        # tabulated from p, so the same value as writing each in turn); all in one device copy
        last = {id(args[idx]): (args[idx], k) for k, (idx, _) in enumerate(self._updates)
                if isinstance(args[idx], torch.Tensor)}
        if last:
            dst = [a for a, _ in last.values()]
            if self._update_rows is not None:
                row = self._update_rows[p].unbind()
                torch._foreach_copy_(dst, [row[k] for _, k in last.values()])
            else:
                torch._foreach_copy_(dst, [self._updates[k][1][p].reshape(a.shape) for a, k in last.values()])
        outs = []
        for v in self.graph.outputs:
            whole = tensors[v.buffer]
            if self.graph.buffers[v.buffer].kind is BufferKind.STATE:
                # an argument updated in place (a KV cache): return it (or a view of it), as eager does
                if v.shape == tuple(whole.shape) and v.strides == whole.stride() and v.offset == 0 \
                        and v.pos_stride == 0:
                    outs.append(whole)
                else:
                    outs.append(whole.as_strided(v.shape, v.strides, whole.storage_offset() + v.offset + p * v.pos_stride))
                continue
            t = whole.reshape(-1)
            outs.append(t.as_strided(v.shape, v.strides, t.storage_offset() + v.offset + p * v.pos_stride).clone())
        if self.out_spec is not None and self.out_spec.num_leaves == len(outs):
            return pytree.tree_unflatten(outs, self.out_spec)  # the module's own structure (a dict, ...)
        return outs[0] if self.single_output and len(outs) == 1 else tuple(outs)
