"""Run-time attention masks planned as causal and checked on every call (tilec.guards).

HF generate() passes each decode step its attention mask as a tensor argument; its attention,
repeat_kv and cache writes ran eagerly. Now the step compiles whole when the mask is causal at
the call's position, and a call with another mask (a padded batch) runs eagerly (torch.compile)
or raises GuardError (compile_module). Outputs are compared with eager PyTorch on random inputs
(relative L2 <= 1e-4, float32 on the CPU reference executor).
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tilec.api import compile_module
from tilec.errors import TilecError, UnsupportedNodeError
from tilec.errors import PositionError
from tilec.guards import GuardError, causal_mismatch

from _helpers import assert_close, greedy_generate

S = 12  # static cache rows


def causal(p: int, sq: int = 1, s: int = S) -> torch.Tensor:
    """[1, 1, sq, s] bool: row i allows columns <= p + i."""
    return (torch.arange(s).view(1, s) <= (p + torch.arange(sq)).view(sq, 1)).view(1, 1, sq, s)


def additive(allowed: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, fill)


@pytest.mark.parametrize("sq", [1, 3])
def test_causal_mismatch_reads_bool_and_hard_float_masks(sq):
    shape = (2, 4, sq, S)
    for p in (0, 5, S - sq - 1):  # some key masked in every row
        m = causal(p, sq)
        assert not causal_mismatch(m, p, shape)
        assert not causal_mismatch(m.expand(2, 1, sq, S), p, shape)
        for fill in (float("-inf"), torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min, -1e4):
            assert not causal_mismatch(additive(m, fill), p, shape), fill
        assert causal_mismatch(additive(m, -1.0), p, shape)  # a soft bias is not a mask
        assert causal_mismatch(m, p + 1, shape) and (p == 0 or causal_mismatch(m, p - 1, shape))
        padded = m.clone().expand(2, 1, sq, S).clone()
        padded[1, 0, :, 0] = False  # the second sequence's first key is padding
        assert causal_mismatch(padded, p, shape)
        soft = additive(m, float("-inf"))
        soft[..., 0] = 0.5
        assert causal_mismatch(soft, p, shape)
        nan = additive(m, float("-inf"))
        nan[..., -1] = float("nan")  # a masked column (eager gives NaN there): not a mask
        assert causal_mismatch(nan, p, shape)


def test_causal_mismatch_broadcasts_without_expanding():
    """The check reduces the mask itself, not its broadcast to ``shape``: the same verdicts, a mask
    that does not broadcast still raises, and an empty broadcast has nothing to mismatch."""
    m = causal(4, 1)  # [1, 1, 1, S]
    bad = m.clone()
    bad[..., 0] = False
    assert not causal_mismatch(m, 4, (3, 8, 1, S)) and causal_mismatch(bad, 4, (3, 8, 1, S))
    with pytest.raises(RuntimeError):
        causal_mismatch(torch.ones(2, 1, 1, S, dtype=torch.bool), 4, (3, 8, 1, S))
    assert not causal_mismatch(bad, 4, (0, 8, 1, S))


class MaskedStep(torch.nn.Module):
    """One decode step of attention over a static cache, masked by a run-time ``mask`` argument:
    x [1, 1, 64] -> q/k/v (4 query heads, 2 KV heads, head_dim 16), cache rows written at ``pos``."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
        self.o = torch.nn.Linear(64, 64)

    def forward(self, x, k_cache, v_cache, pos, mask):
        q = self.q(x).view(1, 1, 4, 16).transpose(1, 2)
        k_cache.index_copy_(2, pos, self.k(x).view(1, 1, 2, 16).transpose(1, 2))
        v_cache.index_copy_(2, pos, self.v(x).view(1, 1, 2, 16).transpose(1, 2))
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(1, 1, 64))


def _step_args(p: int, mask: torch.Tensor):
    return (torch.randn(1, 1, 64), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16), torch.tensor([p]), mask)


def _eager(m, args):
    args = tuple(a.clone() for a in args)
    return m(*args), args


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_argument_is_checked_on_every_call(kind):
    torch.manual_seed(0)
    m = MaskedStep().eval()
    as_kind = (lambda a: a) if kind == "bool" else (lambda a: additive(a, float("-inf")))
    with torch.no_grad():
        prog = compile_module(m, _step_args(3, as_kind(causal(3))), positions=[3], max_positions=S)
        assert [name for name, _ in prog.graph.mask_guards] and "guard causal_mask(" in prog.graph.render()
        for p in (0, 4, S - 1):
            args = _step_args(p, as_kind(causal(p)))
            want, eager_args = _eager(m, args)
            assert_close(prog(*args), want, 1e-4, f"position {p}")
            assert_close(args[1], eager_args[1], 1e-6, f"key cache at {p}")
        args = _step_args(5, as_kind(causal(6)))  # one key too many: not this position's causal mask
        before = args[1].clone()
        with pytest.raises(GuardError, match=r"attention mask computed from argument 4 \(mask\) is not the "
                                             r"causal mask over the static cache at position 5"):
            prog(*args)
        assert torch.equal(args[1], before), "a refused call wrote the cache"


def test_a_mask_read_from_the_cache_it_updates_is_refused_by_name():
    """A run-time mask is checked by evaluating its sub-graph before the step; one that reads a
    tensor the step writes in place cannot be evaluated before it."""

    class CacheMask(MaskedStep):
        def forward(self, x, k_cache, v_cache, pos, mask):
            k_cache.index_copy_(2, pos, self.k(x).view(1, 1, 2, 16).transpose(1, 2))
            v_cache.index_copy_(2, pos, self.v(x).view(1, 1, 2, 16).transpose(1, 2))
            q = self.q(x).view(1, 1, 4, 16).transpose(1, 2)
            seen = (k_cache[:, :1].abs().sum(-1) != 0).view(1, 1, 1, S) & mask
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=seen, enable_gqa=True)
            return self.o(o.transpose(1, 2).reshape(1, 1, 64))

    with pytest.raises(UnsupportedNodeError, match=r"attention mask computed from run-time inputs that tilec cannot "
                                                   r"check on each call: it reads .*(update|write)"):
        compile_module(CacheMask().eval(), _step_args(3, causal(3)), positions=[3], max_positions=S)


def test_an_artifact_refuses_a_program_that_checks_a_mask(tmp_path):
    from tilec import artifact

    torch.manual_seed(0)
    args = _step_args(3, causal(3))
    prog = compile_module(MaskedStep().eval(), args, positions=[3], max_positions=S)
    with pytest.raises(artifact.ArtifactError, match="checks a run-time attention mask"):
        artifact.save(tmp_path / "a", prog, args, positions=[3], max_positions=S, build=False)
    assert not (tmp_path / "a").exists()


def test_a_plan_without_its_guards_is_refused():
    from tilec.frontend import GraphBinding
    from tilec.ir import BufferKind
    from tilec.program import CompiledProgram

    torch.manual_seed(0)
    args = _step_args(3, causal(3))
    prog = compile_module(MaskedStep().eval(), args, positions=[3], max_positions=S)
    params = {n: prog.tensors[n] for n, b in prog.graph.buffers.items() if b.kind is BufferKind.PARAM}
    with pytest.raises(TilecError, match=r"checks 1 run-time attention mask\(s\) on every call"):
        CompiledProgram(prog.compiled, GraphBinding(params=params), single_output=True)


def test_generate_matches_eager(caplog):
    """generate() on one sequence: the same tokens as eager, and every decode call passes the
    mask check (the prefill graph's own fallbacks still log)."""
    from tilec.zoo import make_model

    torch.manual_seed(0)
    model = make_model("llama-tiny", layers=2)
    ids = torch.randint(3, 1000, (1, 5))
    with torch.no_grad():
        want = greedy_generate(model, False, 5, {"workers": 8}, input_ids=ids)
        with caplog.at_level(logging.INFO, logger="tilec"):
            got = greedy_generate(model, True, 5, {"workers": 8}, input_ids=ids)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    lines = [r.getMessage() for r in caplog.records if r.name == "tilec"]
    assert not [line for line in lines if "not the causal mask" in line or "run-time inputs" in line], lines


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_an_hf_decode_step_given_a_4d_mask_compiles_whole(kind):
    """The decode call generate() makes - a [1, 1, 1, cache length] mask built outside the model -
    compiles with fallback off (before, its attention, repeat_kv and cache writes ran eagerly)."""
    from transformers import StaticCache

    from tilec.hf import cache_kwargs
    from tilec.zoo import make_model

    torch.manual_seed(0)
    model = make_model("llama-tiny", layers=2)
    ids = torch.randint(3, 1000, (1, 5))
    caches = [StaticCache(config=model.config, max_cache_len=S) for _ in range(2)]
    f = torch.compile(model, backend="tilec", options={"workers": 8, "fallback": False})
    as_kind = (lambda a: a) if kind == "bool" else (lambda a: additive(a, torch.finfo(torch.float32).min))
    with torch.no_grad():
        for cache in caches:
            model(ids, cache_position=torch.arange(5), use_cache=True, **cache_kwargs(model, cache))
        tok = ids[:, -1:]
        for p in (5, 6, 7):
            kw = dict(attention_mask=as_kind(causal(p)), cache_position=torch.tensor([p]),
                      position_ids=torch.tensor([[p]]), use_cache=True)
            got = f(tok, **kw, **cache_kwargs(model, caches[0])).logits
            want = model(tok, **kw, **cache_kwargs(model, caches[1])).logits
            assert_close(got, want, 1e-4, f"logits at {p}")
            tok = want.argmax(-1)
        padded = causal(8).clone()
        padded[..., 1] = False
        with pytest.raises(Exception, match="not the causal mask"):
            f(tok, attention_mask=as_kind(padded), cache_position=torch.tensor([8]), position_ids=torch.tensor([[8]]),
              use_cache=True, **cache_kwargs(model, caches[0]))
    torch._dynamo.reset()


def test_generate_on_a_padded_batch_runs_its_attention_eagerly(monkeypatch, caplog):
    """The first decode call's mask is already padded: its attention is split off when compiling.
    A fresh user's finding: with the attention split off, the last region of a padded batch's
    decode step ran eagerly whole - the cache writes' write-back ``copy_`` (functionalization puts
    them at the graph's end) copies an ``index_copy`` computed in an earlier region, which a region
    cannot lower - and with it the last layer's o / gate / up / down projections and the LM head.
    Now each region is probed first, those ``copy_`` nodes run eagerly and every GEMV compiles: 7 a
    layer and the LM head. Three layers: a reviewer found the first fix (one refusal a region a round,
    4 rounds) covered two layers only."""
    import tilec.backend as backend
    from tilec.program import CompiledProgram
    from tilec.zoo import make_model

    ran, splits = {}, []
    real = CompiledProgram.__call__
    monkeypatch.setattr(CompiledProgram, "__call__", lambda self, *a: ran.setdefault(id(self), self) and real(self, *a))
    split = backend._partition_once
    monkeypatch.setattr(backend, "_partition_once", lambda *a, **k: splits.append(split(*a, **k)) or splits[-1])
    torch.manual_seed(1)
    model = make_model("llama-tiny", layers=3)
    ids = torch.randint(3, 1000, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        want = greedy_generate(model, False, 4, {"workers": 8}, input_ids=ids, attention_mask=mask)
        with caplog.at_level(logging.INFO, logger="tilec"):
            got = greedy_generate(model, True, 4, {"workers": 8}, input_ids=ids, attention_mask=mask)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    lines = [r.getMessage() for r in caplog.records if r.name == "tilec"]
    assert [line for line in lines if "not the causal mask over the static cache for the example arguments" in line]
    assert not [line for line in lines if "runs eagerly:" in line], lines
    rows = [op.outputs[0].numel // op.outputs[0].shape[-1] for p in ran.values() for op in p.graph.ops
            if op.kind in ("linear", "linear_fused")]
    # the decode step's (one token for each of 2 sequences; the prefill's LM head too: its last tokens)
    assert rows.count(2) >= 7 * 3 + 1, rows
    # one probe finds all a region refuses: a second split compiles (for the prefill's graph and the step's)
    assert sum(isinstance(r, set) for r in splits) <= 2 and len(splits) <= 4, splits


def test_torch_compile_checks_the_mask_of_a_plan_read_from_disk(tmp_path, monkeypatch, caplog):
    """The guards travel in the plan cache (OpGraph.mask_guards in graph.json): a plan loaded from
    disk still checks each call's mask, and a call with a padded mask runs eagerly."""
    from tilec import backend
    from tilec.ir import OpGraph

    monkeypatch.setenv("TILEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TILEC_DUMP_DIR", raising=False)
    torch.manual_seed(0)
    m = MaskedStep().eval()

    def run(args):
        f = torch.compile(m, backend="tilec", options={"workers": 4, "fallback": True})
        return f(*args)

    for fresh in (True, False):
        torch._dynamo.reset()
        backend._PLAN_CACHE.clear()
        before = dict(backend.CACHE_STATS)
        with torch.no_grad():
            args = _step_args(4, causal(4))
            want, _ = _eager(m, args)
            assert_close(run(args), want, 1e-4, "causal call")
            padded = causal(7).clone()
            padded[..., 0] = False
            args = _step_args(7, padded)
            want, _ = _eager(m, args)
            with caplog.at_level(logging.WARNING, logger="tilec"):
                assert_close(run(args), want, 1e-5, "padded call (eager)")
        stats = {k: backend.CACHE_STATS[k] - before[k] for k in before}
        assert stats["compiles" if fresh else "disk_hits"] == 1, stats
    assert sum("is not the causal mask" in r.getMessage() for r in caplog.records) == 2  # once per compiled region
    graph = next(iter(backend._PLAN_CACHE.values())).plan.graph
    assert graph.mask_guards and OpGraph.from_dict(graph.to_dict(), graph.tensors()) == graph


class SelfAttention(torch.nn.Module):
    """Attention over the step's own 6 tokens with a run-time mask (no cache, no position)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(1, 6, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(1, 6, 32))


def test_a_mask_not_causal_on_the_example_is_refused_when_compiling():
    """A bidirectional mask (all ones) was accepted and every call then failed its check (a
    reviewer's finding): compile_module raised GuardError on its own example, and torch.compile ran
    the whole graph eagerly. Now compile_module refuses it, and torch.compile splits off the
    attention only."""
    from tilec import backend

    torch.manual_seed(0)
    m = SelfAttention().eval()
    x, ones = torch.randn(1, 6, 32), torch.ones(1, 1, 6, 6, dtype=torch.bool)
    with pytest.raises(UnsupportedNodeError, match=r"not the causal mask over the static cache for the example "
                                                   r"arguments \(at position 0\)"):
        compile_module(m, (x, ones))
    tril = torch.ones(6, 6, dtype=torch.bool).tril().view(1, 1, 6, 6)
    assert_close(compile_module(m, (x, tril))(x, tril), m(x, tril), 1e-4, "a causal mask compiles")
    torch._dynamo.reset()
    before = backend.CACHE_STATS["compiles"] + backend.CACHE_STATS["disk_hits"] + backend.CACHE_STATS["memory_hits"]
    with torch.no_grad():
        f = torch.compile(m, backend="tilec", options={"workers": 4})
        for _ in range(2):
            x = torch.randn(1, 6, 32)
            assert_close(f(x, ones), m(x, ones), 1e-4, "bidirectional")
    after = backend.CACHE_STATS["compiles"] + backend.CACHE_STATS["disk_hits"] + backend.CACHE_STATS["memory_hits"]
    assert after - before >= 2, "the linears around the attention are compiled"
    torch._dynamo.reset()


def test_a_mask_argument_of_the_wrong_shape_is_named():
    torch.manual_seed(0)
    prog = compile_module(MaskedStep().eval(), _step_args(3, causal(3)), positions=[3], max_positions=S)
    for bad, got in ((None, "NoneType"), (causal(3, s=S + 1), r"torch.bool\[1, 1, 1, 13\]")):
        with pytest.raises(TilecError, match=rf"argument 4 \(mask\): expected torch.bool\[1, 1, 1, 12\] \(the attention mask is "
                                             rf"computed from it\), got {got}"):
            prog(*_step_args(3, causal(3))[:4], bad)


def test_the_layers_masks_are_checked_once_a_call(monkeypatch):
    """HF computes one mask node per layer from the same argument; each was evaluated and synced
    on every call (a reviewer's finding: 8 checks a step for 8 layers). Equal computations are
    checked once."""
    from transformers import StaticCache

    from tilec import guards
    from tilec.hf import cache_kwargs
    from tilec.zoo import make_model

    torch.manual_seed(0)
    model = make_model("llama-tiny", layers=3)
    ids = torch.randint(3, 1000, (1, 5))
    cache = StaticCache(config=model.config, max_cache_len=S)
    calls = []
    real = guards.causal_mismatch
    monkeypatch.setattr(guards, "causal_mismatch", lambda *a: calls.append(1) or real(*a))
    f = torch.compile(model, backend="tilec", options={"workers": 8, "fallback": False})
    with torch.no_grad():
        model(ids, cache_position=torch.arange(5), use_cache=True, **cache_kwargs(model, cache))
        for p in (5, 6):
            f(ids[:, -1:], attention_mask=additive(causal(p), float("-inf")), cache_position=torch.tensor([p]),
              position_ids=torch.tensor([[p]]), use_cache=True, **cache_kwargs(model, cache))
            n = len(calls)
        calls.clear()
        f(ids[:, -1:], attention_mask=additive(causal(7), float("-inf")), cache_position=torch.tensor([7]),
          position_ids=torch.tensor([[7]]), use_cache=True, **cache_kwargs(model, cache))
    assert n >= 1 and len(calls) == 1, (n, len(calls))
    torch._dynamo.reset()


def test_positions_and_masks_come_to_the_host_in_one_read(monkeypatch):
    """A call read its position tensor (a host sync on a GPU), then its masks' check (a second
    one): HF generate() on an H200 synchronized four times a token, counting the step's own check
    (forty-fourth session). The position and the masks' flags now come in one copy; a bad mask
    still raises, naming its argument and position."""
    torch.manual_seed(0)
    m = MaskedStep().eval()
    with torch.no_grad():
        prog = compile_module(m, _step_args(3, causal(3)), positions=[3], max_positions=S)
    reads = []
    for name in ("tolist", "item", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, _name=name: reads.append(_name) or _real(t, *a))
    monkeypatch.setattr(prog.executor, "run", lambda *a, **k: None)  # the binding and checks only
    with torch.no_grad():
        prog(*_step_args(4, causal(4)))
        assert reads == ["tolist"], reads
        with pytest.raises(GuardError, match=r"argument 4 \(mask\) is not the causal mask over the static "
                                             r"cache at position 5"):
            prog(*_step_args(5, causal(6)))


class TableMask(MaskedStep):
    """The mask also indexed by the position (HF Llama once sliced its mask by ``cache_position``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.tril(torch.ones(S, S, dtype=torch.bool)))

    def forward(self, x, k_cache, v_cache, pos, mask):
        return super().forward(x, k_cache, v_cache, pos, mask & self.table[pos].view(1, 1, 1, S))


def test_a_position_past_the_plan_is_a_position_error_before_the_mask_reads_it():
    """The masks are now evaluated with the position read; one indexed by a position past its table
    failed there with an IndexError (a device assert on a GPU) where the range check said
    PositionError, which torch.compile answers by running the call eagerly (a reviewer's case)."""
    torch.manual_seed(0)
    m = TableMask().eval()
    with torch.no_grad():
        prog = compile_module(m, _step_args(3, causal(3)), positions=[3], max_positions=S)
        args = _step_args(4, causal(4))
        want, _ = _eager(m, args)
        assert_close(prog(*args), want, 1e-4, "position 4")
        with pytest.raises(PositionError, match=r"holds decode position 15, outside the planned range \[0, 12\)"):
            prog(*_step_args(S + 3, causal(4)))


def test_a_mask_that_reads_a_module_buffer_is_checked_with_its_value():
    """The mask's sub-graph may read module buffers (constants to tilec): they are bound into the
    check, and two masks reading buffers of other values are two checks."""

    class BufferMask(MaskedStep):
        def __init__(self):
            super().__init__()
            self.register_buffer("keep", torch.ones(1, 1, 1, S, dtype=torch.bool))
            self.register_buffer("keep2", torch.ones(1, 1, 1, S, dtype=torch.bool))

        def forward(self, x, k_cache, v_cache, pos, mask):
            q = self.q(x).view(1, 1, 4, 16).transpose(1, 2)
            k_cache.index_copy_(2, pos, self.k(x).view(1, 1, 2, 16).transpose(1, 2))
            v_cache.index_copy_(2, pos, self.v(x).view(1, 1, 2, 16).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask & self.keep, enable_gqa=True)
            o2 = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask & self.keep2, enable_gqa=True)
            return self.o((o + o2).transpose(1, 2).reshape(1, 1, 64))

    torch.manual_seed(0)
    m = BufferMask().eval()
    m.keep2[..., -1] = False  # masks nothing a causal step at p < S - 1 may see
    with torch.no_grad():
        prog = compile_module(m, _step_args(3, causal(3)), positions=[3], max_positions=S)
        assert len(prog.guards) == 2  # the buffers differ: two computations
        args = _step_args(5, causal(5))
        want, _ = _eager(m, args)
        assert_close(prog(*args), want, 1e-4, "causal through the buffers")
        with pytest.raises(GuardError, match="at position 11"):
            prog(*_step_args(11, causal(11)))  # keep2 hides the last cache row: not causal there


class WhereMask(MaskedStep):
    """HF's form: a bool mask argument turned additive inside the step, ``where(mask, 0, fill)``."""

    def __init__(self, fill: float):
        super().__init__()
        self.fill = fill

    def forward(self, x, k_cache, v_cache, pos, mask):
        return super().forward(x, k_cache, v_cache, pos, torch.where(mask, 0.0, self.fill))


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_a_bool_mask_made_additive_is_checked_as_the_bool(fill):
    """The guard checks ``c`` of ``where(c, 0, fill)`` (fill at most -1e4): 3 kernels a call on a GPU
    instead of 9, the same verdicts."""
    torch.manual_seed(0)
    m = WhereMask(fill).eval()
    with torch.no_grad():
        prog = compile_module(m, _step_args(3, causal(3)), positions=[3], max_positions=S)
        guard, = prog.guards
        assert not [n for n in guard.module.graph.nodes if n.op == "call_function"], guard.module.code
        for p in (0, 6):
            args = _step_args(p, causal(p))
            want, _ = _eager(m, args)
            assert_close(prog(*args), want, 1e-4, f"position {p}")
        with pytest.raises(GuardError, match="is not the causal mask over the static cache at position 5"):
            prog(*_step_args(5, causal(6)))


class MaskedFillStep(MaskedStep):
    """Attention written by hand, its scores masked by a bool argument: ``masked_fill(~mask, -inf)``."""

    def forward(self, x, k_cache, v_cache, pos, mask):
        q = self.q(x).view(1, 1, 4, 16).transpose(1, 2)
        k_cache.index_copy_(2, pos, self.k(x).view(1, 1, 2, 16).transpose(1, 2))
        v_cache.index_copy_(2, pos, self.v(x).view(1, 1, 2, 16).transpose(1, 2))
        k, v = k_cache.repeat_interleave(2, 1), v_cache.repeat_interleave(2, 1)
        scores = (q @ k.transpose(2, 3) * 0.25).masked_fill(~mask, float("-inf"))
        o = torch.softmax(scores, -1) @ v
        return self.o(o.transpose(1, 2).reshape(1, 1, 64))


def test_a_masked_fill_of_a_mask_argument_is_checked_on_every_call():
    """masked_fill of the scores by a run-time bool argument: planned as attention (it was refused), the negated
    mask (frontend.masked_fill_as_where's node, named after the masked_fill) checked at each call."""
    torch.manual_seed(0)
    m = MaskedFillStep().eval()
    with torch.no_grad():
        prog = compile_module(m, _step_args(3, causal(3)), positions=[3], max_positions=S)
        assert [op.kind for op in prog.plan.graph.ops].count("attention") == 1
        for p in (0, 6):
            args = _step_args(p, causal(p))
            want, _ = _eager(m, args)
            assert_close(prog(*args), want, 1e-5, f"position {p}")
        with pytest.raises(GuardError, match=r"\(node masked_fill_allowed\) is not the causal mask over the static "
                                             r"cache at position 5"):
            prog(*_step_args(5, causal(6)))


@pytest.mark.parametrize("form, peeled", [
    (lambda c: torch.where(c, 0.0, float("-inf")), True),
    (lambda c: torch.where(c, torch.scalar_tensor(0.0), torch.scalar_tensor(-1e30)), True),  # HF's, under Dynamo
    (lambda c: torch.where(c, 0.0, -1.0), False),  # a soft bias: checked as the float mask it is
    (lambda c: torch.where(c, float("-inf"), 0.0), False),  # inverted
    (lambda c: torch.where(c, 0.0, float("nan")), False),
    (lambda c: torch.where(~c, 0.0, float("-inf")), False),  # the where's condition is not an argument
])
def test_which_where_masks_are_checked_as_their_bool(form, peeled):
    """Only ``where(c, 0, fill)`` of a bool ``c`` and a fill at most -1e4 is checked as ``c``."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from tilec.guards import _bool_source

    gm = make_fx(form)(causal(3))
    out, = [n for n in gm.graph.nodes if n.op == "output"][0].args[0:1]
    src = _bool_source(out)
    if peeled:
        assert src.op == "placeholder", gm.code
    else:
        assert src is out or src.op != "placeholder", gm.code


def test_the_causal_grid_cache_keeps_only_small_grids():
    """A reviewer's case: a compile-time check of a 1024 x 8192 mask left 64 MiB cached for the life
    of the process (on a GPU, in its memory)."""
    from tilec import guards

    guards._LAGS.clear()
    sq, s = 1024, 8192
    mask = torch.ones(1, 1, sq, s, dtype=torch.bool).tril(s - sq)
    assert not causal_mismatch(mask, s - sq, (1, 1, sq, s))
    assert causal_mismatch(mask, s - sq - 1, (1, 1, sq, s))
    assert not guards._LAGS
    assert not causal_mismatch(causal(3), 3, (1, 2, 1, S)) and len(guards._LAGS) == 1  # a decode step's: cached
