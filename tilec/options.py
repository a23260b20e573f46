"""One typed options object for the whole pipeline (hashed into cache keys)."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass

from .errors import OptionsError

SCHEDULERS = ("list", "round_robin")
EXECUTORS = ("auto", "cuda", "reference")


# Names users pass as options that belong elsewhere: what to do instead (Options.from_dict's error).
NOT_COMPILE_OPTIONS = {
    "fallback": "'fallback' is an option of torch.compile(backend=\"tilec\") only",
    "max_positions": "'max_positions' is an argument of compile_module (and a key of a tilec compile factory's "
                     "dict; an option of torch.compile(backend=\"tilec\"))",
    "positions": "'positions' is an argument of compile_module (and a key of a tilec compile factory's dict)",
}


def did_you_mean(unknown: list, valid: list[str]) -> str:
    """`` (did you mean 'workers' for 'Workers'?)`` naming the nearest valid name of each unknown
    name where one is close, or ``""``."""
    near = {u: m[0] for u in unknown if isinstance(u, str)
            for m in [difflib.get_close_matches(u.lower(), valid, n=1, cutoff=0.6)] if m}
    return f" (did you mean {', '.join(f'{m!r} for {u!r}' for u, m in near.items())}?)" if near else ""


def unknown_options_message(unknown: list, valid: list[str]) -> str:
    """The error for option names not in ``valid``: lists them, the nearest valid name of each
    where one is close (``Workers`` -> ``workers``), where a name belongs if not here, and ``valid``."""
    hint = did_you_mean(unknown, valid)
    hint += "".join(f"; {NOT_COMPILE_OPTIONS[u]}" for u in unknown if u in NOT_COMPILE_OPTIONS)
    return f"unknown tilec option(s) {unknown}{hint}; valid options: {valid}"


@dataclass(frozen=True)
class Options:
    """Compile options.

    workers: number of worker queues W (one persistent CTA each on the GPU; 1..1024).
    scheduler: ``"list"`` (cost-aware list scheduling, default) or ``"round_robin"``.
    tile_n: output columns per GEMV/GEMM tile; None (default) = per op, about N / workers
        (``tilec.ops.gemv_tile_n``).
    split_k: K splits per GEMV tile (> 1 makes ``tile_reduce`` partial tiles, which add into the
        output in its dtype: a bf16 output rounds each partial sum, so the error grows with the
        splits - a K = 4096 bf16 GEMV's relative L2 error against float64 was 3.8e-3 at 8 splits and
        6.2e-3 at 32, eager's 1.7e-3, and near-zero outputs can be far off relatively).
    tile_rows: rows per tile of row-wise ops (norms, elementwise, softmax, RoPE, cache writes), along
        the first dim of size > 1. 1 (the default) gives a batch-1 decode step's RoPE and
        cache-write tiles one head each, which lets each split-KV attention tile wait on its own
        heads' producers directly (with 4, normalization relayed them through empty tasks: 1.513
        vs 1.536 ms a Llama-3.2-1B step on an H200). At batch > 1 a tile is one sequence's heads.
    tile_cols: columns per tile of elementwise ops (default 1024; None = whole rows).
    attn_heads_per_tile: KV heads per decode-attention tile.
    attn_kv_chunk: cache positions per split of split-KV (flash-decoding) attention
        (``tilec.passes.split_kv``); None (default) = per op, the multiple of 32 in 64..288 whose
        rounds of (batch, KV head group, split) tiles over ``workers`` take least by the cost
        model (one round at small batch; ``split_kv.kv_chunk``). An attention op with fewer than
        2 splits stays one ``attention`` op.
    fuse_gemv: fuse RMSNorm / SiLU-mul producers and residual adds into the GEMVs around them
        (``tilec.passes.fuse_gemv``; bitwise the same results, fewer dependent stages).
    swiglu_split: with ``fuse_gemv``, apply SwiGLU's SiLU in the gate projection's epilogue, so
        the down projection's prologue only multiplies (bitwise the same results; its tiles
        stop recomputing the SiLU over every input element).
    fold_casts: let an op computing in float32 write the dtype a following cast converts its result
        to, instead of float32 and a ``unary`` cast (``tilec.passes.fold_casts``; bitwise the same
        results, one dependent stage fewer for each such cast: Gemma's norms, Cohere's and
        ERNIE-4.5's RoPE).
    fold_cache_writes: let a RoPE op write the KV-cache slot directly instead of a following
        ``cache_write`` copying its output there (``tilec.passes.fold_cache_write``; with split_k 1, bitwise the
        same results, one dependent stage fewer per layer).
    fold_rope: let each split-KV attention tile apply the queries' RoPE as it loads them instead
        of a ``rope`` op before it (``tilec.passes.fold_rope``; bitwise the same results, one
        dependent stage fewer per layer).
    fold_kv_append: with ``fold_rope`` and ``fold_cache_writes``, let the split-KV attention tile
        whose split holds the step's cache rows write them (the keys' RoPE and both cache writes)
        as it reads its split, instead of a ``rope`` and a ``cache_write`` op before the attention
        (``tilec.passes.fold_kv_append``; bitwise the same results, one dependent stage fewer per layer).
    fold_combine: let the last split-KV attention tile of each (batch, KV head group) to finish run
        the combine of the group's splits, instead of an ``attention_combine`` op after the partials
        (``tilec.passes.fold_combine``; bitwise the same results, one dependent stage fewer per layer).
    coarsen_forks: when a tile triggers several events that all wake tiles of one op (its columns
        straddle two of that op's tiles' reads), merge those events - and every event sharing a
        producer with them - into one that every such tile waits on, instead of relaying the tile
        through empty tasks (``tilec.passes.fusion.coarsen_forks``; the same results, one dependent
        stage fewer on those waiters' path); ``gemv_groups`` then sizes sibling GEMVs whose outputs
        one op reads by their total columns alone, straddling that op's tiles.
    gemv_groups: size the tiles of sibling GEMVs (same input rows, e.g. q/k/v or gate/up) by their
        total columns, so that together they make about ``workers`` tiles
        (``tilec.passes.gemv_groups``; the same results, fewer instructions per worker).
    fuse_fp8_quant: quantize FP8 GEMM activations inside the GEMM tiles that read them
        (``tilec.passes.fuse_fp8_quant``: ``fp8_quant -> fp8_linear`` becomes ``fp8_linear_quant``;
        the same quantized values, one op and one dependent stage fewer per GEMM).
    fp8_stream: the fused FP8 GEMM tiles take their weights from the worker's weight ring (the
        loader warp streams them ahead, as for bf16 GEMVs) instead of loading them after their wait.
    ring_stages: weight-ring stages per worker on the GPU (2..8), or None (default): as many as
        fit beside the ops' scratch, at most 3 (``tilec.smem``). A deeper ring keeps more weight
        bytes in flight but leaves the SM less L1: a Llama-3.2-1B step was fastest with 3, the
        GLM-5 FP8 prelude with 2 (H200, ``benchmarks/lab/glm5_variants_ab.py --stages``:
        348.4 against 378.6 us). A plan that streams no weights has no ring whatever this says.
    verify: run the stage verifiers after every pass (always on in tests).
    executor: ``"cuda"`` (persistent kernel), ``"reference"`` (CPU reference executor), or
        ``"auto"``: CUDA when the model's tensors are on a CUDA device.
    arch: nvcc target architecture (``sm_90a`` = Hopper with wgmma/TMA).
    watchdog_ms: a device-side event wait longer than this aborts the step with an error.
    check: raise what a CUDA step recorded (a watchdog abort, an index read outside its range).
        True: synchronize after every step and raise it there. ``"deferred"`` (the default of
        ``torch.compile(backend="tilec")``): the host does not wait for the step; its record is
        copied back behind it and raised, prefixed "a step before this call", at a later call of
        the program, the first one after the copy completed (an HF ``generate()`` loop
        synchronizes every token, so the next call), or by ``CompiledProgram.check_errors()``; a
        program that takes no decode position (not a decode step) is checked as with True. So
        the last step's error shows at the program's next use (for the backend: the next
        ``generate()``), and after a watchdog abort the steps run before it is raised return
        stale outputs. False: never (for timing).
    profile: record %globaltimer stamps per instruction on the GPU (for a measured trace).
    dump_dir: write every stage's IR, stats and a predicted trace under this directory
        (``tilec.dump``); None = off, or the ``TILEC_DUMP_DIR`` environment variable if set.
    """

    workers: int = 132
    scheduler: str = "list"
    tile_n: int | None = None
    split_k: int = 1
    tile_rows: int = 1
    tile_cols: int | None = 1024
    attn_heads_per_tile: int = 1
    attn_kv_chunk: int | None = None
    fuse_gemv: bool = True
    swiglu_split: bool = True
    fold_casts: bool = True
    fold_cache_writes: bool = True
    fold_rope: bool = True
    fold_kv_append: bool = True
    fold_combine: bool = True
    coarsen_forks: bool = True
    gemv_groups: bool = True
    fuse_fp8_quant: bool = True
    fp8_stream: bool = True
    ring_stages: int | None = None
    verify: bool = True
    executor: str = "auto"
    arch: str = "sm_90a"
    watchdog_ms: int = 2000
    check: bool | str = True
    profile: bool = False
    dump_dir: str | None = None

    def __post_init__(self):
        if not (isinstance(self.check, bool) or self.check == "deferred"):
            raise OptionsError(f"tilec option check={self.check!r}: must be True, False or \"deferred\"")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "check":
                continue
            optional = isinstance(f.type, str) and "None" in f.type
            if optional and v is None:
                continue
            base = f.type.split("|")[0].strip() if isinstance(f.type, str) else ""
            want = {"int": int, "bool": bool, "str": str}.get(base)
            if want is int and (not isinstance(v, int) or isinstance(v, bool)):
                raise OptionsError(f"tilec option {f.name}={v!r}: must be an int")
            if want is bool and not isinstance(v, bool):
                raise OptionsError(f"tilec option {f.name}={v!r}: must be a bool (True or False; true or false "
                                 f"on the command line)")
            if want is str and not isinstance(v, (str, os.PathLike)):
                raise OptionsError(f"tilec option {f.name}={v!r}: must be a string")
        if not 1 <= self.workers <= 1024:
            raise OptionsError(f"tilec option workers={self.workers}: must be in 1..1024")
        if self.scheduler not in SCHEDULERS:
            raise OptionsError(f"tilec option scheduler={self.scheduler!r}: must be one of {SCHEDULERS}")
        for name in ("tile_n", "split_k", "tile_rows", "attn_heads_per_tile"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise OptionsError(f"tilec option {name}={getattr(self, name)}: must be >= 1")
        if self.executor not in EXECUTORS:
            raise OptionsError(f"tilec option executor={self.executor!r}: must be one of {EXECUTORS}")
        m = re.fullmatch(r"sm_(\d+)a?", self.arch)
        if m is None or int(m.group(1)) < 90:
            raise OptionsError(f"tilec option arch={self.arch!r}: must be sm_90a or a newer sm_XX[a] (the executor "
                             f"uses Hopper's bulk copies and transaction mbarriers)")
        if self.watchdog_ms < 1:
            raise OptionsError(f"tilec option watchdog_ms={self.watchdog_ms}: must be >= 1")
        if self.attn_kv_chunk is not None and self.attn_kv_chunk < 1:
            raise OptionsError(f"tilec option attn_kv_chunk={self.attn_kv_chunk}: must be >= 1 or None")
        if self.ring_stages is not None and not 2 <= self.ring_stages <= 8:
            raise OptionsError(f"tilec option ring_stages={self.ring_stages}: must be 2..8 or None")
        if self.tile_cols is not None and self.tile_cols < 1:
            raise OptionsError(f"tilec option tile_cols={self.tile_cols}: must be >= 1 or None")
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)) or not os.fspath(self.dump_dir):
                raise OptionsError(f"tilec option dump_dir={self.dump_dir!r}: must be a non-empty path or None")
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))  # a str, so digest() can hash it

    @classmethod
    def from_dict(cls, d: dict | None) -> "Options":
        """Build from a user dict; an unknown key raises :class:`tilec.errors.OptionsError` (a
        ``ValueError`` too) listing the valid keys (and the nearest valid key where one is close, e.g.
        ``Workers`` -> ``workers``), and so does a value of the wrong type or range."""
        if d is not None and not isinstance(d, dict) and not hasattr(d, "keys"):
            raise OptionsError(f"tilec options must be a dict such as {{'workers': 8}}, not {type(d).__name__} {d!r}")
        return cls(**dict(d or {}))  # (the constructor names unknown keys: _checked_init)

    def digest(self) -> str:
        """A hash of the options that change the compiled program (``dump_dir`` does not)."""
        d = dataclasses.asdict(self)
        d.pop("dump_dir", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# option name -> its annotation as written ("int", "str | None", ...): the valid keys of from_dict
# and of the command line's -O KEY=VALUE
OPTION_TYPES: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(Options)}


def _checked_init(init):
    """``Options(**kw)`` with an unknown keyword raises OptionsError as ``from_dict`` does (Python's own
    TypeError named the keyword but not the valid ones: a fresh user's case); so does a positional value."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if args:
            raise OptionsError(f"tilec options are keywords (Options(workers=8)), not positional values {args!r}")
        unknown = sorted(set(kwargs) - set(OPTION_TYPES))
        if unknown:
            raise OptionsError(unknown_options_message(unknown, list(OPTION_TYPES)))
        init(self, *args, **kwargs)
    return __init__


Options.__init__ = _checked_init(Options.__init__)
