"""Where a program's loops sit in its SASS (benchmarks/lab): the executor's code layout, to compare between A/Bs.

In the thirty-second session two builds whose weight-ring consumer and loader ran the same instructions at
other addresses differed by 4 % in the Llama-3.2-1B step and 8 % in the Llama-3.1-8B step (benchmarks/RESULTS.md).
A runtime change moves the code placed after it, so before timing variants, compare where their hot loops sit.

    python benchmarks/lab/hot_loops.py TILEC_CACHE_DIR/KEY/program.cu [-D NAME[=VALUE] ...] [--all]
    python benchmarks/lab/hot_loops.py --sass FILE   # nvdisasm -g output

Compiles the program (a build-cache entry's ``program.cu``, beside its ``tilec_layout.h``; ``-D`` as
``variants_ab.py``'s defines) to an sm_90a cubin with ``nvcc -lineinfo`` against this checkout's ``runtime/``,
disassembles it with ``nvdisasm -g`` ($NVDISASM, else beside nvcc, else on PATH) and prints each function's start
address, then each loop (a branch back to an earlier address) of the weight loader (``stream_weights``), the
controller (``control``) and the GEMV instances (``op_linear*``): its function, first and last instruction's
addresses, bytes, first address mod 128 and the source line of its branch (loops up to ``--max-bytes``, 8192 by
default). ``--all``: every function's loops.
Exits 1 when nvcc or nvdisasm is missing or fails.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOT = ("stream_weights", "control", "op_linear")
_NAME = re.compile(r"(op_\w+?|stream_weights|control|dispatch|prepare|no_instance|tilec_executor|gemv_\w+?|"
                   r"attention_\w+?|__cuda_\w+?)(?:I|E|$)")


def short_name(symbol: str) -> str:
    """The tilec function a mangled (``$kernel$callee``) symbol names: its last recognizable part."""
    callee = symbol.split("$")[-1]
    found = _NAME.findall(callee)
    return found[0] if found else callee[-40:]


def parse(sass: str):
    """``(functions, loops)`` of ``nvdisasm -g`` text: functions as ``[(start, name)]``, loops as
    ``[(function, start, end, source)]`` - one per branch back to an earlier label, ``source`` the
    ``file:line`` the branch is attributed to (None without line info)."""
    labels, pending, functions, branches = {}, [], [], []
    fn, source, pending_fn = None, None, None
    for line in sass.splitlines():
        s = line.strip()
        m = re.match(r"\.type\s+(\S+),@function", s)
        if m:
            pending_fn = short_name(m.group(1))
            continue
        m = re.match(r"(\.L_x_\d+):", s)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', s)
        if m:
            source = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = re.match(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", s)
        if not m:
            continue
        addr = int(m.group(1), 16)
        if pending_fn is not None:
            fn = pending_fn
            functions.append((addr, fn))
            pending_fn = None
        for lab in pending:
            labels[lab] = addr
        pending = []
        b = re.search(r"\bBRA\b.*?(\.L_x_\d+)", m.group(2))
        if b:
            branches.append((fn, addr, b.group(1), source))
    loops = [(f, labels[lab], addr, src) for f, addr, lab, src in branches if lab in labels and labels[lab] < addr]
    return functions, loops


def table(functions, loops, every: bool = False, max_bytes: int = 8192) -> list[str]:
    """The printed lines: function starts, then the (hot, or ``every``) loops of at most ``max_bytes`` by
    address (longer back branches are mostly jumps back from out-of-line stubs at a function's end)."""
    out = ["function starts:"] + [f"  {a:#8x}  {name}" for a, name in functions]
    out.append("loops (function, first .. last instruction, bytes, first mod 128, the branch's source line):")
    for f, start, end, src in sorted(loops, key=lambda x: x[1]):
        if end - start + 16 <= max_bytes and (every or any(h in (f or "") for h in HOT)):
            out.append(f"  {f:<22} {start:#8x} .. {end:#8x} {end - start + 16:6d} B  {start % 128:3d}  {src}")
    return out


def disassemble(program: Path, defines: list[str]) -> str:
    """nvdisasm -g text of ``program`` compiled for sm_90a with ``defines`` (raises SystemExit when a tool is
    missing or fails)."""
    nvcc = os.environ.get("TILEC_NVCC") or shutil.which("nvcc")
    if not nvcc:
        raise SystemExit("hot_loops.py: nvcc not found (set TILEC_NVCC or PATH)")
    beside = Path(nvcc).with_name("nvdisasm")
    nvdisasm = os.environ.get("NVDISASM") or (str(beside) if beside.exists() else shutil.which("nvdisasm"))
    if not nvdisasm:
        raise SystemExit("hot_loops.py: nvdisasm not found (set NVDISASM, or install it beside nvcc)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "program.cubin"
        cmd = [nvcc, "-O3", "-std=c++17", "-lineinfo", "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
               f"-I{ROOT / 'runtime'}", f"-I{program.parent}", *[f"-D{d}" for d in defines], "-o", str(cubin),
               str(program)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"hot_loops.py: nvcc failed:\n{res.stderr[-2000:]}")
        res = subprocess.run([nvdisasm, "-g", "-c", str(cubin)], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"hot_loops.py: nvdisasm failed:\n{res.stderr[-2000:]}")
        return res.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("program", nargs="?", type=Path, help="a build-cache entry's program.cu")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME[=VALUE]",
                    help="a #define for the build (as variants_ab.py's variants), e.g. -D TILEC_LAB_PAD=4")
    ap.add_argument("--sass", type=Path, help="read nvdisasm -g output instead of compiling")
    ap.add_argument("--all", action="store_true", help="every function's loops")
    ap.add_argument("--max-bytes", type=int, default=8192, help="longest loop shown (default 8192)")
    args = ap.parse_args(argv)
    if (args.program is None) == (args.sass is None):
        ap.error("give a program.cu or --sass FILE" + ("" if args.program is None else ", not both"))
    if args.program is not None and not args.program.is_file():
        print(f"hot_loops.py: {args.program}: no such file", file=sys.stderr)
        return 1
    try:
        text = args.sass.read_text() if args.sass else disassemble(args.program, args.defines)
    except OSError as e:
        print(f"hot_loops.py: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 1
    functions, loops = parse(text)
    if not functions:
        print("hot_loops.py: no functions found (is it nvdisasm -g output?)", file=sys.stderr)
        return 1
    print("\n".join(table(functions, loops, args.all, args.max_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
