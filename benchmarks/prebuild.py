"""Builds the CUDA libraries of the GLM-5 prelude benchmark (and with ``--gpu-tests`` those of
tests/gpu) here, without a GPU, so a GPU call can skip nvcc: compile the plans on the CPU, build
each ``libtilec.so`` into the build cache, and carry the cache to the GPU machine.

    TILEC_CACHE_DIR=$PWD/.tilec-cache python benchmarks/prebuild.py [--no-prelude] [--gpu-tests [FILE ...] [-k EXPR]]
    # then, on the GPU machine, with .tilec-cache carried along:
    TILEC_CACHE_DIR=$PWD/.tilec-cache python benchmarks/glm5_prelude.py ...

The libraries compress well: ``tar cf - .tilec-cache | xz -T2 > .tilec-cache-carry/NAME.tar.xz`` packed
127 MB into 7.8 MB on 2026-12-05, so every test file's libraries fit one carry (64 MiB); carry
``.tilec-cache-carry`` and ``benchmarks/run_gpu.sh`` unpacks its tarballs into ``TILEC_CACHE_DIR``.

The cache key hashes the generated sources, the runtime headers, the nvcc flags and version and
tilec's version (tilec/codegen/build.py), so a library built here is used there only when both
sides generate the same sources with the same nvcc - a miss just builds there as usual. On
2026-11-29 (nvcc 13.0 on both machines) the GLM-5 builds hit: 51 s of device time each became
under 10 s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import glm5_dsa_prelude as glm  # noqa: E402
from tilec.api import compile_module  # noqa: E402
from tilec.codegen.build import build, cache_root  # noqa: E402
from tilec.codegen.sources import render  # noqa: E402


def gpu_test_programs():
    """``(label, plan)`` of the decode steps of ``tests/gpu/test_cuda_models.py`` (its CASES), which take
    longest to compile there; a two-layer model with a short prefill plans the same program as the test's
    full-size one."""
    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    sys.path.insert(0, str(ROOT / "tests"))
    import test_cuda_models  # noqa: E402  (skips its tests without CUDA; its CASES are plain data)

    for case in test_cuda_models.CASES:
        name, batch, context, steps = getattr(case, "values", case)
        model = make_model(name, torch.bfloat16, "cpu", **({} if "tiny" in name else {"layers": 2}))
        cache, _ = prefill(model, batch, 8, context + steps + 8, "cpu")
        step = compile_decode_step(model, cache, batch, options=dict(executor="reference"))
        yield f"{name} batch {batch}", step.program.compiled.plan


# tests/gpu files whose libraries --gpu-tests builds by running their tests on the CPU (BuildOnly), with a
# pytest -k expression: the model decode steps are gpu_test_programs' (quicker from two layers); the
# full-size GLM-5 prelude test is left out (its inputs and oracle on the CPU take minutes).
TEST_FILES = (("test_cuda_ops.py", ""), ("test_cuda_models.py", "not decode_matches_eager"),
              ("test_cuda_glm5_prelude.py", "not (prelude and full)"), ("test_cuda_hf_families.py", ""))


class BuildOnly:
    """A pytest plugin: tests/gpu's tests run on the CPU until they create a CUDA executor; the plan's
    sources are kept (``sources``, built afterwards) and the test stops there, skipped.

    Without a GPU, tests/gpu/conftest.py marks every test skipped ("needs a CUDA GPU" / "needs nvcc");
    this plugin runs after it and lifts those marks (no other skip), points the test modules' ``DEV``
    at the CPU, and has ``compile_module`` / ``compile_decode_step`` plan with the reference executor
    (the same plan, hence the same library). Only a test's first program is kept: a test that compiles
    two (a fold on and off, say) builds its second on the GPU, and so does a test that fails before
    its first."""

    def __init__(self):
        self.sources: list[dict] = []
        self.saved = None  # tilec.cuda.CudaExecutor while the plugin's stand-in replaces it

    def keep(self, plan):
        self.sources.append(render(plan))
        pytest.skip("sources kept for the build")

    def wrap(self, compile_fn, plan_of):
        def run(*args, options=None, **kwargs):
            result = compile_fn(*args, options={**(options or {}), "executor": "reference"}, **kwargs)
            self.keep(plan_of(result))
        run.build_only = True
        return run

    @pytest.hookimpl(trylast=True)  # after tests/gpu/conftest.py has marked the tests skipped
    def pytest_collection_modifyitems(self, items):
        import tilec.cuda

        plugin = self

        class Executor:  # tests that make a CudaExecutor themselves
            def __init__(self, plan, *args, **kwargs):
                plugin.keep(plan)

        self.saved = tilec.cuda.CudaExecutor
        tilec.cuda.CudaExecutor = Executor
        for item in items:
            item.own_markers = [m for m in item.own_markers
                                if not (m.name == "skip" and str(m.kwargs.get("reason", "")).startswith("needs "))]
            mod = item.module
            if getattr(mod, "DEV", None) == "cuda":
                mod.DEV = "cpu"
            for name, plan_of in (("compile_module", lambda prog: prog.plan),
                                  ("compile_decode_step", lambda step: step.program.compiled.plan)):
                fn = getattr(mod, name, None)
                if fn is not None and not getattr(fn, "build_only", False):
                    setattr(mod, name, self.wrap(fn, plan_of))

    def pytest_sessionfinish(self):
        import tilec.cuda

        if self.saved is not None:
            tilec.cuda.CudaExecutor = self.saved


def build_all(sources: list[dict]) -> list[Path]:
    """Builds each rendered program (two nvcc at a time: nvcc is single-threaded); their libraries."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(build, sources))


def build_test_libraries(files, keyword: str | None = None) -> None:
    """Builds the libraries of the tests of ``files`` (names in TEST_FILES; ``keyword``: a further pytest
    -k expression) with BuildOnly, one pytest run per file. Raises SystemExit when pytest cannot run
    (a usage, collection or internal error; a malformed -k) or when ``keyword`` selects no test at all."""
    selected = False
    for name, own in TEST_FILES:
        if name not in files:
            continue
        plugin = BuildOnly()
        t0 = time.time()
        expr = " and ".join(f"({k})" for k in (own, keyword) if k)
        args = [str(ROOT / "tests" / "gpu" / name), "-q", "-p", "no:cacheprovider", "-rN",
                "-W", "ignore::pytest.PytestAssertRewriteWarning"]
        code = pytest.main(args + (["-k", expr] if expr else []), plugins=[plugin])
        if code not in (0, 1, 5):
            given = f" (check -k {keyword!r})" if keyword else ""
            raise SystemExit(f"prebuild.py: pytest could not run {name} (exit {code}){given}")
        selected |= code != 5
        libs = sorted(set(build_all(plugin.sources)))
        failed = "" if code != 1 else "; some tests failed before their first build: the GPU run builds theirs"
        print(f"{name}: {len(libs)} {'library' if len(libs) == 1 else 'libraries'} ({time.time() - t0:.1f} s{failed})",
              flush=True)
        for lib in libs:
            print(f"  {lib}", flush=True)
    if keyword and not selected:
        raise SystemExit(f"prebuild.py: -k {keyword!r} selects no test in {', '.join(files)}")


def main() -> None:
    ap = argparse.ArgumentParser(description="Builds tilec's CUDA libraries for a GPU machine, without a GPU.")
    ap.add_argument("--workers", type=int, default=132, help="as benchmarks/glm5_prelude.py --workers")
    ap.add_argument("--reduced", action="store_true", help="the CI configuration instead of GLM-5's sizes")
    ap.add_argument("--no-prelude", action="store_true", help="skip the GLM-5 prelude benchmark's libraries")
    names = [name for name, _ in TEST_FILES]
    ap.add_argument("--gpu-tests", nargs="*", metavar="FILE", choices=names,
                    help="also the libraries of tests/gpu: the model decode steps (gpu_test_programs) and the other "
                         "tests' (each run on the CPU up to its first build); with FILEs (names, not paths), only "
                         f"those files' (of {', '.join(names)}). All of them take ~115 MB, more than the GPU tool "
                         "carries (64 MiB): split them over TILEC_CACHE_DIRs, with -k for test_cuda_ops.py")
    ap.add_argument("-k", dest="keyword", metavar="EXPR",
                    help="with --gpu-tests: only the tests pytest -k EXPR selects (the model decode steps are then "
                         "left out)")
    args = ap.parse_args()
    if args.gpu_tests is None and (args.no_prelude or args.keyword):
        ap.error("--no-prelude and -k go with --gpu-tests")
    # the test session's conftest.py points an unset TILEC_CACHE_DIR at a temporary directory
    os.environ.setdefault("TILEC_CACHE_DIR", str(cache_root()))
    print(f"build cache: {cache_root()}")
    if not args.no_prelude:
        cfg = glm.REDUCED if args.reduced else glm.FULL
        for fp8 in (False, True):
            name = "FP8" if fp8 else "bf16"
            t0 = time.time()
            mod = glm.make_prelude(cfg, fp8, torch.bfloat16, "cpu")
            inputs = glm.make_inputs(cfg, fp8, torch.bfloat16, "cpu")
            prog = compile_module(mod, inputs, options=dict(workers=args.workers, check=False,
                                                                executor="reference", tile_rows=4))
            lib = build(render(prog.plan), progress=lambda m: print(f"  {m}", flush=True))
            print(f"GLM-5 prelude {name}: {lib} ({time.time() - t0:.1f} s)", flush=True)
    if args.gpu_tests is not None:
        files = args.gpu_tests or names
        if "test_cuda_models.py" in files and args.keyword:
            print("prebuild.py: with -k, the model decode steps (test_decode_matches_eager) are not built", flush=True)
        elif "test_cuda_models.py" in files:
            programs = [(label, render(plan)) for label, plan in gpu_test_programs()]
            for (label, _), lib in zip(programs, build_all([src for _, src in programs])):
                print(f"{label}: {lib}", flush=True)
        build_test_libraries(files, args.keyword)


if __name__ == "__main__":
    main()
