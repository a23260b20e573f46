"""Runs a few steps of one compiled program for a profiler (``ncu``, ``nsys``) to catch:
the GLM-5 DSA prelude (``glm5-fp8`` / ``glm5-bf16``: full size, ``tile_rows`` 4 and ``ring_stages`` 2 as
``benchmarks/glm5_prelude.py``) or the Llama-3.2-1B decode step (``llama-1b``: batch 1, context
1024, as ``benchmarks/lab/variants_ab.py``; ``--batch`` another batch). Prints the library's build-cache entry (its ``program.cu`` is what
``benchmarks/lab/ncu_by_function.py --sources`` rebuilds as a cubin).

    ncu --section SourceCounters --section WarpStateStats -k regex:tilec_executor --launch-skip 2 -c 1 \\
        -o step -f python3 benchmarks/lab/one_step.py glm5-fp8
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import glm5_dsa_prelude as glm  # noqa: E402
from tilec.api import compile_module  # noqa: E402
from tilec.timing import need_gpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("program", choices=["glm5-fp8", "glm5-bf16", "llama-1b"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="llama-1b: sequences per step")
    args = ap.parse_args()
    need_gpu("one_step.py")
    if args.program == "llama-1b":
        from _llama_step import llama_step

        step, run = llama_step("one_step.py", batch=args.batch)
        for _ in range(args.steps):
            run()
        torch.cuda.synchronize()
        step.program.executor.check()
        print("build-cache entry", Path(step.program.executor.lib_path).parent)
        return
    fp8 = args.program == "glm5-fp8"
    mod = glm.make_prelude(glm.FULL, fp8, torch.bfloat16, "cuda")
    inputs = glm.make_inputs(glm.FULL, fp8, torch.bfloat16, "cuda")
    prog = compile_module(mod, inputs, options=dict(workers=132, tile_rows=4, ring_stages=2, check=False))
    tensors, p = prog.bind_args(inputs)
    table = prog.plan.bind(tensors, p)
    for _ in range(args.steps):
        prog.executor.run(tensors, table)
    torch.cuda.synchronize()
    prog.executor.check()
    print("build-cache entry", Path(prog.executor.lib_path).parent)


if __name__ == "__main__":
    main()
