"""IR dumps: a pipeline hook that writes every stage as stable text into a dump directory.

Enabled by ``Options(dump_dir=...)`` or the ``TILEC_DUMP_DIR`` environment variable (the
option wins; an empty variable means off). Each compile writes into its own subdirectory,
named by a short hash of the OpGraph's text and the options (``dump_dir`` itself excluded;
under torch.compile also the graph inputs' names, :data:`INPUTS_FILE`),
so recompiling the same graph with the same options overwrites the same files and two
different compiles never mix::

    <dump_dir>/<12 hex digits>/
        01-opgraph.txt      OpGraph.render() from the frontend
        02-split_kv.txt     OpGraph.render() after the split-KV attention rewrite
        03-fuse_gemv.txt    OpGraph.render() after GEMV prologue/epilogue fusion
        04-fold_cache.txt   OpGraph.render() after folding cache writes into RoPE ops
        05-gemv_groups.txt  OpGraph.render() after sizing sibling GEMVs' tiles together and the
                            query-RoPE / KV-append folds into the split-KV attention
        06-tasks.txt        TaskGraph.render() after build_taskgraph
        07-fused.txt        ... after event fusion
        08-normalized.txt   ... after normalization (empty tasks inserted)
        09-linearized.txt   ... after linearization
        10-schedule.txt     per worker: linearized index and label of each task; predicted makespan
        11-plan.txt         KernelPlan.render()
        stats.txt           tilec.stats.render_stats (the same numbers as ``program.stats``)
        trace.json          predicted schedule timeline, Chrome/Perfetto trace (tilec.trace)
        inputs.txt          torch.compile only: each graph input buffer (Dynamo's ``argN_1``), its kind
                            and the forward's name for it (``self.model.layers[0].mlp.up_proj.weight``)

Files are written as their stage completes (before its verifier runs), so a compile that
fails verification leaves the stages up to the failing one for inspection. Every file is
written atomically (temporary file + ``os.replace``). Use :func:`with_dump` to add the dump
hook to a user hook.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from .errors import TilecError
from .ir import OpGraph
from .options import Options
from .passes.schedule import Schedule
from .pipeline import Hook
from .stages import STAGE_FILES
from .stats import compile_stats, render_stats
from .taskgraph import TaskGraph
from .trace import predicted_trace, write_atomic, write_trace

ENV_VAR = "TILEC_DUMP_DIR"
STATS_FILE, TRACE_FILE, INPUTS_FILE = "stats.txt", "trace.json", "inputs.txt"
ALL_FILES = (*STAGE_FILES.values(), STATS_FILE, TRACE_FILE)


class DumpError(TilecError):
    """The dump directory cannot be created or written (a file in its place, no permission, a full disk): the
    message names it and where it came from (option ``dump_dir`` or ``$TILEC_DUMP_DIR``)."""


def dump_source(opts: Options) -> str:
    """Where :func:`dump_root`'s path comes from, as messages name it: ``option dump_dir`` or ``$TILEC_DUMP_DIR``."""
    return "option dump_dir" if opts.dump_dir else f"${ENV_VAR}"


def dump_root(opts: Options) -> Path | None:
    """The dump directory: ``opts.dump_dir``, else ``$TILEC_DUMP_DIR``, else None (off)."""
    root = opts.dump_dir or os.environ.get(ENV_VAR) or None
    return Path(root).expanduser() if root else None


def check_dump_root(opts: Options) -> None:
    """Creates the dump directory (when dumping is enabled) so that a bad one fails before a
    compile rather than after it.

    Raises:
        DumpError: it cannot be created or written, or it is or lies inside a tilec artifact, naming
            where the path came from.
    """
    root = dump_root(opts)
    if root is None:
        return
    source = dump_source(opts)
    from .artifact import enclosing_artifact  # (artifact imports this module)

    holder = enclosing_artifact(root)
    if holder is not None:  # its folder there would make a later `compile -o <it> --force` refuse
        where = "is" if holder == root.resolve() else "is inside"
        raise DumpError(f"{source}={root}: the dump directory {where} the tilec artifact {holder}: an artifact "
                        f"holds only what tilec writes there (a later compile -o {holder} --force would refuse it); "
                        f"dump elsewhere")
    if root.exists() and not root.is_dir():  # (mkdir would say "File exists")
        what = "a file" if root.is_file() else "not a directory"
        raise DumpError(f"{source}={root}: the dump directory is {what}; give a directory (a new one is created)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DumpError(f"{source}={root}: cannot create the dump directory ({e.strerror or e})") from e
    if not os.access(root, os.W_OK | os.X_OK):
        raise DumpError(f"{source}={root}: the dump directory is not writable")


def with_dump(hook: Hook | None, opts: Options, labels: dict[str, str] | None = None) -> Hook | None:
    """``hook`` with a :class:`DumpHook` run before it when dumping is enabled; else ``hook``. ``labels``:
    graph input name -> the user's name for it, written to ``inputs.txt`` (the torch.compile backend's)."""
    root = dump_root(opts)
    if root is None:
        return hook
    dump = DumpHook(root, opts, labels)
    if hook is None:
        return dump

    def both(stage: str, ir, seconds: float) -> None:
        dump(stage, ir, seconds)
        hook(stage, ir, seconds)

    return both


def compile_key(graph: OpGraph, opts: Options, labels: dict[str, str] | None = None) -> str:
    """12 hex digits hashing the OpGraph's text, the options other than ``dump_dir`` and, when given, the
    graph inputs' ``labels`` (two torch.compile graphs of one structure read different weights)."""
    fields = {k: v for k, v in dataclasses.asdict(opts).items() if k != "dump_dir"}
    h = hashlib.sha256(graph.render().encode())
    h.update(json.dumps(fields, sort_keys=True).encode())
    if labels:
        h.update(json.dumps(labels, sort_keys=True).encode())
    return h.hexdigest()[:12]


class DumpHook:
    """A pipeline hook (``hook(stage, ir, seconds)``) writing :data:`ALL_FILES` under
    ``root/<compile_key>/``; ``directory`` is that subdirectory once the OpGraph is seen. With ``labels``
    (graph input name -> the user's name for it), also :data:`INPUTS_FILE`: each of the OpGraph's input,
    parameter and state buffers, its kind, and that name.

    Raises:
        DumpError: the directory cannot be created or written (naming it and the system's error).
    """

    def __init__(self, root: str | os.PathLike, opts: Options, labels: dict[str, str] | None = None):
        self.root = Path(root)
        self.opts = opts
        self.labels = labels or {}
        self.directory: Path | None = None
        self._graph: OpGraph | None = None
        self._tg: TaskGraph | None = None
        self._sched: Schedule | None = None

    def __call__(self, stage: str, ir, seconds: float) -> None:
        if stage == "opgraph":
            self._graph = ir
            self.directory = self.root / compile_key(ir, self.opts, self.labels)
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DumpError(f"{dump_source(self.opts)}={self.root}: cannot create {self.directory}: "
                                f"{e.strerror or e}") from e
        if self.directory is None or stage not in STAGE_FILES:
            return
        try:
            self._write(stage, ir)
        except OSError as e:  # e.g. a full disk: the dump directory's problem, named, not the compile's
            raise DumpError(f"{dump_source(self.opts)}={self.root}: cannot write the dump {self.directory}: "
                            f"{e.strerror or e}") from e

    def _write(self, stage: str, ir) -> None:
        if isinstance(ir, OpGraph):
            self._graph = ir  # the last one is the graph the plan runs (stats count its ops)
        if isinstance(ir, TaskGraph):
            self._tg = ir
        if stage == "schedule":
            self._sched = ir
            text = render_schedule(ir, self._tg)
        else:
            text = ir.render()
        write_atomic(self.directory / STAGE_FILES[stage], text + "\n")
        if stage == "opgraph" and self.labels:
            rows = [f"{b.name}  {b.kind.value}  {self.labels[b.name]}\n" for b in ir.buffers.values()
                    if b.name in self.labels]
            write_atomic(self.directory / INPUTS_FILE, "".join(rows))
        if stage == "plan":
            stats = compile_stats(self._graph, self._tg, self._sched)
            write_atomic(self.directory / STATS_FILE, render_stats(stats) + "\n")
            write_trace(self.directory / TRACE_FILE, predicted_trace(ir, self._tg))


def render_schedule(sched: Schedule, tg: TaskGraph) -> str:
    """Stable text of a :class:`Schedule`: per worker ``#<linearized index> <task label>``
    in queue order (workers without tasks omitted), and the predicted makespan in us."""
    index = {tid: i for i, tid in enumerate(tg.order)}
    by_id = {t.id: t for t in tg.tasks}
    lines = [f"schedule policy={sched.policy} workers={len(sched.queues)} "
             f"makespan_us={sched.makespan_us:.3f} {{"]
    for w, q in enumerate(sched.queues):
        if q:
            lines.append(f"  w{w}: " + "; ".join(f"#{index[tid]} {by_id[tid].label()}" for tid in q))
    lines.append("}")
    return "\n".join(lines)
