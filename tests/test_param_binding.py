"""A compiled step binds the module's parameters: in-place updates of them (``load_state_dict``, ``mul_``) are
seen by later calls. A non-contiguous parameter (a weight stored transposed) is bound through a contiguous copy;
that copy once was taken when compiling only, so later in-place updates were silently ignored (a fresh user's
finding, fifty-fifth session: relative L2 0.5 against eager after ``weight.mul_(2)``)."""
from __future__ import annotations

import collections
import copy
import enum
import gc
import re

import pytest
import torch

from _helpers import ScaledLayer, assert_close
from tilec.api import compile_module
from tilec.capture import attribute_paths, attribute_tensor, set_attribute_tensor
from tilec.errors import TilecError

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


# ---- replaced parameters (a fresh user's finding, fifty-sixth session: the step kept reading the tensors it was
# compiled with after load_state_dict(assign=True) - relative L2 0.635 against eager through compile_decode_step -,
# a new Parameter or submodule, or model.to(dtype); now it binds the module's new tensors: tilec.paramwatch) ----

class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp_step(seed: int):
    """An :class:`_Mlp` (float32), its example x [2, 16] and its compiled step."""
    torch.manual_seed(seed)
    m = _Mlp().eval()
    x = torch.randn(2, 16)
    return m, x, compile_module(m, (x,), options=OPTS)


@pytest.mark.parametrize("how", ["assign", "parameter", "submodule", "transposed"])
def test_replaced_parameters_are_bound_at_the_next_call(how):
    m, x, prog = _mlp_step(3)
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)
        if how == "assign":
            m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True)
        elif how == "parameter":
            m.down.weight = torch.nn.Parameter(torch.randn(8, 32))
        elif how == "submodule":
            m.up = torch.nn.Linear(16, 32)
        else:  # a non-contiguous one: read through a contiguous copy, refreshed after in-place updates as before
            m.down.weight = torch.nn.Parameter(torch.randn(32, 8).t())
        assert_close(prog(x), m(x), 1e-6)
        m.down.weight.mul_(-2)  # and later in-place updates of the new tensor are seen as before
        assert_close(prog(x), m(x), 1e-6)


def test_a_converted_module_is_bound_again_or_refused():
    """model.to(dtype) swaps each parameter's .data (no registration): the first and last parameters' memory tells."""
    m, x, prog = _mlp_step(4)
    m.to(torch.bfloat16)
    for _ in range(2):  # refused at every call until it fits again (nothing rebound meanwhile)
        with pytest.raises(TilecError, match=r"parameter up\.weight was replaced after compiling and is now "
                                             r"torch\.bfloat16\[32, 16\] on cpu; the step was compiled for "
                                             r"torch\.float32\[32, 16\] on cpu: compile the step again"):
            prog(x)
    m.to(torch.float32)  # new float32 tensors (the bf16-rounded values): bound
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)


def test_a_converted_module_is_named_by_a_weight_not_by_a_folded_buffer():
    """model.half() converts the folded buffers too (a RoPE table): the refusal named the buffer, "replaced by other
    values", where the weights' dtype is the cause (a fresh user's finding)."""
    torch.manual_seed(12)
    m = _Block().eval()
    x = torch.randn(4, 8)
    prog = compile_module(m, (x,), options=OPTS)
    m.half()
    with pytest.raises(TilecError, match=r"parameter block\.lin\.weight was replaced after compiling and is now "
                                         r"torch\.float16\[8, 8\] on cpu; the step was compiled for torch\.float32"):
        prog(x.half())


def test_a_replacement_of_another_shape_or_a_deleted_parameter_is_refused():
    m, x, prog = _mlp_step(5)
    m.down.weight = torch.nn.Parameter(torch.randn(8, 33))
    with pytest.raises(TilecError, match=r"parameter down\.weight .* now torch\.float32\[8, 33\] on cpu; .*\[8, 32\]"):
        prog(x)
    del m.down.weight
    m.down.weight = torch.randn(8, 32)  # a plain tensor attribute, no longer a parameter
    with pytest.raises(TilecError, match=r"parameter down\.weight is no longer a parameter of the compiled module"):
        prog(x)


def test_registrations_outside_the_module_cost_no_look():
    """Every registration counted once: HF slices its ModuleList of layers at every forward (a new container that
    registers them again), so a step after an eager forward walked the whole model again (~1.4 ms: a reviewer)."""
    torch.manual_seed(6)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).eval()
    x = torch.randn(2, 16)
    prog = compile_module(m, (x,), options=OPTS)
    bound = dict(prog.tensors)
    torch.nn.Linear(4, 4)  # registers parameters on another module
    m[:2]  # a new Sequential holding the watched layers
    assert not prog._watch.moved()
    m[0].weight = m[0].weight  # registered again on a watched module: one look, nothing changed
    assert prog._watch.moved() and not prog._watch.changed()
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)
    assert not prog._watch.moved()
    assert all(prog.tensors[k] is v for k, v in bound.items())


def test_a_module_compiled_through_a_temporary_wrapper_is_still_watched():
    """The watch held the compiled module weakly: a wrapper made for the compile was collected at once, and every
    replacement after it went unseen (rel. error 1.02: a reviewer's finding)."""
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    torch.manual_seed(12)
    m = _Mlp().eval()
    x = torch.randn(2, 16)
    prog = compile_module(Wrapper(m), (x,), options=OPTS)
    gc.collect()
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True)
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)


def test_compile_decode_step_binds_weights_loaded_with_assign():
    from tilec.hf import compile_decode_step, cache_kwargs
    from tilec.zoo import make_model, prefill

    torch.manual_seed(7)
    model = make_model("llama-tiny")
    cache, tok = prefill(model, batch=1, context=6, max_cache_len=16)
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=8))
    model.load_state_dict({k: v * 1.5 for k, v in model.state_dict().items()}, assign=True)
    eager_cache = copy.deepcopy(cache)
    got = step(tok, position=6)
    with torch.no_grad():
        want = model(tok, cache_position=torch.tensor([6]), **cache_kwargs(model, eager_cache)).logits
    assert_close(got, want, 1e-5)
    model.model.norm.weight = torch.nn.Parameter(torch.ones(3))  # named as the user's model names it (a fresh user
    with pytest.raises(TilecError, match=r"^parameter model\.norm\.weight was replaced after compiling and is now "
                                         r"torch\.float32\[3\]"):  # saw model.model.norm.weight: the wrapper's)
        step(tok, position=7)


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


@pytest.mark.parametrize("which", ["head", "emb", "both"])
def test_tied_weights_replaced_together_are_bound_and_untied_ones_refused(which):
    """torch.export binds tied weights as one placeholder under one of their names: replacing the tensor under
    the other name went unseen, and under the watched one the step used it for both (a reviewer's finding)."""
    torch.manual_seed(8)
    m = _Tied().eval()
    ids = torch.tensor([[1, 2, 3]])
    prog = compile_module(m, (ids,), options=OPTS)
    new = torch.nn.Parameter(torch.randn(10, 8))
    if which == "both":
        m.load_state_dict({**m.state_dict(), "emb.weight": new, "head.weight": new.detach()}, assign=True)
        with torch.no_grad():  # two Parameters of one tensor's memory: still tied
            assert_close(prog(ids), m(ids), 1e-6)
        return
    getattr(m, which).weight = new
    with pytest.raises(TilecError, match=r"parameters (emb\.weight and head\.weight|head\.weight and emb\.weight) "
                                         r"were one tensor \(tied\) when compiling and no longer are"):
        prog(ids)


def test_a_whole_module_made_anew_without_registrations_is_seen():
    """to("meta") then to_empty() puts new Parameters under every name without registering any; the old ones
    stayed alive (an earlier list of them, or the export's reference cycles), so only the names tell."""
    torch.manual_seed(9)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(2, 16)
    prog = compile_module(m, (x,), options=OPTS)
    old = list(m.parameters())  # kept alive, as an optimizer would
    m.to("meta")
    m.to_empty(device="cpu")
    assert all(p is not q for p, q in zip(old, m.parameters()))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
        assert_close(prog(x), m(x), 1e-6)


def test_save_binds_replaced_parameters_first(tmp_path):
    from tilec import artifact

    m, x, prog = _mlp_step(10)
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True)
    artifact.save(tmp_path / "a", prog, (x,), build=False)  # no call in between: it wrote the old weights
    with torch.no_grad():
        assert_close(artifact.load(tmp_path / "a").program(executor="reference")(x), m(x), 1e-6)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = ScaledLayer(1.0, 8)

    def forward(self, x):
        return self.block(x)


def test_a_new_submodule_with_other_buffer_values_is_refused():
    """Its parameters were bound and its buffer's new value silently not (the step folds buffers when compiling:
    a reviewer's finding); a buffer of the same values is fine."""
    torch.manual_seed(11)
    m = _Block().eval()
    x = torch.randn(4, 8)
    prog = compile_module(m, (x,), options=OPTS)
    m.block = ScaledLayer(1.0, 8)
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)
    m.block = ScaledLayer(3.0, 8)
    with pytest.raises(TilecError, match=r"buffer block\.scale was replaced after compiling by other values .*"
                                         r"compile the step again"):
        prog(x)


class _Attributed(torch.nn.Module):  # plain tensor attributes: one read by the plan as it is, one folded
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.lin.scale = torch.randn(8)
        self.shift = torch.randn(8)
        self.shift[0] = float("nan")  # (equal values: NaN is NaN)
        self.alias = self.lin.scale  # one tensor under two names: export names the constant by the first

    def forward(self, x):
        return self.lin(x) * self.lin.scale + self.shift[1:].exp().sum()


@pytest.mark.parametrize("attribute, how", [("lin.scale", "other"), ("shift", "other"), ("alias", "other"),
                                            ("shift", "edited"), ("lin.scale", "removed")])
def test_a_tensor_attribute_replaced_by_other_values_is_refused(attribute, how):
    """Setting a plain tensor attribute registers nothing, so a step went on with the values it compiled
    (``m.scale = torch.full(...)``: a silently wrong result, a fresh user's finding). Each call looks at them now,
    under every name of the tensor (a reviewer's finding: ``alias``, the name export did not use), against a copy of
    the values compiled (an in-place edit, then a replacement: taken as equal values before, a reviewer's finding):
    other values, or none, raise naming the attribute, at every later call too; equal values (NaN among them) are
    watched from then on."""
    torch.manual_seed(12)
    m = _Attributed().eval()
    x = torch.randn(4, 8)
    prog = compile_module(m, (x,), options=OPTS)
    owner, _, leaf = attribute.rpartition(".")
    holder = m.get_submodule(owner)
    setattr(holder, leaf, getattr(holder, leaf).clone())  # equal values
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)
    if how == "removed":
        delattr(holder, leaf)
    elif how == "edited":
        getattr(holder, leaf).mul_(3)
        setattr(holder, leaf, getattr(holder, leaf).clone())
    else:
        setattr(holder, leaf, getattr(holder, leaf) * 3)
    for _ in range(2):
        with pytest.raises(TilecError, match=rf"tensor attribute {re.escape(attribute)} was replaced after compiling "
                                             r"by other values \(or removed\).* compile the step again"):
            prog(x)


class _Held(torch.nn.Module):  # tensors in container attributes: torch.export lifts each to lifted_tensor_<n>
    def __init__(self):
        super().__init__()
        self.tabs = [torch.randn(8), torch.randn(8)]
        self.d = {"a": (torch.randn(8),)}

    def forward(self, x):
        return x * self.tabs[1] + self.d["a"][0].exp().sum()


@pytest.mark.parametrize("how, name", [("m.tabs[1] = m.tabs[1] * 3", "tabs[1]"),
                                       ("m.tabs = [m.tabs[0], torch.zeros(8)]", "tabs[1]"),
                                       ("m.d['a'] = (m.d['a'][0] + 1,)", "d['a'][0]"),
                                       ("m.d = {}", "d['a'][0]"),
                                       ("del m.tabs[1]", "tabs[1]")])
def test_a_tensor_held_in_a_container_attribute_replaced_is_refused(how, name):
    """A tensor in a list, tuple or dict attribute is a constant of the step, like a plain tensor attribute, but its
    replacement went unnoticed (``m.tabs[1] = t``: the step went on with the compiled values - a silently wrong result);
    each call looks at it under its keys now: other values raise naming it, at every later call too, and equal values
    (a copy; tabs[0], which forward does not read, replaced) are fine."""
    torch.manual_seed(13)
    m = _Held().eval()
    x = torch.randn(4, 8)
    prog = compile_module(m, (x,), options=OPTS)
    assert sorted(prog._attribute_names.values()) == ["d['a'][0]", "tabs[1]"]
    m.tabs[1] = m.tabs[1].clone()
    m.tabs[0] = torch.randn(8)
    m.d = {"a": (m.d["a"][0].clone(),)}
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)
    exec(how)
    for _ in range(2):
        with pytest.raises(TilecError, match=rf"tensor attribute {re.escape(name)} was replaced after compiling "
                                             r"by other values \(or removed\).* compile the step again"):
            prog(x)


class _Key(enum.IntEnum):
    A = 1


class _Pair(tuple):  # a tuple subclass whose constructor takes its items one by one
    def __new__(cls, a, b):
        return super().__new__(cls, (a, b))


class _Holding(torch.nn.Module):
    def __init__(self, held, path):
        super().__init__()
        self.held, self.path = held, path

    def forward(self, x):
        t = self.held
        for key in self.path:
            t = t[key]
        return x * t


@pytest.mark.parametrize("form, path, name", [
    ("intenum", (_Key.A,), "held[<_Key.A: 1>]"),  # (names were parsed back, and this one did not: every call raised)
    ("parameter", (0,), "held[0]"),  # (export lifts a new tensor of a Parameter in a list: matched by its memory)
    ("deep", (0, 0, 0, 0, 0), "held[0][0][0][0][0]"),
    ("defaultdict", ("a",), "held['a']"),
    ("pair", (1,), "held[1]")])
def test_container_attribute_forms_a_breaker_found(form, path, name):
    """Forms a helper's breaker run found unwatched (a Parameter in a plain list, five containers deep: silently wrong
    results) or refused at every call (an IntEnum dict key); a defaultdict's missing key is not inserted by the
    watch; a tuple subclass whose constructor takes other arguments is rebuilt as a plain tuple by run --check's
    loading (an internal TypeError)."""
    torch.manual_seed(14)
    held = {"intenum": lambda: {_Key.A: torch.randn(8)}, "parameter": lambda: [torch.nn.Parameter(torch.randn(8))],
            "deep": lambda: [[[[[torch.randn(8)]]]]],
            "defaultdict": lambda: collections.defaultdict(lambda: torch.zeros(8), a=torch.randn(8)),
            "pair": lambda: _Pair(torch.randn(8), torch.randn(8))}[form]()
    m = _Holding(held, path).eval()
    x = torch.randn(4, 8)
    prog = compile_module(m, (x,), options=OPTS)
    assert list(prog._attribute_names.values()) == [name]
    with torch.no_grad():
        for _ in range(2):
            assert_close(prog(x), m(x), 1e-6)
    if form == "pair":
        set_attribute_tensor(m, attribute_paths(m)[name], m.held[1] * 3)
        assert type(m.held) is tuple and torch.equal(attribute_tensor(m, attribute_paths(m)[name]), held[1] * 3)
    elif form == "defaultdict":
        del m.held["a"]
    else:
        container = m.held
        for key in path[:-1]:
            container = container[key]
        container[path[-1]] = torch.randn(8)
    with pytest.raises(TilecError, match=rf"tensor attribute {re.escape(name)} was replaced after compiling"):
        prog(x)
    assert form != "defaultdict" or "a" not in m.held


def test_the_registration_hooks_do_not_make_torch_compile_recompile(monkeypatch):
    """The count the hooks bump was traced by Dynamo in a forward that registers modules (HF slices its ModuleList of
    layers at every call): a guard on it recompiled the model at every call, once a step had been compiled; a guard
    on the watched set failed to build once the set had shrunk."""
    from tilec import backend, paramwatch

    watched = compile_module(torch.nn.Sequential(torch.nn.Linear(8, 8)), (torch.randn(2, 8),), options=OPTS)
    assert len(paramwatch._WATCHED) > 0 and watched._watch is not None
    compiles = []
    real = backend._compile_region
    monkeypatch.setattr(backend, "_compile_region", lambda *a, **k: compiles.append(1) or real(*a, **k))

    class Sliced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[:2]:  # a new ModuleList: registers its modules again
                x = layer(x)
            return x

    torch._dynamo.reset()
    m = Sliced().eval()
    # (nor on the watched set, which shrinks as modules are collected: its guard failed to build in CI - IndexError)
    guards = [g.name for g in torch._dynamo.explain(m)(torch.randn(2, 8)).out_guards]
    assert not [g for g in guards if "_WATCHED" in g or "_REGISTERED" in g], guards
    torch._dynamo.reset()
    f = torch.compile(m, backend="tilec", options=dict(workers=2))
    for _ in range(3):
        x = torch.randn(2, 8)
        with torch.no_grad():
            assert_close(f(x), m(x), 1e-6)
    assert len(compiles) == 1


class _Int8Weight(torch.Tensor):
    """A weight-only quantized wrapper subclass (as torchao's): reports float32 and the weight's shape, holds int8."""

    @staticmethod
    def __new__(cls, q, scale):
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=torch.float32, device=q.device)

    def __init__(self, q, scale):
        self.q, self.scale = q, scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return _Int8Weight(args[0].q, args[0].scale)
        unwrap = lambda t: t.q.float() * t.scale if isinstance(t, _Int8Weight) else t  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class _FakeQuantLinear(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.linear(x, (self.weight * 8).round() / 8, self.bias)


@pytest.mark.parametrize("how", ["subclass", "new-bias", "other-class"])
def test_a_replacement_the_traced_step_cannot_take_is_refused(how):
    """Each ran silently wrong (a fresh user's finding: rel. L2 0.39 / 0.055 / 0.051): a quantized wrapper subclass
    was bound as plain memory (its data pointer is 0), a bias added to a bias-free Linear was never read, and a Linear
    swapped for a fake-quantizing subclass kept the traced forward."""
    m, x, prog = _mlp_step(13)
    if how == "subclass":
        w = m.down.weight.detach()
        m.down.weight = torch.nn.Parameter(_Int8Weight((w * 64).round().to(torch.int8), 1 / 64), requires_grad=False)
        why = r"parameter down\.weight was replaced by a _Int8Weight \(a tensor subclass\)"
    elif how == "new-bias":
        m.down.bias = torch.nn.Parameter(torch.randn(8))
        why = r"down\.bias was added to the compiled module after compiling"
    else:
        new = _FakeQuantLinear(32, 8, bias=False)
        new.load_state_dict(m.down.state_dict())
        m.down = new
        why = r"submodule down is now a _FakeQuantLinear \(a Linear when compiling\): the step runs the forward it traced"
    with pytest.raises(TilecError, match=why):
        prog(x)


class _LinearSum(torch.nn.Module):
    """``lin(x) + sum(more)``; for a Python number x (baked into the step: no tensor argument), ``lin.weight * x``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x, *more):
        y = self.lin(x) if isinstance(x, torch.Tensor) else self.lin.weight * x
        for m in more:
            y = y + m
        return y


@pytest.mark.parametrize("shapes,bound", [((), 0), (((4, 64),), 0), (((512, 64),), 1), (((512, 64), (512, 64)), 2)],
                         ids=["a-number", "one-small-tensor", "one-tensor", "two-tensors"])
def test_a_program_round_trips_through_pickle(shapes, bound):
    """pickle.dumps / loads of a compiled program gives one that returns the original's results, whatever number
    of buffers it binds from the call's arguments (``bound``: a small tensor is copied into the program's own
    buffer instead). With none or one it gathered them with a lambda, which pickle cannot hold (AttributeError:
    Can't pickle local object)."""
    import pickle

    torch.manual_seed(0)
    m = _LinearSum().eval()
    args = tuple(torch.randn(s) for s in shapes) or (3.0,)
    prog = compile_module(m, args, options=OPTS)
    assert len(prog._arg_buffers) == bound
    twin = pickle.loads(pickle.dumps(prog))
    assert twin._lock is not prog._lock
    with torch.no_grad():
        want = m(*args)
    assert torch.equal(twin(*args), prog(*args)) and torch.allclose(twin(*args), want, atol=1e-5)


def test_pickling_a_program_on_the_cuda_executor_is_a_clear_error():
    """A program on the CUDA executor holds a loaded library (ctypes) and device buffers: pickle raised ctypes'
    "objects containing pointers cannot be pickled". It is a TilecError saying what works instead. (The executor
    is a bare instance here: the refusal does not depend on its state, and this machine has no GPU.)"""
    import pickle

    from tilec.cuda import CudaExecutor

    prog = compile_module(_LinearSum().eval(), (torch.randn(4, 64),), options=OPTS)
    prog.executor = object.__new__(CudaExecutor)
    with pytest.raises(TilecError, match=r"CUDA executor cannot be pickled.*copy\.deepcopy.*artifact.*reference"):
        pickle.dumps(prog)


def test_a_deep_copy_binds_its_own_buffers_in_its_operand_table(tmp_path):
    """A deep copy kept the original's cached operand tables, which hold the original's buffer addresses: with no
    argument bound by reference (the key is then empty) the copy's launch would use them - on the CUDA executor the
    copy's kernel reading and writing the original's memory (a reviewer's finding)."""
    from tilec import artifact

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
    x = torch.randn(4, 64)
    artifact.save(tmp_path / "a", compile_module(m, (x,), options=dict(workers=2)), (x,), build=False)
    prog = artifact.load(tmp_path / "a").program(executor="reference")  # (no module: no parameter watch)
    tensors, _, _ = prog._bind((x,), prog.guards)
    prog._table(tensors, (x,))  # the original's table, cached
    twin = copy.deepcopy(prog)
    own, _, _ = twin._bind((x,), twin.guards)
    assert torch.equal(twin._table(own, (x,)), twin.plan.bind_base(own))
    assert torch.allclose(twin(x), m(x), atol=1e-5) and torch.allclose(prog(x), m(x), atol=1e-5)


class _Keyed(torch.nn.Module):  # names that do not read back as Python: a ModuleDict key with "[", a tuple dict key
    def __init__(self):
        super().__init__()
        self.md = torch.nn.ModuleDict({"a[0]": torch.nn.Module()})
        self.md["a[0]"].scale = torch.randn(8)
        self.d = {(0, 1): torch.randn(8)}

    def forward(self, x):
        return x * self.md["a[0]"].scale + self.d[(0, 1)]


@pytest.mark.parametrize("how, name", [(None, None), ("m.md['a[0]'].scale = torch.randn(8)", "md.a[0].scale"),
                                       ("m.d[(0, 1)] = torch.randn(8)", "d[(0, 1)]")])
def test_attribute_names_are_looked_up_not_parsed(how, name):
    """A reviewer's findings: the watch parsed names back, so a ModuleDict key holding "[" made every call raise
    ("md.a[0].scale was replaced") and a tuple dict key was not watched at all (replacing it: a silently wrong
    result). Names are looked up in the module's own walk now (capture.attribute_paths)."""
    torch.manual_seed(18)
    m = _Keyed().eval()
    x = torch.randn(4, 8)
    prog = compile_module(m, (x,), options=OPTS)
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)
    if how is None:
        return
    exec(how)
    with pytest.raises(TilecError, match=rf"tensor attribute {re.escape(name)} was replaced after compiling"):
        prog(x)


def test_an_attribute_edited_in_place_then_replaced_is_refused():
    """The step takes a copy of a tensor attribute's values when compiling: editing the compiled tensor in place and
    then replacing it is other values (a reviewer's finding: the copy was lost for plain attributes, so the plan
    followed the live tensor and the replacement compared equal to it - a silently wrong result)."""
    torch.manual_seed(19)
    m = _Attributed().eval()
    x = torch.randn(4, 8)
    prog = compile_module(m, (x,), options=OPTS)
    m.shift.mul_(2)
    m.shift = m.shift.clone()
    with pytest.raises(TilecError, match=r"tensor attribute shift was replaced after compiling"):
        prog(x)


class _ListedBlock(torch.nn.Module):  # a module in a plain list: PyTorch registers none of its parameters
    def __init__(self):
        super().__init__()
        self.blocks = [torch.nn.Linear(8, 8)]
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.blocks[0](x))


def test_a_module_held_in_a_plain_list_is_warned_of(caplog):
    """Its weights are constants of the step (torch.export lifts them), neither bound nor watched: an in-place edit or
    a replacement after compiling went unnoticed with no word (a helper's finding). A warning names the first and
    says to use nn.ModuleList; the step computes eager's values as compiled."""
    torch.manual_seed(16)
    m = _ListedBlock().eval()
    x = torch.randn(2, 8)
    with caplog.at_level("WARNING", logger="tilec"):
        prog = compile_module(m, (x,), options=OPTS)
    assert "blocks[0] (Linear) weight and 1 more: a module held in a list, tuple or dict attribute is not registered " \
           "(use nn.ModuleList or nn.ModuleDict)" in caplog.text
    with torch.no_grad():
        assert_close(prog(x), m(x), 1e-6)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tilec"):
        compile_module(torch.nn.Sequential(torch.nn.Linear(8, 8)), (x,), options=OPTS)
    assert "not registered" not in caplog.text


def test_a_deep_copy_of_a_step_watches_its_own_modules_attributes():
    """The watch kept each owner's ``__dict__``: a deep copy of a step with no parameters (nothing else to notice)
    looked at the copied dict, not its own module's, and a replaced attribute went unseen (a helper's finding)."""
    torch.manual_seed(20)
    prog = compile_module(_Held().eval(), (torch.randn(4, 8),), options=OPTS)
    twin = copy.deepcopy(prog)
    module = twin._watch._root
    module.tabs = [module.tabs[0], torch.randn(8)]
    with pytest.raises(TilecError, match=r"tensor attribute tabs\[1\] was replaced after compiling"):
        twin(torch.randn(4, 8))


def test_long_containers_of_data_are_not_walked_for_tensors():
    """A 200 000-entry vocabulary dict took 0.25 s to walk at every compile and every full look of the watch (a
    helper's finding): a container longer than 256 items is walked only where its first 256 hold a tensor."""
    from tilec.capture import tensor_attributes

    m = torch.nn.Module()
    m.vocab = {str(i): i for i in range(1000)}
    m.merges = [("a", "b")] * 1000
    m.tables = [torch.randn(2) for _ in range(300)]
    names = tensor_attributes(m)
    assert len(names) == 300 and "tables[299]" in names and not any("vocab" in n or "merges" in n for n in names)
