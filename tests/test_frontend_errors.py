"""User-facing errors: unsupported ops name the FX node, aten target and the user's source line;
bad call arguments and bad options name what is wrong."""
from __future__ import annotations

import copy
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

from _helpers import assert_close
from tilec.api import compile_module
from tilec.errors import DataDependentError, InputError, PositionError, TilecError, UnsupportedNodeError
from tilec.hf import cache_kwargs
from tilec.options import Options

THIS_FILE = pathlib.Path(__file__).name


def line_of(marker: str) -> int:
    """Line number (1-based) of the line in this file holding ``marker`` in a comment."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    hits = [i + 1 for i, ln in enumerate(lines) if ln.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


class Cumsum(torch.nn.Module):
    def forward(self, x):
        y = x * 2.0
        return torch.cumsum(y, dim=-1)  # MARK-cumsum


class Sort(torch.nn.Module):
    def forward(self, x):
        values, _ = torch.sort(x * 2.0, dim=-1)  # MARK-sort
        return values + 1.0


class LibraryModule(torch.nn.Module):
    """The unsupported op sits in torch's own nn.Module code; the user's line calls it."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, 8)

    def forward(self, x):
        return self.norm(x)  # MARK-groupnorm


class Fft(torch.nn.Module):
    """An op whose value has a dtype tilec has no storage for (complex64)."""

    def forward(self, x):
        return torch.fft.fft(x).real  # MARK-fft


class Noise(torch.nn.Module):
    """Random values drawn inside forward from no input (folded once, every call would reuse them)."""

    def forward(self, x):
        return x + torch.randn(2, 8)  # MARK-randn


class NoiseAtPosition(torch.nn.Module):
    """Random values scaled by the decode position (tabulated per position, they would repeat)."""

    def forward(self, x, pos):
        return x + torch.empty(2, 8).normal_() * pos.float()  # MARK-normal


@pytest.mark.parametrize("module, args, kwargs, node, marker", [
    (Noise(), (torch.randn(2, 8),), {}, r"randn \(aten\.randn\.default\)", "MARK-randn"),
    (NoiseAtPosition(), (torch.randn(2, 8), torch.tensor([1])), dict(positions=[1], max_positions=4),
     r"normal\w* \(aten\.normal\w*\.default\)", "MARK-normal"),  # (functionalized: normal_functional)
], ids=["constant", "positional"])
def test_random_op_is_refused_not_frozen(module, args, kwargs, node, marker):
    """A random op is never evaluated at compile time: its values would repeat on every call (a fresh
    user's finding: the compiled module returned the same "random" noise each time)."""
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(module, args, **kwargs)
    msg = str(info.value)
    assert re.search(node, msg), msg
    assert re.search(rf'{re.escape(THIS_FILE)}", line {line_of(marker)}, in forward', msg), msg


def test_a_random_op_in_a_run_time_mask_is_refused():
    """A mask the step cannot check per call from its arguments (a random op in it) is not guarded
    (a reviewer's finding: the guard re-drew torch.rand from the global generator on every call)."""
    length = 8

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k", torch.randn(1, 2, length, 4))
            self.register_buffer("v", torch.randn(1, 2, length, 4))

        def forward(self, q, pos):
            mask = (torch.arange(length) <= pos) & (torch.rand(length) >= 0)  # MARK-randmask
            return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask.view(1, 1, 1, length))

    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(M(), (torch.randn(1, 2, 1, 4), torch.tensor([3])), positions=[1], max_positions=length)
    msg = str(info.value)
    assert re.search(r"rand \(aten\.rand\.default\)", msg), msg
    assert re.search(rf'{re.escape(THIS_FILE)}", line {line_of("MARK-randmask")}, in forward', msg), msg


@pytest.mark.parametrize("module, node, target, marker, code", [
    (Cumsum(), "cumsum", "aten.cumsum.default", "MARK-cumsum", "return torch.cumsum(y, dim=-1)"),
    (Fft(), "fft_fft", "aten.fft_fft.default", "MARK-fft", "return torch.fft.fft(x).real"),
    (Sort(), "sort", "aten.sort.default", "MARK-sort", "values, _ = torch.sort(x * 2.0, dim=-1)"),
    (LibraryModule(), "group_norm", "aten.group_norm.default", "MARK-groupnorm", "return self.norm(x)"),
], ids=["cumsum", "complex-dtype", "sort", "nn.GroupNorm"])
def test_unsupported_op_names_node_target_and_source_line(module, node, target, marker, code):
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(module, (torch.randn(2, 8),))
    err = info.value
    msg = str(err)
    line = line_of(marker)
    assert f"{node} ({target})" in msg, msg
    assert re.search(rf'{re.escape(THIS_FILE)}", line {line}, in forward', msg), msg
    assert code in msg, msg
    # the complex value's consumer (.real: view_as_real) cannot run either: listed after it
    assert [n[0] for n in err.nodes] == [node] + (["view_as_real"] if node == "fft_fft" else [])
    name, tgt, src = err.nodes[0]
    assert (name, tgt) == (node, target)
    assert code in src and f"line {line}" in src
    assert isinstance(err, TilecError)
    # every unsupported node says why (a fresh user's finding: cumsum was listed without a reason)
    why = {"cumsum": "a scan along a dim", "sort": "a data-dependent choice"}.get(node, "no tilec op computes it")
    assert (err.why[0] or err.reason).startswith(why) and why in msg, msg


class CumsumInHelper(torch.nn.Module):
    """The unsupported op sits in a method forward calls, and a Sort in a function beside the class."""

    def forward(self, x):
        return self._scan(x * 2.0) + 1.0  # MARK-helper-call

    def _scan(self, y):
        return torch.cumsum(y, dim=-1) + sort_values(y)  # MARK-helper-cumsum


def sort_values(y):
    return torch.sort(y, dim=-1)[0]  # MARK-helper-sort


def test_an_op_in_a_helper_names_the_helpers_line():
    """An unsupported op in a helper forward calls (a method, a function beside the module's class) is named by the
    helper's line, where it is, not by forward's line calling the helper: torch.export records only frames named
    forward in a node's stack trace unless told otherwise."""
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(CumsumInHelper(), (torch.randn(2, 8),))
    msg = str(info.value)
    (_, _, cumsum), (_, _, sort) = [n for n in info.value.nodes if n[0] in ("cumsum", "sort")]
    assert f'{THIS_FILE}", line {line_of("MARK-helper-cumsum")}, in _scan: return torch.cumsum(y' in cumsum, msg
    assert f'{THIS_FILE}", line {line_of("MARK-helper-sort")}, in sort_values: return torch.sort(y' in sort, msg
    assert f"line {line_of('MARK-helper-call')}" not in msg, msg


class UsersSequential(torch.nn.Sequential):
    """A user's Sequential: its forward is torch's."""


def _compile_users_sequential():
    return compile_module(UsersSequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.AvgPool1d(2)),
                          (torch.randn(1, 4, 8),))  # MARK-sequential-call


def test_a_function_beside_the_users_class_that_forward_does_not_call_is_not_named():
    """Every function in the file of a user's class was taken as a helper: with a forward of torch's, the op was
    named by the line of the function calling compile_module (a reviewer's finding). Only the functions the class's
    methods name (in turn) are helpers; torch's line is named, as for torch's own Sequential."""
    with pytest.raises(UnsupportedNodeError) as info:
        _compile_users_sequential()
    src = info.value.nodes[0][2]
    assert "pooling.py" in src and f"line {line_of('MARK-sequential-call')}" not in src, src


def test_helper_frames_of_exports_at_once_stay_registered_until_the_last_ends():
    """The helper registrations are process-wide: an export ending removed those another export of the same class,
    still running, needed (a reviewer's finding). They are counted; torch's own entries are never removed."""
    import torch.fx.proxy as proxy

    from tilec.capture import _helper_frames_recorded, _user_functions

    anchors = getattr(proxy, "_STACK_TRACE_ANCHORS", None)
    if not isinstance(anchors, set):
        pytest.skip("this torch keeps no registry of stack-trace anchors")
    mine = _user_functions(CumsumInHelper())
    assert mine and not mine & anchors
    first, second = _helper_frames_recorded(CumsumInHelper()), _helper_frames_recorded(CumsumInHelper())
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert mine <= anchors
    second.__exit__(None, None, None)
    assert not mine & anchors


class FixedWriteAndCumsum(torch.nn.Module):
    """Two unsupported nodes, one of them an in-place write into an input that is not a planned cache
    write: the report lists both (the write's error once masked the other)."""

    def forward(self, k, cache):
        cache[:, :, 3] = k[:, :, 0]
        return torch.cumsum(k, dim=-1)


def test_refused_node_in_torchs_own_modules_names_the_module():
    """A compiled torch.nn.Linear (or a Sequential of torch's modules) records only torch's frames: its refused
    node's line is torch's linear.py (a fresh user's case), so the module that ran it follows, by its path."""
    with pytest.raises(UnsupportedNodeError, match=r"group_norm \(aten\.group_norm\.default\) at "
                                                   r".*normalization\.py.*\(in the compiled module, a GroupNorm\)"):
        compile_module(torch.nn.GroupNorm(2, 8), (torch.randn(1, 8, 4),))
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.AvgPool1d(2))
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(seq, (torch.randn(1, 4, 8),))
    src = info.value.nodes[0][2]
    assert "pooling.py" in src and src.endswith("(in 2, an AvgPool1d)"), src  # (it said "a AvgPool1d")
    with pytest.raises(UnsupportedNodeError, match=r"linear \(aten\.linear\.default\) at .*linear\.py.*\(in the "
                                                   r"compiled module, a Linear\)") as info:
        compile_module(torch.nn.Linear(8, 4), (torch.randn(1, 8, dtype=torch.bfloat16),))
    assert "mixed dtypes" in str(info.value)
    # a line of the user's is left as it was (the backend groups the nodes it runs eagerly by it)
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(LibraryModule(), (torch.randn(2, 8),))
    assert info.value.nodes[0][2].endswith("# MARK-groupnorm"), info.value.nodes[0]


@pytest.mark.parametrize("path, want", [
    ("L['self'].model.layers[3].mlp", "model.layers.3.mlp"),  # Dynamo
    ("L['m']._modules['fc1']", "fc1"),
    ("G['model'].layers[0].mlp", "layers.0.mlp"),  # a global module under torch.compile of a function
    ("L__self___fc1", "fc1"),
    ("layers.0.mlp", "layers.0.mlp"),  # torch.export
    ("", ""),  # the compiled module
])
def test_module_of_gives_the_modules_own_path(path, want):
    from tilec.fxgraph import module_of

    node = torch.fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {"k0": ("", "pkg.Outer"), "k1": (path, "transformers.models.llama.LlamaMLP")}
    assert module_of(node) == (want, "LlamaMLP")
    node.meta["nn_module_stack"] = {}
    assert module_of(node) == ("", "")


def test_unsupported_in_place_write_is_listed_with_the_others():
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(FixedWriteAndCumsum(), (torch.randn(1, 2, 1, 8), torch.randn(1, 2, 16, 8)))
    names = [n for n, _, _ in info.value.nodes]
    assert "cumsum" in names and "select_scatter" in names and len(names) == len(set(names)), info.value.nodes


class TwoScans(torch.nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=-1) + torch.cumprod(x, dim=-1) + torch.atan2(x, x)


def test_each_unsupported_op_says_why():
    """A reviewer's finding: a reason was printed once for a run of nodes sharing it, so cumprod after cumsum
    looked reasonless. It is said again for another target (a run of one target's nodes still says it once)."""
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(TwoScans(), (torch.randn(2, 8),))
    msg = str(info.value)
    assert [n[0] for n in info.value.nodes] == ["cumsum", "cumprod", "atan2"], msg
    assert msg.count("why: a scan along a dim") == 2 and msg.count("why: no tilec op computes it") == 1, msg


class SoftmaxDim0(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=0)  # MARK-softmax0


def test_unsupported_variant_gives_the_reason():
    with pytest.raises(UnsupportedNodeError, match="softmax over a dim other than the last") as info:
        compile_module(SoftmaxDim0(), (torch.randn(3, 8),))
    assert f"line {line_of('MARK-softmax0')}" in str(info.value)


class Causal(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_prefill_attention_is_rejected_with_reason():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(UnsupportedNodeError, match="is_causal=True"):
        compile_module(Causal(), (q, q.clone(), q.clone()))


# ---- call arguments ----------------------------------------------------------------------

class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, hidden, gate):
        return self.proj(hidden) * gate


@pytest.fixture(scope="module")
def two_inputs():
    torch.manual_seed(0)
    m = TwoInputs().eval()
    args = (torch.randn(2, 8), torch.randn(2, 4))
    return m, args, compile_module(m, args, options=dict(workers=2))


def test_compiled_program_matches_eager(two_inputs):
    m, args, prog = two_inputs
    torch.testing.assert_close(prog(*args), m(*args).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, pattern", [
    ((torch.randn(3, 8), torch.randn(2, 4)),
     r"argument 0 \(hidden\): expected torch.float32\[2, 8\], got torch.float32\[3, 8\]"),
    ((torch.randn(2, 8), torch.randn(2, 5)),
     r"argument 1 \(gate\): expected torch.float32\[2, 4\], got torch.float32\[2, 5\]"),
    ((torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 4)),
     r"argument 0 \(hidden\): expected torch.float32\[2, 8\], got torch.float64\[2, 8\]"),
    ((torch.randn(2, 8), [[1.0] * 4] * 2), r"argument 1 \(gate\): expected torch.float32\[2, 4\], got list"),
    ((torch.randn(2, 8),), r"takes 2 arguments, got 1"),
], ids=["rows", "cols", "dtype", "not-a-tensor", "arity"])
def test_wrong_arguments_name_the_argument(two_inputs, bad, pattern):
    _, _, prog = two_inputs
    with pytest.raises(TilecError, match=pattern):
        prog(*bad)


def test_non_contiguous_read_only_argument_is_accepted(two_inputs):
    """A read-only input may be any layout (a contiguous copy is used); in-place state may not."""
    m, args, prog = two_inputs
    hidden = args[0].t().contiguous().t()
    assert not hidden.is_contiguous()
    torch.testing.assert_close(prog(hidden, args[1]), m(*args).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [8, 20000], ids=["staged", "bound"])
def test_sparse_and_mkldnn_arguments_are_refused_by_layout(width):
    """They failed inside tilec with torch's own RuntimeError ("copy_() between dense and sparse Tensors", "Cannot
    access data pointer of Tensor that doesn't have storage"), and a sparse example compiled into a program its own
    example could not call (a fresh user's finding)."""
    m = torch.nn.Linear(width, 4).eval()
    x = torch.randn(2, width)
    with pytest.raises(InputError, match=rf"argument 0 is a torch\.sparse_coo tensor \(torch\.float32\[2, {width}\]\): "
                                         r"a compiled step reads dense \(strided\) tensors only; pass it as a dense "
                                         r"tensor \(x\.to_dense\(\)\)"):
        compile_module(m, (x.to_sparse(),))
    prog = compile_module(m, (x,), options=dict(workers=2))
    for bad, layout in ((x.to_sparse(), "sparse_coo"), (x.to_mkldnn(), "_mkldnn")):
        with pytest.raises(TilecError, match=rf"argument 0 \(input\) is a torch\.{layout} tensor \(torch\.float32"
                                             rf"\[2, {width}\]\): a compiled step reads dense \(strided\) tensors"):
            prog(bad)
    torch.testing.assert_close(prog(x), m(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("width", [8, 20000], ids=["staged", "bound"])
def test_nested_arguments_are_refused_by_name(width):
    """A strided nested tensor raised torch's "Internal error: NestedTensorImpl doesn't support sizes. Please file an
    issue." from inside tilec's shape check, when compiling and at a call; a jagged one was refused by its shape."""
    m = torch.nn.Linear(width, 4).eval()
    x = torch.randn(2, width)
    prog = compile_module(m, (x,), options=dict(workers=2))
    for layout in (torch.strided, torch.jagged):
        nt = torch.nested.nested_tensor([torch.randn(width), torch.randn(width)], layout=layout)
        why = (rf"is a nested tensor \(torch\.float32, {layout} layout\): a compiled step reads dense tensors of the "
               r"example's shape only; pass it padded to that shape \(x\.to_padded_tensor\(0\.0\)\)")
        with pytest.raises(InputError, match="argument 0 " + why):
            compile_module(m, (nt,))
        if layout is torch.strided:  # (a jagged one has a shape: refused by it at a call)
            with pytest.raises(TilecError, match=r"argument 0 \(input\) " + why):
                prog(nt)
    torch.testing.assert_close(prog(x), m(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_nested_position_tensor_is_refused_by_name():
    """It passed the position read's fast check (integer, strided layout, one element) and raised torch's
    "NestedTensorImpl doesn't support sizes" at the shape check (a reviewer's finding)."""
    m, x = TwoCounters(), torch.randn(1, 8)
    prog = compile_module(m, (x, torch.tensor([3]), torch.tensor([3]), torch.tensor([3])), positions=[1, 2, 3],
                          max_positions=16)
    nt = torch.nested.nested_tensor([torch.tensor([4])])
    with pytest.raises(TilecError, match=r"argument 1 \(pos\) is a nested tensor \(torch\.int64, torch\.strided layout\)"):
        prog(x, nt, torch.tensor([4]), torch.tensor([4]))
    assert torch.equal(prog(x, torch.tensor([4]), torch.tensor([4]), torch.tensor([4])), x * 2 + 4)


def test_program_still_works_after_a_bad_call(two_inputs):
    m, args, prog = two_inputs
    with pytest.raises(TilecError):
        prog(torch.randn(5, 8), args[1])
    torch.testing.assert_close(prog(*args), m(*args).detach(), rtol=1e-5, atol=1e-6)


# ---- options -------------------------------------------------------------------------------

def test_unknown_option_lists_valid_keys():
    with pytest.raises(ValueError) as info:
        compile_module(TwoInputs(), (torch.randn(2, 8), torch.randn(2, 4)), options=dict(wokers=4, tile_n=8))
    msg = str(info.value)
    assert "wokers" in msg and "tile_n'" not in msg.split("valid")[0]
    for key in ("workers", "scheduler", "tile_n", "split_k", "tile_rows", "tile_cols", "verify"):
        assert f"'{key}'" in msg.split("valid")[1], msg


def test_option_errors_are_tilec_errors():
    """Bad options raised a bare ValueError where every other refusal is a TilecError (a fresh user's case);
    an OptionsError is both."""
    from tilec.errors import OptionsError
    from tilec.options import Options

    for bad in ({"workers": "four"}, {"wokers": 4}, ["workers", 4]):
        with pytest.raises(OptionsError) as info:
            Options.from_dict(bad)
        assert isinstance(info.value, TilecError) and isinstance(info.value, ValueError)
    # the constructor too (it raised Python's TypeError, naming no valid option: a fresh user's case)
    with pytest.raises(OptionsError, match=r"unknown tilec option\(s\) \['Workers'\] \(did you mean 'workers'"):
        Options(Workers=8)
    assert Options(workers=8).workers == 8 and Options().workers == 132
    with pytest.raises(OptionsError, match=r"keywords \(Options\(workers=8\)\), not positional values \(8,\)"):
        Options(8)


def test_a_non_bool_flag_option_is_a_clear_error():
    """A flag option given anything but a bool names the option, the value and both spellings
    (Python's True / False, the command line's true / false)."""
    from tilec.options import Options

    with pytest.raises(ValueError, match=r"tilec option fold_rope='yes': must be a bool \(True or False; true or false "
                                         r"on the command line\)"):
        Options(fold_rope="yes")


def test_unknown_option_through_the_hf_entry_point():
    transformers = pytest.importorskip("transformers")
    from tilec.hf import compile_decode_step

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, vocab_size=50, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=8)
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.int64), **cache_kwargs(model, cache), cache_position=torch.arange(2),
              use_cache=True)
    with pytest.raises(ValueError, match=r"unknown tilec option\(s\) \['schedular'\] \(did you mean 'scheduler' for 'schedular'\?\); valid options: \["):
        compile_decode_step(model, cache, options=dict(schedular="list"))


@pytest.mark.parametrize("bad, pattern", [
    (dict(workers=0), r"workers=0: must be in 1\.\.1024"),
    (dict(workers=2000), r"workers=2000"),
    (dict(scheduler="random"), r"scheduler='random': must be one of \('list', 'round_robin'\)"),
    (dict(tile_n=0), r"tile_n=0: must be >= 1"),
    (dict(split_k=0), r"split_k=0"),
    (dict(tile_cols=0), r"tile_cols=0"),
    (dict(ring_stages=1), r"ring_stages=1: must be 2\.\.8 or None"),
    (dict(ring_stages=9), r"ring_stages=9"),
])
def test_invalid_option_values(bad, pattern):
    with pytest.raises(ValueError, match=pattern):
        Options.from_dict(bad)


def test_options_digest_is_stable_and_distinguishes():
    assert Options().digest() == Options.from_dict({}).digest()
    assert Options(workers=8).digest() != Options(workers=9).digest()


def test_hf_step_rejects_a_position_that_skips_ahead():
    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model("llama-tiny")
    cache, tok = prefill(model, 1, 4, 12)
    step = compile_decode_step(model, cache, 1, options=dict(workers=4))
    with pytest.raises(ValueError, match="must be an int"):
        step(tok, 4.5)
    if any(isinstance(getattr(layer, "cumulative_length", None), torch.Tensor) for layer in cache.layers):
        with pytest.raises(ValueError, match="cache holds 4 tokens"):
            step(tok, 6)
    assert step(tok, 4).shape == (1, 1, 1000)


def test_decode_position_outside_the_plan_names_the_argument():
    class AddPos(torch.nn.Module):
        def forward(self, x, p):
            return x + p.to(x.dtype)

    prog = compile_module(AddPos(), (torch.randn(2, 4), torch.tensor([1])), positions=[1], max_positions=3)
    with pytest.raises(TilecError, match=r"argument 1 \(p\) holds decode position 7, outside the planned range \[0, 3\)"):
        prog(torch.randn(2, 4), torch.tensor([7]))


def test_hf_dynamic_cache_is_rejected_clearly():
    import transformers

    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model

    model = make_model("llama-tiny")
    with pytest.raises(ValueError, match="StaticCache; got DynamicCache"):
        compile_decode_step(model, transformers.DynamicCache(config=model.config), 1)


def test_hf_batch_size_must_match_the_cache():
    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model("llama-tiny")
    cache, _ = prefill(model, 2, 4, 12)
    with pytest.raises(ValueError, match="batch_size=1, but the StaticCache holds 2 sequences"):
        compile_decode_step(model, cache, 1)
    # True and 1.0 equal the cache's 1 and failed later inside torch.zeros; "1" read as "batch_size=1, but ... 1"
    cache, _ = prefill(model, 1, 4, 12)
    for bad in (True, 1.0, "1"):
        with pytest.raises(InputError, match=re.escape(f"batch_size must be an int, got {bad!r}")):
            compile_decode_step(model, cache, bad)


def test_state_read_before_in_place_write_sees_the_old_value():
    """A read of a state row placed after the in-place write in the functional graph must not
    see the new value (the frontend orders old-value readers before the write)."""

    class ReadThenWrite(torch.nn.Module):
        def forward(self, x, pos, st):
            y = st[:, 0:1] * 2 + st[:, 1:2]
            st.index_copy_(1, pos, x)
            return y

    torch.manual_seed(0)
    st, x = torch.randn(2, 4, 8), torch.randn(2, 1, 8)
    prog = compile_module(ReadThenWrite(), (x, torch.tensor([0]), st.clone()), positions=[1], max_positions=4)
    for p in (0, 1, 3):
        mine, ref = st.clone(), st.clone()
        want = ReadThenWrite()(x, torch.tensor([p]), ref)
        got = prog(x, torch.tensor([p]), mine)
        assert torch.equal(got, want), f"position {p}: read the updated state"
        assert torch.equal(mine, ref)


def test_negative_token_id_is_an_error_not_a_wrapped_row():
    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model("llama-tiny")
    cache, _ = prefill(model, 1, 4, 12)
    step = compile_decode_step(model, cache, 1, options=dict(workers=4))
    with pytest.raises(TilecError, match=r"; it reads input_ids\) failed: token id -1 outside the "
                                         r"embedding table \[0, "):  # names the argument (a fresh user's case)
        step(torch.full((1, 1), -1), 4)


class CastIds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, ids):
        return self.emb(ids.long()) * 2.0


def test_index_error_through_a_cast_names_the_argument():
    """The ids reach the embedding through a cast (a copy op): the error names the argument behind it (a fresh
    user's case: it named none)."""
    torch.manual_seed(0)
    m = CastIds()
    prog = compile_module(m, (torch.tensor([[3]], dtype=torch.int32),))
    ids = torch.tensor([[5]], dtype=torch.int32)
    assert torch.equal(prog(ids), m(ids))
    with pytest.raises(TilecError, match=r"; it reads a copy of argument 0 \(ids\)\) failed: token id 99 outside the "
                                         r"embedding table \[0, 16\)"):
        prog(torch.tensor([[99]], dtype=torch.int32))


def test_seek_checks_its_position_before_changing_anything():
    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model("llama-tiny")
    cache, _ = prefill(model, 1, 4, 12)
    step = compile_decode_step(model, cache, 1, options=dict(workers=4))
    before = [int(l.cumulative_length) for l in cache.layers if isinstance(getattr(l, "cumulative_length", None),
                                                                            torch.Tensor)]
    for bad in (8.0, True, "3", torch.tensor(4.0), torch.tensor([True]), torch.tensor([4, 5]),
                torch.tensor([5], device="meta")):  # (meta: no value; int() raised torch's RuntimeError)
        with pytest.raises(PositionError, match="position must be an int or an integer tensor of one element"):
            step.seek(bad)
    after = [int(l.cumulative_length) for l in cache.layers if isinstance(getattr(l, "cumulative_length", None),
                                                                           torch.Tensor)]
    assert before == after


def test_hf_empty_dynamic_cache_is_rejected_clearly():
    import transformers

    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model

    with pytest.raises(ValueError, match="StaticCache"):
        compile_decode_step(make_model("llama-tiny"), transformers.DynamicCache(), 1)


def test_a_branch_on_a_tensor_value_names_the_users_line(capfd):
    """torch.export fails on data-dependent control flow with a message about guards and symbols and
    prints its partial graph to stderr twice; tilec names the user's line and prints no graph."""

    class Branches(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # the line the error names
                return x * 2
            return x

    with pytest.raises(DataDependentError, match=r"depends on a tensor's value at .*test_frontend_errors\.py:\d+ "
                                         r"\(if x\.sum\(\) > 0:  # the line the error names\)"):
        compile_module(Branches(), (torch.randn(2, 4),), options=dict(executor="reference"))
    assert "def forward" not in capfd.readouterr().err


@pytest.mark.parametrize("call, pattern", [
    (lambda m, x: compile_module(lambda t: t * 2, (x,)), r"needs a torch\.nn\.Module, got a function"),
    (lambda m, x: compile_module(m, x), r"args must be a tuple of example arguments, got a Tensor \(wrap a single "
                                        r"tensor as \(x,\)\)"),
    (lambda m, x: compile_module(m, (x,), positions=1), r"positions=1 must be a list of argument indices"),
    (lambda m, x: compile_module(m, (x,), options={"fallback": False}),
     r"'fallback' is an option of torch\.compile\(backend=\"tilec\"\) only"),
    (lambda m, x: compile_module(m, (x,), options={"max_positions": 4}),
     r"'max_positions' is an argument of compile_module"),
])
def test_compile_module_call_mistakes_are_named(call, pattern):
    """Mistakes the CLI already caught, now through the Python API too (they were a raw TypeError or
    AttributeError, an unexplained unknown option, or - a bare tensor - iterated row by row)."""
    with pytest.raises(ValueError, match=pattern):
        call(torch.nn.Linear(4, 4), torch.randn(2, 4))


class NestedArgs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, extra):
        return self.lin(x) * extra["scale"] + extra["shift"] if isinstance(extra, dict) else self.lin(x) * sum(extra)


@pytest.mark.parametrize("extra, kind, n", [
    ({"scale": torch.randn(4), "shift": torch.randn(4)}, "dict", "of 2 values"),
    ([torch.randn(4), torch.randn(4)], "list", "of 2 values"),
    ((torch.randn(4),), "tuple", "of 1 value"),
], ids=["dict", "list", "tuple"])
def test_a_container_argument_is_refused_when_compiling(extra, kind, n):
    """A dict/list/tuple argument compiled (torch.export flattens it into graph inputs of their own) into a
    program that could not be called with it: "compiled step takes 3 arguments, got 2" (a fresh user's case)."""
    with pytest.raises(InputError, match=rf"argument 1 is a {kind} \({n}\): compile_module takes tensors, Python "
                                         rf"numbers or None as arguments, not containers; pass the tensors it holds "
                                         rf"as separate arguments"):
        compile_module(NestedArgs().eval(), (torch.randn(2, 4), extra))


class TwoCounters(torch.nn.Module):
    """Two position inputs advanced in place (HF caches' per-layer ``cumulative_length += 1``)."""

    def forward(self, x, pos, c1, c2):
        c1.add_(1)
        c2.add_(1)
        return x * 2 + pos


def test_position_arguments_as_ints_tensors_and_one_shared_counter():
    """The decode position may come as an int or a one-element tensor; each counter argument ends
    at position + 1, also when one tensor is passed for both (tilec tabulates each counter's new
    value from the position, so it writes position + 1 there; eager, adding 1 twice to the one
    tensor, would leave position + 2); arguments holding different positions are refused before
    anything runs."""
    torch.manual_seed(0)
    m, x = TwoCounters(), torch.randn(1, 8)
    prog = compile_module(m, (x, torch.tensor([3]), torch.tensor(3), torch.tensor(3)), positions=[1, 2, 3],
                          max_positions=16)
    a, b = torch.tensor(4), torch.tensor(4)
    assert torch.equal(prog(x, torch.tensor([4]), a, b), x * 2 + 4)
    assert int(a) == int(b) == 5
    shared = torch.tensor(6)
    assert torch.equal(prog(x, 6, shared, shared), x * 2 + 6)
    assert int(shared) == 7
    c1, c2 = torch.tensor(6), torch.tensor(7)
    with pytest.raises(TilecError, match=r"position arguments disagree \(argument 1 \(pos\) holds 6, argument 2 \(c1\) "
                                         r"holds 6, argument 3 \(c2\) holds 7\)"):
        prog(x, 6, c1, c2)
    assert int(c1) == 6 and int(c2) == 7


def test_position_arguments_of_other_dtypes_and_shapes_are_read_and_advanced():
    """A call reads its position tensors with one stack a group of equal example shape (promoting int32
    to int64), and writes the counters' new values from one table row when they share a dtype and from
    each one's table when they do not: every form gives the same values, and the first argument out of
    range in call order is named (a reviewer's case: groups [1], (), [1] named the third)."""
    torch.manual_seed(0)
    m, x = TwoCounters(), torch.randn(1, 8)
    for pos_dtype, c1_dtype, c1_shape in ((torch.int32, torch.int64, ()), (torch.int64, torch.int32, (1,)),
                                          (torch.int32, torch.int32, (1,))):
        c1 = torch.tensor(3, dtype=c1_dtype).reshape(c1_shape)
        prog = compile_module(m, (x, torch.tensor([3], dtype=pos_dtype), c1, torch.tensor([3])),
                              positions=[1, 2, 3], max_positions=16)
        a, b = torch.tensor(9, dtype=c1_dtype).reshape(c1_shape), torch.tensor([9])
        assert torch.equal(prog(x, torch.tensor([9], dtype=pos_dtype), a, b), x * 2 + 9)
        assert a.dtype == c1_dtype and int(a) == int(b) == 10
        with pytest.raises(TilecError, match=r"position arguments disagree \(argument 1 \(pos\) holds 5, argument 2 \(c1\) "
                                             r"holds 5, argument 3 \(c2\) holds 6\)"):
            prog(x, torch.tensor([5], dtype=pos_dtype), torch.tensor(5, dtype=c1_dtype).reshape(c1_shape),
                 torch.tensor([6]))
        with pytest.raises(TilecError, match=r"^argument 2 \(c1\) holds decode position 100, outside"):
            prog(x, torch.tensor([3], dtype=pos_dtype), torch.tensor(100, dtype=c1_dtype).reshape(c1_shape),
                 torch.tensor([200]))


def test_a_step_compiled_under_inference_mode_runs_outside_it():
    """Its own buffers (staged inputs, outputs, the executor's) were inference tensors when it was compiled
    under ``torch.inference_mode()``, so a call outside it raised "Inplace update to inference tensor outside
    InferenceMode" (a reviewer's case); now they are normal tensors, and calls in every mode agree."""
    torch.manual_seed(0)
    x = torch.randn(1, 8)
    with torch.inference_mode():
        prog = compile_module(TwoCounters(), (x, torch.tensor([3]), torch.tensor(3), torch.tensor(3)),
                              positions=[1, 2, 3], max_positions=16)
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            a, b = torch.tensor(4), torch.tensor(4)
            assert torch.equal(prog(x, torch.tensor([4]), a, b), x * 2 + 4), mode
            assert int(a) == int(b) == 5


def test_position_tensors_that_do_not_stack_are_read_one_by_one(monkeypatch):
    """When stacking a group of position tensors fails (devices that differ, dtypes such as uint32 that do
    not promote), the call reads them one by one, and so do later calls (not a failed stack each)."""
    torch.manual_seed(0)
    m, x = TwoCounters(), torch.randn(1, 8)
    prog = compile_module(m, (x, torch.tensor([3]), torch.tensor([3]), torch.tensor([3])), positions=[1, 2, 3],
                          max_positions=16)
    stacks = []

    def failing_stack(tensors, *a, **k):
        stacks.append(len(tensors))
        raise RuntimeError("cannot stack these")

    monkeypatch.setattr(torch, "stack", failing_stack)
    for p in (4, 5):
        a, b = torch.tensor([p]), torch.tensor([p])
        assert torch.equal(prog(x, torch.tensor([p]), a, b), x * 2 + p)
        assert int(a) == int(b) == p + 1
    assert stacks == [3]  # tried once
    with pytest.raises(TilecError, match=r"position arguments disagree \(argument 1 \(pos\) holds 5, argument 2 \(c1\) "
                                         r"holds 5, argument 3 \(c2\) holds 6\)"):
        prog(x, torch.tensor([5]), torch.tensor([5]), torch.tensor([6]))


class BufferCache(torch.nn.Module):
    """A cache kept as a module buffer and written in place (a fresh user's module)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 16, 8))

    def forward(self, x, pos):
        self.cache.index_copy_(1, pos, x)
        return self.cache[:, :4] * 2


def test_in_place_update_of_a_module_buffer_is_refused_at_compile_time():
    """Nothing would bind the buffer when the program runs ("no tensor bound" on every call), so
    the compile refuses it, naming the buffer as the module does (not the capture's ``b_cache``), the
    write's source line and what to do instead - torch.compile compiles it whole (its hint said torch.compile would
    run the write eagerly: a fresh user's note)."""
    with pytest.raises(UnsupportedNodeError, match=r"(?s)in-place update of buffer cache, kept in the module rather "
                                                   r"than passed to forward.*index_copy_\(1, pos, x\).*hint: Pass the "
                                                   r"cache to forward, or compile the module with torch.compile\(module, "
                                                   r"backend='tilec'\), which takes its buffers as the graph's inputs"):
        compile_module(BufferCache(), (torch.randn(2, 1, 8), torch.tensor([3])), positions=[1], max_positions=16)
    torch._dynamo.reset()
    m, ref = BufferCache(), BufferCache()
    f = torch.compile(m, backend="tilec", options={"workers": 2, "fallback": False, "max_positions": 16})
    for p in (3, 9):
        x = torch.randn(2, 1, 8)
        with torch.no_grad():
            assert torch.equal(f(x, torch.tensor([p])), ref(x, torch.tensor([p])))
    assert torch.equal(m.cache, ref.cache)


@pytest.mark.parametrize("pos,got", [(torch.tensor([7.6]), r"torch.float32\[1\]"), (torch.tensor([True]), r"torch.bool\[1\]"),
                                     (torch.tensor([5, 9]), r"torch.int64\[2\]"), (7.0, "float"), (True, "bool"),
                                     ([4], "list")])
def test_a_position_argument_must_be_one_integer(pos, got):
    """A float, a bool or several elements are refused (eager refuses them as indices too), before
    anything runs; ints, numpy ints and integer tensors of the example's shape (any integer dtype)
    are read; another shape is refused, as it can change eager's output shape."""
    import numpy as np

    torch.manual_seed(0)
    m, x = TwoCounters(), torch.randn(1, 8)
    prog = compile_module(m, (x, torch.tensor([3]), torch.tensor(3), torch.tensor(3)), positions=[1, 2, 3],
                          max_positions=16)
    c1, c2 = torch.tensor(4), torch.tensor(4)
    with pytest.raises(TilecError, match=rf"argument 1 \(pos\) holds the decode position: expected an int or an integer "
                                         rf"tensor of one element, got {got}$"):
        prog(x, pos, c1, c2)
    assert int(c1) == int(c2) == 4
    for ok in (np.int64(4), torch.tensor([4], dtype=torch.int32)):
        assert torch.equal(prog(x, ok, torch.tensor(4), torch.tensor(4)), x * 2 + 4)
    with pytest.raises(TilecError, match=r"argument 1 \(pos\): expected an integer tensor of shape \[1\]"):
        prog(x, torch.tensor([[4]]), torch.tensor(4), torch.tensor(4))


class PerRowPosition(torch.nn.Module):
    """Reads its position as HF's ``position_ids`` [batch, 1]: one value per sequence."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)

    def forward(self, x, pos_ids):
        return self.l(x) * (pos_ids.float() + 1)


def test_a_position_tensor_of_several_equal_elements_runs_as_compiled():
    """The compile accepts a position argument of several elements that all hold p; every call, its own
    example's included, once refused it ("expected ... an integer tensor of one element": a fresh user's
    finding). A call reads all its elements now, and refuses elements that differ or another shape."""
    torch.manual_seed(0)
    m, x = PerRowPosition().eval(), torch.randn(2, 8)
    example = torch.tensor([[3], [3]])
    prog = compile_module(m, (x, example), positions=[1], max_positions=16, options=dict(workers=3))
    with torch.no_grad():
        for pos in (example, torch.tensor([[9], [9]], dtype=torch.int32)):
            assert_close(prog(x, pos), m(x, pos), 1e-6)
    with pytest.raises(TilecError, match=r"argument 1 \(pos_ids\) holds \[5, 6\] \(torch.int64\[2, 1\]\), not one value"):
        prog(x, torch.tensor([[5], [6]]))
    with pytest.raises(TilecError, match=r"argument 1 \(pos_ids\): expected an integer tensor of shape \[2, 1\]"):
        prog(x, torch.tensor([5]))


def test_a_sparse_position_tensor_is_refused_by_layout_and_later_calls_stay_grouped():
    """A sparse position tensor passed the position read's first check, failed its stack - which turned the
    grouped read off for every later call - and then raised torch's RuntimeError (a reviewer's finding)."""
    torch.manual_seed(0)
    m, x = TwoCounters(), torch.randn(1, 8)
    prog = compile_module(m, (x, torch.tensor([3]), torch.tensor([3]), torch.tensor([3])), positions=[1, 2, 3],
                          max_positions=16)
    with pytest.raises(TilecError, match=r"argument 1 \(pos\) is a torch.sparse_coo tensor .*dense"):
        prog(x, torch.tensor([4]).to_sparse(), torch.tensor([4]), torch.tensor([4]))
    assert prog._position_groups is not None
    assert torch.equal(prog(x, torch.tensor([4]), torch.tensor([4]), torch.tensor([4])), x * 2 + 4)


def test_position_arguments_that_disagree_or_are_empty_are_refused_when_compiling():
    """Both were compiled, and then no call could run the example (a fresh user's finding)."""
    m, x = TwoCounters(), torch.randn(1, 8)
    with pytest.raises(InputError, match=r"positions: the decode position arguments disagree \(argument 1 holds 3, "
                                         r"argument 2 holds 3, argument 3 holds 4\)"):
        compile_module(m, (x, torch.tensor([3]), torch.tensor(3), torch.tensor(4)), positions=[1, 2, 3],
                       max_positions=16)
    with pytest.raises(InputError, match=r"positions: argument 1 \(int64\[0\]\) is empty"):
        compile_module(m, (x, torch.tensor([], dtype=torch.int64), torch.tensor(3), torch.tensor(3)),
                       positions=[1, 2, 3], max_positions=16)


def test_linear_of_mixed_dtypes_is_refused_like_eager():
    """Eager raises for a float16 input into float32 weights; tilec refused nothing and computed a
    float32 result (a fresh user's finding): now the compile names the node and the dtypes."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with pytest.raises(UnsupportedNodeError, match=r"linear of mixed dtypes \(input float16, weight float32, bias "
                                                   r"float32\): eager PyTorch requires one dtype"):
        compile_module(m, (torch.randn(2, 8, dtype=torch.float16),))
    with pytest.raises(InputError, match="eager PyTorch raises on this node too"):  # EagerFailsError: bad input
        compile_module(m, (torch.randn(2, 8, dtype=torch.float16),))


class _CumsumOfTokens(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, tok):
        return torch.cumsum(self.lin(tok), -1)  # cumsum: unsupported, and lowered first (from the output)


def test_a_node_eager_refuses_is_bad_input_whatever_else_is_unsupported():
    """It was bad input only when the lowering met it first; here the cumsum is met first, and the error was
    "cannot lower 2 FX node(s)" with the advice to run them eagerly (a reviewer's finding)."""
    with pytest.raises(InputError, match=r"cannot lower 1 FX node\(s\): linear of mixed dtypes \(input int64, weight "
                                         r"float32, bias float32\)(.|\n)*eager PyTorch raises on this node too") as info:
        compile_module(_CumsumOfTokens(), (torch.randint(0, 9, (2, 8)),))
    assert "aten.cumsum" not in str(info.value)


def test_keyword_arguments_are_refused_clearly():
    """A compiled step binds its arguments by position (a raw TypeError before: a re-check trial's finding)."""
    torch.manual_seed(0)
    m, x = TwoCounters(), torch.randn(1, 8)
    prog = compile_module(m, (x, torch.tensor([3]), torch.tensor(3), torch.tensor(3)), positions=[1, 2, 3],
                          max_positions=16)
    with pytest.raises(TilecError, match=r"takes its arguments by position, .*got keyword argument\(s\) pos, x$"):
        prog(x=x, pos=4)


def test_an_example_failing_inside_torch_names_no_tilec_frame():
    """nn.Linear refusing its example fails inside torch: no user line to name, and tilec's own
    frame (the eager re-run in tilec/capture.py) must not stand in for one (a re-check trial's finding)."""
    from tilec.errors import ExampleInputError

    with pytest.raises(ExampleInputError) as info:
        compile_module(torch.nn.Linear(4, 4), (torch.randn(1, 5),))
    msg = str(info.value)
    assert msg == ("the module fails on its example arguments [(1, 5) torch.float32]: RuntimeError: mat1 and mat2 "
                   "shapes cannot be multiplied (1x5 and 4x4)"), msg


def test_an_example_position_outside_max_positions_is_refused():
    """The step could never run at its own example (the CLI refused it already; compile_module
    did not: a re-check trial's finding)."""
    from tilec.errors import InputError

    m, x = TwoCounters(), torch.randn(1, 8)
    with pytest.raises(InputError, match=r"positions: argument 1 holds position 20, outside the planned range "
                                         r"\[0, 16\) of max_positions=16"):
        compile_module(m, (x, torch.tensor([20]), torch.tensor(20), torch.tensor(20)), positions=[1, 2, 3],
                       max_positions=16)


class ReturnsNone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(24, 8)

    def forward(self, x):
        return self.lin(x), None


def test_a_none_output_is_named_not_an_attribute_error():
    """``return y, None`` ended compile_module in AttributeError inside the capture."""
    with pytest.raises(InputError, match=r"output 1 of forward is None, not a tensor: a compiled step returns tensors"):
        compile_module(ReturnsNone().eval(), (torch.randn(2, 24),))


class ReturnsMore(torch.nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.lin = torch.nn.Linear(24, 8)
        self.extra = extra

    def forward(self, x):
        return self.extra(self.lin(x), x)


@pytest.mark.parametrize("extra, said", [
    (lambda y, x: (y, x.shape), r"forward's result\[1\]\[0\] is 2, not a tensor \(an element of a torch\.Size: a shape "
                                r"is fixed when compiling"),
    (lambda y, x: {"y": y, "rows": x.shape[0]}, r"forward's result\['rows'\] is 2, not a tensor"),
    (lambda y, x: [y, (y, 3)], r"forward's result\[1\]\[1\] is 3, not a tensor"),
    (lambda y, x: x.shape[0], r"forward returns 2, not a tensor"),
], ids=["shape", "dict", "nested", "alone"])
def test_a_non_tensor_output_is_named_where_forward_returns_it(extra, said):
    """``return y, x.shape`` was refused as "output 1 of forward is 2", the first element of the torch.Size (the
    outputs are the flattened structure): the value is now named where it sits in forward's result."""
    with pytest.raises(InputError, match=said + ".*: a compiled step returns tensors only"):
        compile_module(ReturnsMore(extra).eval(), (torch.randn(2, 24),))


class Scaled2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, s: float, n: int):
        return self.lin(x) * s + n


def test_python_values_are_baked_in_and_checked():
    """torch.export bakes Python scalar arguments into the graph; a call with other values returned
    the example values' result silently (a breaker trial's finding)."""
    torch.manual_seed(0)
    m = Scaled2().eval()
    x = torch.randn(2, 8)
    prog = compile_module(m, (x, 0.5, 3), options=dict(workers=4))
    with torch.no_grad():
        assert torch.allclose(prog(x, 0.5, 3), m(x, 0.5, 3), atol=1e-5)
    for s, n, bad in ((0.7, 3, "argument 1 (s) is 0.7"), (0.5, 5, "argument 2 (n) is 5"),
                      (torch.tensor(0.5), 3, "argument 1 (s) is a tensor (torch.float32[])"),
                      (0.5, torch.full((2, 8), 3), "argument 2 (n) is a tensor (torch.int64[2, 8])"),
                      (0.5, 3.0, "argument 2 (n) is 3.0")):
        with pytest.raises(TilecError, match=rf"{re.escape(bad)}.*the step was compiled for .*a Python value is baked"):
            prog(x, s, n)
    zero = compile_module(m, (x, 0.0, 3), options=dict(workers=4))  # -0.0 == 0.0 let -0.0 through (x / a: +inf
    with pytest.raises(TilecError, match=r"argument 1 \(s\) is -0\.0, but the step was compiled for 0\.0"):  # for -inf)
        zero(x, -0.0, 3)
    nan = compile_module(m, (x, float("nan"), 3), options=dict(workers=4))  # a NaN is the value it was compiled for
    with torch.no_grad():
        assert torch.isnan(nan(x, float("nan"), 3)).all()


class PositionTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(64, 8))

    def forward(self, x, p):
        return self.lin(x) + self.table[p]


def test_max_positions_past_a_position_indexed_table_is_bad_input():
    """Tabulating positions the module cannot index raised torch's IndexError from inside tilec."""
    args = (torch.randn(1, 8), torch.tensor([3]))
    with pytest.raises(InputError, match=r"fails at decode position 64: IndexError: .*max_positions=100 plans "
                                         r"positions the module cannot take - use max_positions <= 64"):
        compile_module(PositionTable(), args, positions=[1], max_positions=100)
    prog = compile_module(PositionTable(), args, positions=[1], max_positions=64)
    assert prog.graph.max_positions == 64


def test_an_unlisted_position_gets_a_hint():
    """A table indexed by a position argument not listed in positions said only "cannot lower"."""
    with pytest.raises(UnsupportedNodeError, match=re.escape("it reads argument 1 (p), a one-element integer input; if "
                                                             "that holds the decode position, mark it as one "
                                                             "(compile_module's positions=[1])")):
        compile_module(PositionTable(), (torch.randn(1, 8), torch.tensor([3])))


def test_a_base_model_is_refused_naming_the_causal_lm():
    """compile_decode_step(model.model, ...) ended in "no attribute 'logits'" from the example run."""
    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model("llama-tiny")
    cache, _ = prefill(model, 1, 4, 12)
    with pytest.raises(InputError, match=r"LlamaModel has no language-model head .*pass the causal-LM model"):
        compile_decode_step(model.model, cache, 1)


class SliceWriteAtInt(torch.nn.Module):
    def forward(self, k, pos: int, kc):
        kc[:, :, pos:pos + 1] = k
        return k * 2


def test_unlowerable_ops_end_with_what_to_do():
    """compile_module's error named the nodes but not a next step; a Python int position was not
    pointed out as the cause (a fresh user's finding)."""
    args = (torch.randn(1, 4, 1, 16), 3, torch.zeros(1, 4, 16, 16))
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(SliceWriteAtInt(), args)
    text = str(info.value)
    assert "hint: argument 1 is a Python int, baked into the graph as a constant: a decode position must be an " \
           "integer tensor (torch.tensor([p])) listed in positions." in text
    assert "compile it with torch.compile(module, backend='tilec'), which runs them eagerly" in text


class ZeroDimSlot(torch.nn.Module):
    def forward(self, k, pos, kc):
        kc[:, :, pos] = k
        return k * 2


def test_a_zero_dim_position_used_as_an_index_says_to_add_a_dimension():
    """The export error said to make the computation independent of tensor values; the fix is a
    position of one dimension (a fresh user's finding)."""
    args = (torch.randn(1, 4, 16), torch.tensor(3), torch.zeros(1, 4, 16, 16))
    with pytest.raises(DataDependentError, match=r"If the value read there is position argument 1, a 0-d tensor that indexing "
                                         r"reads as a number, pass it with one dimension, torch.tensor\(\[p\]\)"):
        compile_module(ZeroDimSlot(), args, positions=[1], max_positions=16)


def test_a_data_dependent_hf_model_is_not_told_to_change_the_cache_counters():
    """OPT slices its position ids by the cache's length: compile_decode_step said "position argument
    4 is a 0-d tensor ... pass it with one dimension" about a cache counter tilec passes itself (a
    breaker's finding). Now it names the model and what to do."""
    import transformers

    from tilec.hf import cache_kwargs, compile_decode_step

    torch.manual_seed(0)
    cfg = transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4,
                                 vocab_size=100, max_position_embeddings=64, word_embed_proj_dim=64)
    cfg._attn_implementation = "sdpa"
    model = transformers.OPTForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 4)), cache_position=torch.arange(4), use_cache=True,
              **cache_kwargs(model, cache))
    with pytest.raises(DataDependentError, match=r"(?s)depends on a tensor's value.*torch.compile\(module, backend='tilec'\).*"
                                         r"OPTForCausalLM's forward reads a value at run time") as e:
        compile_decode_step(model, cache, 1)
    assert "0-d tensor" not in str(e.value)


def test_integer_arithmetic_on_run_time_values_is_refused():
    """Elementwise ops compute in float32: ``ids + 1`` rounded ids past 2**24 silently (a breaker's
    finding). It is now an unsupported node naming the reason; float results of ints still work."""
    class M(torch.nn.Module):
        def forward(self, ids):
            return ids + 1

    with pytest.raises(UnsupportedNodeError, match=r"(?s)integer arithmetic on values read at run time.*add"):
        compile_module(M(), (torch.tensor([[16777217, 5]]),))


def test_integer_arithmetic_on_a_bool_tensor_is_refused_past_float32s_integers():
    """A bool tensor with an integer scalar (an int64 result) computed in float32: ``mask + 16777217`` gave
    16777216 silently (a fuzzer's finding). What float32 holds exactly for both 0 and 1 compiles (``mask * 16777216``
    and ``mask ** 16777217`` were refused too, by a bound on the scalar); the rest is refused."""
    mask = torch.tensor([[True, False, True]])

    class Exact(torch.nn.Module):
        def forward(self, m):
            return m * 4, m + 16777215, m * 16777216, m ** 16777217, m * -(2 ** 40)

    got = compile_module(Exact(), (mask,))(mask)
    for g, w in zip(got, Exact()(mask)):
        assert g.dtype == w.dtype == torch.int64 and torch.equal(g, w)

    for inexact in (lambda m: m + 16777217, lambda m: m * 16777217, lambda m: m + 16777216,
                    lambda m: m * (2 ** 53 + 1)):  # (the lowering's float of it is 2**53: a reviewer's case)
        class Large(torch.nn.Module):
            def forward(self, m):
                return inexact(m)

        with pytest.raises(UnsupportedNodeError, match=r"integer arithmetic on a bool tensor read at run time and "
                                                       r"the scalar (1677721[67]|9007199254740992) \(int64 result\)"):
            compile_module(Large(), (mask,))


def test_an_op_torchs_tracing_refuses_where_eager_runs_it_names_the_users_line():
    """``mask << 1`` of a bool tensor runs eagerly, but torch's meta kernel (which export traces with) wants an
    integer dtype: compile_module raised torch's bare RuntimeError from deep inside torch.export. It is now a
    TilecError naming the user's line and the advice; the advised form (tilec has no shift op: a product with 2**k)
    compiles and matches eager."""
    class Shift(torch.nn.Module):
        def forward(self, m):
            return m << 1  # the line the error names

    class Product(torch.nn.Module):
        def forward(self, m):
            return m * 2

    mask = torch.tensor([[True, False, True, True]])
    assert torch.equal(Shift()(mask), Product()(mask))  # eager runs both
    with pytest.raises(TilecError, match=r"(?s)cannot trace the module at .*test_frontend_errors.py:\d+ "
                                         r"\(return m << 1.*lshift.*torch.bool.*bool mask as its product with 2\*\*k, `mask \* 2`"):
        compile_module(Shift(), (mask,))
    got = compile_module(Product(), (mask,))(mask)
    assert got.dtype == torch.int64 and torch.equal(got, Shift()(mask))


def test_matrix_vector_product_is_refused_as_such_with_advice_that_works():
    """``x @ v`` with a 1-D ``v`` was refused as "matmul with a batched right operand" (a fuzzer's finding)."""
    class MatVec(torch.nn.Module):
        def forward(self, x, v):
            return x @ v

    class Advised(torch.nn.Module):
        def forward(self, x, v):
            return (x @ v.unsqueeze(-1)).squeeze(-1)

    class LinearOfVector(torch.nn.Module):  # (an internal IndexError)
        def forward(self, x, v):
            return torch.nn.functional.linear(x, v)

    class AdvisedLinear(torch.nn.Module):
        def forward(self, x, v):
            return torch.nn.functional.linear(x, v.unsqueeze(0)).squeeze(-1)

    x, v = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(UnsupportedNodeError, match=r"linear with a weight of shape \[8\] .*v\.unsqueeze\(0\)"):
        compile_module(LinearOfVector(), (x, v))
    assert torch.allclose(compile_module(AdvisedLinear(), (x, v))(x, v), x @ v, rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedNodeError, match=r"matmul with a vector right operand \(\[8\]; .*v\.unsqueeze\(-1\)"):
        compile_module(MatVec(), (x, v))
    got = compile_module(Advised(), (x, v))(x, v)
    assert torch.allclose(got, x @ v, rtol=1e-5, atol=1e-5)


def test_a_tensor_where_the_step_baked_none_is_named_by_dtype_and_shape():
    """The refusal printed the whole tensor (a fuzzer's finding)."""
    class Opt(torch.nn.Module):
        def forward(self, x, c):
            return x * 2 if c is None else x + c

    prog = compile_module(Opt(), (torch.randn(4, 6), None))
    with pytest.raises(TilecError, match=r"^argument 1 \(c\) is a tensor \(torch\.float32\[4, 6\]\), but the step was "
                                         r"compiled for None: a Python value is baked"):
        prog(torch.randn(4, 6), torch.randn(4, 6))


@pytest.mark.parametrize("dims", [3, 2])
def test_attention_on_fewer_than_4_dims_is_an_unsupported_node(dims):
    """3-d and 2-d ``scaled_dot_product_attention`` (valid in eager) crashed with a bare ValueError."""
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    shape = (2, 1, 16)[3 - dims:]
    kv = (2, 5, 16)[3 - dims:]
    with pytest.raises(UnsupportedNodeError, match=f"attention over {dims}-d queries"):
        compile_module(M(), (torch.randn(shape), torch.randn(kv), torch.randn(kv)))


def test_a_float64_module_is_told_to_cast():
    """The float64 refusal ended with "move such ops out" (a breaker's finding): the fix is a cast."""
    with pytest.raises(UnsupportedNodeError, match=r"(?s)dtype torch.float64.*hint: tilec has no float64 kernels: cast "
                                                   r"the module and its inputs"):
        compile_module(torch.nn.Linear(8, 4).double(), (torch.randn(2, 8, dtype=torch.float64),))


class _WindowAttention(torch.nn.Module):
    """Decode attention over a static cache of 40 rows with a sliding-window mask of ``window`` rows."""

    def __init__(self, window):
        super().__init__()
        self.window = window

    def forward(self, q, k, v, pos):
        j = torch.arange(k.shape[2])
        mask = (j <= pos) & (j > pos - self.window)  # [40]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.view(1, 1, 1, -1))


@pytest.mark.parametrize("window,first_bad", [(7, 7), (100, None)])
def test_a_mask_other_than_causal_names_its_first_position(window, first_bad):
    """The causal-mask check evaluates the mask one position at a time, once per mask node (it was
    tabulated over every position: host memory as the square of the cache length); a sliding window
    differs from the causal mask from position ``window`` on, and the error names that position."""
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    args = (q, k, v, torch.tensor([3]))
    if first_bad is None:
        prog = compile_module(_WindowAttention(window), args, positions=[3], max_positions=40)
        want = _WindowAttention(window)(q, k, v, torch.tensor([30]))
        torch.testing.assert_close(prog(q, k, v, torch.tensor([30])), want)
        return
    with pytest.raises(UnsupportedNodeError, match=f"attention mask at decode position {first_bad} is not the causal mask"):
        compile_module(_WindowAttention(window), args, positions=[3], max_positions=40)


class ParamTimesArg(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        return x * self.w + self.b


def test_the_modules_own_parameter_as_an_argument_is_captured_apart():
    """``compile_module(m, (m.w,))``: torch.export captured the argument and the parameter as one input, and every
    later call read its argument where forward reads ``m.w`` (x * x + b: a silently wrong result, a helper's
    finding). The argument is exported as a detached alias now, the buffer too: each call's own value, and the
    module's."""
    torch.manual_seed(0)
    m = ParamTimesArg()
    for arg in (m.w, m.b, m.w.detach()):
        prog = compile_module(m, (arg,))
        for x in (torch.randn(4), arg):
            with torch.no_grad():
                assert torch.equal(prog(x), m(x))


def test_opt_with_eager_attention_is_a_data_dependent_error():
    """OPT sizes its position ids by ``.item()`` of the cache's length counter; with eager attention torch.export
    captures that as a symbolic size, and compile_decode_step crashed with torch's GuardOnDataDependentSymNode from
    tilec's cache-length check (a helper's finding). A DataDependentError naming the node, its line and the read."""
    import transformers

    from tilec.hf import compile_decode_step
    from tilec.zoo import prefill

    cfg = transformers.OPTConfig(hidden_size=64, num_hidden_layers=1, ffn_dim=96, num_attention_heads=4,
                                 max_position_embeddings=64, word_embed_proj_dim=64, vocab_size=100, pad_token_id=0,
                                 bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(cfg).eval()
    cache, _ = prefill(model, 1, 6, 24, "cpu")
    with pytest.raises(DataDependentError, match=r"(?s)shapes depend on a tensor's value: \w+ \(aten\.\w+\.\w+\) "
                                                 r"at .*modeling_opt\.py.* has shape \[1, u\d+\].*\(item \(aten\.item"
                                                 r"\.default\).*OPTForCausalLM's forward reads a value at run time"):
        compile_decode_step(model, cache, 1, options={"workers": 8})


def test_a_sliding_window_cache_is_named_as_such():
    """Mistral's default sliding_window gives StaticSlidingWindowLayers, whose mask HF builds from a
    Python int: a constant in the graph. The error called it a padding mask (a breaker's finding);
    compile_decode_step now names the sliding window before lowering (the frontend's refusal of a
    constant mask: the next test)."""
    import transformers

    from tilec.hf import cache_kwargs, compile_decode_step

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = transformers.MistralForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 4)), cache_position=torch.arange(4), use_cache=True,
              **cache_kwargs(model, cache))
    from tilec.errors import InputError

    with pytest.raises(InputError, match=r"MistralForCausalLM has sliding-window attention .*StaticSlidingWindowLayer"
                                         r", window 4096\): .*does not support sliding windows") as e:
        compile_decode_step(model, cache, 1)
    assert "padding" not in str(e.value)
    if not hasattr(cache.layers[0], "_is_croppable"):  # (older transformers: no such flag, no advice)
        return
    assert "no shorter than the cache, so the attention is plain causal: set model.config.sliding_window = None " \
           "before building the StaticCache" in str(e.value)  # (Mistral's default window over a short cache: a
    model.config.sliding_window = None  # fresh user's finding) - and the advice works
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    prompt, tok = torch.randint(0, 100, (1, 4)), torch.randint(0, 100, (1, 1))
    with torch.no_grad():
        model(prompt, cache_position=torch.arange(4), use_cache=True, **cache_kwargs(model, cache))
        step = compile_decode_step(model, cache, 1, options=dict(workers=4))
        eager_cache = copy.deepcopy(cache)
        got = step(tok, position=4)
        want = model(tok, cache_position=torch.tensor([4]), **cache_kwargs(model, eager_cache)).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_a_constant_attention_mask_is_refused_as_such():
    """A mask that is the same at every decode position (a sliding-window layer's, built from Python
    ints, as torch.compile hands it over) is not the causal mask over the static cache."""
    class ConstMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.zeros(1, 1, 1, 8))

        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)

    args = (torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    with pytest.raises(UnsupportedNodeError, match=r"attention mask that is a constant.*sliding_window"):
        compile_module(ConstMask().eval(), args)


def test_expert_routing_is_named_as_such():
    """Mixtral's refusal listed 28 nodes whose only reason was a cache write's (a fresh user's finding):
    a top-k over router scores now says it is mixture-of-experts routing."""
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(16, 4, bias=False)

        def forward(self, x):
            w, idx = torch.topk(torch.softmax(self.gate(x), -1), 2, dim=-1)
            return w * idx.float()

    with pytest.raises(UnsupportedNodeError, match=r"a data-dependent choice .* mixture-of-experts layers are not "
                                                   r"supported yet\n  topk \(aten\.topk\.default\)"):
        compile_module(Router().eval(), (torch.randn(3, 16),))


def test_a_five_dim_operand_is_named_by_its_argument():
    """The reason printed the graph's buffer (``operand arg9_1[2x2x4x17x32]@0/...``) for a user's
    KV cache (a fresh user's finding): a graph input is named as the user knows it. (A 5-d view
    whose dims fold to 4 or fewer lowers: tests/test_frontend_forms.py; these five cannot fold.)"""

    class FiveDims(torch.nn.Module):
        def forward(self, x):
            return x.view(2, 2, 2, 2, 2).permute(4, 3, 2, 1, 0) * 2.0

    with pytest.raises(UnsupportedNodeError, match=r"operand argument 0 \(x\) viewed as \[2, 2, 2, 2, 2\] has more "
                                                   r"than 4 dims \(tilec ops take at most 4\)"):
        compile_module(FiveDims(), (torch.randn(2, 16),))


def test_refused_parameters_are_named_as_the_module_names_them():
    """A float64 module's refused inputs were listed by their capture placeholders (``p_weight (p_weight)``,
    ``argument 0 (input) (input)``); now as the user knows them, with their dtype and shape (a fresh user's
    case)."""
    torch.manual_seed(0)
    with pytest.raises(UnsupportedNodeError) as info:
        compile_module(torch.nn.Linear(4, 4).double(), (torch.randn(1, 4, dtype=torch.float64),))
    text = str(info.value)
    assert "  parameter weight (torch.float64[4, 4])" in text and "  parameter bias (torch.float64[4])" in text
    assert "  argument 0 (input) (torch.float64[1, 4])" in text
    assert "p_weight" not in text and "p_bias" not in text


class ItemSlice(torch.nn.Module):
    def forward(self, x, n):
        return x[:, :n.item()]


class MaskSelect(torch.nn.Module):
    def forward(self, x):
        return x[x > 0] * 2


class ItemOnes(torch.nn.Module):
    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 1)
        return x * torch.ones(1, k).cumsum(1)[:, -1:]


class TwoReads(torch.nn.Module):
    def forward(self, x, s, n):
        a = s.item()
        k = n.item()  # the size's read
        torch._check(k >= 1)
        torch._check(k <= 16)
        return x[:, :k] * a


class ItemIndex(torch.nn.Module):
    def forward(self, x, n):
        return x[n.item()] * 2, x.narrow(0, n.item(), 1) * 2


@pytest.mark.parametrize("module,args,node,read", [
    (ItemSlice(), (torch.randn(1, 16), torch.tensor(4)), r"slice\S* \(aten\.slice\.Tensor\)", "item"),
    (MaskSelect(), (torch.randn(1, 16),), r"index\S* \(aten\.index\.Tensor\)", None),
    (ItemOnes(), (torch.randn(4, 8), torch.tensor([3])), r"ones \(aten\.ones\.default\)", "item"),
    (TwoReads(), (torch.randn(2, 16), torch.tensor(0.5), torch.tensor(3)), r"slice\S* \(aten\.slice\.Tensor\)",
     "item_1")])
def test_a_shape_read_from_data_is_refused_by_name(module, args, node, read):
    """torch.export captures ``x[:, :n.item()]`` with a symbolic size (``u1``); the lowering then crashed in
    torch's symbolic shapes (GuardOnDataDependentSymNode from tilec/ir.py; a fresh user's case), and OPT's position
    ids sized by ``.item()`` of its cache counter crashed it before the node's refusal (a helper's finding). Now the
    capture refuses the first such node, naming its shape, its line and the node that read the size (not another
    ``.item()`` before it: a reviewer's finding)."""
    with pytest.raises(DataDependentError, match=rf"(?s)shapes depend on a tensor's value: {node} at .*"
                                                 rf"test_frontend_errors\.py.* has shape \[[^\]]*u\d+\]") as e:
        compile_module(module, args)
    assert (f"({read} (aten.item.default) " in str(e.value)) == (read is not None)
    if read == "item_1":
        assert "k = n.item()  # the size's read" in str(e.value) and "a = s.item()" not in str(e.value)


def test_an_index_read_from_data_is_refused_by_name():
    """``x[n.item()]`` and ``x.narrow(0, n.item(), 1)`` have static shapes and an offset read from data: they
    compiled with the example's index, a wrong result at any other (a reviewer's finding). Refused, naming the
    offset (the shape is static)."""
    x = torch.randn(8, 16)
    with pytest.raises(DataDependentError, match=r"indexing depends on a tensor's value: select \(aten\.select\.int\) "
                                                 r"at .* reads its input at an offset taken from data .*\(item "):
        compile_module(ItemIndex(), (x, torch.tensor(3)))


@pytest.mark.parametrize("hook, pattern", [
    (5, r"hook=5: must be a callable hook\(stage, ir, seconds\), or None"),
    (lambda stage, ir: None, r"hook '<lambda>'\(stage, ir\): it is called as hook\(stage, ir, seconds\)"),
])
def test_a_bad_hook_is_refused_before_the_capture(hook, pattern, monkeypatch):
    """compile_module(hook=5) or a hook of the wrong arity failed with Python's TypeError after the whole capture
    (a fresh user's case): refused first, as an OptionsError."""
    import tilec.api

    monkeypatch.setattr(tilec.api, "export_graph", lambda *a, **k: pytest.fail("captured"))
    with pytest.raises(TilecError, match=pattern) as info:
        compile_module(torch.nn.Linear(4, 4), (torch.randn(1, 4),), hook=hook)
    assert isinstance(info.value, ValueError)
    seen = []
    monkeypatch.undo()
    compile_module(torch.nn.Linear(4, 4), (torch.randn(1, 4),), hook=lambda stage, ir, seconds, *more: seen.append(stage))
    assert seen[0] == "opgraph" and seen[-1] == "plan"


def test_max_positions_past_what_tilec_tabulates_is_refused_at_once():
    """Every position-dependent value is tabulated per planned position, so max_positions=10**9 on a cacheless step ran
    until killed (a fresh user's case; a KV cache's own length check refuses such values first). Past 2**20 the
    first such value is refused, naming it; 2**10 still plans."""
    from tilec.frontend import MAX_POSITIONS

    class Scale(torch.nn.Module):
        def forward(self, x, pos):
            return x * (pos.float() + 1)

    args = (torch.randn(4), torch.tensor([2]))
    with pytest.raises(InputError, match=rf"add \(aten.add.Tensor\) at .*test_frontend_errors.py.* depends on the "
                                         rf"decode position.*max_positions=1000000000 is more than the {MAX_POSITIONS}"):
        compile_module(Scale(), args, positions=[1], max_positions=10**9)
    with pytest.raises(InputError, match=r"^argument 0 \(input\) depends on the decode position"):
        compile_module(torch.nn.Embedding(10, 4), (torch.tensor([[3]]),), positions=[0], max_positions=MAX_POSITIONS + 1)
    prog = compile_module(Scale(), args, positions=[1], max_positions=1 << 10)
    assert torch.allclose(prog(*args), Scale()(*args))


def test_a_dropout_left_in_training_mode_says_to_call_eval():
    """The hint said to move the dropout out or run it eagerly under torch.compile (a fresh user's GPT-2 left in
    training mode); module.eval() is the fix, and after it the module compiles."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 4))
    x = torch.randn(2, 8)
    with pytest.raises(UnsupportedNodeError, match=r"native_dropout(.|\n)*hint: The module is in training mode, where "
                                                   r"dropout draws random masks: call module\.eval\(\) before compiling"):
        compile_module(m, (x,))
    m.eval()
    with torch.no_grad():
        assert torch.allclose(compile_module(m, (x,), options=dict(workers=2))(x), m(x), atol=1e-6)


class _PowByItem(torch.nn.Module):
    def forward(self, x, pos):
        return x ** pos.item()


class _PowByBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("p", torch.tensor(3.0))

    def forward(self, x):
        return x ** self.p.item()


class _WriteAtItem(torch.nn.Module):
    def forward(self, cache, k, pos):
        cache[:, pos.item()] = k
        return cache * 1.0


class _Attribute(torch.nn.Module):
    def __init__(self, name="scale"):
        super().__init__()
        self.name = name
        setattr(self, name, torch.randn(8))

    def forward(self, x):
        return x * getattr(self, self.name)


def test_run_time_values_and_attributes_a_fresh_user_broke():
    """Raw tracebacks a fresh user found, each a clear error now: ``x ** pos.item()`` (a TypeError from float() of a
    node), ``cache[:, pos.item()] = k`` (torch.export's IndexError "got SymInt"), a view of a plain tensor
    attribute as the example argument (an AttributeError from export's guards) and a tensor attribute named like an
    nn.Module method, ``self.half`` (a KeyError from export's register_buffer). The attribute itself as the
    argument compiles to eager's values."""
    with pytest.raises(UnsupportedNodeError, match=r"(?s)its exponent is read at run time.*pow_1 \(aten\.pow"):
        compile_module(_PowByItem(), (torch.randn(2, 8), torch.tensor([3])), positions=[1], max_positions=16)
    x = torch.randn(2, 8)  # a constant exponent read from a buffer folds
    assert_close(compile_module(_PowByBuffer(), (x,))(x), x ** 3, 1e-6, "pow")
    with pytest.raises(DataDependentError, match=r"index read from data; for a cache written at a position read with "
                                                 r"\.item\(\), write cache\.index_copy_"):
        compile_module(_WriteAtItem(), (torch.zeros(2, 8, 4), torch.randn(2, 4), torch.tensor([3])), positions=[2],
                       max_positions=8)
    m = _Attribute()
    with pytest.raises(InputError, match=r"^argument 0 and the module's tensor attribute scale share memory"):
        compile_module(m, (m.scale.expand(4, 8),))
    prog = compile_module(m, (m.scale,))
    x = torch.randn(8)
    assert torch.equal(prog(x), m(x))
    with pytest.raises(InputError, match=r"^tensor attribute half is named like nn\.Module\.half: .*rename"):
        compile_module(_Attribute("half"), (torch.randn(8),))
