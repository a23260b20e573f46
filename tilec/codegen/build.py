"""nvcc build with a content-hash cache, atomic writes and a file lock."""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from filelock import FileLock

from .. import __version__
from ..errors import TilecError


def runtime_dir() -> Path:
    """The hand-written runtime headers (``runtime/`` of the source tree, or the installed copy)."""
    for cand in (Path(__file__).resolve().parents[2] / "runtime", Path(__file__).resolve().parent / "runtime"):
        if (cand / "tilec" / "executor.cuh").exists():
            return cand
    raise TilecError("tilec runtime headers not found (expected runtime/tilec/*.cuh beside the package)")


def nvcc_path() -> str:
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


def cache_root() -> Path:
    return Path(os.environ.get("TILEC_CACHE_DIR") or Path.home() / ".cache" / "tilec")


def flags(arch: str) -> list[str]:
    """nvcc flags for ``arch``, then any in ``TILEC_NVCC_FLAGS`` (shell-split; e.g. ``-DNAME`` for
    a runtime experiment). All of them are part of the build cache key."""
    num = arch.removeprefix("sm_")
    return ["-O3", "-std=c++17", f"-gencode=arch=compute_{num},code=sm_{num}", "-shared", "-Xcompiler", "-fPIC",
            "-lineinfo", *shlex.split(os.environ.get("TILEC_NVCC_FLAGS", ""))]


def build(sources: dict[str, str], arch: str = "sm_90a", progress=None) -> Path:
    """Compiles ``sources`` (``program.cu`` + generated headers) into a shared library.

    The cache key hashes the sources, the runtime headers, the flags, the nvcc version and
    tilec's version; a hit returns at once. Builds are written to a temporary directory and
    renamed into place under a file lock, so concurrent builds and crashes never leave a
    partial library.

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
    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    lib = final / "libtilec.so"
    if lib.exists():
        return lib
    with FileLock(str(root / f"{key}.lock")):
        if lib.exists():
            return lib
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=root))
        try:
            for name, text in sources.items():
                (tmp / name).write_text(text)
            cmd = [nvcc, *flags(arch), "-I", str(rt), "-I", str(tmp), str(tmp / "program.cu"), "-o",
                   str(tmp / "libtilec.so")]
            if progress:
                progress(f"nvcc {arch}: building {key}")
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise TilecError(f"nvcc failed ({res.returncode}):\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return lib
