"""Noticing a compiled module's parameters and buffers replaced after compiling.

A step from :func:`tilec.api.compile_module` (and so :func:`tilec.hf.compile_decode_step`) binds the
module's parameter tensors when compiling and folds its buffers (RoPE ``inv_freq``) into constants.
In-place updates of the parameters are seen (the step reads the same memory); replacing one was not -
``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(...)``, a new submodule,
``model.to(dtype)`` (which swaps each parameter's ``.data``) - and the step went on reading the old
tensors. :class:`ParamWatch` lets the step notice, at a few hundred nanoseconds a call:

- every parameter, buffer or submodule registered on a module of a watched tree bumps a counter (torch's
  global registration hooks, installed once): ``assign=True``, a new Parameter, a new submodule;
- a conversion of the whole module (``.to()``, ``.half()``, ``.to_empty()``) registers nothing, but puts
  new tensors (or new memory) under its parameters' names: the module's first and last bound parameters
  are compared with what the step binds at every call;
- a plain tensor attribute the step took as a constant (``self.scale = t``, or a tensor in a list, tuple or dict
  attribute: ``self.tabs[0] = t``) registers nothing when set: each call compares the tensor under each such
  attribute's name with the one seen last (a dict look-up and the container's keys: ~50-130 ns each on a CPU core).

Any of these signs makes the step look every parameter (:meth:`ParamWatch.changed`), then every folded buffer
and tensor attribute (:meth:`ParamWatch.check_buffers`), up again by its module names (~1-2 ms for a 32-layer
model on a CPU core): a parameter replaced by one the plan fits is bound; anything else raises - another shape,
dtype or device, a tensor subclass, untied weights, a folded buffer or tensor attribute of other values, a
parameter or buffer added (a new bias), a submodule of another class (its forward was not traced: a Linear swapped
for a fake-quantizing one; another plain Linear is fine).

Not seen: ``weight.data = t``, a write into a module's ``_parameters`` dict, setting a parameter to None, or
a submodule's own ``.to()`` / ``.half()``, of parameters other than the module's first and last, with nothing
registered since; in-place edits of a buffer or tensor attribute; forward hooks added after compiling (README).
"""
from __future__ import annotations

import weakref

import torch

from .capture import attribute_tensor, attribute_walk, held_item
from .errors import TilecError, with_article

_REGISTERED = [0]  # parameters, buffers and submodules registered on a watched module since the hooks went in
_WATCHED: weakref.WeakSet = weakref.WeakSet()  # every module of every watched module's tree (as of its last look)
_hooked = False


def _count(module, *_args) -> None:
    # Only the watched modules count: HF slices its ModuleList of layers at every forward (a new container that
    # registers them again), and a module made anywhere registers its parameters - neither replaces anything.
    # (Skipped, before anything else is read, while Dynamo traces a forward that registers something: it guards on
    # what the hook reads - the count recompiled the model at every call, and the watched set, which shrinks as
    # modules are collected, failed the guard's own build.)
    if torch.compiler.is_compiling():
        return
    if module in _WATCHED:
        _REGISTERED[0] += 1


def _install_hooks() -> None:
    global _hooked
    if not _hooked:
        hooks = torch.nn.modules.module
        hooks.register_module_parameter_registration_hook(_count)
        hooks.register_module_buffer_registration_hook(_count)
        hooks.register_module_module_registration_hook(_count)
        _hooked = True


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` holds ``b``'s values: shape, dtype, device and elements, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(a, b) or (a.is_floating_point() and bool(torch.isclose(a, b, 0, 0, equal_nan=True).all()))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor's data (tied weights loaded as two Parameters of one storage)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.device == b.device)


class ParamWatch:
    """The parameters a step binds and the buffers it folded, as ``module`` holds them.

    ``params``: placeholder name -> the module's name for the parameter (tied weights: one placeholder,
    every name of the tensor is watched); ``buffers``: placeholder name -> (the module's name, the value
    folded); ``attributes``: the same for plain tensor attributes the step took as constants (the value compiled, a
    copy; every name holding the tensor is watched). Holds the module (``compile_module(Wrapper(model), ...)``: a
    wrapper held weakly was collected at once, and with it every look) and the bound parameters themselves (their memory is bound anyway). A wrapper
    whose ``tilec_user_module`` names the attribute holding the user's model (:class:`tilec.hf.StaticCacheStep`:
    ``"model"``) has its errors name parameters as that model does (``model.embed_tokens.weight``, not
    ``model.model.embed_tokens.weight``)."""

    def __init__(self, module: torch.nn.Module, params: dict[str, str], buffers: dict[str, tuple[str, torch.Tensor]],
                 attributes: dict[str, tuple[str, torch.Tensor]] | None = None):
        _install_hooks()
        self._root = module
        under = getattr(module, "tilec_user_module", None)
        self._prefix = f"{under}." if isinstance(under, str) else ""
        named = dict(module.named_parameters(remove_duplicate=False))
        names_of: dict[int, list[str]] = {}
        for name, p in named.items():
            names_of.setdefault(id(p), []).append(name)
        self._names = {ph: names_of[id(named[target])] for ph, target in params.items()}
        self._seen = {ph: (named[target], named[target].data_ptr()) for ph, target in params.items()}
        held = dict(module.named_buffers(remove_duplicate=False))
        self._buffers = {target: (held[target], held[target].data_ptr(), value)
                         for target, value in buffers.values() if target in held}
        # plain tensor attributes the step took as constants (setting one registers nothing, so each call looks at
        # them: a dict look-up each, and a container's keys): the module's name -> [the owner submodule, the path
        # (owner's name, attribute, container keys), the tensor there, the value compiled]
        self._attributes = {}
        if attributes:
            walk = attribute_walk(module)
            names_of_tensor: dict[int, list[str]] = {}
            for name, (t, _) in walk.items():
                names_of_tensor.setdefault(id(t), []).append(name)
            for target, value in attributes.values():
                t = walk[target][0]
                for name in names_of_tensor[id(t)]:  # (self.scale = self.l.scale: both names)
                    path = walk[name][1]
                    self._attributes[name] = [module.get_submodule(path[0]), path, t, value]
        # what the traced forward was made of: a parameter or buffer added later, or a submodule of another class
        # (whose forward the step never traced), is refused rather than silently left out
        self._state_names = set(named) | set(held)
        self._classes = {name: type(m) for name, m in module.named_modules(remove_duplicate=False)}
        self.settle()

    def shown(self, name: str) -> str:
        """``name`` (of a parameter, buffer or submodule of the compiled module) as the user's model names it."""
        return name.removeprefix(self._prefix) if self._prefix and name != self._prefix[:-1] else name

    def _look_at_ends(self, module: torch.nn.Module) -> None:
        """Notes where the first and last bound parameters live: (the owner's parameter dict, name, placeholder)."""
        self._ends = []
        for ph in dict.fromkeys((next(iter(self._names)), next(reversed(self._names)))) if self._names else ():
            owner, _, leaf = self._names[ph][0].rpartition(".")
            self._ends.append((module.get_submodule(owner)._parameters, leaf, ph))

    def moved(self) -> bool:
        """Whether a parameter may have been replaced since the last look (cheap: see the module's doc)."""
        if self._generation_seen != _REGISTERED[0]:
            return True
        for owner, (_, attr, keys), held, _ in self._attributes.values():
            now = owner.__dict__.get(attr)  # (the module, not its __dict__: a deep copy of the step has its own)
            if (held_item(now, keys) if keys else now) is not held:
                return True
        for params, leaf, ph in self._ends:
            p, ptr = self._seen[ph]
            if params.get(leaf) is not p or p.data_ptr() != ptr:
                return True
        return False

    def changed(self) -> dict[str, tuple[str, torch.Tensor]]:
        """The parameters the module now holds in place of those the step binds: placeholder name -> (its
        name as the user's model has it, :meth:`shown`; the new tensor); empty when none changed. Call
        :meth:`accept` for each once bound, then :meth:`check_buffers` and :meth:`settle`. Raises TilecError
        naming a parameter the module no longer has, one replaced by a tensor subclass, tied parameters that are
        no longer one tensor, a parameter or buffer added, or a submodule of another class."""
        root = self._root
        named = dict(root.named_parameters(remove_duplicate=False))
        held = dict(root.named_buffers(remove_duplicate=False))
        for name, m in root.named_modules(remove_duplicate=False):
            was = self._classes.get(name)
            if was is not None and type(m) is not was:
                kind, compiled = with_article(type(m).__name__), with_article(was.__name__)
                raise TilecError(f"submodule {self.shown(name)} is now {kind} ({compiled} when compiling): "
                                 f"the step runs the forward it traced, not the new one; compile the step again")
        added = sorted((set(named) | set(held)) - self._state_names)
        if added:
            more = f" and {len(added) - 1} more" if len(added) > 1 else ""
            raise TilecError(f"{self.shown(added[0])}{more} was added to the compiled module after compiling, "
                             f"which the traced step does not read: compile the step again")
        out = {}
        for ph, names in self._names.items():
            now = [named.get(n) for n in names]
            gone = [n for n, p in zip(names, now) if p is None]
            if gone:
                raise TilecError(f"parameter {self.shown(gone[0])} is no longer a parameter of the compiled module "
                                 f"(deleted, set to None or replaced by a plain tensor): compile the step again")
            if not all(_same_memory(p, now[0]) for p in now[1:]):
                raise TilecError(f"parameters {' and '.join(map(self.shown, names))} were one tensor (tied) when "
                                 f"compiling and no longer are: compile the step again")
            p, ptr = self._seen[ph]
            if now[0] is not p or now[0].data_ptr() != ptr:
                if type(now[0].detach()) is not torch.Tensor:  # (a quantized wrapper: no plain memory to bind)
                    kind = with_article(type(now[0].detach()).__name__)
                    raise TilecError(f"parameter {self.shown(names[0])} was replaced by {kind} (a tensor subclass): "
                                     f"the step binds plain tensors; compile the step again")
                out[ph] = (self.shown(names[0]), now[0])
        return out

    def check_buffers(self) -> None:
        """Raises TilecError naming a folded buffer or a plain tensor attribute the module now holds other values in
        (after :meth:`changed` and the caller's own checks of the new parameters, so ``model.half()`` is named by a
        weight's dtype rather than by a RoPE table's); one replaced by equal values is watched from now on."""
        held = dict(self._root.named_buffers(remove_duplicate=False))
        for target, (b, ptr, value) in list(self._buffers.items()):
            now = held.get(target)
            if now is b and now.data_ptr() == ptr:
                continue
            if now is None or not _same_values(now, value):
                raise TilecError(f"buffer {self.shown(target)} was replaced after compiling by other values (a new "
                                 f"submodule, the module's .to(), a RoPE update): the step folded its values when "
                                 f"compiling; compile the step again")
            self._buffers[target] = (now, now.data_ptr(), value)
        for target, entry in self._attributes.items():
            path = entry[1]
            now = attribute_tensor(self._root, path)  # (by its path: no walk of the module's containers)
            if now is not entry[2] and (not isinstance(now, torch.Tensor) or not _same_values(now, entry[3])):
                raise TilecError(f"tensor attribute {self.shown(target)} was replaced after compiling by other values "
                                 f"(or removed): the step took its values as constants when compiling (a tensor held "
                                 f"under several names is watched under each); compile the step again")
            # equal values (or the same tensor, perhaps in a new submodule or container): watched there from now on
            entry[0], entry[2] = self._root.get_submodule(path[0]), now

    def accept(self, ph: str, param: torch.Tensor) -> None:
        """Records ``param`` as what the step now binds for placeholder ``ph``."""
        self._seen[ph] = (param, param.data_ptr())

    def settle(self) -> None:
        """Marks every registration so far as looked at, and notes the module's tree and ends as they are now."""
        for m in self._root.modules():
            _WATCHED.add(m)
        self._look_at_ends(self._root)
        self._generation_seen = _REGISTERED[0]
