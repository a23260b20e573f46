"""The GLM-5 prelude (examples/glm5_dsa_prelude.py, reduced configuration, bf16 and FP8) run once
on the CUDA executor, for compute-sanitizer (it exercises the ops of runtime/tilec/ops_glm.cuh):

    compute-sanitizer --tool memcheck  python tests/gpu/sanitize_glm.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_glm.py
"""
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tilec.timing import need_gpu  # noqa: E402

need_gpu(Path(__file__).name)
from tilec.api import compile_module  # noqa: E402

spec = importlib.util.spec_from_file_location("glm5_dsa_prelude", ROOT / "examples" / "glm5_dsa_prelude.py")
glm = importlib.util.module_from_spec(spec)
sys.modules["glm5_dsa_prelude"] = glm
spec.loader.exec_module(glm)

for fp8 in (False, True):
    mod = glm.make_prelude(glm.REDUCED, fp8, torch.bfloat16, device="cuda")
    inputs = glm.make_inputs(glm.REDUCED, fp8, torch.bfloat16, device="cuda")
    prog = compile_module(mod, inputs, options=dict(executor="cuda", workers=16, watchdog_ms=600_000))
    out = prog(*inputs)
    torch.cuda.synchronize()
    print("sanitize glm ok", "fp8" if fp8 else "bf16", tuple(out[0].shape))
