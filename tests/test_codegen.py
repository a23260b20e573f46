"""Codegen and build on a machine without a GPU: the layout header is generated from the
Python definition, and the generated sources of the tiny Llama and Qwen3 steps compile
with the machine's nvcc (they are not run here)."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tilec import codegen
from tilec.api import compile_module
from tilec.errors import TilecError
from tilec.hf import compile_decode_step
from tilec.plan import DESCRIPTOR, OPERAND
from tilec.zoo import make_model, prefill

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def tiny_plan(name, dtype, batch=1):
    model = make_model(name, dtype)
    cache, _ = prefill(model, batch, 4, 16)
    return compile_decode_step(model, cache, batch, options=dict(workers=8)).program.plan


@pytest.fixture(scope="module")
def llama_plan():
    return tiny_plan("llama-tiny", torch.bfloat16)


def test_layout_header_generated_from_python(llama_plan):
    header = codegen.render(llama_plan)["tilec_layout.h"]
    for name, start, _ in DESCRIPTOR:
        assert f"#define TILEC_W_{name.upper()} {start} " in header
    for name, start, _ in OPERAND:
        assert f"#define TILEC_OF_{name.upper()} {start}\n" in header
    from tilec import ops
    for kind, d in ops.REGISTRY.items():
        assert f"#define TILEC_OP_{kind.upper()} {d.opcode}\n" in header


def test_program_instantiates_exactly_the_used_variants(llama_plan):
    src = codegen.render(llama_plan)["program.cu"]
    used = {op.kind for op in llama_plan.graph.ops}
    instantiated = set(re.findall(r"tilec::op_(\w+)<", src))
    assert instantiated == used
    # one token per step: GEMV instances specialized for 1 row (kRowCap), the class in the signature
    assert "run_op<tilec::op_linear_fused<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, 1>>(c)" in src
    for sig in re.findall(r"if \(sig == (-?\d+)\) \{ run_op<tilec::op_linear_fused<", src):
        assert (int(sig) >> 24) & 127 == 1
    assert "torch" not in src.lower()  # plain C ABI, no torch headers


def test_template_errors_name_the_template(monkeypatch):
    from tilec.codegen import sources as r
    with pytest.raises(TilecError, match="layout.h.j2"):
        r._render("layout.h.j2", version="x")  # StrictUndefined: missing context keys are errors


def install_nvcc(tmp_path, monkeypatch, build_script: str) -> None:
    """A stand-in nvcc at tmp_path/nvcc (``--version`` answers, any other call runs ``build_script``, sh) and a
    fresh build cache under tmp_path/cache."""
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "fake nvcc V0"; exit 0; fi\n' + build_script)
    fake.chmod(0o755)
    monkeypatch.setenv("TILEC_NVCC", str(fake))
    monkeypatch.setenv("TILEC_CACHE_DIR", str(tmp_path / "cache"))


def writing_to_o(what: str) -> str:
    """A stand-in nvcc's build: writes ``what`` (sh words) as its -o file."""
    return f'while [ $# -gt 1 ]; do if [ "$1" = -o ]; then echo {what} > "$2"; fi; shift; done\n'


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """A stand-in nvcc (writes "lib\\n" as the library) and a fresh build cache under tmp_path/cache."""
    install_nvcc(tmp_path, monkeypatch, writing_to_o("lib"))


@pytest.mark.parametrize("script", ["exit 0\n",  # none, or an empty one:
                                    'while [ $# -gt 1 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done\n'])
def test_an_nvcc_that_writes_no_library_is_a_tilec_error(tmp_path, monkeypatch, script):
    """A stand-in nvcc that exits 0 without writing the library (TILEC_NVCC=/bin/true, a wrapper in a container) was
    an internal FileNotFoundError from the digest (a helper's finding); an empty one likewise. A TilecError naming
    it, and no cache entry."""
    install_nvcc(tmp_path, monkeypatch, script)
    with pytest.raises(TilecError, match=r"nvcc exited 0 but wrote no library \(libtilec\.so missing or empty: is "
                                         r".*/nvcc nvcc\?\)"):
        codegen.build({"program.cu": "// no library\n"})
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_a_cached_library_damaged_on_disk_is_built_again(fake_nvcc, tmp_path, capsys, monkeypatch):
    """The build cache returned any existing libtilec.so: 8 garbage bytes in its place were copied into a new artifact,
    whose manifest then hashed and "verified" them (a fresh user's case). A library is checked against the sha256
    written with it, and rebuilt on a mismatch; an entry from before the digests is trusted once when it is a whole
    ELF file, and gets one. An entry that cannot be set aside (another user's, in a shared cache) is a TilecError."""
    lib = codegen.build({"program.cu": "// cached\n"})
    digest = lib.with_name("libtilec.so.sha256")
    assert digest.read_text() == hashlib.sha256(b"lib\n").hexdigest()
    capsys.readouterr()
    lib.write_bytes(b"garbage!")
    assert codegen.build({"program.cu": "// cached\n"}) == lib and lib.read_text() == "lib\n"
    err = capsys.readouterr().err
    assert "is missing or does not match its sha256 digest (damaged on disk): building it again" in err and "built in" in err
    digest.unlink()  # an entry from before the digests, not a library: built again
    assert codegen.build({"program.cu": "// cached\n"}) == lib and "building it again" in capsys.readouterr().err
    cut = bytearray(b"\x7fELF\x02\x01" + bytes(58))  # a 64-bit ELF header whose section headers lie past its end
    cut[0x28:0x30] = (4096).to_bytes(8, "little")  # e_shoff
    cut[0x3A:0x3E] = (64).to_bytes(2, "little") + (3).to_bytes(2, "little")  # e_shentsize, e_shnum
    lib.write_bytes(bytes(cut))
    digest.unlink()  # a library cut short, from before the digests: built again
    assert codegen.build({"program.cu": "// cached\n"}) == lib and "building it again" in capsys.readouterr().err
    elf = b"\x7fELF\x02\x01" + bytes(58)  # (no section headers: whole)
    lib.write_bytes(elf)
    digest.unlink()  # an ELF entry from before the digests: used as it is, and given one
    assert codegen.build({"program.cu": "// cached\n"}) == lib and capsys.readouterr().err == ""
    assert lib.read_bytes() == elf and digest.read_text() == hashlib.sha256(elf).hexdigest()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")) == [lib.parent.name]
    lib.write_bytes(b"garbage!")
    real = os.replace

    def refused(src, dst):
        if Path(dst).name == "entry":
            raise PermissionError(13, "Permission denied")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(TilecError, match=r"cannot replace the damaged build cache entry .*: Permission denied; "
                                         r"remove it, or set TILEC_CACHE_DIR"):
        codegen.build({"program.cu": "// cached\n"})
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")) == [lib.parent.name]


def test_a_killed_builds_temporary_folder_is_removed_by_the_next_build(fake_nvcc, tmp_path):
    """A build killed during nvcc (SIGKILL) left its <key>.XXXX folder in the cache for good (a fresh user's case).
    Only the holder of the key's lock makes those, so the next build of the key removes them."""
    lib = codegen.build({"program.cu": "// killed\n"})
    key, cache = lib.parent.name, tmp_path / "cache"
    shutil.rmtree(lib.parent)
    (cache / f"{key}.abc123").mkdir()
    (cache / f"{key}.abc123" / "program.cu").write_text("// half written")
    (cache / "other.def456").mkdir()  # another key's: not this build's business
    assert codegen.build({"program.cu": "// killed\n"}) == lib and lib.read_text() == "lib\n"
    assert sorted(p.name for p in cache.iterdir()) == sorted([key, f"{key}.lock", "other.def456"])


def test_an_interrupted_build_kills_nvccs_children_too(tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM during nvcc killed nvcc alone: its cicc / ptxas / host compiler ran on (a reviewer's case).
    nvcc and the processes below it get SIGINT, and SIGKILL after a grace (this child, a shell's background job,
    ignores SIGINT)."""
    pidfile = tmp_path / "child.pid"
    install_nvcc(tmp_path, monkeypatch, f"sleep 60 &\necho $! > {pidfile}\nwait\n")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(KeyboardInterrupt):
            codegen.build({"program.cu": "// interrupted\n"})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    child = int(pidfile.read_text())
    for _ in range(100):  # reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"nvcc's child {child} still runs")
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []  # no half-built entry


def test_nvccs_temporary_files_go_to_the_build_folder(tmp_path, monkeypatch):
    """nvcc killed mid-build left its tmpxft_* files in /tmp (a fresh user's case): its TMPDIR is the build's
    folder, removed with it."""
    install_nvcc(tmp_path, monkeypatch, writing_to_o('"$TMPDIR"'))
    lib = codegen.build({"program.cu": "// tmpdir\n"})
    used = Path(lib.read_text().strip())
    assert used.parent == tmp_path / "cache" and used.name.startswith(f"{lib.parent.name}.") and not used.exists()


def test_a_killed_build_of_another_key_is_removed_once_nobody_builds_it(fake_nvcc, tmp_path):
    """A killed build's folder was removed only by a later build of the same key - never for a plan not built
    again (a fresh user's case). Any build removes other keys' folders whose lock nobody holds."""
    from filelock import FileLock
    cache = tmp_path / "cache"
    cache.mkdir()
    for key in ("aaaa", "bbbb"):
        (cache / f"{key}.lock").touch()
        (cache / f"{key}.x1").mkdir()
    with FileLock(str(cache / "bbbb.lock")):  # bbbb is being built right now
        lib = codegen.build({"program.cu": "// other keys\n"})
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        ["aaaa.lock", "bbbb.lock", "bbbb.x1", lib.parent.name, f"{lib.parent.name}.lock"])


def test_a_cached_library_that_is_no_regular_file_is_built_again(fake_nvcc, tmp_path, capsys):
    """A FIFO in place of a cached libtilec.so from before the digests (none beside it): the ELF check's open blocked
    for good (the plan cache's case, sha256_file, had been mended; this reader had not). It is built again."""
    lib = codegen.build({"program.cu": "// fifo\n"})
    lib.unlink()
    lib.with_name("libtilec.so.sha256").unlink()
    os.mkfifo(lib)
    capsys.readouterr()
    assert codegen.build({"program.cu": "// fifo\n"}) == lib and lib.read_text() == "lib\n"
    assert "building it again" in capsys.readouterr().err


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name,dtype,batch", [("llama-tiny", torch.bfloat16, 1), ("qwen3-tiny", torch.bfloat16, 2),
                                              ("llama-tiny", torch.float32, 2)])
def test_generated_step_compiles(name, dtype, batch, tmp_path, monkeypatch):
    monkeypatch.setenv("TILEC_CACHE_DIR", str(tmp_path))
    plan = tiny_plan(name, dtype, batch)
    lib = codegen.build(codegen.render(plan))
    assert lib.exists() and lib.stat().st_size > 0
    assert lib.parent.parent == tmp_path
    # a second build of the same sources is a cache hit: same path, nothing rebuilt
    mtime = lib.stat().st_mtime_ns
    assert codegen.build(codegen.render(plan)) == lib and lib.stat().st_mtime_ns == mtime


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("fold_combine", [True, False])
def test_generated_step_with_split_kv_attention_compiles(tmp_path, monkeypatch, fold_combine):
    """A longer cache with attn_kv_chunk=32: the plan runs attention as split-KV partials, whose
    last tile per head group combines them (``fold_combine``), or partials + a combine op."""
    monkeypatch.setenv("TILEC_CACHE_DIR", str(tmp_path))
    model = make_model("llama-tiny", torch.bfloat16)
    cache, _ = prefill(model, 1, 40, 128)
    opts = dict(workers=8, attn_kv_chunk=32, fold_combine=fold_combine)
    plan = compile_decode_step(model, cache, 1, options=opts).program.plan
    kinds = {op.kind for op in plan.graph.ops}
    assert "attention_partial" in kinds and "attention" not in kinds
    assert ("attention_combine" in kinds) != fold_combine
    src = codegen.render(plan)["program.cu"]
    assert "run_op<tilec::op_attention_partial<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, float>>(c)" in src
    assert ("run_op<tilec::op_attention_combine<float, float, __nv_bfloat16>>(c)" in src) != fold_combine
    lib = codegen.build(codegen.render(plan))
    assert lib.exists() and lib.stat().st_size > 0


@needs_nvcc
@pytest.mark.slow
def test_executor_static_shared_memory_fits_beside_the_largest_dynamic_request(tmp_path):
    """The executor's static shared memory (the decoded operands - 13 a row since the split-KV
    attention appends the KV rows and combines -, descriptors, barriers) fits in the room
    ``tilec.smem`` leaves beside MAX_DYNAMIC_SMEM of Hopper's 227 KiB, so a plan asking for that
    much still launches. ptxas reports it (``--resource-usage``); the plan has split-KV attention
    with the append and combine folds."""
    from tilec import smem
    from tilec.codegen.build import flags, nvcc_path, runtime_dir

    model = make_model("llama-tiny", torch.bfloat16)
    cache, _ = prefill(model, 1, 40, 128)
    plan = compile_decode_step(model, cache, 1, options=dict(workers=8, attn_kv_chunk=32)).program.plan
    assert any(op.attr("append") and op.attr("combine") for op in plan.graph.ops)
    for name, text in codegen.render(plan).items():
        (tmp_path / name).write_text(text)
    res = subprocess.run([nvcc_path(), *flags("sm_90a"), "--resource-usage", "-I", str(runtime_dir()), "-I",
                          str(tmp_path), str(tmp_path / "program.cu"), "-o", str(tmp_path / "lib.so")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    static = [int(n) for n in re.findall(r"(\d+) bytes smem", res.stdout + res.stderr)]
    assert static and max(static) <= 227 * 1024 - smem.MAX_DYNAMIC_SMEM


@needs_nvcc
def test_failed_build_leaves_nothing(tmp_path, monkeypatch, llama_plan):
    monkeypatch.setenv("TILEC_CACHE_DIR", str(tmp_path))
    srcs = codegen.render(llama_plan)
    srcs["program.cu"] += "\nthis is not C++;\n"
    with pytest.raises(TilecError, match="nvcc failed"):
        codegen.build(srcs)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


@needs_nvcc
def test_tables_header_holds_the_plan_and_compiles(llama_plan, tmp_path):
    tables = codegen.render_tables(llama_plan)
    (tmp_path / "tables.h").write_text(tables)
    (tmp_path / "tilec_layout.h").write_text(codegen.render(llama_plan)["tilec_layout.h"])
    w, length = llama_plan.queues.shape[:2]
    (tmp_path / "check.cu").write_text(
        '#include "tables.h"\n'
        f"static_assert(tilec_plan::kWorkers == {w} && tilec_plan::kLength == {length}, \"shape\");\n"
        "int first_opcode() { return tilec_plan::kQueues[TILEC_W_OPCODE]; }\n")
    res = subprocess.run(["nvcc", "-std=c++17", "-c", str(tmp_path / "check.cu"), "-o", str(tmp_path / "check.o")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    first = ", ".join(map(str, llama_plan.queues[0, 0].tolist()))
    assert first in tables


def test_ops_differing_only_in_operand_count_get_their_own_instances():
    """float32's dtype code is 0: a bias-free and a biased float32 linear once packed to the same
    dispatch signature, so one instance (without bias) ran both (a review finding)."""
    mod = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 32, bias=True))
    x = torch.randn(1, 64)
    prog = compile_module(mod, (x,), options=dict(workers=4, executor="reference"))
    lin = [v for v in codegen.variants(prog.plan) if v.kind == "linear"]
    assert sorted(v.types for v in lin) == [("float", "float", "float", "1"), ("float", "float", "float", "float", "1")]
    assert len({v.sig for v in lin}) == 2
    torch.testing.assert_close(prog(x), mod(x), rtol=1e-5, atol=1e-5)


def test_a_build_is_announced_on_stderr_once(fake_nvcc, capsys):
    """An nvcc build takes a minute or more for a model; from the Python API (no progress callback)
    it ran silently. A cache hit says nothing."""
    lib = codegen.build({"program.cu": "// announced\n"})
    err = capsys.readouterr().err
    assert lib.read_text() == "lib\n"
    assert re.search(r"^tilec: nvcc sm_90a: building the executor \w+ \(once per plan; cached in .*cache\)$", err, re.M), err
    assert re.search(r"^tilec: nvcc sm_90a: built in \d+ s$", err, re.M), err
    assert codegen.build({"program.cu": "// announced\n"}) == lib and capsys.readouterr().err == ""
    said = []
    codegen.build({"program.cu": "// with a callback\n"}, progress=said.append)
    assert capsys.readouterr().err == "" and said[0].startswith("nvcc sm_90a: building") and len(said) == 2


@needs_nvcc
@pytest.mark.slow
def test_integer_copies_compile(tmp_path, monkeypatch):
    """The exact integer paths (move_integers) of op_copy (int32 -> int64, int64 -> int64, 0-d) and
    op_concat build with nvcc."""
    monkeypatch.setenv("TILEC_CACHE_DIR", str(tmp_path))

    class M(torch.nn.Module):
        def forward(self, ids32, ids64, one):
            return ids32.long(), ids64.t().contiguous(), torch.cat([ids64, ids32.long()], 1), one.long()

    prog = compile_module(M(), (torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.tensor([[1, 2], [3, 4]]),
                                torch.tensor(5, dtype=torch.int32)))
    src = codegen.render(prog.plan)["program.cu"]
    assert "op_copy<int, long long>" in src and "op_copy<long long, long long>" in src
    assert "op_concat<long long, long long>" in src
    assert codegen.build(codegen.render(prog.plan)).exists()


def test_an_elementwise_integer_result_is_refused_before_nvcc(tmp_path):
    """Arithmetic on a bool mask with an integer result (``mask * 3``, ``mask + mask``) runs on the reference
    executor, but the CUDA instances of the elementwise ops have no integer stores: nvcc failed with ptxas's
    "Unresolved extern function ... from_f" (a fresh user's finding). Rendering now refuses it naming the op, and
    an artifact is written for the reference executor with that note, as for a dtype without CUDA code."""
    from tilec import artifact
    from tilec.errors import TilecError

    class M(torch.nn.Module):
        def forward(self, m, x):
            return m * 3, x * 2 + (m * 3).float(), m + m

    args = (torch.tensor([[True, False, True, False]]), torch.randn(1, 4))
    prog = compile_module(M(), args)
    for got, want in zip(prog(*args), M()(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(TilecError, match=r"op unary_mul\w*: an elementwise op whose result is int64 has no CUDA "
                                         r"implementation yet \(the reference executor runs it"):
        codegen.render(prog.plan)
    artifact.save(tmp_path / "a", prog, args)  # (build on: nothing to build)
    cuda = artifact.load(tmp_path / "a").manifest["cuda"]
    assert cuda["library"] is None and "result is int64 has no CUDA implementation" in cuda["note"], cuda


def test_waiting_for_another_build_of_the_same_library_says_so(fake_nvcc, tmp_path):
    """Two compiles building the same library: the second waited on the file lock without a word, for as long as
    nvcc ran in the other (a fresh user's finding). It now says it waits, and for whom, through progress."""
    import threading

    from filelock import FileLock

    lib = codegen.build({"program.cu": "// shared\n"})
    lib.unlink()  # built again below, by the waiting build
    key = lib.parent.name
    said: list[str] = []
    other = FileLock(str(tmp_path / "cache" / f"{key}.lock"))
    other.acquire()  # another process building it right now
    try:
        waiter = threading.Thread(target=codegen.build, args=({"program.cu": "// shared\n"},),
                                  kwargs={"progress": said.append})
        waiter.start()
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said == [f"waiting for another process building the same executor {key} (it holds "
                        f"{tmp_path / 'cache' / (key + '.lock')}) ..."], said
        assert waiter.is_alive()  # still waiting
    finally:
        other.release()
    waiter.join(30)
    assert not waiter.is_alive() and lib.read_text() == "lib\n"
    assert said[1].startswith("waited ") and said[1].endswith(f"s for the other build of {key}"), said
