"""Whole HF decoders (random weights, static KV cache): compiled decode steps vs eager HF.

Prefill 4 tokens eagerly, deep-copy the cache for the eager reference, compile one decode
step with :func:`tilec.hf.compile_decode_step`, then run three consecutive decode steps on
both and compare the logits and every layer's key/value cache (1e-4 relative L2), plus the
slot each step writes on its own.
"""
from __future__ import annotations

import copy

import pytest
import torch

from _helpers import assert_close, rel_l2
from tilec.errors import PositionError, TilecError
from tilec.hf import cache_kwargs, compile_decode_step

transformers = pytest.importorskip("transformers")

MAX_CACHE_LEN = 16
PREFILL = 4
STEPS = 3
TOL = 1e-4


def llama_config():
    return transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=128,
        attn_implementation="sdpa")


def qwen3_config():
    return transformers.Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=500, max_position_embeddings=128,
        attn_implementation="sdpa")


MODELS = {
    "llama": (transformers.LlamaForCausalLM, llama_config),
    "qwen3": (transformers.Qwen3ForCausalLM, qwen3_config),
}


def build(arch: str, batch: int, seed: int = 0):
    """(model, prefilled StaticCache, vocab size), deterministic for (arch, batch, seed)."""
    cls, make_cfg = MODELS[arch]
    cfg = make_cfg()
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    assert model.config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    cache = transformers.StaticCache(config=cfg, max_cache_len=MAX_CACHE_LEN)
    ids = torch.randint(0, cfg.vocab_size, (batch, PREFILL))
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache), cache_position=torch.arange(PREFILL), use_cache=True)
    return model, cache, cfg.vocab_size


def run_and_compare(arch: str, batch: int, options: dict):
    model, cache, vocab = build(arch, batch)
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, batch_size=batch, options=options)
    assert step.program.plan.workers == options.get("workers", 132)
    gen = torch.Generator().manual_seed(1)
    pos = PREFILL
    for s in range(STEPS):
        tok = torch.randint(0, vocab, (batch, 1), generator=gen)
        with torch.no_grad():
            ref = model(tok, **cache_kwargs(model, eager_cache), cache_position=torch.tensor([pos]), use_cache=True).logits
        out = step(tok, pos)
        assert out.shape == ref.shape == (batch, 1, vocab)
        assert_close(out, ref, TOL, f"{arch} B={batch} step {s}: logits")
        for li, (got, want) in enumerate(zip(cache.layers, eager_cache.layers)):
            assert_close(got.keys, want.keys, TOL, f"{arch} B={batch} step {s}: layer {li} key cache")
            assert_close(got.values, want.values, TOL, f"{arch} B={batch} step {s}: layer {li} value cache")
            # the slot this step wrote, on its own (a missed write must not hide in the average)
            assert_close(got.keys[:, :, pos], want.keys[:, :, pos], TOL, f"layer {li} keys at slot {pos}")
            assert_close(got.values[:, :, pos], want.values[:, :, pos], TOL, f"layer {li} values at slot {pos}")
            assert got.keys[:, :, pos + 1:].abs().sum() == 0, "wrote past the decode position"
            if isinstance(getattr(want, "cumulative_length", None), torch.Tensor):
                assert int(got.cumulative_length) == int(want.cumulative_length) == pos + 1
        pos += 1
    # new token tensors every step: staged into the program's buffer, one operand table
    assert len(step.program._tables) == 1
    return step


@pytest.mark.parametrize("batch", [1, 2])
def test_llama_decode_steps_match_eager(batch):
    step = run_and_compare("llama", batch, dict(workers=8 if batch == 1 else 5))
    stats = step.program.stats
    assert stats["deps_after_fusion"] < stats["deps_before_fusion"], stats
    assert stats["events_after_fusion"] < stats["events_before_fusion"], stats
    kinds = {op.kind for op in step.program.compiled.stages['opgraph'].ops}
    assert {"embedding", "rmsnorm", "linear", "rope", "cache_write", "attention", "silu_mul"} <= kinds
    # GQA: the attention op reads the 2 KV heads directly (no repeat_kv copy)
    att = next(op for op in step.program.compiled.stages['opgraph'].ops if op.kind == "attention")
    assert att.inputs[0].shape[1] == 8 and att.inputs[1].shape[1] == 2 and att.inputs[2].shape[1] == 2


@pytest.mark.parametrize("batch", [1, 2])
def test_qwen3_decode_steps_match_eager(batch):
    step = run_and_compare("qwen3", batch, dict(workers=6, scheduler="round_robin" if batch == 2 else "list"))
    # q_norm / k_norm: per-head RMSNorms in front of RoPE, two more per layer than Llama
    n_rms = sum(op.kind == "rmsnorm" for op in step.program.compiled.stages['opgraph'].ops)
    assert n_rms == 2 * 4 + 1


def test_seek_redecodes_a_position_and_skipping_one_is_an_error():
    model, cache, vocab = build("llama", 1)
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    tok = torch.tensor([[7]])
    first = step(tok, PREFILL)
    if any(isinstance(getattr(l, "cumulative_length", None), torch.Tensor) for l in cache.layers):
        with pytest.raises(ValueError, match=f"position {PREFILL}, but the cache holds {PREFILL + 1} tokens.*"
                                             r"call step.seek\(position\) first"):
            step(tok, PREFILL)  # the same position again, without seek
        with pytest.raises(ValueError, match="consecutive positions"):
            step(tok, PREFILL + 2)  # a skipped position
    step.seek(torch.tensor(PREFILL))  # a 0-d integer tensor is a position too
    again = step(tok, torch.tensor([PREFILL]))  # re-decoding gives the same logits
    assert torch.equal(first, again)
    with torch.no_grad():
        ref = model(tok, **cache_kwargs(model, eager_cache), cache_position=torch.tensor([PREFILL]), use_cache=True).logits
    assert_close(again, ref, TOL, "logits after seek")
    nxt = step(tok, PREFILL + 1)  # and decoding goes on from there
    assert nxt.shape == (1, 1, vocab)
    with pytest.raises(TilecError, match="outside the planned range"):
        step.seek(MAX_CACHE_LEN)


def test_cache_errors_name_the_cache_tensors():
    """Refusals of a cache tensor named tilec's own arguments ("argument 2 (state_0)"), which the user of
    compile_decode_step never passes (a fresh user's finding): now ``cache.layers[i].keys`` / ``.values``."""
    model, cache, _ = build("llama", 1)
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    tok = torch.tensor([[7]])
    keys0, values1 = cache.layers[0].keys, cache.layers[1].values
    cache.layers[1].values = keys0  # two cache tensors alias
    with pytest.raises(TilecError, match=r"^cache\.layers\[0\]\.keys and cache\.layers\[1\]\.values share memory"):
        step(tok, PREFILL)
    cache.layers[1].values = values1
    values0 = cache.layers[0].values
    cache.layers[0].values = values0.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, not contiguous
    with pytest.raises(TilecError, match=r"^cache\.layers\[0\]\.values is updated in place and must be contiguous"):
        step(tok, PREFILL)
    cache.layers[0].values = values0
    assert step(tok, PREFILL).shape == (1, 1, 1000)  # nothing broken by the refusals


def test_one_step_called_from_two_threads_stays_correct():
    """Two threads calling one step at once raised false deadlock errors, and later single-threaded calls
    returned NaN logits: the calls shared the executor's event counters and the step's temporaries without a
    lock (a fresh user's finding). Calls are serialized now; each thread's re-decode of the position is eager's."""
    import threading

    model, cache, _ = build("llama", 1)
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    tok = torch.tensor([[7]])
    with torch.no_grad():
        ref = model(tok, **cache_kwargs(model, eager_cache), cache_position=torch.tensor([PREFILL]), use_cache=True).logits
    errors, worst = [], []

    def worker():
        for _ in range(15):
            try:
                step.seek(PREFILL)
                got = step(tok, PREFILL)
                worst.append(rel_l2(got, ref))
            except PositionError:  # the other thread stepped in between: the position is refused, as it should be
                pass
            except Exception as e:  # noqa: BLE001 - any other error is the finding
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]
    step.seek(PREFILL)
    assert_close(step(tok, PREFILL), ref, TOL, "logits after the threads")
    assert worst and max(worst) < TOL


def test_copies_of_a_step_share_or_own_its_lock_as_they_share_its_state():
    """A shallow copy shares the program's executor and temporaries, so it shares the lock too (a fresh lock let a
    copy's call race the original's: a reviewer's finding); a deep copy, with its own state, has its own and runs."""
    model, cache, _ = build("llama", 1)
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    assert copy.copy(step)._lock is step._lock and copy.copy(step.program)._lock is step.program._lock
    twin = copy.deepcopy(step)
    assert twin._lock is not step._lock and twin.program._lock is not step.program._lock
    tok = torch.tensor([[7]])
    assert torch.equal(twin(tok, PREFILL), step(tok, PREFILL))


def _counts_tokens(cache) -> bool:
    return any(isinstance(getattr(l, "cumulative_length", None), torch.Tensor) for l in cache.layers)


def test_a_cache_changed_behind_the_step_is_checked_again():
    """The step skips reading the cache's counters when its own last step left them at the position asked for;
    it once did so also after an eager forward, ``cache.reset()`` or another compiled step over the cache had
    changed them (a fresh user's finding): it wrote position 6 into a cache holding 3 tokens, with no error."""
    model, cache, _ = build("llama", 1)
    if not _counts_tokens(cache):
        pytest.skip("this transformers' StaticCache counts no tokens")
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    tok = torch.tensor([[7]])
    step(tok, PREFILL)
    assert step._unchanged(step._counters(), PREFILL + 1)  # consecutive steps: no device read
    cache.reset()  # a new prompt of 3 tokens, prefilled eagerly
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache_position=torch.arange(3), use_cache=True, **cache_kwargs(model, cache))
    with pytest.raises(ValueError, match=f"position {PREFILL + 1}, but the cache holds 3 tokens"):
        step(tok, PREFILL + 1)
    step(tok, 3)  # where the cache is
    other = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    other(tok, 4)  # another compiled step over the same cache moves it on
    with pytest.raises(ValueError, match="position 4, but the cache holds 5 tokens"):
        step(tok, 4)
    step(tok, 5)


def test_a_called_step_and_its_cache_are_freed():
    """The record of the cache's last compiled writer held the step itself, which holds the cache: neither was
    ever freed (a reviewer's finding: a whole KV cache and the program kept a step)."""
    import gc
    import weakref

    model, cache, _ = build("llama", 1)
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    step(torch.tensor([[7]]), PREFILL)
    gone = weakref.ref(cache), weakref.ref(step)
    del step, cache
    gc.collect()
    assert [r() for r in gone] == [None, None]


def test_a_cache_made_under_inference_mode_is_stepped_inside_it():
    """Compiling over it outside inference mode ended in torch's raw RuntimeError from inside the export, and a
    call outside it in a failed task (a fresh user's finding): both are named now; inside it the step matches."""
    from tilec.errors import InputError

    from tilec.zoo import prefill

    model, _, _ = build("llama", 1)
    with torch.inference_mode():  # (a pipeline's prefill)
        cache, _ = prefill(model, batch=1, context=PREFILL, max_cache_len=MAX_CACHE_LEN)
        eager_cache = copy.deepcopy(cache)
    with pytest.raises(InputError, match=r"made under torch.inference_mode\(\).*compile and call the step inside"):
        compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    tok = torch.tensor([[7]])
    with torch.inference_mode():
        step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
        got = step(tok, PREFILL)
        want = model(tok, cache_position=torch.tensor([PREFILL]), use_cache=True, **cache_kwargs(model, eager_cache)).logits
    assert_close(got, want, TOL, "logits")
    with pytest.raises(InputError, match=r"call the step inside torch.inference_mode\(\)"):
        step(tok, PREFILL + 1)


def test_a_cache_prefilled_with_grad_on_gives_logits_without_autograd_history():
    """A prefill outside torch.no_grad leaves the cache with a grad history; the reference executor's torch ops then
    gave the step's logits one (requires_grad, CloneBackward0), whose backward() failed on an unrelated in-place
    error (a fresh user's finding)."""
    cls, make_cfg = MODELS["llama"]
    torch.manual_seed(0)
    model = cls(make_cfg()).eval()
    cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)
    model(torch.randint(0, 1000, (1, PREFILL)), **cache_kwargs(model, cache), cache_position=torch.arange(PREFILL),
          use_cache=True)  # grad mode on
    assert cache.layers[0].keys.requires_grad
    with torch.no_grad():  # the same cache's values for eager, detached (a graph's tensors do not deep-copy)
        eager_cache = transformers.StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)
        model(torch.zeros(1, PREFILL, dtype=torch.long), **cache_kwargs(model, eager_cache),
              cache_position=torch.arange(PREFILL), use_cache=True)
        for mine, theirs in zip(eager_cache.layers, cache.layers):
            mine.keys.copy_(theirs.keys)
            mine.values.copy_(theirs.values)
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    tok = torch.tensor([[7]])
    got = step(tok, PREFILL)
    assert not got.requires_grad and got.grad_fn is None
    with torch.no_grad():
        want = model(tok, cache_position=torch.tensor([PREFILL]), use_cache=True, **cache_kwargs(model, eager_cache)).logits
    assert_close(got, want, TOL, "logits")


def test_decode_position_outside_planned_range_raises():
    model, cache, vocab = build("llama", 1)
    step = compile_decode_step(model, cache, batch_size=1, options=dict(workers=4))
    with pytest.raises(TilecError, match="position 16 outside"):
        step(torch.zeros(1, 1, dtype=torch.int64), MAX_CACHE_LEN)


def test_uninitialized_cache_is_rejected():
    cfg = qwen3_config()
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=MAX_CACHE_LEN)
    with pytest.raises(ValueError, match="prefill"):
        compile_decode_step(model, cache, batch_size=1)


def test_rel_l2_helper_rejects_zero_reference():
    with pytest.raises(AssertionError, match="zeros"):
        rel_l2(torch.zeros(3), torch.zeros(3))


@pytest.mark.parametrize("extra", [-1, 1])
def test_static_cache_step_checks_its_state_count(extra):
    """One state tensor too few or too many is an InputError naming both counts (it was an
    IndexError inside tilec/hf.py, or silently ignored)."""
    from tilec.errors import InputError
    from tilec.hf import StaticCacheStep

    model, cache, vocab = build("llama", 1)
    mod = StaticCacheStep(model, cache)
    state = mod.state()
    want = len(state)
    state = state[:-1] if extra < 0 else state + [state[0]]
    ids = torch.randint(0, vocab, (1, 1))
    with pytest.raises(InputError, match=f"takes {want} state tensors .*; got {want + extra}$"):
        mod(ids, torch.tensor([PREFILL]), *state)
    assert mod(ids, torch.tensor([PREFILL]), *mod.state()).shape == (1, 1, vocab)



def test_static_cache_step_needs_a_prefilled_static_cache():
    from tilec.errors import InputError
    from tilec.hf import StaticCacheStep

    cfg = llama_config()
    model = transformers.LlamaForCausalLM(cfg).eval()
    with pytest.raises(InputError, match="needs a transformers StaticCache prefilled eagerly.*got NoneType$"):
        StaticCacheStep(model, None)
    dynamic = transformers.DynamicCache()
    with pytest.raises(InputError, match="got DynamicCache, whose tensors grow every step"):  # it said "got 0" later
        StaticCacheStep(model, dynamic)
    fresh = transformers.StaticCache(config=cfg, max_cache_len=MAX_CACHE_LEN)
    if not all(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in fresh.layers):  # lazily allocated
        with pytest.raises(InputError, match="unallocated layers: run a prefill step first"):
            StaticCacheStep(model, fresh)


def test_state_count_error_passes_through_compile_module():
    """The wrapper's own InputError reaches the user as it is, not as 'the module fails on its example
    arguments at tilec/hf.py'."""
    from tilec.api import compile_module
    from tilec.errors import ExampleInputError, InputError
    from tilec.hf import StaticCacheStep

    model, cache, vocab = build("llama", 1)
    mod = StaticCacheStep(model, cache)
    state = mod.state()
    with pytest.raises(InputError, match=f"takes {len(state)} state tensors") as info:
        compile_module(mod, (torch.randint(0, vocab, (1, 1)), torch.tensor([PREFILL]), *state[:-1]),
                       positions=[1], max_positions=MAX_CACHE_LEN)
    assert not isinstance(info.value, ExampleInputError)
