"""One tilec decode step of a 2-layer model (Llama-3.2-1B layer shapes) for compute-sanitizer:

    compute-sanitizer --tool memcheck  python tests/gpu/sanitize_step.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_step.py

No eager model step runs in this process (the KV cache is filled with random values
instead of a prefill), so every kernel the sanitizer sees is tilec's or a plain copy/fill.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tilec.timing import need_gpu  # noqa: E402

need_gpu(Path(__file__).name)
from transformers import StaticCache  # noqa: E402

from tilec.hf import compile_decode_step  # noqa: E402
from tilec.zoo import make_model  # noqa: E402

model = make_model("llama-3.2-1b", torch.bfloat16, "cuda", layers=2)
cfg = model.config
cache = StaticCache(config=cfg, max_cache_len=48)
kv = torch.zeros(1, cfg.num_key_value_heads, 1, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
for layer in cache.layers:
    layer.lazy_initialization(kv, kv)
    layer.keys.normal_()
    layer.values.normal_()
    if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
        layer.cumulative_length.fill_(32)
# 16-position splits: the attention is split-KV, and its tiles append the step's K / V rows
# (tilec.passes.fold_kv_append) - at position 32 the first row of split 2, at 40 one inside it -
# and the last tile of each KV head to finish combines the splits (tilec.passes.fold_combine)
step = compile_decode_step(model, cache, 1, options=dict(watchdog_ms=600_000, attn_kv_chunk=16))
assert any(op.attr("append") and op.attr("combine") for op in step.program.plan.graph.ops)
tok = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
logits = step(tok, 32)
step.seek(40)
logits = step(tok, 40)
torch.cuda.synchronize()
print("sanitize step ok", tuple(logits.shape), float(logits.float().abs().mean()))
