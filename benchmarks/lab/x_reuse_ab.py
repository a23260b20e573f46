"""Staged-x reuse, A/B in one process (benchmarks/lab: an experiment, not part of run_gpu.sh).

Compiles the Llama-3.2-1B decode step (batch 1, context 1024, bf16, random weights) once and
times its CUDA-graph replay alternately with the plan's reuse flags (linear_fused param 4, set
by tilec/plan.py from OpDef.staged_x) and with them zeroed in the executor's queues, then checks
that the logits are bitwise equal either way.

    PYTHONPATH=. python benchmarks/lab/x_reuse_ab.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _llama_step import llama_step  # noqa: E402
from decode import time_cuda  # noqa: E402
from tilec.ops import opdef  # noqa: E402
from tilec.plan import F  # noqa: E402
from tilec.timing import cuda_graph  # noqa: E402


def main():
    step, run = llama_step("x_reuse_ab.py")
    ex = step.program.executor
    run()
    ex.check()
    flag = F["params"][0] + 4
    with_reuse = ex.queues.clone()
    linear_fused = with_reuse[..., F["opcode"][0]] == opdef("linear_fused").opcode  # param 4 is op-specific
    without = with_reuse.clone()
    without[..., flag][linear_fused] = 0
    print("reused tiles:", int((with_reuse[..., flag][linear_fused] != 0).sum()), flush=True)
    graph = cuda_graph(run)  # the launch reads ex.queues: copying into it switches the variant
    res = {"reuse": [], "no reuse": []}
    for _ in range(4):
        for name, q in (("reuse", with_reuse), ("no reuse", without)):
            ex.queues.copy_(q)
            res[name].append(round(time_cuda(graph.replay, 100), 4))
    ex.check()
    print("step ms (CUDA graph replay, 4 alternations):", res, flush=True)
    ex.queues.copy_(with_reuse)
    a = run().clone()
    ex.check()
    ex.queues.copy_(without)
    b = run().clone()
    ex.check()
    print("logits bitwise equal with and without reuse:", torch.equal(a, b))


if __name__ == "__main__":
    main()
