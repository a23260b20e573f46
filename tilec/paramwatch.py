"""Noticing a compiled module's parameters replaced after compiling.

A step from :func:`tilec.api.compile_module` (and so :func:`tilec.hf.compile_decode_step`) binds the
module's parameter tensors when compiling. In-place updates of them are seen (the step reads the same
memory); replacing one is not - ``load_state_dict(..., assign=True)``, ``module.weight =
nn.Parameter(...)``, a new submodule, ``model.to(dtype)`` (which swaps each parameter's ``.data``) - and
the step would go on reading the old tensors. :class:`ParamWatch` lets the step notice, at the cost of a
few hundred nanoseconds a call:

- every parameter or submodule registered on any module in the process bumps a counter (torch's global
  registration hooks, installed once): ``assign=True``, a new Parameter and a new submodule all register;
- a conversion of the whole module (``.to()``, ``.half()``, ``.cuda()``) registers nothing, but gives its
  parameters new memory: the first and last parameter's data pointers are compared at every call.

Either sign makes the step look every parameter up again by its module name (:meth:`ParamWatch.changed`).
Not seen: ``weight.data = t`` of one parameter other than the first or last, with nothing registered
since (documented in the README).
"""
from __future__ import annotations

import weakref

import torch

from .errors import TilecError

_REGISTERED = [0]  # parameters and submodules registered on any module since the hooks went in
_hooked = False


def _count(*_args) -> None:
    _REGISTERED[0] += 1


def _install_hooks() -> None:
    global _hooked
    if not _hooked:
        torch.nn.modules.module.register_module_parameter_registration_hook(_count)
        torch.nn.modules.module.register_module_module_registration_hook(_count)
        _hooked = True


class ParamWatch:
    """The parameters a step binds, as ``module`` holds them: placeholder name -> the module's name for it
    (``targets``). Holds the module and its parameters weakly (a module collected leaves nothing to watch)."""

    def __init__(self, module: torch.nn.Module, targets: dict[str, str]):
        _install_hooks()
        self._root = weakref.ref(module)
        self._targets = dict(targets)
        self._seen: dict[str, tuple] = {}  # name -> (weak ref to the Parameter, its data pointer)
        for name, target in self._targets.items():
            self.accept(name, module.get_parameter(target))
        self._generation = _REGISTERED[0]
        names = list(self._targets)
        self._ends = [self._seen[n] for n in dict.fromkeys((names[0], names[-1]))] if names else []

    def accept(self, name: str, param: torch.Tensor) -> None:
        """Records ``param`` as what the step now binds for placeholder ``name``."""
        entry = (weakref.ref(param), param.data_ptr())
        if name in self._seen:  # (the first and last parameters' entries are compared at every call)
            old = self._seen[name]
            self._ends = [entry if e is old else e for e in self._ends]
        self._seen[name] = entry

    def moved(self) -> bool:
        """Whether a parameter may have been replaced since the last look (cheap: see the module's doc)."""
        if self._generation != _REGISTERED[0]:
            return True
        for ref, ptr in self._ends:
            p = ref()
            if p is None or p.data_ptr() != ptr:
                return True
        return False

    def changed(self) -> dict[str, tuple[str, torch.Tensor]]:
        """The parameters the module now holds in place of those the step binds: placeholder name -> (the
        module's name, the new tensor). Empty when none changed (or the module is gone). Call :meth:`settle`
        once they are bound. Raises TilecError naming a parameter the module no longer has."""
        root = self._root()
        if root is None:
            return {}
        out = {}
        for name, target in self._targets.items():
            try:
                p = root.get_parameter(target)
            except AttributeError:
                raise TilecError(f"parameter {target} is no longer a parameter of the compiled module (deleted or "
                                 f"replaced by a plain tensor): compile the step again") from None
            ref, ptr = self._seen[name]
            if ref() is not p or p.data_ptr() != ptr:
                out[name] = (target, p)
        return out

    def settle(self) -> None:
        """Marks every registration so far as looked at."""
        self._generation = _REGISTERED[0]
