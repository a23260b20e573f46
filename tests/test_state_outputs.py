"""A module may return the cache it updates in place. torch.export lists that output twice - as
the in-place update and as a user output of the same node - and tilec once dropped the user
output, returning ``()`` where eager returned the cache (a review finding)."""
from __future__ import annotations

import pytest
import torch

from _helpers import assert_close
from tilec.api import compile_module

H, D, S = 2, 16, 8


class CacheStep(torch.nn.Module):
    """k = x W; cache[:, :, pos] = k (in place); returns the cache, or (cache, 2k), or 2k."""

    def __init__(self, returns: str):
        super().__init__()
        self.returns = returns
        self.k_proj = torch.nn.Linear(H * D, H * D, bias=False)

    def forward(self, x, pos, cache):
        k = self.k_proj(x).view(x.shape[0], 1, H, D).transpose(1, 2)
        cache.index_copy_(2, pos, k)
        if self.returns == "cache":
            return cache
        if self.returns == "both":
            return cache, k * 2
        return k * 2


@pytest.mark.parametrize("returns", ["cache", "both", "k"])
def test_returned_cache_matches_eager(returns):
    torch.manual_seed(0)
    m = CacheStep(returns).eval()
    x, cache = torch.randn(2, 1, H * D), torch.randn(2, H, S, D)
    prog = compile_module(m, (x, torch.tensor([0]), cache.clone()), positions=[1], max_positions=S,
                          options=dict(workers=3, executor="reference"))
    for p in (0, 5):
        mine, ref = cache.clone(), cache.clone()
        with torch.no_grad():
            want = m(x, torch.tensor([p]), ref)
        got = prog(x, torch.tensor([p]), mine)
        assert torch.equal(mine, ref)  # the cache updated in place
        if returns == "both":
            assert isinstance(got, tuple) and len(got) == 2
            assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
            assert got[0] is mine  # the caller's cache itself, as eager returns it
        else:
            if returns == "cache":
                assert got is mine
            assert isinstance(got, torch.Tensor), f"returned {got!r}"
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


class TwoCaches(torch.nn.Module):
    def forward(self, x, pos, cache, other):
        cache.index_copy_(2, pos, x)
        return other.sum(-1)


def test_aliased_arguments_are_named():
    """The same tensor passed as two arguments, one updated in place: torch.export fails with an
    opaque AssertionError; tilec names the arguments."""
    from tilec.errors import TilecError

    cache = torch.randn(1, H, S, D)
    with pytest.raises(TilecError, match="arguments 2 and 3 share memory"):
        compile_module(TwoCaches(), (torch.randn(1, H, 1, D), torch.tensor([0]), cache, cache), positions=[1],
                       max_positions=S, options=dict(executor="reference"))


@pytest.mark.parametrize("detached", [True, False])
def test_an_example_cache_aliasing_a_parameter_is_named(detached):
    """An example cache in a parameter's memory: torch.export failed with an IndexError (or an
    AttributeError from its guards) that named nothing of the user's; now the argument and the parameter
    are named (a fresh user's case)."""
    from tilec.errors import TilecError

    torch.manual_seed(0)
    m = CacheStep("k").eval()
    weight = m.k_proj.weight.data if detached else m.k_proj.weight
    cache = weight.view(-1)[:H * S * D].view(1, H, S, D)
    with pytest.raises(TilecError, match=r"argument 2 and the module's parameter k_proj\.weight share memory: "
                                         r"torch\.export cannot capture an argument that shares memory with the "
                                         r"module's state \(its parameters, buffers and tensor attributes\), and "
                                         r"the step updates it in "
                                         r"place; pass a tensor of its own"):
        compile_module(m, (torch.randn(1, 1, H * D), torch.tensor([0]), cache), positions=[1], max_positions=S,
                       options=dict(executor="reference"))


def test_a_read_only_argument_viewing_a_parameter_is_not_said_to_be_updated():
    """An argument that only views a parameter (read, never written) was refused as "an argument updated in place
    that aliases the module's state" (a fresh user's case): torch.export does fail on it, but nothing is updated."""
    from tilec.errors import InputError

    m = torch.nn.Linear(8, 8).eval()
    with pytest.raises(InputError, match=r"argument 0 and the module's parameter weight share memory: torch\.export "
                                         r"cannot capture an argument that shares memory with the module's state "
                                         r"\(its parameters, buffers and tensor attributes\), even one it only "
                                         r"reads; pass a copy "
                                         r"\(e\.g\. x\.clone\(\)\)") as info:
        compile_module(m, (m.weight.detach()[:2],))
    assert "in place" not in str(info.value)


def test_a_strided_cache_is_refused_at_a_call_with_its_strides():
    """A non-contiguous example cache compiles (the plan binds any contiguous tensor of its shape) and
    contiguous caches run; a strided cache at a call is refused, and the message gives its strides and says
    the example's did not matter (a fresh user's case: the refusal read as if the example's own layout were
    wrong; a compile-time refusal tried in between broke compiling with such an example, a reviewer's case)."""
    from tilec.errors import TilecError

    torch.manual_seed(0)
    m = CacheStep("k").eval()
    x = torch.randn(1, 1, H * D)
    strided = torch.randn(1, H, S, 2 * D)[..., :D]
    prog = compile_module(m, (x, torch.tensor([0]), strided), positions=[1], max_positions=S,
                          options=dict(executor="reference"))
    mine, ref = strided.contiguous(), strided.contiguous()
    with torch.no_grad():
        want = m(x, torch.tensor([3]), ref)
    assert_close(prog(x, torch.tensor([3]), mine), want, 1e-5, "a contiguous cache")
    assert torch.equal(mine, ref)
    with pytest.raises(TilecError, match=r"argument 2 \(cache\) is updated in place and must be contiguous \(got "
                                         r"strides \[512, 256, 32, 1\] for shape \[1, 2, 8, 16\]; the step was planned "
                                         r"for any contiguous tensor"):
        prog(x, torch.tensor([3]), strided)


class CacheBesideState(torch.nn.Module):
    """Reads a weight argument ``w`` (a caller may pass the module's own, tied) and keeps a non-persistent
    buffer (not in its state_dict)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(H * D, H * D))
        self.register_buffer("store", torch.randn(1, H, S, D), persistent=False)

    def forward(self, x, w, pos, cache):
        cache.index_copy_(2, pos, (x @ w).view(x.shape[0], 1, H, D).transpose(1, 2))
        return (x @ self.w) * 2 + self.store[:, :, :1].reshape(1, 1, -1)[..., :H * D]


def test_an_example_cache_aliasing_state_is_found_past_a_tied_read_and_in_unsaved_buffers():
    """Two holes a reviewer found in the check above: a non-persistent buffer (not in the state_dict) and an
    earlier harmless overlap (a tied weight argument, only read: ``m.w.detach()``) left torch.export's raw errors.
    The module's own parameter object as the argument: torch.export captured it and ``self.w`` as one input, so a
    call with another ``w`` read it for both - a silently wrong result this test once took for a tied read that is
    fine, as it only compared the module's own weight (a helper's finding); exported as a detached alias now."""
    from tilec.errors import TilecError

    torch.manual_seed(0)
    m = CacheBesideState().eval()
    x = torch.randn(1, 1, H * D)
    for w in (m.w.detach().clone(), m.w.detach()):
        with pytest.raises(TilecError, match=r"argument 3 and the module's buffer store share memory"):
            compile_module(m, (x, w, torch.tensor([0]), m.store[:]), positions=[2], max_positions=S,
                           options=dict(executor="reference"))
    with pytest.raises(TilecError, match=r"argument 3 and the module's buffer store share memory: .* and the step "
                                         r"updates it in place"):  # the buffer object itself
        compile_module(m, (x, m.w.detach(), torch.tensor([0]), m.store), positions=[2], max_positions=S,
                       options=dict(executor="reference"))
    for tied in (m.w, m.w.detach()):  # the parameter object itself (captured apart: a detached alias), or an alias
        prog = compile_module(m, (x, tied, torch.tensor([0]), m.store.clone()), positions=[2], max_positions=S,
                              options=dict(executor="reference"))  # the tied read alone is fine
        for w in (m.w.detach(), torch.randn(H * D, H * D)):  # the module's weight, and another
            mine, ref = m.store.clone(), m.store.clone()
            with torch.no_grad():
                want = m(x, w, torch.tensor([3]), ref)
                assert_close(prog(x, w, torch.tensor([3]), mine), want, 1e-5, "tied read")
            assert_close(mine, ref, 1e-5, "the cache written")


class WriteThenRead(torch.nn.Module):
    def forward(self, x, pos, cache, other):
        cache.index_copy_(2, pos, x)
        return other * 2


@pytest.mark.parametrize("other", ["same", "overlapping", "strided"])
def test_arguments_aliased_at_a_call_are_named(other):
    """A program compiled with separate tensors and called with aliased ones (the cache the step
    writes, or memory of it, passed also as the argument it reads) computed what eager does not, with
    no error: the cache write and the read are planned as independent, and a strided argument is read
    through a copy. Now the call raises, naming both arguments, before the step runs."""
    from tilec.errors import TilecError

    torch.manual_seed(0)
    x, n = torch.randn(1, H, 1, D), H * S * D
    prog = compile_module(WriteThenRead(), (x, torch.tensor([0]), torch.randn(1, H, S, D), torch.randn(1, H, S, D)),
                          positions=[1], max_positions=S, options=dict(executor="reference"))
    memory = torch.randn(2 * n)
    cache, apart = memory[:n].view(1, H, S, D), memory[n:].view(1, H, S, D)
    view = {"same": cache, "overlapping": memory[n // 2:n // 2 + n].view(1, H, S, D),
            "strided": cache.as_strided((1, H, S, D), (n, S * D, 1, S))}[other]
    for first in (True, False):  # (a reviewer's case: a call with this cache before, so its operand table is kept)
        before = memory.clone()
        with pytest.raises(TilecError, match=r"argument 2 \(cache\) and argument 3 \(other\) share memory, "
                                             r"and the step writes argument 2 \(cache\)"):
            prog(x, torch.tensor([3]), cache, view)
        assert torch.equal(memory, before), "the failed call wrote the cache"
        want_cache = cache.clone()
        want = WriteThenRead()(x, torch.tensor([3]), want_cache, apart)
        assert_close(prog(x, torch.tensor([3]), cache, apart), want, 1e-6, "a call without aliases")
        assert torch.equal(cache, want_cache)


def test_a_cache_aliasing_a_parameter_is_named_by_the_module():
    """A written cache passed in a parameter's memory: the error named the parameter by its capture
    placeholder (``the module's p_k_proj_weight``); now by the module's own name for it."""
    from tilec.errors import TilecError

    torch.manual_seed(0)
    m = CacheStep("k").eval()
    x = torch.randn(1, 1, H * D)
    prog = compile_module(m, (x, torch.tensor([0]), torch.randn(1, H, S, D)), positions=[1], max_positions=S,
                          options=dict(workers=3, executor="reference"))
    weight = m.k_proj.weight.data  # [H D, H D]: 1024 elements, a [1, H, S, D] cache 256
    with pytest.raises(TilecError, match=r"argument 2 \(cache\) and parameter k_proj\.weight share memory, and "
                                         r"the step writes argument 2 \(cache\)"):
        prog(x, torch.tensor([3]), weight.view(-1)[:H * S * D].view(1, H, S, D))


def test_a_saved_program_names_its_parameters_too(tmp_path):
    """An artifact saved from Python (not the CLI, which matched parameters to the state_dict) kept no
    parameter names, and its loaded program's error named ``parameter p_k_proj_weight`` (a reviewer's case)."""
    from tilec import artifact
    from tilec.errors import TilecError

    torch.manual_seed(0)
    m = CacheStep("k").eval()
    args = (torch.randn(1, 1, H * D), torch.tensor([0]), torch.randn(1, H, S, D))
    prog = compile_module(m, args, positions=[1], max_positions=S, options=dict(workers=3, executor="reference"))
    artifact.save(tmp_path / "a", prog, args, positions=[1], max_positions=S, build=False)
    loaded = artifact.load(tmp_path / "a").program("reference")
    weight = loaded.tensors[next(n for n in loaded.tensors if "k_proj" in n)]
    with pytest.raises(TilecError, match=r"and parameter k_proj\.weight share memory"):
        loaded(args[0], torch.tensor([3]), weight.view(-1)[:H * S * D].view(1, H, S, D))


def test_read_only_arguments_may_share_memory():
    """Two arguments the step only reads may be one tensor (tied weights)."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    prog = compile_module(TiedReads(), (x, w, w.clone()), options=dict(executor="reference"))
    assert_close(prog(x, w, w), TiedReads()(x, w, w), 1e-5, "tied reads")


class TiedReads(torch.nn.Module):
    def forward(self, x, a, b):
        return x @ a.t() + x @ b.t()


class ReadsTwice(torch.nn.Module):
    def forward(self, x, y):
        if y.sum() > 0:  # data-dependent control flow: torch.export fails, aliasing or not
            return x + y
        return x - y


def test_aliasing_is_not_blamed_for_other_export_failures():
    x = torch.randn(4, 8)
    with pytest.raises(Exception) as info:
        compile_module(ReadsTwice(), (x, x), options=dict(executor="reference"))
    assert "share memory" not in str(info.value)


class OneTuple(torch.nn.Module):
    def forward(self, x):
        return (x * 2,)


def test_a_tuple_of_one_stays_a_tuple():
    x = torch.randn(4, 8)
    got = compile_module(OneTuple(), (x,), options=dict(executor="reference"))(x)
    assert isinstance(got, tuple) and len(got) == 1 and torch.equal(got[0], x * 2)


class IndexPutStep(torch.nn.Module):
    """cache[:, :, pos] = k: torch.export makes it an index_put whose value lost its leading unit
    (batch) dim; tilec once read the slot count from the wrong dim (8 rows, not 1)."""

    def forward(self, k, pos, cache):
        cache[:, :, pos] = k
        return cache * 2


def test_index_put_cache_write_with_broadcast_value():
    k, cache = torch.randn(1, H, 1, D), torch.randn(1, H, S, D)
    m = IndexPutStep()
    prog = compile_module(m, (k, torch.tensor([0]), cache.clone()), positions=[1], max_positions=S,
                          options=dict(workers=3, executor="reference"))
    for p in (0, S - 1):
        mine, ref = cache.clone(), cache.clone()
        want = m(k, torch.tensor([p]), ref)
        got = prog(k, torch.tensor([p]), mine)
        assert torch.equal(mine, ref)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


class BroadcastWrite(torch.nn.Module):
    def forward(self, k, pos, cache):
        cache[:, :, pos] = k  # k [1, 1, 1, D] broadcasts over the heads
        return cache * 2


def test_broadcasting_cache_write_is_reported():
    from tilec.errors import UnsupportedNodeError

    with pytest.raises(UnsupportedNodeError, match=r"the value must have the cache's shape outside dim 2"):
        compile_module(BroadcastWrite(), (torch.randn(1, 1, 1, D), torch.tensor([0]), torch.randn(1, H, S, D)),
                       positions=[1], max_positions=S, options=dict(executor="reference"))


def test_cache_write_of_another_dtype_is_reported():
    """Eager refuses an index_put whose value's dtype differs from the cache's; tilec once cast it silently."""
    from tilec.errors import UnsupportedNodeError

    class CastWrite(torch.nn.Module):
        def forward(self, k, pos, cache):
            cache[:, :, pos] = k.to(torch.bfloat16)
            return cache * 2

    from tilec.errors import EagerFailsError, InputError

    with pytest.raises(UnsupportedNodeError, match=r"cache write of a bfloat16 value into a float32 cache"):
        compile_module(CastWrite(), (torch.randn(1, H, 1, D), torch.tensor([0]), torch.randn(1, H, S, D)),
                       positions=[1], max_positions=S, options=dict(executor="reference"))
    with pytest.raises(InputError) as info:  # bad input: eager raises on it too (EagerFailsError)
        compile_module(CastWrite(), (torch.randn(1, H, 1, D), torch.tensor([0]), torch.randn(1, H, S, D)),
                       positions=[1], max_positions=S, options=dict(executor="reference"))
    assert isinstance(info.value, EagerFailsError) and "eager PyTorch raises on this node too" in str(info.value)


def test_index_put_write_at_an_unlisted_position_gets_the_positions_hint():
    from tilec.errors import InputError

    with pytest.raises(InputError, match=r"takes its index from argument 1 \(pos\), which positions \[\] does not list"):
        compile_module(IndexPutStep(), (torch.randn(1, H, 1, D), torch.tensor([0]), torch.randn(1, H, S, D)),
                       positions=[], max_positions=S, options=dict(executor="reference"))


def test_meta_tensors_are_input_errors():
    from tilec.errors import InputError

    with torch.device("meta"):
        lin = torch.nn.Linear(8, 8)
    with pytest.raises(InputError, match=r"^weight, bias, argument 0: meta-device tensor\(s\) with no data"):
        compile_module(lin, (torch.randn(1, 8, device="meta"),))


class IndexedWrite(torch.nn.Module):
    """``cache.index_copy_(2, index(pos), k)`` for a test's ``index``."""

    def __init__(self, index):
        super().__init__()
        self.index = index

    def forward(self, k, pos, cache):
        cache.index_copy_(2, self.index(pos), k)
        return cache * 2


@pytest.mark.parametrize("index, tokens, max_positions, pattern", [
    # pos + 1: the index it saw, the one expected ([p] for one token; it once said "expected positions p..p+0")
    (lambda pos: pos + 1, 1, S - 1, r"index is not the step's position: at decode position 0 it is \[1\], not "
                                    r"\[0\]; tilec plans writes at exactly the step's positions "
                                    r"\(cache\.index_copy_\(dim, pos, new\)"),
    (lambda pos: pos + torch.arange(3) + 1, 3, S - 3, r"it is \[1, 2, 3\], not \[0, 1, 2\]; .*; for 3 tokens, "
                                                      r"pos \+ torch\.arange\(3\)\)"),
    (lambda pos: torch.tensor([2]), 1, S, r"not the decode position \(tilec plans writes at the step's "
                                          r"positions: cache\.index_copy_\(dim, pos, new\)"),
], ids=["pos_plus_1", "three_rows_shifted", "constant_index"])
def test_cache_write_at_a_wrong_index_names_what_tilec_plans(index, tokens, max_positions, pattern):
    from tilec.errors import UnsupportedNodeError

    with pytest.raises(UnsupportedNodeError, match=pattern):
        compile_module(IndexedWrite(index), (torch.randn(1, H, tokens, D), torch.tensor([0]), torch.randn(1, H, S, D)),
                       positions=[1], max_positions=max_positions, options=dict(executor="reference"))


def test_two_writes_into_one_cache_are_named_as_such():
    """The second write's target is the first write's result; it was reported as "a tensor that is
    not a graph input". The cache is named as the user knows it (it was the capture's name, ``'cache'``
    here but ``'arg8_1'`` under torch.compile)."""
    from tilec.errors import UnsupportedNodeError

    class TwoWrites(torch.nn.Module):
        def forward(self, k, v, pos, cache):
            cache.index_copy_(2, pos, k)
            cache.index_copy_(2, pos, v)
            return cache * 2

    with pytest.raises(UnsupportedNodeError, match=r"a second write into argument 3 \(cache\) in one step \(tilec plans one "
                                                   r"in-place write per cache and step"):
        compile_module(TwoWrites(), (torch.randn(1, H, 1, D), torch.randn(1, H, 1, D), torch.tensor([0]),
                                     torch.randn(1, H, S, D)), positions=[2], max_positions=S,
                       options=dict(executor="reference"))
