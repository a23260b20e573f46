"""Hugging Face decoders with a ``StaticCache``: one decode step as a capturable module."""
from __future__ import annotations

import inspect
import numbers
import threading
import warnings
import weakref

import torch

from .api import compile_module
from .errors import DataDependentError, InputError, PositionError
from .options import Options
from .ir import is_integer
from .program import OneCallAtATime, tensor_version


def cache_kwargs(model, cache) -> dict:
    """The keyword that passes ``cache`` to an HF causal LM's ``forward``: ``{"cache": cache}`` where
    the forward takes ``cache`` (transformers 5.24 renamed ``past_key_values``, warning that the old
    name goes in 5.40), else ``{"past_key_values": cache}`` (earlier versions). ``model`` may be
    wrapped by ``torch.compile``."""
    forward = type(getattr(model, "_orig_mod", model)).forward
    return {"cache": cache} if "cache" in inspect.signature(forward).parameters else {"past_key_values": cache}


def _layers(cache):
    return cache.layers if hasattr(cache, "layers") else None


def _is_static(cache) -> bool:
    """A transformers StaticCache (by class, or by its layers' classes on versions that keep one
    Cache class with per-layer kinds)."""
    import transformers

    if isinstance(cache, getattr(transformers, "StaticCache", ())):
        return True
    layers = _layers(cache)
    return bool(layers) and all("Static" in type(layer).__name__ for layer in layers)


class StaticCacheStep(torch.nn.Module):
    """``forward(input_ids [B, S] int64, cache_position [S] int64, *state) -> logits [B, S, V]``.

    ``state`` holds, per cache layer, the key cache [B, Hkv, L, D], the value cache and - on
    transformers versions whose ``StaticLayer`` keeps one - its ``cumulative_length`` counter.
    The cache tensors are passed as inputs so the captured graph updates them in place.
    """

    tilec_user_module = "model"  # the parameter watch's errors name parameters as ``model`` does (ParamWatch)

    def __init__(self, model, cache):
        """Raises InputError unless ``cache`` is a prefilled transformers ``StaticCache``."""
        super().__init__()
        if cache is not None and not _is_static(cache):
            grows = ", whose tensors grow every step (tilec plans fixed buffers)" if "Dynamic" in type(cache).__name__ \
                else ""
            raise InputError(f"StaticCacheStep needs a transformers StaticCache prefilled eagerly; got "
                             f"{type(cache).__name__}{grows}: build it as transformers.StaticCache(config=model.config, "
                             f"max_cache_len=...) and prefill with it")
        layers = _layers(cache) if cache is not None else None
        if not layers or not all(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
            raise InputError(f"StaticCacheStep needs a transformers StaticCache prefilled eagerly (its layers' keys "
                             f"and values allocated); got {type(cache).__name__}"
                             + (" with unallocated layers: run a prefill step first" if layers else ""))
        head = getattr(model, "get_output_embeddings", None)
        if not callable(head) or head() is None:
            raise InputError(f"{type(model).__name__} has no language-model head (its output embeddings): pass the "
                             f"causal-LM model (e.g. LlamaForCausalLM, from AutoModelForCausalLM), not its base model")
        self.model, self.cache = model, cache
        self.has_counter = [isinstance(getattr(l, "cumulative_length", None), torch.Tensor) for l in _layers(cache)]

    def state(self) -> list[torch.Tensor]:
        """The cache tensors :meth:`forward` takes after ``cache_position``, in its order: per cache
        layer the key cache [B, Hkv, L, D], the value cache, and - where ``has_counter`` says the
        layer has one - its ``cumulative_length`` counter. The cache's own tensors, not copies."""
        out = []
        for layer, counter in zip(_layers(self.cache), self.has_counter):
            out += [layer.keys, layer.values] + ([layer.cumulative_length] if counter else [])
        return out

    def state_labels(self) -> list[str]:
        """How errors name :meth:`state`'s tensors: ``cache.layers[i].keys``, ``.values``, ``.cumulative_length``."""
        return [f"cache.layers[{i}].{what}" for i, counter in enumerate(self.has_counter)
                for what in ("keys", "values") + (("cumulative_length",) if counter else ())]

    def forward(self, input_ids, cache_position, *state):
        """Raises InputError when ``state`` does not hold one tensor per cache tensor (``state()``)."""
        want = 2 * len(self.has_counter) + sum(self.has_counter)
        if len(state) != want:
            raise InputError(f"StaticCacheStep takes {want} state tensors after input_ids and cache_position "
                             f"(keys and values of {len(self.has_counter)} cache layers"
                             + (", each with its cumulative_length" if any(self.has_counter) else "")
                             + f", as StaticCacheStep.state() lists them); got {len(state)}")
        i = 0
        saved = []
        for layer, counter in zip(_layers(self.cache), self.has_counter):
            saved.append((layer.keys, layer.values, getattr(layer, "cumulative_length", None)))
            layer.keys, layer.values = state[i], state[i + 1]
            i += 2
            if counter:
                layer.cumulative_length = state[i]
                i += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return self.model(input_ids, cache_position=cache_position, use_cache=True,
                                  **cache_kwargs(self.model, self.cache)).logits
        finally:
            for layer, (k, v, c) in zip(_layers(self.cache), saved):
                layer.keys, layer.values = k, v
                if c is not None:
                    layer.cumulative_length = c


# a cache made under torch.inference_mode holds inference tensors: compiling or calling a step over it outside it
INFERENCE_CACHE_WHY = ("the StaticCache was made under torch.inference_mode() (its keys and values are inference "
                       "tensors, which torch lets only code inside it update): compile and call the step inside "
                       "torch.inference_mode() too, or prefill the cache under torch.no_grad()")


# cache -> the token of the HFDecodeStep that last set its token counters (a step over a cache another step wrote
# since must read the counters, whatever it remembers). A token, not the step: the step holds the cache, which
# would then never be freed
_LAST_WRITER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ends(counters: list[torch.Tensor]) -> tuple:
    """The first and last counter and their versions: every eager forward, ``cache.reset()`` and compiled step
    updates all of a cache's counters in place, which moves each one's version (None where torch keeps none:
    tensors made under ``torch.inference_mode``)."""
    first, last = counters[0], counters[-1]
    return first, last, tensor_version(first), tensor_version(last)


class HFDecodeStep(OneCallAtATime):
    """A compiled decode step of an HF causal LM over its ``StaticCache``.

    ``step(input_ids [B, 1], position)`` returns logits [B, 1, V] (float, the model's dtype)
    and writes the new keys/values into the cache at ``position`` in place, advancing the
    cache's own position counters as eager HF would.

    The step binds the model's parameter tensors when compiled: in-place updates of them
    (``load_state_dict``, ``weight.mul_(...)``, ``weight.data.copy_(...)``) are seen - of a
    non-contiguous parameter, which the step reads through a contiguous copy taken again when its
    version counter moved, all but those through ``.data`` (a view with a version of its own);
    replacing one (``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(...)``, a new
    submodule, ``model.to(...)``) is noticed at the next call, which binds the new tensors or, when their
    shape, dtype or device changed, raises TilecError naming the parameter (:mod:`tilec.paramwatch`, which
    also says what is not noticed: ``weight.data = t`` of one parameter - compile again after that).
    Buffers (RoPE ``inv_freq``) are constants taken when compiling.
    The cache's token counters are read back (a sync on a GPU) only when something other than this
    step may have changed them since its last call (see ``__call__``).
    """

    def __init__(self, model, cache, batch_size: int, options=None, hook=None):
        layers = _layers(cache)
        if not layers or not all(hasattr(layer, "keys") and hasattr(layer, "is_initialized") for layer in layers) \
                or not _is_static(cache):
            raise InputError(f"tilec compiles decode steps over a transformers StaticCache; got {type(cache).__name__} "
                             f"(create one with StaticCache(config=model.config, max_cache_len=...))")
        if not all(l.is_initialized for l in layers):
            raise InputError("the StaticCache is not initialized: run a prefill step eagerly first")
        windowed = [i for i, layer in enumerate(layers) if "Sliding" in type(layer).__name__]
        if windowed:
            window = getattr(model.config, "sliding_window", None)
            # (transformers' own flag: the cache asked for is no longer than the window - a Mistral config's
            # default 4096 over a short cache)
            moot = ("; this window is no shorter than the cache, so the attention is plain causal: set "
                    "model.config.sliding_window = None before building the StaticCache"
                    if all(getattr(layers[i], "_is_croppable", None) is True for i in windowed) else "")
            raise InputError(f"{type(model).__name__} has sliding-window attention (cache layers {windowed[:4]}"
                             f"{' ...' if len(windowed) > 4 else ''} are {type(layers[windowed[0]]).__name__}"
                             f"{f', window {window}' if window else ''}): tilec plans causal attention over the whole "
                             f"static cache and does not support sliding windows yet{moot}")
        self._inference_cache = any(t.is_inference() for layer in layers for t in (layer.keys, layer.values))
        if self._inference_cache and not torch.is_inference_mode_enabled():
            raise InputError(INFERENCE_CACHE_WHY)
        cache_batch = int(layers[0].keys.shape[0])
        if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool):
            raise InputError(f"batch_size must be an int, got {batch_size!r}")
        if batch_size != cache_batch:
            raise InputError(f"batch_size={batch_size!r}, but the StaticCache holds {cache_batch} "
                             f"sequence{'s' if cache_batch != 1 else ''}")
        self.cache = cache
        self.module = StaticCacheStep(model, cache)
        self.max_len = int(_layers(cache)[0].keys.shape[2])
        device = next(model.parameters()).device
        ids = torch.zeros(batch_size, 1, dtype=torch.int64, device=device)
        pos = torch.zeros(1, dtype=torch.int64, device=device)
        state = [torch.zeros_like(t) if t.dim() == 0 else t for t in self.module.state()]  # (counters: at p = 0, as pos)
        positions = [1] + [2 + i for i, t in enumerate(state) if t.dim() == 0]
        self._expected: int | None = None  # the cache's token count after our last step (host copy)
        self._mark: tuple | None = None  # the first and last counter and their versions, as our last step left them
        self._token = object()  # names this step in _LAST_WRITER
        self._lock = threading.Lock()
        try:
            self.program = compile_module(self.module, (ids, pos, *state), positions=positions,
                                          max_positions=self.max_len, options=options, hook=hook)
            self.program.name_arguments(["input_ids", "position"] + self.module.state_labels())
        except DataDependentError as e:
            # the 0-d arguments are the cache's counters, which tilec passes itself: not the user's to change
            raise DataDependentError(f"{e.base} ({type(model).__name__}'s forward reads a value at run time: its "
                                     f"decode step is not one static graph)") from e

    def __call__(self, input_ids: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """``position``: an int, or an integer tensor of one element (read on the host: a device
        tensor costs a sync). Raises :class:`tilec.errors.PositionError` (a ``TilecError`` and a
        ``ValueError``) if it is neither, does not equal the number of tokens the cache holds (on
        transformers versions whose cache counts them), or is outside ``[0, max_cache_len)``. The counters are
        read on the device (a sync) unless this step's own last step or seek left them at ``position``, unchanged
        since (their version counters; a cache made under ``torch.inference_mode`` keeps none, and there an eager
        forward or ``cache.reset()`` in between goes unnoticed - another compiled step over the cache does not)."""
        if self._inference_cache and not torch.is_inference_mode_enabled():
            raise InputError(INFERENCE_CACHE_WHY)
        with self._lock:  # a step, or a seek, at a time: the cache's counters and what this step remembers of them
            return self._step(input_ids, position)

    def _after_last_call(self) -> None:
        """On a GPU, orders this call's counter reads and writes after the program's last call on another stream."""
        if self.program.executor_kind == "cuda":
            with self.program._lock:
                self.program._order_after_last_call()

    def _step(self, input_ids: torch.Tensor, position) -> torch.Tensor:
        position = self._check_position(position)
        self._after_last_call()
        counters = self._counters()
        if counters and not self._unchanged(counters, position):  # checked on the device only when in doubt
            held = torch.stack([c.reshape(()) for c in counters]).tolist()
            bad = [h for h in held if h != position]
            if bad:
                raise PositionError(f"position {position}, but the cache holds {bad[0]} tokens: "
                                    f"decode steps must write consecutive positions (to re-decode from a position, "
                                    f"call step.seek(position) first)")
        # the position argument and every layer's counter argument as the int (no host tensors to
        # parse; the cache's own counters are advanced below)
        state = [position if t.dim() == 0 else t for t in self.module.state()]
        logits = self.program(input_ids, position, *state)
        if counters:  # advance the cache's own counters as eager HF would (two kernels, no sync)
            torch._foreach_zero_(counters)
            torch._foreach_add_(counters, position + input_ids.shape[1])
        self._remember(counters, position + input_ids.shape[1])
        return logits

    def seek(self, position: int | torch.Tensor) -> None:
        """Rewinds (or advances) the cache's own token counters to ``position`` (as for a step) without
        a host sync, so the next step may write there (re-decoding a position, e.g. when a speculative
        token is rejected, or timing the same step repeatedly). Cache contents are untouched."""
        position = self._check_position(position)
        with self._lock:
            self._after_last_call()
            counters = self._counters()
            if counters:
                torch._foreach_zero_(counters)
                torch._foreach_add_(counters, position)
            self._remember(counters, position)

    def _remember(self, counters: list[torch.Tensor], held: int) -> None:
        """Notes that the cache's counters hold ``held`` tokens as this step set them."""
        self._expected = held
        if not counters:
            return
        self._mark = _ends(counters)
        try:
            if _LAST_WRITER.get(self.cache) is not self._token:
                _LAST_WRITER[self.cache] = self._token
        except TypeError:  # a cache that takes no weak reference: no record (the versions still tell)
            pass

    def _unchanged(self, counters: list[torch.Tensor], position: int) -> bool:
        """Whether the counters surely hold ``position`` tokens without reading them: this step set them to
        that and nothing changed them since - not another compiled step over the cache, not an eager forward or
        ``cache.reset()`` (the first and last counters' versions: those update every layer's counter; an edit of
        one middle layer's counter alone goes unnoticed. Counters made under ``torch.inference_mode`` keep no
        version, and then only another compiled step is noticed)."""
        if position != self._expected or self._mark is None:
            return False
        try:
            if _LAST_WRITER.get(self.cache) is not self._token:
                return False
        except TypeError:
            pass
        first, last, v_first, v_last = self._mark
        return counters[0] is first and counters[-1] is last and tensor_version(first) == v_first \
            and tensor_version(last) == v_last

    def _check_position(self, position) -> int:
        """``position`` as an int, checked against the cache's length."""
        if isinstance(position, torch.Tensor) and position.numel() == 1 and is_integer(position.dtype) \
                and not position.is_meta:
            position = int(position.reshape(-1)[0])
        elif not isinstance(position, numbers.Integral) or isinstance(position, bool):
            got = (f"a {position.dtype} tensor of shape {list(position.shape)}"
                   f"{' on the meta device (no value)' if position.is_meta else ''}"
                   if isinstance(position, torch.Tensor) else repr(position))
            raise PositionError(f"position must be an int or an integer tensor of one element, got {got}")
        position = int(position)
        if not 0 <= position < self.max_len:
            raise PositionError(f"decode position {position} outside the planned range [0, {self.max_len}) "
                                f"(the static cache holds {self.max_len} positions)")
        return position

    def _counters(self) -> list[torch.Tensor]:
        return [layer.cumulative_length for layer, counter in zip(_layers(self.cache), self.module.has_counter)
                if counter]


def compile_decode_step(model, cache, batch_size: int = 1, options: Options | dict | None = None,
                        hook=None) -> HFDecodeStep:
    """Compiles one decode step (one new token per sequence) of ``model`` over ``cache``."""
    return HFDecodeStep(model, cache, batch_size, options, hook)
