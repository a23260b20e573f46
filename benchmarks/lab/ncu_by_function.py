"""Attributes an ``ncu`` source-counter profile of the executor to its device functions
(benchmarks/lab: a tool for finding where a step's time goes).

ncu's source page lists every SASS instruction of the kernel with its warp-stall samples, but the
executor is one ELF function holding every op (the non-inlined ops are local subroutines of it),
so the page does not say which op an instruction belongs to. The symbol table of a cubin built
from the same generated sources does: each subroutine is a FUNC symbol with its offset and size.
This script joins the two and prints, per function, its share of the stall samples and its main
stall reasons; with ``--function REGEX``, that function's hottest instructions.

    # on the GPU machine (one step of any compiled program, e.g. the GLM-5 prelude):
    ncu --section SourceCounters --section WarpStateStats -k regex:tilec_executor --launch-skip 2 -c 1 \\
        -o step -f python3 my_step.py
    ncu -i step.ncu-rep --page source --csv --print-source sass > src.csv
    ncu -i step.ncu-rep --page source --csv --print-source cuda,sass > lines.csv  # for --lines
    # anywhere with nvcc and binutils: the library's build-cache entry holds its program.cu
    python benchmarks/lab/ncu_by_function.py src.csv --sources $TILEC_CACHE_DIR/<key> [--function bmm [--lines lines.csv]]

Used on 2026-12-01 (H200, GLM-5 FP8 prelude): the absorption bmm's inner loop was generic loads
from its shared-memory scratch. On 2026-12-03 (H200, Llama-3.2-1B batch 1, ``--lines``): 41 % of the
loader warp's samples waited in ``mbarrier.try_wait`` for a free ring stage, and the batch-1 GEMV's
dot products and their shuffle sums were about a third of that op's samples. The cubin must come
from the same sources and flags as the profiled library (the script checks that the sizes agree).
"""
from __future__ import annotations

import argparse
import bisect
import csv
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build_cubin(sources: Path, out: Path) -> Path:
    """nvcc's cubin of ``sources/program.cu`` with tilec's flags (less the shared-library ones)."""
    from tilec.codegen.build import flags, runtime_dir

    fl = [f for f in flags("sm_90a") if f not in ("-shared", "-Xcompiler", "-fPIC")]
    cubin = out / "program.cubin"
    cmd = ["nvcc", *fl, "-cubin", "-I", str(runtime_dir()), "-I", str(sources), str(sources / "program.cu"),
           "-o", str(cubin)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"nvcc failed:\n{r.stderr[-2000:]}")
    return cubin


def functions(cubin: Path) -> list[tuple[int, int, str]]:
    """``(offset, size, demangled name)`` of the cubin's FUNC symbols, by offset (readelf, c++filt)."""
    if shutil.which("readelf") is None:
        sys.exit("needs readelf (binutils)")
    out = subprocess.run(["readelf", "-s", "-W", str(cubin)], capture_output=True, text=True).stdout
    syms = []
    for line in out.splitlines():
        p = line.split()
        if len(p) >= 8 and p[3] == "FUNC":
            size = int(p[2], 16) if p[2].startswith("0x") else int(p[2])
            syms.append((int(p[1], 16), size, p[7].split("$")[-1]))
    syms.sort()
    names = [s[2] for s in syms]
    if shutil.which("c++filt"):
        names = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    short = [re.sub(r"_INTERNAL_\w+::|\(anonymous namespace\)::|_GLOBAL__N_\w+::", "", n) for n in names]
    return [(o, s, n) for (o, s, _), n in zip(syms, short)]


def source_lines(path: Path, base: int) -> dict[int, list[str]]:
    """``{offset: ["file:line", ...]}`` from an ``ncu --page source --csv --print-source cuda,sass``
    export (its rows: a "File Path" row per source file, then each line's row followed by the rows of
    the SASS instructions ncu attributes to it; offsets from the kernel's first instruction at
    ``base``). ncu lists an inlined instruction under every line of its inlining chain (the helper's
    line and its call sites'), so an offset may map to several lines."""
    loc: dict[int, list[str]] = {}
    where, line = "?", 0
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "File Path":
                where, line = Path(r[1]).name, 0
            elif r[0].isdigit():
                line = int(r[0])
            elif len(r) > 2 and r[2].startswith("0x"):
                loc.setdefault(int(r[2], 16) - base, []).append(f"{where}:{line}")
    return loc


def line_table(hot: list, loc: dict[int, list[str]], top: int) -> list[tuple[str, int, dict[str, int]]]:
    """The ``top`` source lines with the most stall samples among ``hot``'s instructions (``(samples,
    offset, sass, reasons)`` each), as ``(file:line, samples, reasons)``: inclusive, as ncu's own line
    rows count - an instruction counts for every line ``loc`` lists it under, so a call site's line
    includes what was inlined into it and the lines' samples can add up to more than the function's."""
    per: dict[str, dict[str, int]] = {}
    for n, off, _, reasons in hot:
        for where in loc.get(off, ["?"]):
            d = per.setdefault(where, {"n": 0})
            d["n"] += n
            for k, v in reasons.items():
                d[k] = d.get(k, 0) + v
    rows = sorted(per.items(), key=lambda kv: -kv[1]["n"])[:top]
    return [(where, d.pop("n"), d) for where, d in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--cubin", type=Path, help="a cubin of the profiled program")
    g.add_argument("--sources", type=Path, help="a build-cache entry (program.cu, tilec_layout.h): builds the cubin")
    ap.add_argument("--function", help="also list the hottest instructions of the first function matching this regex")
    ap.add_argument("--lines", type=Path, metavar="CSV",
                    help="the same report's --print-source cuda,sass export: --function's hottest source lines too")
    ap.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    args = ap.parse_args()
    if args.top < 1:
        ap.error(f"--top {args.top}: must be at least 1")
    if args.lines and not args.function:
        ap.error("--lines lists the source lines of --function's instructions: pass --function too")
    for what, path in (("csv", args.csv), ("--cubin", args.cubin), ("--lines", args.lines)):
        if path is not None and not Path(path).is_file():
            ap.error(f"{what} {path}: no such file")
    if args.function:
        try:
            re.compile(args.function)
        except re.error as e:
            ap.error(f"--function {args.function!r}: not a regular expression ({e})")
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if head is None:
        sys.exit(f"{args.csv}: no 'Address' header row (not an ncu --page source --csv --print-source sass export?)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = args.cubin or build_cubin(args.sources, Path(tmp))
        syms = functions(cubin)
    if not syms:
        sys.exit(f"{cubin}: no FUNC symbols (not a cubin?)")
    hdr, data = rows[head], [r for r in rows[head + 1:] if r and r[0].startswith("0x")]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][ix["Address"]], 16)
    kernel = max(syms, key=lambda s: s[1])
    if abs(len(data) * 16 - kernel[1]) > 256:
        print(f"warning: {len(data)} instructions profiled, the cubin's kernel has {kernel[1] // 16}: "
              f"not the same build?", file=sys.stderr)
    subs = [s for s in syms if s is not kernel]
    starts = [s[0] for s in subs]

    def owner(off: int) -> str:
        i = bisect.bisect_right(starts, off) - 1
        return subs[i][2] if i >= 0 and off < subs[i][0] + subs[i][1] else "executor (inlined code)"

    per: dict[str, dict[str, int]] = {}
    hot = []
    for r in data:
        n = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        if not n:
            continue
        off = int(r[ix["Address"]], 16) - base
        d = per.setdefault(owner(off), {"n": 0})
        d["n"] += n
        reasons = {s[6:]: int(r[ix[s]]) for s in stalls if r[ix[s]].isdigit()}
        for k, v in reasons.items():
            d[k] = d.get(k, 0) + v
        hot.append((n, off, r[ix["Source"]].strip(), reasons))
    total = sum(d["n"] for d in per.values())
    print(f"{total} stall samples; per function: samples, share, main reasons")
    for name, d in sorted(per.items(), key=lambda kv: -kv[1]["n"])[:args.top]:
        top = sorted(((v, k) for k, v in d.items() if k != "n"), reverse=True)[:3]
        print(f"{d['n']:7d} {100 * d['n'] / total:5.1f}%  {name[:90]:90s} "
              + ", ".join(f"{k} {v}" for v, k in top))
    if args.function:
        match = [s for s in subs if re.search(args.function, s[2])]
        if not match:
            sys.exit(f"no function matches {args.function!r}")
        off0, size, name = match[0]
        print(f"\n{name} (offset {off0:#x}, {size} bytes): hottest instructions")
        mine = [h for h in hot if off0 <= h[1] < off0 + size]
        for n, off, src, reasons in sorted(mine, reverse=True)[:args.top]:
            top = sorted(((v, k) for k, v in reasons.items()), reverse=True)[:2]
            print(f"  +{off - off0:#7x} {n:6d}  {src[:64]:64s} " + ", ".join(f"{k} {v}" for v, k in top))
        if args.lines:
            loc = source_lines(args.lines, base)
            if not loc:
                sys.exit(f"{args.lines}: no SASS rows under source lines (not a --print-source cuda,sass export?)")
            if set(loc) != {int(r[ix["Address"]], 16) - base for r in data}:
                sys.exit(f"{args.lines}: its instructions are not those of {args.csv} (not the same report?)")
            own = sum(h[0] for h in mine)
            print(f"\n{name[:90]}: hottest source lines (of its {own} samples; inclusive: an inlined "
                  f"instruction counts for its call sites' lines too)")
            for where, n, reasons in line_table(mine, loc, args.top):
                top = sorted(((v, k) for k, v in reasons.items()), reverse=True)[:3]
                print(f"  {n:6d} {100 * n / own:5.1f}%  {where:28s} " + ", ".join(f"{k} {v}" for v, k in top))


if __name__ == "__main__":
    main()
