"""CPU tests of the lab's profile readers (benchmarks/lab)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "lab"))
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
