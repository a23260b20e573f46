"""One tilec decode step of a 2-layer model (Llama-3.2-1B layer shapes) for compute-sanitizer:

    compute-sanitizer --tool memcheck  python tests/gpu/sanitize_step.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_step.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.zoo import make_model, prefill  # noqa: E402

model = make_model("llama-3.2-1b", torch.bfloat16, "cuda", layers=2)
cache, tok = prefill(model, 1, 32, 48, "cuda")
step = compile_decode_step(model, cache, 1)
logits = step(tok, 32)
torch.cuda.synchronize()
print("sanitize step ok", tuple(logits.shape), float(logits.float().abs().mean()))
