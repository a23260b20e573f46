"""On-disk cache of compiled plans (the ``torch.compile`` path's second-level cache).

A plan is stored under ``$TILEC_CACHE_DIR/plans/<key>/`` (default ``~/.cache/tilec``) as
``graph.json`` + ``plan.json`` (the OpGraph and operand bindings) and ``tensors.safetensors``
(plan tables, constants, position tables). The key hashes the aten graph, its input
shapes/dtypes, the options, tilec's version, its Python sources (:func:`code_digest`: a plan
made by other code - before a pull or a fix - is not reused) and the target arch. Entries are written to a
temporary directory and renamed into place, so a crash never leaves a partial entry; ``sha256.json``
holds the other files' digests, so a file damaged on disk is caught before its tables reach an executor, and
``plan.json`` its key, so an entry copied under another key's name is not taken for that key's plan; an entry
that fails to load or to match them is ignored (removed and recompiled).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file as load_tensors

from .artifact import save_tensors
from .codegen.build import cache_path, sha256_file
from .errors import describe_exception
from .ir import OpGraph
from .pipeline import Compiled
from .plan import KernelPlan

log = logging.getLogger("tilec")
FILES = ("tensors.safetensors", "graph.json", "plan.json")  # an entry's files, each hashed in its sha256.json


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A hash of tilec's own Python sources (read once per process, a few ms)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _dir(key: str) -> Path:
    return cache_path() / "plans" / key


def load(key: str) -> Compiled | None:
    """The cached plan for ``key``, or None (missing or unreadable)."""
    root = _dir(key)
    try:
        read = _stamp(root)  # the entry this load reads (a repair by another process is another)
    except OSError:
        return None
    try:
        if not (root / "sha256.json").is_file():  # a FIFO or a device there would block or never end the read
            raise ValueError("sha256.json is not a regular file")
        want = json.loads((root / "sha256.json").read_text())
        # hashed in blocks, then loaded: the tables are in memory once (an entry can hold ~1 GB of them)
        bad = [name for name in FILES if want.get(name) != sha256_file(root / name)]
        if bad:
            raise ValueError(f"damaged on disk: {', '.join(bad)} {'differs' if len(bad) == 1 else 'differ'} "
                             f"from the digest in sha256.json")
        tensors = load_tensors(root / "tensors.safetensors")
        graph_tensors = {k.removeprefix("graph."): v for k, v in tensors.items() if k.startswith("graph.")}
        plan_tensors = {k.removeprefix("plan."): v for k, v in tensors.items() if k.startswith("plan.")}
        graph = OpGraph.from_dict(json.loads((root / "graph.json").read_text()), graph_tensors)
        meta = json.loads((root / "plan.json").read_text())
        if meta.get("key") != key:  # an entry copied or moved under another key: another graph's plan
            raise ValueError(f"it holds the plan of key {meta.get('key')!r}, not of its directory's name")
        plan = KernelPlan.from_tables(graph, plan_tensors, meta["plan"], meta["stats"])
    except Exception as e:  # a corrupt entry is a cache miss, never an error; removed, so this compile rewrites it
        if isinstance(e, FileNotFoundError) and not _same(root, read):  # another process's repair, mid-way: a miss
            return None
        removed = _discard(root, read)
        log.warning("tilec: ignoring unreadable plan cache entry %s (%s); %s", root, describe_exception(e),
                    "it is removed and written again" if removed else "it could not be removed (it stays a miss)")
        return None
    if not _same(root, read):  # replaced between its hashing and its loading (another process's repair): a miss
        return None
    return Compiled(stages={"opgraph": graph, "plan": plan}, plan=plan, stats=dict(meta["stats"]))


def _stamp(entry: Path) -> tuple:
    """Which entry is at ``entry`` now (its plan file's inode and change time). Raises OSError when it has
    no plan file."""
    st = os.stat(entry / "plan.json")
    return st.st_ino, st.st_mtime_ns


def _same(entry: Path, stamp: tuple) -> bool:
    """Whether the entry at ``entry`` is still the one ``stamp`` (:func:`_stamp`) names."""
    try:
        return _stamp(entry) == stamp
    except OSError:
        return False


def _discard(entry: Path, stamp: tuple | None = None) -> bool:
    """Removes a cache entry (best effort): renamed aside first, so no reader sees it half removed. With
    ``stamp``, only if the entry is still the one stamped: two processes that read one corrupt entry must
    not both remove it, the second the first one's repair. False when it could not be moved (a read-only
    cache)."""
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".{entry.name[:12]}.bad-", dir=entry.parent))
    except OSError:
        return False
    moved = False
    try:
        os.replace(entry, aside / "entry")
        moved = True
        if stamp is not None and _stamp(aside / "entry") != stamp:  # repaired meanwhile: put it back
            with contextlib.suppress(OSError):
                os.rename(aside / "entry", entry)  # (fails if yet another entry was written there: fine)
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)
    return moved


def store(key: str, compiled: Compiled) -> None:
    """Writes ``compiled`` under ``key`` atomically (best effort: failures are logged)."""
    final = _dir(key)
    try:
        if (final / "plan.json").exists():
            return
        if final.exists() and not (final / "plan.json").exists():  # (checked again: another process's entry
            # may have landed since) an entry without its plan (a copy or a disk cut short): replaced
            if not _discard(final):
                log.warning("tilec: could not replace the plan cache entry %s, which has no plan.json", final)
                return
            log.warning("tilec: replacing the plan cache entry %s, which had no plan.json", final)
    except OSError as e:  # e.g. another user's entry in a shared cache (entries are private to their writer)
        log.warning("tilec: could not write the plan cache entry %s: %s", final, e)
        return
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:12]}.", dir=final.parent))
    except OSError as e:
        log.warning("tilec: could not write the plan cache entry %s: %s", final, e)
        return
    try:
        plan = compiled.plan
        tables, meta = plan.to_tables()
        tensors = {f"plan.{k}": v for k, v in tables.items()}
        tensors.update({f"graph.{k}": v for k, v in plan.graph.tensors().items()})
        save_tensors(tmp / "tensors.safetensors", tensors)
        (tmp / "graph.json").write_text(json.dumps(plan.graph.to_dict()))
        (tmp / "plan.json").write_text(json.dumps({"key": key, "plan": meta, "stats": compiled.stats}))
        digests = {name: sha256_file(tmp / name) for name in FILES}
        (tmp / "sha256.json").write_text(json.dumps(digests))
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "plan.json").exists():
                raise
            # another process wrote this key's entry meanwhile (the same plan): keep it
    except Exception as e:  # a cache is an optimization: never fail the compile (a full disk is safetensors'
        # SafetensorError, no OSError)
        log.warning("tilec: could not write the plan cache entry %s: %s", final, describe_exception(e))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
