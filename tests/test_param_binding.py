"""A compiled step binds the module's parameters: in-place updates of them (``load_state_dict``, ``mul_``) are
seen by later calls. A non-contiguous parameter (a weight stored transposed) is bound through a contiguous copy;
that copy once was taken when compiling only, so later in-place updates were silently ignored (a fresh user's
finding, fifty-fifth session: relative L2 0.5 against eager after ``weight.mul_(2)``)."""
from __future__ import annotations

import pytest
import torch

from _helpers import assert_close
from tilec.api import compile_module

OPTS = dict(workers=3, executor="reference")


def _linear(transposed: bool) -> torch.nn.Linear:
    m = torch.nn.Linear(16, 8, bias=False).eval()
    if transposed:  # the same shape, stored column-major (a weight loaded as the transpose of another)
        m.weight = torch.nn.Parameter(torch.randn(16, 8).t())
    return m


@pytest.mark.parametrize("transposed", [False, True])
def test_in_place_parameter_updates_are_seen(transposed):
    torch.manual_seed(0)
    m = _linear(transposed)
    assert m.weight.is_contiguous() is not transposed
    x = torch.randn(2, 16)
    prog = compile_module(m, (x,), options=OPTS)
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)
        m.weight.mul_(2)
        assert_close(prog(x), m(x), 1e-6)
    m.load_state_dict({"weight": torch.randn(8, 16)})  # copies into the parameter in place
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)


def test_a_non_contiguous_parameter_is_copied_only_after_it_changed():
    torch.manual_seed(1)
    m = _linear(True)
    x = torch.randn(2, 16)
    prog = compile_module(m, (x,), options=OPTS)
    name = next(n for n, b in prog.graph.buffers.items() if b.kind.name == "PARAM")
    bound = prog.tensors[name]  # the contiguous copy the step reads (a copy into it moves its version)
    assert not m.weight.is_contiguous() and bound.is_contiguous()
    before = bound._version
    prog(x)
    prog(x)
    assert bound._version == before  # unchanged parameter: no copy a call
    with torch.no_grad():
        m.weight.add_(1)
    prog(x)
    assert bound._version == before + 1  # one copy after the update
    assert prog.tensors[name] is bound  # into the same memory (the operand table holds its address)


def test_a_parameter_made_under_inference_mode_is_copied_every_call():
    torch.manual_seed(2)
    with torch.inference_mode():  # such tensors keep no version counter
        m = _linear(True)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        prog = compile_module(m, (x,), options=OPTS)
        m.weight.mul_(3)
        assert_close(prog(x), m(x), 1e-6)


def test_a_program_compiled_under_inference_mode_refreshes_its_copy_outside_it():
    """The contiguous copy was made in the compile's mode, so under inference mode it was an inference tensor,
    and the refresh after an update failed outside it ("Inplace update to inference tensor outside
    InferenceMode": a reviewer's case); it is a normal tensor now, as the program's other buffers are."""
    torch.manual_seed(3)
    with torch.inference_mode():
        m = _linear(True)
        x = torch.randn(2, 16)
        prog = compile_module(m, (x,), options=OPTS)
    with torch.inference_mode():
        m.weight.mul_(2)  # (an inference tensor: no version, so every call copies)
    for mode in (torch.no_grad, torch.enable_grad, torch.inference_mode):
        with mode():
            assert_close(prog(x), m(x).detach(), 1e-6)


def test_a_parameter_made_under_inference_mode_and_compiled_outside_it_is_copied_every_call():
    """The program records the parameter detached, and an inference tensor's detached alias reads a version 0
    that never moves, so an update under inference mode was never copied (a fresh user's finding: rel. L2 2/3)."""
    torch.manual_seed(4)
    with torch.inference_mode():  # (a loaded model's weights: no grad; export refuses grad-requiring ones here)
        m = torch.nn.Linear(16, 8, bias=False).eval()
        m.weight = torch.nn.Parameter(torch.randn(16, 8).t(), requires_grad=False)
    x = torch.randn(2, 16)
    prog = compile_module(m, (x,), options=OPTS)
    with torch.inference_mode():
        m.weight.mul_(3)
        assert_close(prog(x), m(x), 1e-6)
