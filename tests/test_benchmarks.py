"""CPU runs of the benchmark scripts' own logic (their timings need a GPU)."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import generate as generate_bench  # noqa: E402


def test_generate_benchmark_runs_on_the_cpu(capsys):
    """A smoke run of benchmarks/generate.py: both rows timed, tilec's tokens equal to eager's
    (float32, reference executor), the table printed."""
    rows = generate_bench.main(["--model", "llama-tiny", "--device", "cpu", "--context", "8", "--new-tokens", "3",
                                "--iters", "1"])
    assert [r[0] for r in rows] == ["eager", "tilec"] and all(math.isfinite(r[1]) and r[2] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "ms / token" in out and "tokens equal to eager's" in out
    assert [line.split()[-1] for line in out.splitlines()[-4:-2]] == ["100.0%", "100.0%"], out
    assert "one or two runs of each length are noise" in out and "not a speed" in out


def test_first_difference_names_the_step_and_eager_logit_gap():
    want = torch.tensor([[5, 6, 7], [5, 6, 7]])
    logits = [torch.zeros(2, 10) for _ in range(3)]
    logits[1][1, 6], logits[1][1, 2] = 3.0, 2.75
    assert generate_bench.first_difference(want, want.clone(), logits) is None
    got = torch.tensor([[5, 6, 1], [5, 2, 9]])
    assert generate_bench.first_difference(want, got, logits) == (1, 0.25)


@pytest.mark.parametrize("argv,message", [
    (["--new-tokens", "1"], "needs at least 2"),
    (["--pad", "8", "--context", "8"], "expected 0 <= pad < --context"),
    (["--iters", "0"], "expected an integer >= 1, got '0'"),
    (["--model", "llama-tiny", "--context", "9000"], "exceeds llama-tiny's max_position_embeddings"),
])
def test_generate_benchmark_names_a_bad_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        generate_bench.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err
