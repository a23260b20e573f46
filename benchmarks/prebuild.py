"""Builds the CUDA libraries of the GLM-5 prelude benchmark here, without a GPU, so a GPU call
can skip nvcc: compile the plans on the CPU, build each ``libtilec.so`` into the build cache,
and carry the cache to the GPU machine.

    TILEC_CACHE_DIR=$PWD/.tilec-cache python benchmarks/prebuild.py [--gpu-tests]
    # then, on the GPU machine, with .tilec-cache carried along:
    TILEC_CACHE_DIR=$PWD/.tilec-cache python benchmarks/glm5_prelude.py ...

The cache key hashes the generated sources, the runtime headers, the nvcc flags and version and
tilec's version (tilec/codegen/build.py), so a library built here is used there only when both
sides generate the same sources with the same nvcc - a miss just builds there as usual. On
2026-11-29 (nvcc 13.0 on both machines) the GLM-5 builds hit: 51 s of device time each became
under 10 s.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import glm5_dsa_prelude as glm  # noqa: E402
from tilec.api import compile_module  # noqa: E402
from tilec.codegen.build import build, cache_root  # noqa: E402
from tilec.codegen.sources import render  # noqa: E402


def gpu_test_programs():
    """``(label, plan)`` of the programs tests/gpu builds that take longest to compile there: the
    decode steps of ``test_cuda_models.py`` (its CASES; a short prefill plans the same program) and
    the fused and unfused FP8 GEMMs of ``test_cuda_glm5_prelude.py`` (one program each whatever the
    shape: the generated source depends on the op variants only)."""
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
    for fuse in (True, False):
        lin = glm.Linear(2048, 136, fp8=True)
        lin.set_weight(torch.randn(136, 2048) * 0.05)

        class Gemm(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = lin

            def forward(self, x):
                return self.lin(glm.act_quant(x), out_dtype=x.dtype)

        x = torch.randn(16, 2048, dtype=torch.bfloat16)
        prog = compile_module(Gemm(), (x,), options=dict(executor="reference", fuse_fp8_quant=fuse))
        yield f"FP8 GEMM {'fused' if fuse else 'unfused'}", prog.plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=132, help="as benchmarks/glm5_prelude.py --workers")
    ap.add_argument("--reduced", action="store_true", help="the CI configuration instead of GLM-5's sizes")
    ap.add_argument("--gpu-tests", action="store_true",
                    help="also the libraries of tests/gpu's model decode steps and FP8 GEMMs (gpu_test_programs)")
    args = ap.parse_args()
    cfg = glm.REDUCED if args.reduced else glm.FULL
    print(f"build cache: {cache_root()}")
    for fp8 in (False, True):
        name = "FP8" if fp8 else "bf16"
        t0 = time.time()
        mod = glm.make_prelude(cfg, fp8, torch.bfloat16, "cpu")
        inputs = glm.make_inputs(cfg, fp8, torch.bfloat16, "cpu")
        prog = compile_module(mod, inputs, options=dict(workers=args.workers, check=False,
                                                            executor="reference", tile_rows=4))
        lib = build(render(prog.plan), progress=lambda m: print(f"  {m}", flush=True))
        print(f"GLM-5 prelude {name}: {lib} ({time.time() - t0:.1f} s)", flush=True)
    if args.gpu_tests:
        from concurrent.futures import ThreadPoolExecutor

        programs = [(label, render(plan)) for label, plan in gpu_test_programs()]
        with ThreadPoolExecutor(2) as pool:  # nvcc is single-threaded
            for (label, _), lib in zip(programs, pool.map(lambda p: build(p[1]), programs)):
                print(f"{label}: {lib}", flush=True)


if __name__ == "__main__":
    main()
