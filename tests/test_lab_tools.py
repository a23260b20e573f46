"""CPU tests of the lab's tools (benchmarks/lab): the profile readers, and that its CUDA programs compile."""
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tilec.trace import hop_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "lab"))
from gap_table import gap_lines, self_signaled  # noqa: E402
from hot_loops import main as hot_loops_main, parse as hot_loops_parse  # noqa: E402
from layer_phases import main as layer_phases_main, phase_rows as layer_phase_rows  # noqa: E402
from ncu_by_function import line_table, source_lines  # noqa: E402

# An excerpt in the shape of `ncu --page source --csv --print-source cuda,sass`: per source file a
# "File Path" row, then each source line's row followed by its SASS instructions' rows ("..." rows
# elide instructions).
CUDA_SASS = '''"File Path","/work/main/runtime/tilec/ops.cuh"
"Function Name","tilec_executor(const int *, int)"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)"
"548","const uint4 a = *reinterpret_cast<const uint4*>(x);","-","-","5"
"","","0x7fb100c71010","      LDS.128 R8, [R15]","3"
"","","...","...","-"
"","","0x7fb100c71030","      FFMA R32, R32, R51, R53","2"
"690","for (int v = lane; v < len / 8; v += 32) {","-","-","0"
"File Path","/work/main/runtime/tilec/common.cuh"
"Function Name","tilec_executor(const int *, int)"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)"
"189","for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);","-","-","2"
"","","0x7fb100c71030","      FFMA R32, R32, R51, R53","2"
"File Path","/work/main/runtime/tilec/stream.cuh"
"Function Name","tilec_executor(const int *, int)"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)"
"44","while (!mbar_test(bar, parity)) {","-","-","1"
"","","0x7fb100c71000","      @P3   BRA 0x7fb100c70ca0","1"
'''


def test_source_lines_maps_each_instruction_to_every_line_ncu_lists_it_under(tmp_path):
    p = tmp_path / "lines.csv"
    p.write_text(CUDA_SASS)
    loc = source_lines(p, 0x7fb100c71000)
    assert loc == {0x10: ["ops.cuh:548"], 0x30: ["ops.cuh:548", "common.cuh:189"], 0x0: ["stream.cuh:44"]}
    # inclusive per line, hottest first: 0x30's 2 samples count for both of its lines
    hot = [(3, 0x10, "LDS", {"short_sb": 3}), (2, 0x30, "FFMA", {"wait": 2}), (1, 0x0, "BRA", {"long_sb": 1}),
           (4, 0x40, "?", {"barrier": 4})]
    assert line_table(hot, loc, 3) == [("ops.cuh:548", 5, {"short_sb": 3, "wait": 2}), ("?", 4, {"barrier": 4}),
                                       ("common.cuh:189", 2, {"wait": 2})]


LAB_CU = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "lab").glob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("src", LAB_CU, ids=[p.name for p in LAB_CU])
def test_lab_cuda_programs_compile(src, tmp_path):
    """The standalone labs include runtime/tilec/ptx.cuh: they must keep compiling as it changes (as
    run_gpu.sh lab builds them, for sm_90a; compile only - running them needs an H200)."""
    res = subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-c", str(src),
                          "-o", str(tmp_path / "lab.o")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_gap_table_splits_ties_like_hop_table():
    """An instruction whose event became ready exactly when its worker freed is event-bound in
    both tables (hand-made trace, makespan 100 us: event 0 signaled at 40; worker 1 frees at 40 and
    starts its GEMV at 41 - a tie; worker 2 frees at 45 and starts at 46 - worker-bound)."""
    def sl(w, j, ts, dur, cat, op, wait=-1, sig=-1):
        return {"ph": "X", "ts": ts, "dur": dur, "cat": cat,
                "args": {"worker": w, "instruction": j, "op": op, "wait_event": wait, "signal_event": sig}}
    trace = {"otherData": {"makespan_us": 100.0}, "traceEvents": [
        sl(0, 0, 0.0, 40.0, "linear", "p", sig=0),
        sl(1, 0, 0.0, 40.0, "linear", "q"), sl(1, 1, 41.0, 5.0, "linear_fused", "a", wait=0),
        sl(2, 0, 0.0, 45.0, "linear", "q"), sl(2, 1, 46.0, 5.0, "linear_fused", "a", wait=0)]}
    lines = {ln.split()[1]: ln.split() for ln in gap_lines(trace) if ln.split()[0] == "linear_fused"}
    assert lines["all"][2] == "n=" and lines["all"][3] == "2"
    assert lines["worker-bound"][3] == "1" and lines["worker-bound"][5] == "1.00"  # worker 2 only: gap 46 - 45
    rows = [r.split() for r in hop_table(trace).splitlines()[1:]]
    assert ["linear_fused", "event-bound", "1", "1.00", "1.00"] in rows
    assert ["linear_fused", "worker-bound", "1", "1.00", "1.00"] in rows


def test_gap_table_counts_an_event_completed_by_the_waiting_worker_as_self_signaled():
    """Event 0's last signals are worker 0's and worker 3's first instructions (both end at 40,
    after worker 1's at 30); each of them then waits for event 0: self-signaled, whatever the
    order of the trace's events. Worker 0's waiter starts at 42.5 (gap 2.5), worker 3's at 43.5
    after a skipped instruction index (gap 3.5). Worker 1's waiter is not self-signaled (its signal
    was not the last), nor is worker 2's (its previous instruction signals nothing: None)."""
    def sl(w, j, ts, dur, cat, op, wait=-1, sig=-1):
        return {"ph": "X", "ts": ts, "dur": dur, "cat": cat,
                "args": {"worker": w, "instruction": j, "op": op, "wait_event": wait, "signal_event": sig}}
    events = [
        sl(0, 0, 0.0, 40.0, "linear_fused", "p", sig=0), sl(0, 1, 42.5, 5.0, "linear_fused", "a", wait=0),
        sl(1, 0, 0.0, 30.0, "linear_fused", "p", sig=0), sl(1, 1, 41.0, 5.0, "linear_fused", "a", wait=0),
        sl(2, 0, 0.0, 45.0, "linear", "q", sig=None), sl(2, 1, 46.0, 5.0, "linear_fused", "a", wait=0),
        sl(3, 0, 10.0, 30.0, "linear_fused", "p", sig=0), sl(3, 2, 43.5, 5.0, "linear_fused", "a", wait=0)]
    for order in (events, events[::-1]):
        trace = {"otherData": {"makespan_us": 100.0}, "traceEvents": order}
        assert self_signaled(trace) == {(0, 1), (3, 2)}
        lines = {ln.split()[1]: ln.split() for ln in gap_lines(trace) if ln.split()[0] == "linear_fused"}
        assert lines["self-signaled"][3] == "2" and lines["self-signaled"][5] == "3.00"  # median of 2.5, 3.5
        assert lines["worker-bound"][3] == "1" and lines["worker-bound"][5] == "1.00"  # worker 2: 46 - 45


def test_gap_table_cli_reads_gzip_and_refuses_a_predicted_trace(tmp_path, monkeypatch, capsys):
    """gap_table.py reads a gzip-compressed measured trace (tilec.tracefile.read_trace) and exits 1 on a
    predicted one, naming that file, with the good file's table still printed."""
    import gzip
    import json

    from gap_table import main as gap_table_main

    tile = {"ph": "X", "ts": 10.0, "dur": 5.0, "cat": "linear_fused",
            "args": {"worker": 0, "instruction": 1, "op": "a", "wait_event": -1, "signal_event": -1}}
    first = dict(tile, ts=0.0, cat="linear", args=dict(tile["args"], instruction=0, op="p"))
    trace = {"otherData": {"clock": "measured", "makespan_us": 20.0}, "traceEvents": [first, tile]}
    good = tmp_path / "good.json.gz"
    good.write_bytes(gzip.compress(json.dumps(trace).encode()))
    predicted = tmp_path / "pred.json"
    predicted.write_text(json.dumps(dict(trace, otherData={"clock": "predicted by tilec.cost", "makespan_us": 20.0})))
    monkeypatch.setattr(sys, "argv", ["gap_table.py", str(good), str(predicted)])
    assert gap_table_main() == 1
    out, err = capsys.readouterr()
    assert out.startswith(f"{good}: makespan 20.0 us")
    assert err.strip() == (f"{predicted}: ValueError: not a measured trace (clock 'predicted by tilec.cost'): pass "
                           f"measured=False to read a predicted one")
    # a measured trace without the makespan it is written with: one line naming the file, no table
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(dict(trace, otherData={"clock": "measured"})))
    monkeypatch.setattr(sys, "argv", ["gap_table.py", str(bare)])
    assert gap_table_main() == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == f"{bare}: ValueError: no otherData.makespan_us (tilec.trace.measured_trace writes it)"


def test_layer_phases_names_and_times_the_layer_phases():
    """Hand-made trace of an embedding (no phase) and two layers on two workers: q / k / v (siblings
    overlapping in time), the attention, o_proj, gate / up and down (both on the MLP's source line),
    with tiles of unequal times; every column is checked on its own values."""
    def sl(w, ts, dur, op, src, mark1=None, mark2=None):
        args = {"worker": w, "op": op, "source": src}
        if mark1 is not None:
            args["mark1_us"] = mark1
        if mark2 is not None:
            args["mark2_us"] = mark2
        return {"ph": "X", "ts": ts, "dur": dur, "cat": "linear_fused", "args": args}
    mlp = "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
    ev = [sl(0, 0.0, 2.0, "emb", "inputs_embeds = self.embed_tokens(input_ids)")]
    for layer, t in enumerate((3.0, 53.0)):
        n = f"{layer}"
        ev += [sl(0, t, 5.0, "q" + n, "q = self.q_proj(h)", 1.0), sl(1, t + 1, 3.0, "k" + n, "k = self.k_proj(h)", 3.0),
               sl(0, t + 2, 2.0, "v" + n, "v = self.v_proj(h)", 1.0),
               sl(0, t + 7, 8.0, "attn" + n, "o, w = attention_interface(", 2.0),
               sl(1, t + 8, 10.0, "attn" + n, "o, w = attention_interface("),
               sl(0, t + 19, 4.0, "o" + n, "a = self.o_proj(a)"),
               sl(1, t + 21, 2.0, "o" + n, "a = self.o_proj(a)", 0.5),
               sl(0, t + 24, 10.0, "gate" + n, mlp), sl(1, t + 25, 12.0, "up" + n, mlp),
               sl(0, t + 38, 6.0, "down" + n, mlp, 2.0, 3.0 + layer), sl(1, t + 40 + layer, 4.0, "down" + n, mlp, None, 2.0)]
    rows = layer_phase_rows({"traceEvents": ev})
    assert list(rows) == ["qkv", "attn", "o", "gateup", "down"]
    assert all(r["n"] == 2 for r in rows.values())
    q, a, o, gu, d = (rows[k] for k in ("qkv", "attn", "o", "gateup", "down"))
    assert (q["span"], q["tile"], q["mark1"]) == (5.0, 3.0, 1.0)
    # layer 0's after the embedding (ends at 2), layer 1's after layer 0's down (ends at 47)
    assert (q["first"], q["last"], q["last_m1"]) == (3.5, 5.5, 6.5)
    assert (a["span"], a["tile"], a["mark1"], a["first"], a["last"]) == (11.0, 9.0, 2.0, 2.0, 3.0)
    assert math.isnan(a["last_m1"])  # the attention's last tile has no mark 1
    assert (o["tile"], o["first"], o["last"], o["last_m1"]) == (3.0, 1.0, 3.0, 3.5)
    assert (gu["span"], gu["tile"], gu["first"], gu["last"]) == (13.0, 11.0, 1.0, 2.0)
    assert (d["span"], d["tile"], d["first"], d["last"]) == (6.5, 5.0, 1.0, 3.5)  # down's last start: 40, 41
    assert d["mark2"] == 2.75 and math.isnan(q["mark2"])  # medians 2.5 and 3.0 over the two layers; q has none


def test_layer_phases_cli_refuses_what_it_cannot_read(tmp_path, monkeypatch, capsys):
    """Exit 1 with one line per bad file (not measured, no named phase, a corrupt gzip), the good
    file's table still printed; a gzip file is recognized by its bytes, not its name."""
    import gzip
    import json

    def write(name, trace, gz=True):
        path = tmp_path / name
        raw = json.dumps(trace).encode()
        path.write_bytes(gzip.compress(raw) if gz else raw)
        return str(path)
    tile = {"ph": "X", "ts": 0.0, "dur": 5.0, "args": {"worker": 0, "op": "q", "source": "q = self.q_proj(h)"}}
    good = write("good.json", {"otherData": {"clock": "measured"}, "traceEvents": [tile]})  # gzip under a .json name
    predicted = write("pred.json.gz", {"otherData": {"clock": "predicted by tilec.cost"}, "traceEvents": [tile]})
    other = dict(tile, args={"worker": 0, "op": "x", "source": "y = self.mlp(x)"})
    unnamed = write("none.json", {"otherData": {"clock": "measured"}, "traceEvents": [other]}, gz=False)
    corrupt = tmp_path / "bad.json.gz"
    corrupt.write_bytes(gzip.compress(b"{}" * 100)[:30])
    monkeypatch.setattr(sys, "argv", ["layer_phases.py", good, predicted, unnamed, str(corrupt)])
    assert layer_phases_main() == 1
    out, err = capsys.readouterr()
    assert "qkv" in out and "good.json: last instruction ends at 5.0 us" in out
    bad = err.strip().splitlines()
    assert len(bad) == 3
    assert "pred.json.gz" in bad[0] and "not a measured trace" in bad[0]
    assert "none.json" in bad[1] and "no named phases" in bad[1]
    assert "bad.json.gz" in bad[2]


BUILD_ONLY_CONFTEST = '''import pytest


def pytest_collection_modifyitems(config, items):  # as tests/gpu/conftest.py does without CUDA
    for item in items:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
'''
BUILD_ONLY_TEST = '''import torch

from tilec.api import compile_module

DEV = "cuda"


def test_linear():
    lin = torch.nn.Linear(64, 32).to(DEV)
    prog = compile_module(lin, (torch.randn(2, 64, device=DEV),), options=dict(executor="cuda"))
    raise AssertionError(f"not reached: the plugin stops the test at its build ({prog})")
'''


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_prebuild_builds_a_gpu_tests_library_without_a_gpu(tmp_path, monkeypatch):
    """benchmarks/prebuild.py --gpu-tests runs tests/gpu's tests on the CPU up to their CUDA executor (its
    BuildOnly plugin), although tests/gpu/conftest.py marks them skipped there, and builds the plans' libraries
    into the build cache; tilec.cuda.CudaExecutor, sys.path and sys.modules are as before afterwards."""
    import importlib.util

    import tilec.cuda

    monkeypatch.setenv("TILEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the nested session's and prebuild.py's additions go
    modules = dict(sys.modules)
    gpu = tmp_path / "tests" / "gpu"
    gpu.mkdir(parents=True)
    (gpu / "conftest.py").write_text(BUILD_ONLY_CONFTEST)
    (gpu / "test_build_only.py").write_text(BUILD_ONLY_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the checkout's pyproject.toml settings
    executor = tilec.cuda.CudaExecutor
    try:
        spec = importlib.util.spec_from_file_location("prebuild", Path(__file__).resolve().parents[1] /
                                                      "benchmarks" / "prebuild.py")
        prebuild = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(prebuild)
        plugin = prebuild.BuildOnly()
        code = pytest.main([str(gpu / "test_build_only.py"), "-q", "-p", "no:cacheprovider", "--rootdir",
                            str(tmp_path), "-c", str(tmp_path / "pytest.ini")], plugins=[plugin])
        assert code == 0  # the one test skipped at its build (not failed)
        (lib,) = prebuild.build_all(plugin.sources)
    finally:  # the nested session's test modules and conftest, and the prebuild's imports, go
        for name, mod in list(sys.modules.items()):
            if name in ("prebuild", "glm5_dsa_prelude") or str(tmp_path) in str(getattr(mod, "__file__", "")):
                if name in modules:
                    sys.modules[name] = modules[name]
                else:
                    del sys.modules[name]
    assert lib.name == "libtilec.so" and lib.is_file() and (tmp_path / "cache") in lib.parents
    assert tilec.cuda.CudaExecutor is executor


# An excerpt in the shape of `nvdisasm -g -c`: two functions, a loop in the second (a branch back to .L_x_2),
# a forward branch, and a back branch from a stub far after its target.
SASS = '''        .type           $_ZN5k14tilec_executorEv$_ZN5tilec12op_embeddingI13__nv_bfloat16EEvRNS_7TileCtxE,@function
$_ZN5k14tilec_executorEv$_ZN5tilec12op_embeddingI13__nv_bfloat16EEvRNS_7TileCtxE:
        /*0100*/                   IMAD.MOV.U32 R1, RZ, RZ, R2 ;
        /*0110*/                   RET.REL.NODEC R20 `(_ZN5k14tilec_executorEv) ;
        .type           $_ZN5k14tilec_executorEv$_ZN5tilec14stream_weightsEPKiRKNS_10WeightRingE,@function
$_ZN5k14tilec_executorEv$_ZN5tilec14stream_weightsEPKiRKNS_10WeightRingE:
        /*0120*/                   MOV R2, RZ ;
.L_x_2:
	//## File "/work/main/runtime/tilec/stream.cuh", line 158
        /*0130*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0140*/                   ISETP.GE.AND P0, PT, R2, 0x8, PT ;
        /*0150*/               @!P0 BRA `(.L_x_2) ;
        /*0160*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0170*/                   EXIT ;
        /*5000*/                   BRA `(.L_x_2) ;
'''


def test_hot_loops_finds_functions_and_the_loops_between_back_branches(tmp_path, capsys):
    functions, loops = hot_loops_parse(SASS)
    assert functions == [(0x100, "op_embedding"), (0x120, "stream_weights")]
    assert loops == [("stream_weights", 0x130, 0x150, "stream.cuh:158"), ("stream_weights", 0x130, 0x5000,
                                                                          "stream.cuh:158")]
    path = tmp_path / "p.sass"
    path.write_text(SASS)
    assert hot_loops_main(["--sass", str(path)]) == 0
    out = capsys.readouterr().out
    assert "0x120  stream_weights" in out
    assert re.search(r"stream_weights +0x130 \.\. +0x150 +48 B +48 +stream\.cuh:158", out)
    assert "0x5000" not in out  # longer than --max-bytes' 8192: a stub's jump back, not a loop
    (tmp_path / "empty.sass").write_text("nothing")
    assert hot_loops_main(["--sass", str(tmp_path / "empty.sass")]) == 1
    assert "no functions found" in capsys.readouterr().err


def test_call_host_cost_times_a_backend_call_without_its_run(capsys):
    from call_host_cost import main as call_host_cost_main

    rows = call_host_cost_main(["--model", "llama-tiny", "--layers", "2", "--iters", "3"])
    assert set(rows) == {"bind_args", "call, no run"} and all(v > 0 for v in rows.values())
    assert "llama-tiny, 2 layers, cpu:" in capsys.readouterr().out


def test_generate_host_times_the_decode_calls_on_the_cpu(capsys):
    """benchmarks/lab/generate_host.py (where generate()'s time per token goes under tilec): a CPU smoke run
    prints each timed part of a decode call, and leaves the patched tilec classes as they were."""
    import generate_host

    import tilec.backend
    import tilec.program

    call, bind = tilec.backend._Region.__call__, tilec.program.CompiledProgram._bind
    rows = generate_host.main(["--device", "cpu", "--model", "llama-tiny", "--context", "8", "--new-tokens", "3"])
    assert set(rows) == {"HF prepare_inputs", "compiled forward", "Dynamo + AOTAutograd", "tilec region",
                         "binding + host read", "mask guards"}, rows
    assert all(v > 0 for v in rows.values()) and rows["compiled forward"] >= rows["tilec region"]
    assert tilec.backend._Region.__call__ is call and tilec.program.CompiledProgram._bind is bind
    assert "medians over its 2 decode calls" in capsys.readouterr().out  # 3 new tokens: the prefill and 2


def test_generate_host_needs_a_decode_call():
    """``--new-tokens 1`` printed "medians over its 0 decode calls" and an empty table."""
    import generate_host

    with pytest.raises(SystemExit):
        generate_host.main(["--device", "cpu", "--model", "llama-tiny", "--new-tokens", "1"])


def test_gemv_fixed_fits_a_fixed_cost_and_a_rate():
    """benchmarks/lab/gemv_fixed.py splits a GEMV plan's time into a fixed cost a launch and MB / rate: its
    least-squares fit finds an exact line, and without a GPU the script exits with one line, before timing."""
    import gemv_fixed

    a, b = gemv_fixed.fit([33.6, 67.1, 134.2, 268.4], [12.0 + mb / 3.0 for mb in (33.6, 67.1, 134.2, 268.4)])
    assert a == pytest.approx(12.0) and 1 / b == pytest.approx(3.0)
    if not gemv_fixed.torch.cuda.is_available():
        with pytest.raises(SystemExit, match="gemv_fixed.py: needs a CUDA GPU"):
            gemv_fixed.main([])


def test_gemv_context_needs_a_gpu():
    """benchmarks/lab/gemv_context.py (decode.py's slow first GEMV row) exits with one line without a GPU,
    before it builds a model."""
    import gemv_context

    if not gemv_context.torch.cuda.is_available():
        with pytest.raises(SystemExit, match="gemv_context.py: needs a CUDA GPU"):
            gemv_context.main()


@pytest.mark.parametrize("options, why", [('{"check": true}', "decode.py sets check=False itself"),
                                           ('{"executor": "reference"}', "decode.py times the CUDA executor"),
                                           ('{"check": false, "executor": "cuda"}', None)])
def test_decode_refuses_options_it_would_override(options, why):
    """``decode.py --options`` took ``check`` and ``executor`` and then timed with its own (a fresh user's finding):
    other values than its own are refused with the argument errors, before anything needs a GPU."""
    import torch

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "decode.py"), "--options", options],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    if why is not None:
        assert run.returncode == 2 and why in run.stderr, run.stderr
    elif not torch.cuda.is_available():  # accepted: then it needs the GPU
        assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr + run.stdout, run.stderr


def test_gemv_fixed_stamp_summary_leaves_out_idle_workers():
    """A plan of 128 tiles on 132 workers left four workers' stamps zero, and the profiled line read a span of
    1796538065148347 us (from a zero start): the summary keeps only workers that ran an instruction."""
    import gemv_fixed
    import torch

    us = 1_000.0
    stamps = torch.tensor([[100 * us, 110 * us, 101 * us, 102 * us],
                           [101 * us, 113 * us, 103 * us, 104 * us],
                           [102 * us, 112 * us, 103 * us, 105 * us],
                           [0, 0, 0, 0]], dtype=torch.int64)
    line = gemv_fixed.stamp_summary(stamps)
    assert "stamped span 13.00" in line and "medians over 3 workers" in line
    assert "start 1.00 after the first" in line and "end 10.00 after it" in line and "last end 1.00 after" in line
    with pytest.raises(ValueError, match="no worker stamped"):
        gemv_fixed.stamp_summary(torch.zeros(4, 4, dtype=torch.int64))
