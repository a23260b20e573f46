"""nvcc build with a content-hash cache, atomic writes and a file lock."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from filelock import FileLock, Timeout

from .. import __version__
from ..errors import TilecError


def runtime_dir() -> Path:
    """The hand-written runtime headers (``runtime/`` of the source tree, or the installed copy)."""
    for cand in (Path(__file__).resolve().parents[2] / "runtime", Path(__file__).resolve().parent / "runtime"):
        if (cand / "tilec" / "executor.cuh").exists():
            return cand
    raise TilecError("tilec runtime headers not found (expected runtime/tilec/*.cuh beside the package)")


def nvcc_path() -> str:
    """The nvcc to build with: ``$TILEC_NVCC`` when set (returned as given, not checked), else
    ``nvcc`` on ``PATH``, else ``/usr/local/cuda/bin/nvcc`` when it exists.

    Raises:
        TilecError: none of them is found.
    """
    nvcc = os.environ.get("TILEC_NVCC") or shutil.which("nvcc")
    if nvcc is None:
        for cand in ("/usr/local/cuda/bin/nvcc",):
            if os.path.exists(cand):
                return cand
        raise TilecError("nvcc not found: install the CUDA toolkit or set TILEC_NVCC")
    return nvcc


def nvcc_version(nvcc: str | None = None) -> str:
    """The last line of ``nvcc --version`` (``nvcc`` or :func:`nvcc_path`, cached per path).

    Raises:
        TilecError: no nvcc; OSError / subprocess.CalledProcessError: it does not run."""
    return _version_of(nvcc or nvcc_path())


@lru_cache(maxsize=None)
def _version_of(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def cache_path() -> Path:
    """The build and plan cache directory: ``$TILEC_CACHE_DIR``, default ``~/.cache/tilec``."""
    return Path(os.environ.get("TILEC_CACHE_DIR") or Path.home() / ".cache" / "tilec")


def cache_root() -> Path:
    """:func:`cache_path`, created and checked writable (the build cache needs it).

    Raises:
        TilecError: it cannot be created or written, naming where the path came from."""
    env = os.environ.get("TILEC_CACHE_DIR")
    root = cache_path()
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=root))
    except OSError as e:
        origin = f"TILEC_CACHE_DIR={env}" if env else f"the build cache {root}"
        raise TilecError(f"{origin}: not a writable directory ({e.strerror or e})") from e
    return root


def flags(arch: str) -> list[str]:
    """nvcc flags for ``arch``, then any in ``TILEC_NVCC_FLAGS`` (shell-split; e.g. ``-DNAME`` for
    a runtime experiment). All of them are part of the build cache key."""
    num = arch.removeprefix("sm_")
    return ["-O3", "-std=c++17", f"-gencode=arch=compute_{num},code=sm_{num}", "-shared", "-Xcompiler", "-fPIC",
            "-lineinfo", *extra_flags()]


def extra_flags() -> list[str]:
    """``$TILEC_NVCC_FLAGS`` split as a shell would. Raises TilecError naming it when it does not parse."""
    text = os.environ.get("TILEC_NVCC_FLAGS", "")
    try:
        return shlex.split(text)
    except ValueError as e:
        raise TilecError(f"TILEC_NVCC_FLAGS={text!r}: {e}") from e


def _stderr(text: str) -> None:
    print(f"tilec: {text}", file=sys.stderr, flush=True)


DIGEST = "libtilec.so.sha256"  # beside a cached library: its sha256, written with it


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of the file at ``path``, read in 1 MiB blocks (also the artifacts' file digests).
    Raises OSError when ``path`` is not a regular file: a FIFO or a device in a cache would block the open or never
    end the read."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_digest(lib: Path) -> None:
    """Writes ``lib``'s digest beside it, whole or not at all (a temporary file renamed into place)."""
    tmp = lib.with_name(f".{DIGEST}.{os.getpid()}")
    tmp.write_text(sha256_file(lib))
    os.replace(tmp, lib.with_name(DIGEST))


def _whole_elf(path: Path) -> bool:
    """Whether ``path`` starts as a 64-bit little-endian ELF file whose section header table ends inside it (a
    library cut short fails this; nvcc's libraries are ELF64 LSB)."""
    with path.open("rb") as f:
        head = f.read(64)
    if len(head) < 64 or head[:6] != b"\x7fELF\x02\x01":
        return False
    shoff, = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    return shoff + shentsize * shnum <= path.stat().st_size


def _intact(lib: Path) -> bool:
    """Whether the cached library ``lib`` exists and matches the digest built with it. An entry from before the
    digests (none beside it) is trusted when it is a whole ELF file, and gets one (best effort: a read-only cache is
    used as it is); a library changed on disk since is not intact."""
    try:
        if not lib.is_file():  # (missing, or a FIFO / device, whose open or read would never end)
            return False
        digest = lib.with_name(DIGEST)
        if not digest.exists():
            if not _whole_elf(lib):
                return False
            with contextlib.suppress(OSError):
                _write_digest(lib)
            return True
        return digest.read_text().strip() == sha256_file(lib)
    except OSError:
        return False


_NVCC_GRACE_S = 3  # after SIGINT, before SIGKILL


def _run_nvcc(cmd: list[str], tmpdir: Path) -> subprocess.CompletedProcess:
    """Runs ``cmd`` (nvcc) with its temporary files in ``tmpdir`` (the build's folder, removed with it), capturing
    its output. On any exception in the wait (Ctrl-C, SIGTERM raised by the CLI) nvcc and the processes it started
    (cicc, ptxas, the host compiler) get SIGINT, on which nvcc removes its files, and those still running
    ``_NVCC_GRACE_S`` later SIGKILL. nvcc stays in tilec's process group, so a signal to the group (a terminal's
    Ctrl-C, ``timeout``) reaches them all too."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmpdir)})
    try:
        out, err = proc.communicate()
    except BaseException:
        below = _descendants(proc.pid)
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGINT)
        for pid in below:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)
        try:
            proc.wait(timeout=_NVCC_GRACE_S)
        except BaseException:  # (also a second Ctrl-C)
            pass
        proc.kill()  # (nothing once it has ended)
        for pid in below:  # reparented when nvcc ended: killed by the pids noted before
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux ``/proc``; none found elsewhere)."""
    parent = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat_file.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
            parent[int(stat_file.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier]
        found += children
        frontier = children
    return found


def _remove_stale_builds(root: Path, held: str) -> None:
    """Removes the build folders (``<key>.XXXX``, also ``<key>.bad-XXXX``) that builds killed mid-way left in the
    cache: only a key's lock holder makes them, so those of ``held`` (whose lock the caller holds) and of every key
    whose lock nobody holds are leftovers. Errors are ignored."""
    for entry in root.glob("*.*"):
        key, _, rest = entry.name.partition(".")
        if rest == "lock" or not entry.is_dir() or entry.is_symlink():
            continue
        if key == held:
            shutil.rmtree(entry, ignore_errors=True)
        elif (root / f"{key}.lock").exists():
            with contextlib.suppress(Timeout, OSError):
                with FileLock(str(root / f"{key}.lock"), timeout=0):
                    shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path, key: str, say):
    """Holds the build lock ``path`` of ``key`` in the block; when another process holds it (a compile building the
    same library), says so through ``say`` before waiting for it - that build may take minutes."""
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"waiting for another process building the same executor {key} (it holds {path}) ...")
        t0 = time.perf_counter()
        lock.acquire()
        say(f"waited {time.perf_counter() - t0:.0f} s for the other build of {key}")
    try:
        yield
    finally:
        lock.release()


def build(sources: dict[str, str], arch: str = "sm_90a", progress=None) -> Path:
    """Compiles ``sources`` (``program.cu`` + generated headers) into a shared library.

    The cache key hashes the sources, the runtime headers, the flags, the nvcc version and
    tilec's version; a hit returns at once. Builds are written to a temporary directory and
    renamed into place under a file lock, so concurrent builds and crashes never leave a
    partial library.

    A build (a cache miss: a minute or more for a model) is announced through ``progress(text)``,
    else on stderr, with its time.

    Returns: the path of ``libtilec.so``.
    Raises: TilecError with nvcc's output when compilation fails.
    """
    nvcc = nvcc_path()
    rt = runtime_dir()
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    for path in sorted((rt / "tilec").glob("*.cuh")):
        h.update(path.name.encode() + path.read_bytes())
    h.update(" ".join(flags(arch)).encode() + nvcc_version(nvcc).encode() + __version__.encode())
    key = h.hexdigest()[:24]
    root = cache_root()
    final = root / key
    lib = final / "libtilec.so"
    if _intact(lib):
        return lib
    say = progress or _stderr
    with _locked(root / f"{key}.lock", key, say):
        if _intact(lib):
            return lib
        _remove_stale_builds(root, key)  # this key's and other keys' (a plan never built again) killed builds
        if final.exists():  # missing or damaged on disk: set aside, then built again
            say(f"the cached library {lib} is missing or does not match its sha256 digest (damaged on disk): "
                f"building it again")
            aside = Path(tempfile.mkdtemp(prefix=f"{key}.bad-", dir=root))
            try:
                os.replace(final, aside / "entry")
            except OSError as e:  # e.g. another user's entry in a shared cache
                raise TilecError(f"cannot replace the damaged build cache entry {final}: {e.strerror}; remove it, "
                                 f"or set TILEC_CACHE_DIR to another directory") from e
            finally:
                shutil.rmtree(aside, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=root))
        try:
            for name, text in sources.items():
                (tmp / name).write_text(text)
            cmd = [nvcc, *flags(arch), "-I", str(rt), "-I", str(tmp), str(tmp / "program.cu"), "-o",
                   str(tmp / "libtilec.so")]
            say(f"nvcc {arch}: building the executor {key} (once per plan; cached in {root})")
            t0 = time.perf_counter()
            res = _run_nvcc(cmd, tmp)
            if res.returncode != 0:
                extra = extra_flags()
                note = f" (with TILEC_NVCC_FLAGS={' '.join(extra)})" if extra else ""
                raise TilecError(f"nvcc failed ({res.returncode}){note}:\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
            built = tmp / "libtilec.so"
            if not built.is_file() or built.stat().st_size == 0:  # (a stand-in nvcc: an internal error before)
                raise TilecError(f"nvcc exited 0 but wrote no library ({built.name} missing or empty: is {nvcc} "
                                 f"nvcc?):\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
            _write_digest(built)
            os.replace(tmp, final)
            say(f"nvcc {arch}: built in {time.perf_counter() - t0:.0f} s")
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return lib
