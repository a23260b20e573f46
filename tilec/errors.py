"""tilec's exceptions. Each names the user's thing: FX node, source line, op, shape, event."""
from __future__ import annotations


class TilecError(Exception):
    """Base class of every error tilec raises on purpose."""


class UnsupportedNodeError(TilecError):
    """One or more FX nodes cannot be lowered to tilec ops.

    ``nodes`` holds ``(node name, target, source line)`` for each; an entry given with a fourth
    element (that node's own reason) prints it after the node's line, once for a run of nodes with
    the same reason and target (``index_copy``, ``index_copy_1``, ...; a ``cumprod`` after a
    ``cumsum`` says why again). ``hint``, when given, ends the message: what the user can do.
    """

    def __init__(self, nodes: list[tuple[str, ...]], reason: str = "", hint: str = ""):
        self.nodes = [tuple(n[:3]) for n in nodes]
        self.reason = reason
        self.why = [n[3] if n[3:4] else "" for n in nodes]
        lines, last = [], None
        for n, why in zip(nodes, self.why):
            lines.append(f"  {n[0]} ({n[1]})" + (f" at {n[2]}" if n[2] else ""))
            if why and (why, n[1]) != last:
                lines.append(f"    why: {why}")
            last = (why, n[1])
        head = f"tilec cannot lower {len(nodes)} FX node(s)" + (f": {reason}" if reason else "")
        super().__init__(head + "\n" + "\n".join(lines) + (f"\n  hint: {hint}" if hint else ""))


class InputError(TilecError, ValueError):
    """The inputs of a compile call do not fit the module: its example arguments, ``positions``
    or ``max_positions``. The message names the argument and the shapes or values involved. Also a
    ``ValueError``, which :func:`tilec.api.compile_module` raised for such inputs before."""


class OptionsError(TilecError, ValueError):
    """A compile option's name or value is not valid (the message names the option, and for an
    unknown name the nearest valid one). Also a ``ValueError``, which :class:`tilec.options.Options`
    raised before."""


class ExampleInputError(InputError):
    """The module fails when run eagerly on its own example arguments (wrong count, shapes or
    dtypes): the message names the argument shapes and the user's source line that raised, or
    the signature of the ``forward`` they do not fit."""


def with_article(noun: str) -> str:
    """``noun`` after its indefinite article, for messages: ``a list``, ``an int``, ``an Embedding``."""
    return f"{'an' if noun[:1].lower() in tuple('aeiou') else 'a'} {noun}"


def describe_exception(e: BaseException) -> str:
    """``Type: message`` of an exception raised by the user's code, ``Type (no message)`` without a
    message, and ``Type (its message cannot be printed: ...)`` when its ``__str__`` itself raises
    (such a report once ended ``tilec compile`` with an internal error)."""
    try:
        text = str(e)
    except Exception as inner:  # noqa: BLE001 - a broken __str__ of the user's exception class
        return f"{type(e).__name__} (its message cannot be printed: {type(inner).__name__} in __str__)"
    return f"{type(e).__name__}: {text}" if text else f"{type(e).__name__} (no message)"


class PositionError(TilecError, ValueError):
    """A call's decode position arguments do not fit its program: one is outside the planned range
    ``[0, max_positions)``, two disagree, or (``HFDecodeStep``) it is not an integer or not the
    cache's next position. The message names the arguments and values. Also a ``ValueError``, which
    ``HFDecodeStep`` raised for the latter before."""


class EagerFailsError(UnsupportedNodeError, InputError):
    """A node eager PyTorch cannot run either, on these inputs (a linear of mixed dtypes, a cache write of
    another dtype): the module or its example arguments are wrong, not tilec's coverage. An
    :class:`UnsupportedNodeError` (it lists the node) and an :class:`InputError` (``tilec compile`` exits 2,
    bad input, rather than 3)."""


class DataDependentError(TilecError):
    """``torch.export`` cannot capture the module: its forward depends on a tensor's value (a
    branch, a loop count, a size or an index read from data). ``base`` is the message without ``hint``, the
    advice for the case where the value read is a 0-d position argument (empty when no position
    argument is 0-d): a caller that passes those arguments itself (``compile_decode_step``) words
    its own advice instead."""

    def __init__(self, base: str, hint: str = ""):
        self.base, self.hint = base, hint
        super().__init__(base + hint)


class VerificationError(TilecError):
    """A stage verifier found a broken invariant (a compiler bug, or a corrupted plan)."""


class DeadlockError(TilecError):
    """No worker can make progress: ``cycle`` lists ``(worker, instruction, event)`` triples."""

    def __init__(self, message: str, cycle: list[tuple[int, int, int]]):
        self.cycle = cycle
        super().__init__(message)
