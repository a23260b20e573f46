"""Compile-option variants of one decode step, A/B in one process (benchmarks/lab: an experiment).

Compiles the Llama-3.2-1B decode step (or ``--model``'s; batch 1 or ``--batch``, bf16, random weights) once per variant, over
the same model and KV cache, then prints each variant's logits difference from the first and
the median CUDA-graph replay time per round (variants alternate, so drifts of the GPU's clocks
hit all of them alike).

    PYTHONPATH=. python benchmarks/lab/options_ab.py 'groups={}' 'no groups={"gemv_groups": false}'
    PYTHONPATH=. python benchmarks/lab/options_ab.py 'base={}' 'c128={"attn_kv_chunk": 128}' --trace /tmp/traces

A variant is NAME=JSON (tilec compile options, as ``decode.py --options`` takes them; under a
"costs" key, ``tilec.cost.MEASURED`` figures to plan with instead, e.g.
'refit={"costs": {"linear_fused": [3.42, 31.8e3]}}', null for the roofline).
"""
import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _llama_step import alternating_rounds, json_options, llama_model, step_runner  # noqa: E402
from tilec import cost  # noqa: E402
from tilec.cuda import CudaExecutor  # noqa: E402
from tilec.hf import compile_decode_step  # noqa: E402
from tilec.timing import cuda_graph  # noqa: E402
from tilec.trace import measured_trace, write_trace  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description="Compile-option variants of one decode step, timed in one process.")
    ap.add_argument("variants", nargs="+", metavar="NAME=JSON",
                    help='a variant: a new name and a JSON object of tilec options, e.g. \'c128={"attn_kv_chunk": 128}\' '
                         '(a "costs" key: tilec.cost.MEASURED figures to plan with)')
    ap.add_argument("--model", default="llama-3.2-1b", help="a tilec.zoo Llama-family model (default: llama-3.2-1b)")
    ap.add_argument("--context", type=int, default=1024, help="positions in the KV cache before the step (default 1024)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, the variants alternating (default 5)")
    ap.add_argument("--iters", type=int, default=50, help="CUDA-graph replays timed per round (default 50)")
    ap.add_argument("--trace", type=Path, metavar="DIR",
                    help="also write each variant's measured trace (one profiled run) to DIR/trace_NAME.json")
    args = ap.parse_args()
    variants = {}
    for v in args.variants:
        name, _, text = v.partition("=")
        if not name or name in variants:
            ap.error(f"variant {v!r}: needs a name, and one no other variant has")
        try:  # checked before the GPU check and the model's load
            variants[name] = json_options(text or "{}", extra=("costs",))
        except argparse.ArgumentTypeError as e:
            ap.error(f"variant {v!r}: {e}")
    model, cache, tok = llama_model("options_ab.py", args.context, args.model, args.batch)
    steps, graphs, ref = {}, {}, None
    for name, opts in variants.items():
        opts = dict(opts)
        with cost.measured_overrides(opts.pop("costs", {})):
            step = compile_decode_step(model, cache, args.batch, options=dict(opts, check=False))
        run = step_runner(step, tok, args.context)
        out = run().float()
        step.program.executor.check()
        ref = out if ref is None else ref
        print(f"{name:14s} logits max|diff| vs {next(iter(variants))}: {float((out - ref).abs().max()):.3e}; "
              f"tasks {step.program.plan.stats['tasks']}, queue length max {step.program.plan.stats['queue_len_max']}",
              flush=True)
        if args.trace:  # one run with the per-instruction stamps, on the same library
            ex = step.program.executor
            prof = CudaExecutor(ex.plan, dataclasses.replace(ex.opts, profile=True), ex.device, lib_path=ex.lib_path)
            step.program.executor = prof
            run()
            prof.check()
            args.trace.mkdir(parents=True, exist_ok=True)
            write_trace(args.trace / f"trace_{name}.json",
                        measured_trace(ex.plan, prof.stamps.cpu(), step.program.compiled.stages["linearized"]))
            step.program.executor = ex
        steps[name], graphs[name] = step, cuda_graph(run)
    res, mhz = alternating_rounds(graphs, args.rounds, args.iters)
    print(f"median SM clock {mhz if mhz is not None else '-'} MHz over the rounds", flush=True)
    for step in steps.values():
        step.program.executor.check()
    print(f"\n{'variant':14s} {'median ms':>10s}  rounds")
    for name, ts in res.items():
        print(f"{name:14s} {statistics.median(ts):10.3f}  {[round(t, 3) for t in ts]}")


if __name__ == "__main__":
    main()
