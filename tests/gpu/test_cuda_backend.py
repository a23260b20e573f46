"""torch.compile(backend="tilec") on the CUDA executor: HF generate() with a static cache.

The decode step's attention mask is a run-time argument that tilec checks per call
(tilec.guards): one sequence compiles the whole step; a left-padded batch's mask is not causal,
so its attention runs eagerly. float32 weights, so greedy tokens must equal eager's exactly (no bf16 ties).
"""
import logging

import pytest
import torch

from _helpers import greedy_generate
from tilec.zoo import make_model

DEV = "cuda"


@pytest.mark.parametrize("padded", [False, True])
def test_generate_matches_eager(padded, caplog):
    torch.manual_seed(0)
    model = make_model("llama-tiny", torch.float32, DEV, layers=2)
    ids = torch.randint(3, 1000, (2 if padded else 1, 6), device=DEV)
    kw = {"input_ids": ids}
    if padded:
        kw["attention_mask"] = torch.ones_like(ids)
        kw["attention_mask"][1, :2] = 0
    with torch.no_grad():
        want = greedy_generate(model, False, 8, **kw)
        with caplog.at_level(logging.INFO, logger="tilec"):
            got = greedy_generate(model, True, 8, **kw)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    # padded: the first decode call's mask is not causal, so its attention stays eager (logged);
    # else every decode call passes the mask check and runs compiled (the prefill graph logs its own)
    lines = [r.getMessage() for r in caplog.records if r.name == "tilec"]
    assert bool([line for line in lines if "not the causal mask" in line or "run-time inputs" in line]) == padded, lines
