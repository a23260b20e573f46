"""Event fusion drops triggers implied by other triggers (``drop_implied_triggers``).

A dropped dependency is only safe if the final task graph still orders every pair of tasks
the region-overlap analysis ordered. The CPU reference executor cannot show a missing
dependency (it may run tasks in a lucky order), so these tests check reachability directly:
every (producer, consumer) pair of the ``tasks`` stage is connected in the ``linearized``
graph, for whole decoders and the GLM-5 prelude.
"""
from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from _helpers import StageRecorder
from tilec.api import compile_module
from tilec.hf import compile_decode_step
from tilec.zoo import make_model, prefill


def assert_orders_preserved(before, after) -> None:
    """Every dependency of ``before`` (a TaskGraph) is a path in ``after`` (same task ids)."""
    preds_of: dict[int, set[int]] = {t.id: set() for t in after.tasks}
    for e in after.events:
        for s in e.succs:
            preds_of[s] |= set(e.preds)
    anc: dict[int, int] = {}
    for tid in after.order:  # a topological order
        bits = 0
        for p in preds_of[tid]:
            bits |= anc[p] | (1 << p)
        anc[tid] = bits
    missing = [(p, s) for e in before.events for s in e.succs for p in e.preds if not (anc[s] >> p) & 1]
    assert not missing, f"{len(missing)} dependencies lost, e.g. t{missing[0][0]} -> t{missing[0][1]}"


@pytest.mark.parametrize("name,layers", [("llama-tiny", None), ("qwen3-tiny", None), ("llama-3.2-1b", 2)])
def test_decoder_orders_preserved(name, layers):
    model = make_model(name, torch.bfloat16, "cpu", layers=layers)
    cache, _ = prefill(model, 1, 40, 48, "cpu")
    rec = StageRecorder()
    step = compile_decode_step(model, cache, 1, options=dict(executor="reference"), hook=rec)
    fused = rec.stages["fused"]
    assert fused.stats["implied_triggers_dropped"] > 0
    assert_orders_preserved(rec.stages["tasks"], rec.stages["linearized"])
    if name == "llama-3.2-1b":  # the residual stream no longer needs an empty task per GEMV tile
        assert step.program.stats["empty_tasks_added"] <= 8 * layers + 8


def test_glm5_prelude_orders_preserved():
    path = Path(__file__).resolve().parents[1] / "examples" / "glm5_dsa_prelude.py"
    spec = importlib.util.spec_from_file_location("glm5_dsa_prelude", path)
    glm = sys.modules.get("glm5_dsa_prelude") or importlib.util.module_from_spec(spec)
    if "glm5_dsa_prelude" not in sys.modules:
        sys.modules["glm5_dsa_prelude"] = glm
        spec.loader.exec_module(glm)
    module = glm.make_prelude(glm.REDUCED, True, torch.float32)
    inputs = glm.make_inputs(glm.REDUCED, True, torch.float32)
    rec = StageRecorder()
    prog = compile_module(module, inputs, options=dict(workers=24), hook=rec)
    assert_orders_preserved(rec.stages["tasks"], rec.stages["linearized"])
    want = glm.oracle(module, *copy.deepcopy(inputs))
    got = prog(*inputs)
    for g, w in zip(got, want):
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g))
        assert float((g[finite].double() - w[finite].double()).norm() / w[finite].double().norm()) < 1e-4
