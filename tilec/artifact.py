"""Compiled programs as self-contained artifact directories (``tilec compile`` / ``tilec run``).

Layout of an artifact (every file except the manifest has its sha256 in ``manifest.json``)::

    manifest.json            format, versions (tilec, torch, transformers, nvcc, python), target
                             arch, options, the factory that built it, the call signature,
                             compile stats, the hash of every other file, and its own digest
    params.safetensors       the parameters (weights) the plan reads, by buffer name
    constants.safetensors    folded constants and position tables (OpGraph.tensors)
    inputs.safetensors       the example inputs: ``arg<i>`` for tensor argument i
    state.safetensors        the module buffers and plain tensor attributes the plan folded into other values or
                             does not read, as compiled (by placeholder; each up to STATE_TENSOR_BYTES, smallest
                             first up to STATE_BYTES in all), for ``tilec run --check``'s eager module; absent
                             when there are none
    ir/01-opgraph.txt .. ir/11-plan.txt      every stage's stable text (file names of tilec.dump)
    ir/01-opgraph.json .. ir/11-plan.json    every stage as structured JSON (tilec inspect)
    trace.json               the schedule timeline predicted by the cost model (Chrome trace)
    plan/plan.safetensors    queues int32 [W, L, 32], events int32 [E, 4], static_operands int64
    plan/graph.json          the OpGraph the plan runs (OpGraph.to_dict, after the OpGraph passes)
    plan/operands.json       operand bindings and op names (KernelPlan.to_tables)
    cuda/program.cu, cuda/tilec_layout.h     generated sources (tilec.codegen.render)
    cuda/tables.h                            the plan's tables as C++ arrays (tilec.codegen.render_tables)
    cuda/libtilec.so         the built library (when nvcc was present at compile time)

An artifact is written into a temporary directory beside the target and renamed into place
only when complete, so a failure leaves nothing behind. :func:`load` verifies the manifest
and every hash; :meth:`Artifact.program` rebuilds a runnable
:class:`~tilec.program.CompiledProgram` from ``plan/`` and the tensor files, without
re-tracing the module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path, PurePosixPath

try:
    import fcntl
except ImportError:  # (not on Windows: no partial-folder cleanup there)
    fcntl = None

import jinja2
import torch
import torch.utils._pytree as pytree
import safetensors.torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import tilec

from . import codegen
from .codegen.build import sha256_file as _sha256
from .dump import render_schedule
from .errors import InputError, TilecError
from .frontend import IGNORED, POSITION, GraphBinding
from .ir import OpGraph, is_integer
from .options import Options
from .passes.schedule import Schedule
from .pipeline import Compiled
from .plan import DESCRIPTOR, KernelPlan
from .program import CompiledProgram
from .stages import STAGE_FILES, STAGES
from .taskgraph import TaskGraph
from .trace import predicted_trace, trace_text

log = logging.getLogger("tilec")

# format 2: the split_kv and fuse_gemv stages (ir/02, ir/03); 3: the fold_cache stage (ir/04);
# 4: dispatch signatures pack dtype code + 1 (tilec.plan.dtype_signature); 5: plan format 3
# (linear_fused's staged-x flag); 6: the gemv_groups stage (ir/05; later stages renumbered); 7: plan
# format 4 (12 operands a row); 8: plan format 5 (13 operands a row, arrival counters); 9: 5..8-row
# GEMV tiles stream to the tensor-core consumer (tilec.ops.GEMV_RING_ROWS 4: an older plan's stream
# words for them would make the new runtime abort)
FORMAT, FORMAT_VERSION = "tilec-artifact", 10  # 10: non-finite Python arguments as {"float": "inf"}
MANIFEST = "manifest.json"
LIBRARY = "cuda/libtilec.so"


class ArtifactError(TilecError):
    """The directory is not a usable artifact: missing, corrupt, tampered with, or incompatible."""


class ArtifactVersionError(ArtifactError):
    """The artifact was built by another tilec version (or artifact format)."""


class ArtifactArchError(ArtifactError):
    """The artifact targets another GPU architecture than the one present."""


# ---- writing -----------------------------------------------------------------------------

def save(path: str | os.PathLike, program: CompiledProgram, inputs, *, factory: dict | None = None,
         positions=None, max_positions: int | None = None, param_sources: dict[str, str] | None = None,
         build: bool = True, force: bool = False, progress=None) -> Path:
    """Writes ``program`` as an artifact directory at ``path`` (atomically).

    Args:
        program: a program from :func:`tilec.api.compile_module` (all ten stages present).
        inputs: the example arguments it was compiled with (tensors, or plain numbers).
        factory: how to rebuild the eager module (``{"spec", "module", "file", "name", "cwd", "source_sha256"}``,
            and ``model_sources`` where the module's classes come from other files of the user's:
            ``tilec.commands.model_sources``), recorded for ``tilec run --check`` and ``tilec bench``.
        positions, max_positions: as given to ``compile_module``, recorded for ``tilec run`` and ``tilec bench``;
            None (the default): the program's own (:attr:`CompiledProgram.position_args`, the plan's
            ``max_positions``). Given, they must agree with the program (``positions`` may also list
            integer tensor arguments its graph does not read, which it cannot tell apart).
        param_sources: parameter buffer name -> the module's ``state_dict`` key it came from (over the
            names the capture recorded; either names a parameter in a loaded program's errors).
        build: build ``cuda/libtilec.so`` with nvcc when nvcc is present.
        force: replace an existing artifact at ``path`` (a non-empty folder without a
            ``manifest.json`` is never replaced).
        progress: called with a message before slow steps (nvcc).

    Returns: the artifact's path.
    Raises:
        ArtifactError: ``path`` holds an artifact (without ``force``) or other files, an example
            argument is neither a tensor nor a plain number, ``positions`` or ``max_positions``
            disagree with the program (nothing is written), or the program checks a run-time
            attention mask (:mod:`tilec.guards`; an artifact does not carry the check).
        TilecError: nvcc failed, ``TILEC_NVCC`` names a program that does not run as nvcc, or a
            codegen template is missing or broken; a module parameter replaced since the program's last
            call no longer fits it (:meth:`CompiledProgram.sync_params`; nothing is written).
    """
    given = Path(path)
    final = _absolute(given)  # "." or "a/..": its temporary and backup folders go beside it
    check_target(final, force)
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, (tuple, list)):
        raise ArtifactError(f"inputs: the example arguments as a tuple or list, not {type(inputs).__name__} "
                            f"(one tensor: (x,))")
    meta = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and a.is_meta]
    if meta:
        raise ArtifactError(f"example argument {meta[0]} is a meta-device tensor (no data to store)")
    missing = [s for s in STAGES if s not in program.compiled.stages]
    if missing:
        raise ArtifactError(f"the program lacks pipeline stage(s) {missing}; compile it with tilec.api.compile_module")
    if program.graph.mask_guards:
        raise ArtifactError(f"the program checks a run-time attention mask on every call "
                            f"({', '.join(name for name, _ in program.graph.mask_guards)}), which an artifact cannot "
                            f"carry yet: compile a step without a mask argument (its attention is causal), or use "
                            f"the program in this process")
    call_args, input_tensors = _describe_inputs(inputs)
    program.sync_params()  # parameters replaced or updated in place since its last call: saved as a call binds them
    try:  # the inputs tilec run and tilec bench will pass
        program.check_example(list(inputs))
    except InputError as e:  # (also a bad decode position)
        raise ArtifactError(f"the example inputs do not fit the program: {e}") from e
    positions, max_positions = _call_positions(program, inputs, positions, max_positions)
    plan, opts = program.plan, program.opts
    try:
        sources, cuda_note = codegen.render(plan), None
    except TilecError as e:  # e.g. a dtype without a CUDA implementation: still runs on the reference executor
        if isinstance(e.__cause__, jinja2.TemplateError):  # a broken installation or template: not a note
            raise
        sources, cuda_note = {}, str(e)
    lib = None
    if build and sources:
        if _nvcc_version() is None:
            if os.environ.get("TILEC_NVCC"):  # set on purpose but broken: say so rather than skip the build
                raise TilecError(f"TILEC_NVCC={os.environ['TILEC_NVCC']} does not run as nvcc ('--version' failed); "
                                 f"point it at nvcc, unset it, or pass --no-build")
            cuda_note = "nvcc not found at compile time: no library built"
        else:
            lib = codegen.build(sources, opts.arch, progress)

    created = [d for d in (final.parent, *final.parent.parents) if not d.exists()]  # removed again on failure
    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(final, progress)
        tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(final), dir=final.parent))
        writing = _hold(tmp)  # until the rename: a later compile's cleanup leaves a live writer's folder alone
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in created:
            if d.exists() and not any(d.iterdir()):
                d.rmdir()
        raise ArtifactError(f"cannot write the artifact {final}: {e.strerror} ({e.filename})") from e
    done = False
    try:
        try:
            _write_contents(tmp, program, input_tensors, sources, lib)
            _write_manifest(tmp, program, opts, factory, call_args, positions, max_positions, param_sources,
                            sources, lib, cuda_note)
        except OSError as e:
            if e.errno is None:  # not the system's error (no errno): a bug, reported as one
                raise
            # a full disk or quota, an I/O error: the user's place, not tilec - named, without a traceback
            where = f" (writing {os.path.relpath(e.filename, tmp)})" if e.filename and \
                str(e.filename).startswith(str(tmp)) else f" ({e.filename})" if e.filename else ""
            raise ArtifactError(f"cannot write the artifact {final}: {e.strerror or e}{where}; nothing was "
                                f"written") from e
        # again: another compile may have written there meanwhile (two compiles to one path both
        # "succeeded", the second silently replacing the first); without force the rename itself
        # then fails on the non-empty folder
        check_target(final, force)
        if force and final.exists():  # swap the old one out only once the new one is complete
            # no Ctrl-C / SIGTERM from here until the old one is removed: a signal between the renames lost both
            # artifacts; during the removal, it left the old one's folder (a SIGKILL: see _remove_stale_partials)
            with _signals_deferred():
                old = Path(tempfile.mkdtemp(prefix=_old_prefix(final), dir=final.parent))
                keep_old = False  # the old artifact could not be put back: leave it where it is
                try:
                    try:
                        os.replace(final, old / "artifact")
                    except OSError as e:  # the old artifact stays as it was
                        raise ArtifactError(f"cannot replace the artifact {final}: {e.strerror}") from e
                    try:
                        os.replace(tmp, final)
                    except BaseException as e:  # the old one goes back
                        try:
                            os.replace(old / "artifact", final)
                        except OSError as e2:
                            keep_old = True
                            raise ArtifactError(f"cannot replace the artifact {final} ({e}), and the old one "
                                                f"could not be put back ({e2.strerror}): it is now at "
                                                f"{old / 'artifact'}") from e
                        if isinstance(e, OSError):
                            raise ArtifactError(f"cannot replace the artifact {final}: {e.strerror} (the old one "
                                                f"is kept)") from e
                        raise
                finally:
                    if not keep_old:
                        shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(tmp, final)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # written by another compile after the check
                    raise ArtifactError(f"{final} holds an artifact (written while this one compiled); pass --force "
                                        f"to replace it (from Python: force=True)") from e
                raise ArtifactError(f"cannot write the artifact {final}: {e.strerror}") from e
        done = True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if writing is not None:
            os.close(writing)
        if not done:
            for d in created:  # innermost first
                with contextlib.suppress(OSError):
                    d.rmdir()
    return given


def _write_manifest(tmp: Path, program: CompiledProgram, opts: Options, factory, call_args, positions, max_positions,
                    param_sources, sources: dict, lib: Path | None, cuda_note: str | None) -> None:
    """Writes ``manifest.json`` (with the sha256 of every file written before it) and gives the folder ordinary
    permissions. Raises OSError as the file system does."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tilec": tilec.__version__,
        "torch": torch.__version__,
        "transformers": _dist_version("transformers"),
        "nvcc": _nvcc_version(),
        "python": platform.python_version(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "arch": opts.arch,
        "device": program.device.type,
        "options": dataclasses.asdict(opts),
        "factory": factory,
        "call": {"args": call_args, "positions": list(positions), "max_positions": max_positions,
                 "single_output": program.single_output, "out_spec": _spec_text(program.out_spec)},
        "param_sources": {**program._param_names, **(param_sources or {})},  # the capture's, or the caller's
        # module buffers and plain tensor attributes (placeholder -> the module's name): tilec run --check loads
        # those kept as constants
        "buffer_sources": {**getattr(program, "_buffer_names", {}), **getattr(program, "_attribute_names", {})},
        # state.safetensors' limits (bytes: a tensor, all of them): it leaves out larger ones (and dtypes it
        # cannot store)
        "state_limits": [STATE_TENSOR_BYTES, STATE_BYTES],
        "stats": program.stats,
        "cuda": {"sources": sorted(f"cuda/{n}" for n in sources), "library": LIBRARY if lib else None,
                 "note": cuda_note},
        "files": {rel: _sha256(tmp / rel) for rel in _list_files(tmp)},
    }
    manifest["digest"] = _digest(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _set_modes(tmp)


def _side_name(final: Path) -> str:
    """``final``'s name in the names of the folders beside it: the name itself, or for one too long to take the
    suffixes within a file system's 255 bytes, its first 150 bytes (whole characters) and a hash of the whole."""
    name = final.name
    if len(name.encode()) <= 200:
        return name
    return f"{name.encode()[:150].decode(errors='ignore')}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def _partial_prefix(final: Path) -> str:
    """The name prefix of the folders a compile writes ``final`` in before renaming it into place."""
    return f".{_side_name(final)}.partial-"


def _old_prefix(final: Path) -> str:
    """The name prefix of the folder ``--force`` moves the replaced artifact into, removed once the new one is in."""
    return f".{_side_name(final)}.old-"


@contextlib.contextmanager
def _signals_deferred():
    """Defers SIGINT and SIGTERM over a few steps that must not be split: their Python handlers are swapped for
    one that notes the signal, and the first noted is handed to the handler it was meant for on leaving (which
    raises KeyboardInterrupt / the CLI's Terminated; a default SIGTERM then ends the process as it would have).
    A thread mask would not do: the signal goes to whichever of torch's threads does not block it. Outside the
    main thread (no handlers can be set there) a no-op."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():  # (None: set in C)
        yield
        return
    noted = []
    for s in previous:
        signal.signal(s, lambda signum, frame: noted.append((signum, frame)))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if noted:
            signum, frame = noted[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def _hold(folder: Path, wait: bool = True) -> int | None:
    """Opens ``folder`` and takes an exclusive ``flock`` on it: the writer's mark, held until the descriptor
    (returned) is closed or the process dies - also across PID namespaces and, on NFSv4, hosts. None where the
    system has no ``flock``. Raises OSError (BlockingIOError when ``wait`` is false and another holds it)."""
    if fcntl is None:
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        raise
    return fd


_STALE_AFTER_S = 60  # a folder younger than this may be a writer's between its mkdtemp and its lock


def _remove_stale_partials(final: Path, progress=None) -> None:
    """Removes the folders beside ``final`` that compiles killed mid-write left (SIGKILL, a crash), each up to a
    model's weights in size: those nobody holds locked (:func:`_hold`) and untouched for a minute; a live
    writer's folder is kept. That includes a ``--force`` replacement's folder of the old artifact (one killed
    between its two renames left the old artifact there and none at ``final``: the replacement the user asked
    for, which this compile now makes). Errors are ignored (a folder that cannot be removed stays)."""
    if fcntl is None:
        return
    prefixes, stale = (_partial_prefix(final), _old_prefix(final)), []
    with contextlib.suppress(OSError):
        for entry in final.parent.iterdir():
            if not entry.name.startswith(prefixes) or entry.is_symlink() or not entry.is_dir():
                continue
            with contextlib.suppress(OSError):
                if time.time() - entry.stat().st_mtime < _STALE_AFTER_S:
                    continue
                fd = _hold(entry, wait=False)  # BlockingIOError: a live writer holds it
                try:
                    stale.append(entry)
                    shutil.rmtree(entry, ignore_errors=True)
                finally:
                    os.close(fd)
    if stale:
        (progress or log.warning)(f"removed {len(stale)} partial artifact folder(s) beside {final} left by "
                                  f"interrupted compiles ({stale[0].name}{', ...' if len(stale) > 1 else ''})")


def _absolute(path: Path) -> Path:
    """``path`` as the directory the system means by it: absolute, through symlinks and ``..`` as the OS
    resolves them (``link/../out`` is beside the link's target; ``--force`` over a link to an artifact
    replaces the artifact, not the link). Raises ArtifactError for a relative path when the current
    directory no longer exists."""
    try:
        return Path(os.path.realpath(path))
    except OSError as e:
        raise ArtifactError(f"cannot write the artifact {path}: the current directory no longer exists "
                            f"({e.strerror}); give an absolute path") from e


def check_target(final: Path, force: bool) -> None:
    """Raises :class:`ArtifactError` unless an artifact may be written at ``final``: a missing or
    empty directory, or (with ``force``) an existing artifact - not the current directory or one
    holding it (an artifact is written beside it and renamed into place as a whole, which would
    leave the shell in a directory that no longer exists), nor a mount point (which a rename cannot
    replace). Writability is checked up front by
    creating and removing a probe directory in the nearest existing ancestor, so an unwritable
    place fails before a long compile."""
    final = _absolute(final)  # through symlinks: the shell's directory by another name
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except OSError:  # the current directory was removed: nothing to protect
        cwd = None
    if cwd is not None and (final == cwd or final in cwd.parents):
        where = "the current directory" if final == cwd else f"a directory holding the current one ({cwd})"
        raise ArtifactError(f"{final} is {where}: tilec writes an artifact beside its output directory and "
                            f"renames it into place whole, which would leave your shell in a removed directory; "
                            f"give a new directory (e.g. -o out) or run from another directory")
    inside = enclosing_artifact(final.parent)
    if inside is not None:  # a later --force on that artifact would remove this one with it
        raise ArtifactError(f"{final} is inside the tilec artifact {inside}: write it beside that artifact, not in "
                            f"it (replacing that artifact with --force would remove this one too)")
    for parent in final.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArtifactError(f"{parent} is not a directory: cannot write the artifact {final}")
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".tilec-probe-", dir=parent))
            except OSError as e:  # e.g. EACCES, EROFS; ENOENT under /proc: no new entries there at all
                raise ArtifactError(f"cannot write the artifact {final}: cannot create a directory in {parent} "
                                    f"({e.strerror})") from e
            break
    if not final.exists():
        return
    if not final.is_dir():
        raise ArtifactError(f"{final} exists and is not a directory")
    if os.path.ismount(final):  # e.g. a container's volume: a rename can neither replace it nor move into it
        raise ArtifactError(f"{final} is a mount point: tilec writes an artifact beside its output directory and "
                            f"renames it into place, which a mount point does not allow; write it into a new "
                            f"directory inside it (e.g. -o {final / 'artifact'})")
    if any(final.iterdir()):
        if not _is_artifact(final, damaged=True):  # --force replaces artifacts, never other folders
            why = f"its {MANIFEST} is not tilec's" if (final / MANIFEST).exists() else f"no {MANIFEST}"
            raise ArtifactError(f"{final} exists and is not a tilec artifact ({why}); choose another output directory")
        if not force:
            raise ArtifactError(f"{final} holds an artifact; pass --force to replace it (from Python: force=True)")
        extra = _foreign_entries(final)
        if extra:  # --force replaces the whole folder: never what the user put beside the artifact's files
            shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
            n = f"{len(extra)} other entr{'y' if len(extra) == 1 else 'ies'}"
            raise ArtifactError(f"{final} holds an artifact and {n} ({shown}) that --force would remove with it: "
                                f"move them out first")


def enclosing_artifact(path: str | os.PathLike) -> Path | None:
    """The tilec artifact ``path`` is, or lies inside (through symlinks and ``..``): the nearest of ``path`` and its
    parents holding a tilec ``manifest.json``; None when there is none. Nothing but tilec writes into an artifact
    (a ``--force`` replacement refuses a folder holding anything else)."""
    real = Path(os.path.realpath(path))
    return next((p for p in (real, *real.parents) if _is_artifact(p, damaged=False)), None)


def _is_artifact(root: Path, damaged: bool) -> bool:
    """Whether ``root`` holds a tilec artifact: a ``manifest.json`` file that is a JSON object of tilec's format
    (another tool's - a browser extension's, ``docker save``'s list - is not one); with ``damaged``, also one that
    does not parse as JSON or is larger than a manifest gets (a damaged artifact, which ``--force`` may replace)."""
    path = root / MANIFEST
    try:
        if not path.is_file():
            return False
        if path.stat().st_size > 64 << 20:
            return damaged
        m = json.loads(path.read_text())
    except ValueError:  # (UnicodeDecodeError too)
        return damaged
    except OSError:
        return False
    return isinstance(m, dict) and m.get("format") == FORMAT


# What an artifact's folder holds at its top (_write_contents): a damaged manifest's folder may hold nothing else.
LAYOUT = frozenset({MANIFEST, "params.safetensors", "constants.safetensors", "inputs.safetensors", "state.safetensors",
                    "trace.json", "ir", "plan", "cuda"})

# The largest folded buffer or tensor attribute state.safetensors stores (bytes): the check needs those drawn at
# random (a scale, a 0-dim temperature); a larger one (a precomputed mask) is rebuilt alike by the factory.
STATE_TENSOR_BYTES = 16 << 20
STATE_BYTES = 64 << 20  # and all of them together, smallest first


def _foreign_entries(root: Path) -> list[str]:
    """The top-most paths under the artifact ``root`` that its manifest does not list (nor their folders), sorted -
    a foreign folder once, not its files. When the manifest's file list cannot be read (a damaged artifact), the
    top-level entries outside an artifact's layout (:data:`LAYOUT`)."""
    try:
        listed = json.loads((root / MANIFEST).read_text())["files"]
        if not isinstance(listed, dict) or not all(isinstance(k, str) for k in listed):
            raise TypeError("files")
        listed = set(listed)
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p.name for p in root.iterdir() if p.name not in LAYOUT)
    keep = {MANIFEST} | listed | {parent.as_posix() for rel in listed for parent in Path(rel).parents}
    rels = (p.relative_to(root) for p in root.rglob("*"))
    return sorted(r.as_posix() for r in rels if r.as_posix() not in keep and r.parent.as_posix() in keep)


def _write_contents(root: Path, program: CompiledProgram, inputs: dict, sources: dict, lib: Path | None) -> None:
    from .ir import BufferKind

    graph, plan, stages = program.graph, program.plan, program.compiled.stages
    params = {n: program.tensors[n] for n, b in graph.buffers.items() if b.kind is BufferKind.PARAM}
    save_tensors(root / "params.safetensors", params)
    save_tensors(root / "constants.safetensors", graph.tensors())
    save_tensors(root / "inputs.safetensors", inputs)
    state, total = {}, 0
    for name, t in sorted(getattr(program, "_folded_state", {}).items(), key=lambda kv: kv[1].nbytes):
        if t.nbytes > STATE_TENSOR_BYTES or total + t.nbytes > STATE_BYTES:
            break
        if _storable(t):  # (an unread complex128 buffer is no safetensors dtype: left out)
            state[name], total = t, total + t.nbytes
    if state:
        save_tensors(root / "state.safetensors", state)
    (root / "ir").mkdir()
    linearized = stages["linearized"]
    for name, fname in STAGE_FILES.items():
        ir = stages[name]
        text = render_schedule(ir, linearized) if name == "schedule" else ir.render()
        (root / "ir" / fname).write_text(text + "\n")
        _write_json(root / "ir" / fname.replace(".txt", ".json"), stage_json(name, ir, linearized))
    (root / "trace.json").write_text(trace_text(predicted_trace(plan, linearized)))  # one event a line, as a dump
    (root / "plan").mkdir()
    tables, meta = plan.to_tables()
    save_tensors(root / "plan" / "plan.safetensors", tables)
    _write_json(root / "plan" / "graph.json", graph.to_dict())
    _write_json(root / "plan" / "operands.json", meta)
    if sources:
        (root / "cuda").mkdir()
        for name, text in sources.items():
            (root / "cuda" / name).write_text(text)
        (root / "cuda" / "tables.h").write_text(codegen.render_tables(program.plan))
        if lib is not None:
            shutil.copyfile(lib, root / LIBRARY)


def _spec_text(spec) -> str | None:
    """The output structure as text for the manifest (None when there is none, or it holds a type
    pytree cannot write, e.g. a class not registered for serialization: outputs come back as a tuple)."""
    if spec is None:
        return None
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # noqa: BLE001 - any failure only costs the structure
        return None


def _spec_of(text: str | None, root: Path):
    """:func:`_spec_text` read back; None (outputs as a tuple) for artifacts written without one, and,
    with a warning, for a structure whose types are not registered in this process (an HF
    ``ModelOutput`` before ``import transformers``)."""
    if not text:
        return None
    try:
        return pytree.treespec_loads(text)
    except Exception as e:  # noqa: BLE001 - any failure only costs the structure
        log.warning("tilec: %s: its outputs come back as a tuple: their structure cannot be read here (%s: %s)",
                    root, type(e).__name__, " ".join(str(e).split())[:200])
        return None


def _call_positions(program: CompiledProgram, inputs, positions, max_positions) -> tuple[list[int], int]:
    """``(call.positions, call.max_positions)`` for the manifest of ``program`` saved with example ``inputs``
    (already checked to fit it): the program's own where None, else the values given once they agree with
    it. ``positions`` must list every argument the program reads as its decode position and may add others
    it ignores (a position argument its graph does not read is an ignored argument to the program) when they
    are integer tensors, as :func:`load` requires. Raises :class:`ArtifactError` naming the disagreement."""
    own = list(program.position_args)
    planned = program.graph.max_positions
    if max_positions is None:
        max_positions = planned
    elif isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions != planned:
        raise ArtifactError(f"max_positions={max_positions!r}, but the program plans {planned} decode position"
                            f"{'' if planned == 1 else 's'} (it was compiled with max_positions={planned}): leave "
                            f"max_positions out to record the program's")
    if positions is None:
        positions = own
    elif not isinstance(positions, (list, tuple)):
        raise ArtifactError(f"positions={positions!r}: a list of argument indices, or None for the program's own "
                            f"({own})")
    for i in positions:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(inputs):
            raise ArtifactError(f"positions lists {i!r}, not an argument index (the program takes {len(inputs)} "
                                f"argument{'' if len(inputs) == 1 else 's'})")
        if program.graph.inputs[i] not in (POSITION, IGNORED):
            raise ArtifactError(f"positions lists {i}, but the program reads {program._labels[i]} as a tensor, not "
                                f"as its decode position (its position arguments: {own}); leave positions out to "
                                f"record the program's")
        a = inputs[i]
        if not (isinstance(a, torch.Tensor) and is_integer(a.dtype)):  # (load() requires it: run and bench index them)
            got = f"{a.dtype}{list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
            raise ArtifactError(f"positions lists {i}, but example argument {i} is a {got}, not an integer tensor "
                                f"holding the decode position (an artifact records its position arguments as "
                                f"tensors)")
    if len(set(positions)) != len(positions):
        raise ArtifactError(f"positions={list(positions)} lists an argument twice")
    missing = [i for i in own if i not in positions]
    if missing:
        raise ArtifactError(f"positions={list(positions)} omits {program._labels[missing[0]]}, which the program "
                            f"reads as its decode position (its position arguments: {own}); leave positions out to "
                            f"record the program's")
    return list(positions), max_positions


def _describe_inputs(inputs) -> tuple[list[dict], dict[str, torch.Tensor]]:
    args, tensors = [], {}
    for i, a in enumerate(inputs):
        if isinstance(a, torch.Tensor):
            tensors[f"arg{i}"] = a
            args.append({"tensor": f"arg{i}", "dtype": str(a.dtype).removeprefix("torch."), "shape": list(a.shape)})
        elif isinstance(a, float) and not math.isfinite(a):  # as the IR's JSON has them: JSON has no inf / nan
            args.append({"float": repr(a)})
        elif a is None or isinstance(a, (bool, int, float, str)):
            args.append({"value": a})
        else:
            raise ArtifactError(f"example argument {i} is a {type(a).__name__}: an artifact stores tensors and "
                                f"plain numbers/strings only")
    return args, tensors


_SAFETENSORS_DTYPES = frozenset(getattr(safetensors.torch, "_TYPES", {}).values())


def _storable(t: torch.Tensor) -> bool:
    """Whether safetensors can store ``t``'s dtype (its dtype table; without one, any but a complex dtype)."""
    return t.dtype in _SAFETENSORS_DTYPES if _SAFETENSORS_DTYPES else not t.is_complex()


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Writes ``tensors`` to a safetensors file, which wants contiguous tensors that own their storage
    (views of one tensor, e.g. folded constants, are refused): copies only those that do not."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        storage = t.untyped_storage()
        whole = t.is_contiguous() and t.storage_offset() == 0 and t.nbytes == storage.nbytes()
        if not whole or storage.data_ptr() in seen:
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    try:
        save_file(out, str(path))
    except SafetensorError as e:  # safetensors reports the system's errors as its own: "... (os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, separators=(",", ":")) + "\n")


# ---- structured stage dumps --------------------------------------------------------------

def stage_json(name: str, ir, linearized: TaskGraph | None = None):
    """A stage's IR as JSON-able data (what ``tilec inspect --format json`` prints)."""
    if isinstance(ir, OpGraph):
        return ir.to_dict()
    if isinstance(ir, TaskGraph):
        return {
            "tasks": [{"id": t.id, "label": t.label(), "op": t.op, "kind": t.kind,
                       "coords": [list(c) for c in t.tile.coords] if t.tile else None,
                       "variant": t.tile.variant if t.tile else 0, "exact": t.exact, "bytes": t.nbytes,
                       "flops": t.flops, "reads": [[b, [list(r) for r in box]] for b, box in t.reads],
                       "writes": [[b, [list(r) for r in box], acc] for b, box, acc in t.writes]} for t in ir.tasks],
            "events": [{"id": e.id, "strategy": e.strategy, "preds": sorted(e.preds), "succs": sorted(e.succs),
                        "first": e.first, "last": e.last} for e in sorted(ir.events, key=lambda e: e.id)],
            "order": list(ir.order),
            "stats": dict(ir.stats),
        }
    if isinstance(ir, Schedule):
        index = {tid: i for i, tid in enumerate(linearized.order)} if linearized else {}
        return {"policy": ir.policy, "workers": len(ir.queues), "makespan_us": ir.makespan_us,
                "queues": [[{"index": index.get(tid), "task": tid} for tid in q] for q in ir.queues]}
    if isinstance(ir, KernelPlan):
        return plan_json(ir)
    raise TypeError(f"stage {name}: no JSON form for {type(ir).__name__}")


def plan_json(plan: KernelPlan) -> dict:
    """The encoded plan with every non-NoOp descriptor decoded into named fields."""
    from .ops import EMPTY, NOOP

    queues = []
    for q in plan.queues.tolist():
        instrs = []
        for d in q:
            if d[0] == NOOP:
                continue
            fields = {name: d[start] if n == 1 else d[start:start + n] for name, start, n in DESCRIPTOR}
            fields["coords"] = [fields["coords"][2 * k:2 * k + 2] for k in range(fields["ncoords"])]
            fields["op_name"] = None if d[0] == EMPTY else plan.op_names[fields["op"]]
            instrs.append(fields)
        queues.append(instrs)
    events = [{"id": e, "count": c, "first": f, "last": last} for e, (c, f, last, _) in enumerate(plan.events.tolist())]
    return {"workers": plan.queues.shape[0], "length": plan.queues.shape[1], "queues": queues, "events": events,
            "arrivals": plan.arrivals, "op_names": list(plan.op_names)}


# ---- reading -----------------------------------------------------------------------------

class Artifact:
    """A verified artifact directory (use :func:`load`). Every later read of one of its files checks
    the bytes it read against the manifest's sha256 again, so a ``compile --force`` that replaces the
    artifact meanwhile is an :class:`ArtifactError`, never a mix of two artifacts' files."""

    def __init__(self, path: Path, manifest: dict, verified: dict[str, tuple]):
        self.path, self.manifest = path, manifest
        # its files are read through the path absolute as of now (a factory may change the working directory)
        self._root = path.absolute()
        self._verified = verified  # file -> its identity (_identity) when load() hashed it

    @property
    def factory(self) -> dict | None:
        return self.manifest.get("factory")

    def file(self, rel: str) -> Path:
        """The path of the artifact's file ``rel`` (a manifest ``files`` key, e.g. ``plan/graph.json``),
        checked to be the file :func:`load` verified: same device, inode, size and modification time (a
        ``compile --force`` renames a new folder into place, so every file's inode changes).

        Raises:
            ArtifactError: ``rel`` is not one of the artifact's files, is gone, or was replaced since.
        """
        if rel not in self.manifest["files"]:
            raise ArtifactError(f"{self.path}: {rel} is not one of the artifact's files (its manifest does not "
                                f"list it)")
        f = self._root / rel
        try:
            now = _identity(f)
        except OSError as e:
            raise ArtifactError(f"{self.path}: cannot read {rel} ({e.strerror or e}); was the artifact removed "
                                f"since it was opened?") from e
        if self._verified.get(rel) != now:
            raise ArtifactError(f"{self.path}: {rel} changed since the artifact was opened and verified (another "
                                f"compile --force replaced it?); open it again")
        return f

    def read_bytes(self, rel: str) -> bytes:
        """The bytes of the artifact's file ``rel``, checked as :meth:`file` does and against its sha256.

        Raises:
            ArtifactError: as :meth:`file`, or the bytes read are not the ones the manifest records.
        """
        f = self.file(rel)
        try:
            data = f.read_bytes()
        except OSError as e:
            raise ArtifactError(f"{self.path}: cannot read {rel} ({e.strerror or e})") from e
        if hashlib.sha256(data).hexdigest() != self.manifest["files"][rel]:
            raise ArtifactError(f"{self.path}: {rel} changed since the artifact was opened and verified (another "
                                f"compile --force replaced it?); open it again")
        return data

    def _tensors(self, rel: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        # memory-mapped, not read whole and hashed again (load() hashed it; file() checks it is that file)
        path = self.file(rel)
        try:
            return load_file(str(path), device=str(device))
        except SafetensorError as e:  # a file that matches its hash but is no safetensors file (written so)
            raise ArtifactError(f"{self.path}: {rel} is not a readable safetensors file ({e}); compile the "
                                f"artifact again") from e

    def _json(self, rel: str):
        return json.loads(self.read_bytes(rel))

    def stage_text(self, stage: str) -> str:
        return self.read_bytes(f"ir/{STAGE_FILES[resolve_stage(stage)]}").decode()

    def stage_json(self, stage: str):
        return self._json(f"ir/{STAGE_FILES[resolve_stage(stage)].replace('.txt', '.json')}")

    def graph(self) -> OpGraph:
        """The OpGraph, rebuilt from ``plan/graph.json`` and ``constants.safetensors``."""
        d = self._json("plan/graph.json")
        try:
            return OpGraph.from_dict(d, self._tensors("constants.safetensors"))
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{self.path}: plan/graph.json does not describe an OpGraph: {e}") from e

    def plan(self, graph: OpGraph | None = None) -> KernelPlan:
        """The KernelPlan, rebuilt from ``plan/`` (no tracing, no recompilation)."""
        graph = graph or self.graph()
        tables = self._tensors("plan/plan.safetensors")
        meta = self._json("plan/operands.json")
        return KernelPlan.from_tables(graph, tables, meta, self.manifest.get("stats"))

    def inputs(self, device: str | torch.device = "cpu") -> list:
        """A fresh copy of the example arguments (tensors on ``device``), in call order."""
        tensors = self._tensors("inputs.safetensors", device)
        missing = [a["tensor"] for a in self.manifest["call"]["args"] if "tensor" in a and a["tensor"] not in tensors]
        if missing:
            raise ArtifactError(f"{self.path}: inputs.safetensors holds no tensor {missing[0]!r}, which the "
                                f"manifest's call.args names")
        return [tensors[a["tensor"]] if "tensor" in a else float(a["float"]) if "float" in a else a["value"]
                for a in self.manifest["call"]["args"]]

    def params(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        return self._tensors("params.safetensors", device)

    def constants(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The plan's constant tensors by buffer name (a module buffer the plan did not fold is
        ``const_<placeholder>``, the placeholder named in the manifest's ``buffer_sources``)."""
        return self._tensors("constants.safetensors", device)

    def folded_state(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The module buffers and plain tensor attributes the plan folded into other values (or does not read), as
        compiled, by placeholder (named in the manifest's ``buffer_sources``); empty for an artifact without
        ``state.safetensors`` (none to store, or written before it existed)."""
        return self._tensors("state.safetensors", device) if "state.safetensors" in self.manifest["files"] else {}

    def program(self, executor: str | None = None, progress=None) -> CompiledProgram:
        """A runnable program: ``program(*artifact.inputs(program.device))``.

        Args:
            executor: ``"cuda"``, ``"reference"``, or None: CUDA when a GPU is available.
        Raises:
            ArtifactArchError: executor ``cuda`` on a GPU of another architecture than the artifact's.
            ArtifactError: executor ``cuda`` and a ``cuda/libtilec.so`` the manifest does not list (another plan's).
            TilecError: executor ``cuda`` without a GPU.
        """
        kind = executor or ("cuda" if torch.cuda.is_available() else "reference")
        if kind not in ("cuda", "reference"):
            raise TilecError(f"executor {kind!r}: must be 'cuda' or 'reference'")
        listed = self.manifest["cuda"].get("library") == LIBRARY and LIBRARY in self.manifest["files"]
        if kind == "cuda" and not listed and os.path.lexists(self._root / LIBRARY):
            # load() hashed only what the manifest lists: an unlisted library is some other plan's code
            raise ArtifactError(f"{self.path / LIBRARY}: this artifact was compiled without a library (its manifest "
                                f"lists none), so that file is not its plan's; remove it (the program then builds "
                                f"its library from cuda/ with nvcc), and to have the artifact carry a built library, "
                                f"recompile it once the file is removed{_recompile_hint(self.manifest, self.path)}")
        device = torch.device("cpu")
        if kind == "cuda":
            gpu = gpu_arch()
            if gpu is None:
                raise TilecError("executor 'cuda' needs a CUDA GPU, and torch sees none "
                                 f"(torch {torch.__version__}); use --executor reference")
            check_arch(self, gpu)
            device = torch.device("cuda", torch.cuda.current_device())
        graph = self.graph()
        plan = self.plan(graph)
        try:
            opts = Options.from_dict({**self.manifest["options"], "executor": kind, "dump_dir": None})
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{self.path}: its options are not understood by this tilec ({e}); recompile it"
                                f"{_recompile_hint(self.manifest, self.path)}") from e
        lib = self._root / LIBRARY if kind == "cuda" and listed else None
        if lib is not None:
            self.file(LIBRARY)  # still the library load() verified (not one a compile --force put there since)
        compiled = Compiled(stages={"opgraph": graph, "plan": plan}, plan=plan, stats=dict(plan.stats))
        return CompiledProgram(compiled, GraphBinding(params=self.params(device),
                                                   param_names=dict(self.manifest.get("param_sources") or {})),
                               single_output=self.manifest["call"]["single_output"], opts=opts, progress=progress,
                               example_args=tuple(self.inputs(device)),
                               library=lib, out_spec=_spec_of(self.manifest["call"].get("out_spec"), self.path))


def load(path: str | os.PathLike, *, check_version: bool = True) -> Artifact:
    """Opens an artifact and verifies it: format, manifest digest, every file's sha256, and
    (with ``check_version``) that this tilec version built it.

    Raises:
        ArtifactError: not an artifact, a file missing, corrupt or modified (names the file).
        ArtifactVersionError: built by another tilec version or artifact format.
    """
    root = Path(path)
    if not root.is_dir():
        why = "it does not exist" if not root.exists() and not root.is_symlink() else \
            "a dangling symbolic link" if not root.exists() else "not a directory"
        raise ArtifactError(f"no artifact at {root}: {why}")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{root} is not a tilec artifact: {MANIFEST} is missing")
    try:
        manifest = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{mpath} is corrupt: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{root} is not a tilec artifact ({MANIFEST} has no format {FORMAT!r})")
    if manifest.get("digest") != _digest(manifest):
        raise ArtifactError(f"{mpath} is corrupt or was modified: its digest does not match its content")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactVersionError(f"{root}: artifact format version {manifest.get('format_version')}, this tilec "
                                   f"reads version {FORMAT_VERSION}; recompile it{_recompile_hint(manifest, root)}")
    _check_schema(manifest, mpath)
    verified: dict[str, tuple] = {}
    for rel, want in sorted(manifest["files"].items()):
        parts = PurePosixPath(rel).parts
        if not isinstance(want, str) or not parts or PurePosixPath(rel).is_absolute() or ".." in parts or "\\" in rel:
            raise ArtifactError(f"{mpath} is not a valid manifest: files lists {rel!r}, not a file inside the "
                                f"artifact with its sha256")
        f = root / rel
        if not f.is_file():
            raise ArtifactError(f"{root} is incomplete: {rel} (listed in the manifest) is missing")
        before = _identity(f)
        got = _sha256(f)
        if got != want:
            raise ArtifactError(f"{root} is corrupt or was tampered with: {rel} has sha256 {got[:16]}..., "
                                f"the manifest records {want[:16]}...")
        if _identity(f) != before:
            raise ArtifactError(f"{root}: {rel} changed while it was verified (a compile writing this artifact?); "
                                f"open it again")
        verified[rel] = before
    if check_version and manifest["tilec"] != tilec.__version__:
        raise ArtifactVersionError(f"{root} was built by tilec {manifest['tilec']}; this is tilec {tilec.__version__}. "
                                   f"Recompile it{_recompile_hint(manifest, root)}")
    return Artifact(root, manifest, verified)


def _identity(f: Path) -> tuple:
    """What tells one file from its replacement: device, inode, size and modification time (ns)."""
    st = os.stat(f)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


# what load and its callers read from a manifest: key -> type (a dict: the keys within)
_SCHEMA = {"tilec": str, "arch": str, "device": str, "options": dict, "stats": dict, "files": dict,
           "call": {"args": list, "positions": list, "max_positions": int, "single_output": bool},
           "cuda": {"sources": list}}
# keys that may be null (absent in older artifacts of this format): key -> type when present
_OPTIONAL = {"param_sources": dict, "buffer_sources": dict, "factory": dict, "state_limits": list}


def _check_schema(manifest: dict, mpath: Path, schema: dict = _SCHEMA, where: str = "") -> None:
    """Raises :class:`ArtifactError` naming the first key of ``schema`` the manifest lacks or holds
    with another type (a manifest edited by hand, with its digest recomputed)."""
    for key, kind in schema.items():
        value = manifest.get(key) if isinstance(manifest, dict) else None
        want = dict if isinstance(kind, dict) else kind
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ArtifactError(f"{mpath} is not a valid manifest: {where}{key} is "
                                f"{'missing' if value is None else type(value).__name__}, expected {want.__name__}")
        if isinstance(kind, dict):
            _check_schema(value, mpath, kind, f"{where}{key}.")
    for key, want in (_OPTIONAL.items() if not where else ()):
        value = manifest.get(key)
        if value is not None and not isinstance(value, want):
            raise ArtifactError(f"{mpath} is not a valid manifest: {key} is {type(value).__name__}, expected "
                                f"{want.__name__} or null")
    factory = manifest.get("factory") if not where else None
    if isinstance(factory, dict) and not (isinstance(factory.get("spec"), str) and
                                          (not factory.get("file") or isinstance(factory.get("name"), str))):
        raise ArtifactError(f"{mpath} is not a valid manifest: factory lacks its spec (or, with a file, its name)")
    for i, a in enumerate(manifest.get("call", {}).get("args", []) if not where else ()):
        if not isinstance(a, dict) or not ("tensor" in a or "value" in a or a.get("float") in ("inf", "-inf", "nan")):
            raise ArtifactError(f"{mpath} is not a valid manifest: call.args[{i}] is neither a tensor nor a value")
    call = manifest.get("call", {}) if not where else {}
    args = call.get("args", [])
    for p in call.get("positions", []):  # run and bench index the arguments with them
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(args) or "tensor" not in args[p] or \
                not str(args[p].get("dtype", "int64")).startswith(("int", "uint")):
            raise ArtifactError(f"{mpath} is not a valid manifest: call.positions lists {p!r}, not the index of an "
                                f"integer tensor argument (of {len(args)} in call.args)")
    if call and call.get("max_positions", 1) < 1:
        raise ArtifactError(f"{mpath} is not a valid manifest: call.max_positions is {call['max_positions']}, "
                            f"expected >= 1")


def resolve_stage(stage: str) -> str:
    """``"linearized"``, ``"09"``, ``"9"`` or ``"09-linearized"`` -> ``"linearized"``; ``ValueError`` listing
    the stages."""
    s = stage.strip().removesuffix(".txt").removesuffix(".json")
    for i, name in enumerate(STAGES, 1):
        if s in (name, str(i), f"{i:02d}", f"{i:02d}-{name}"):
            return name
    raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(f'{i:02d}-{n}' for i, n in enumerate(STAGES, 1))}")


def gpu_arch() -> str | None:
    """``sm_<major><minor>`` of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def check_arch(artifact: Artifact, gpu: str) -> None:
    """Raises :class:`ArtifactArchError` unless the artifact's arch (``sm_90a``) runs on ``gpu`` (``sm_90``)."""
    want = artifact.manifest["arch"]
    if want.removeprefix("sm_").rstrip("af") != gpu.removeprefix("sm_"):
        if int(gpu.removeprefix("sm_")) < 90:
            raise ArtifactArchError(f"{artifact.path} was built for {want}; this GPU is {gpu}, and tilec's executor "
                                    f"needs sm_90 (Hopper) or newer: run it with --executor reference")
        raise ArtifactArchError(f"{artifact.path} was built for {want}; this GPU is {gpu}. Recompile it with "
                                f"--option arch={gpu}{'a' if gpu in ('sm_90', 'sm_100') else ''}"
                                f"{_recompile_hint(artifact.manifest, artifact.path, ' ')}")


def _recompile_hint(manifest: dict, root: Path, lead: str = ": ") -> str:
    """The command that compiles the artifact again from its factory, with the ``-O`` options it was compiled with
    that are not the defaults (without them it would be another plan); "" without a recorded factory."""
    spec = (manifest.get("factory") or {}).get("spec")
    if not spec:
        return ""
    defaults = dataclasses.asdict(Options())
    opts = manifest.get("options") if isinstance(manifest.get("options"), dict) else {}
    pairs = [f" -O {k}={_option_text(v)}" for k, v in sorted(opts.items())
             if k in defaults and k not in ("dump_dir", "executor") and v != defaults[k]]
    return f"{lead}tilec compile {spec} -o {root}{''.join(pairs)} --force"


def _option_text(v) -> str:
    """An option's value as ``-O KEY=VALUE`` spells it (commands.parse_options reads it back)."""
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


# ---- helpers -----------------------------------------------------------------------------

def _list_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _set_modes(root: Path) -> None:
    """Ordinary permissions (``mkdtemp`` makes the directory private, safetensors the files)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in (root, *root.rglob("*")):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _nvcc_version() -> str | None:
    try:
        return codegen.nvcc_version()
    except (TilecError, OSError, subprocess.SubprocessError, IndexError):  # nvcc absent or unusable
        return None
