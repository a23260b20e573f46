"""Whole decode steps of HF models on the CUDA executor (bf16, StaticCache), against eager.

The full-size cases (Llama-3.2-1B, Qwen3-0.6B shapes, context 1024) are the acceptance
runs of the CUDA-executor issue; the tiny ones are quick smoke tests.
"""
import copy

import pytest
import torch

from tilec import smem
from tilec.errors import TilecError
from tilec.hf import compile_decode_step
from tilec.timing import cuda_graph
from tilec.zoo import eager_step, make_model, prefill

DEV = "cuda"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cache_rel(c1, c2):
    return max(max(rel(a.keys, b.keys), rel(a.values, b.values)) for a, b in zip(c1.layers, c2.layers))


CASES = [
    ("llama-tiny", 1, 32, 8),
    ("qwen3-tiny", 2, 32, 8),
    ("llama-tiny", 12, 32, 8),  # 12 rows: every GEMV tile streams to the tensor-core ring consumer
    pytest.param("llama-3.2-1b", 1, 1024, 100, marks=pytest.mark.slow),
    pytest.param("qwen3-0.6b", 1, 1024, 100, marks=pytest.mark.slow),
    pytest.param("qwen3-0.6b", 4, 1024, 100, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,batch,context,steps", CASES)
def test_decode_matches_eager(name, batch, context, steps):
    """The CUDA-executor issue's criteria, judged against the bf16 noise floor.

    Two eager bf16 runs that differ only in the SDPA kernel (default vs math) are already
    2.7e-2 apart on Llama-3.2-1B shapes with random weights (benchmarks/bf16_noise.py), so the
    comparison with eager bf16 allows max(2e-2, 1.25 x that distance). Greedy agreement must
    reach 95 % of the steps, where a step also agrees when tilec's token and eager's are a bf16
    tie: in every batch row where they differ, eager's logits of the two differ by no more than
    eager's own default-SDPA and math-SDPA logits of that row differ anywhere (random weights
    make near-ties common; the math-SDPA run itself agreed with eager in 90-96 of 100 steps on
    these shapes, varying from run to run with the eager tokens). The float32 criterion (no
    farther from fp32 than 1.5 x eager bf16) and the KV-cache check are as the issue states.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model(name, torch.bfloat16, DEV)
    cache, tok = prefill(model, batch, context, context + steps + 8, DEV)
    eager_cache, math_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    step = compile_decode_step(model, cache, batch)
    assert step.program.executor_kind == "cuda"

    model32 = copy.deepcopy(model).float()
    cache32 = copy.deepcopy(cache)
    for layer in cache32.layers:
        layer.keys, layer.values = layer.keys.float(), layer.values.float()
    ref32 = eager_step(model32, cache32, tok, context)
    del model32, cache32

    agree = agree_math = ties = 0
    for i in range(steps):
        pos = context + i
        want = eager_step(model, eager_cache, tok, pos)
        with sdpa_kernel([SDPBackend.MATH]):
            other = eager_step(model, math_cache, tok, pos)
        got = step(tok, pos)
        if i == 0:
            r, floor = rel(got, want), rel(other, want)
            d_tilec, d_eager = rel(got, ref32), rel(want, ref32)
            print(f"{name} b{batch}: rel L2 vs eager bf16 {r:.2e} (eager math-SDPA vs eager {floor:.2e}); "
                  f"vs fp32: tilec {d_tilec:.2e} eager {d_eager:.2e}")
            assert r <= max(2e-2, 1.25 * floor)
            assert d_tilec <= 1.5 * d_eager
        same = torch.equal(got.argmax(-1), want.argmax(-1))
        agree += int(same)
        agree_math += int(torch.equal(other.argmax(-1), want.argmax(-1)))
        if not same:  # per row: eager's logit gap between its token and tilec's, vs the eager runs' largest difference
            w = want.float()
            gap = w.amax(-1) - w.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)  # [B, 1]; 0 where the row agrees
            ties += int(bool((gap <= (other.float() - w).abs().amax(-1)).all()))
        tok = want.argmax(-1)  # every variant is fed eager's tokens
    c = cache_rel(cache, eager_cache)
    print(f"{name} b{batch}: greedy agreement with eager {agree}/{steps}, {ties} more within bf16 ties "
          f"(eager math-SDPA {agree_math}/{steps}); cache rel {c:.2e}")
    assert agree + ties >= 0.95 * steps
    assert c < 2e-2


def greedy_on_off(model, cache, tok, batch: int, position: int, options, steps: int = 10) -> dict:
    """For fold True and False: the decode step compiled with ``options(fold)`` over a copy of
    ``cache``, run ``steps`` greedy steps from ``position``: ``{fold: (logits per step, the cache
    copy, the step)}``."""
    out = {}
    for fold in (True, False):
        c = copy.deepcopy(cache)
        step = compile_decode_step(model, c, batch, options=options(fold))
        logits, t = [], tok
        for i in range(steps):
            logits.append(step(t, position + i).clone())
            t = logits[-1].argmax(-1)
        out[fold] = (logits, c, step)
    return out


def assert_on_off_bitwise(out: dict, position: int) -> None:
    """:func:`greedy_on_off`'s two runs gave bitwise the same logits at every step and the same caches."""
    for i, (a, b) in enumerate(zip(out[True][0], out[False][0])):
        assert torch.equal(a, b), f"step {i} (position {position + i}): logits differ"
    assert cache_rel(out[True][1], out[False][1]) == 0.0


@pytest.mark.parametrize("name,batch", [("llama-tiny", 1), ("qwen3-tiny", 2)])
@pytest.mark.parametrize("option", ["fold_rope", "fold_kv_append", "fold_combine"])
def test_folds_are_bitwise(name, batch, option):
    """The queries' RoPE applied inside the split-KV attention tiles (``tilec.passes.fold_rope``),
    the step's new K / V rows written by those tiles (``fold_kv_append``, on by default with
    it), and the combine run by each head group's last partial tile to finish (``fold_combine``)
    give bitwise the logits and KV cache of the plan without the fold over 10 greedy steps
    from position 40 (16-position splits, so every head has several; at 48 the new row moves
    into the next split; Qwen3 also normalizes q and k before their RoPE)."""
    model = make_model(name, torch.bfloat16, DEV)
    cache, tok = prefill(model, batch, 40, 56, DEV)
    out = greedy_on_off(model, cache, tok, batch, 40, lambda fold: {option: fold, "attn_kv_chunk": 16})
    folded = {}
    for fold, (_, _, step) in out.items():
        kinds = [op.kind for op in step.program.compiled.stages["gemv_groups"].ops]
        assert kinds.count("attention_partial") == model.config.num_hidden_layers
        folded[fold] = kinds.count("rope") + kinds.count("cache_write") + kinds.count("attention_combine")
    assert folded[True] < folded[False]  # the folded ops are gone
    assert_on_off_bitwise(out, 40)


@pytest.mark.parametrize("heads", [8, 16])  # 2 KV heads: 4 or 8 queries a head group, one or two passes of 4
def test_append_in_later_segment_is_bitwise(heads):
    """An appending split-KV tile writes the step's new K / V rows into its staged rows as it
    stages them (and into the cache on its first pass of queries): in the first segment of its
    split or a later one. With 256-position splits llama-tiny's tiles stage 128 positions at a
    time (``attn_staged_seg`` with its scratch), so steps at positions 124..133 append in both
    segments of split 0; logits and cache bitwise those of the plan with separate cache writes."""
    model = make_model("llama-tiny", torch.bfloat16, DEV, num_attention_heads=heads)
    cache, tok = prefill(model, 1, 124, 300, DEV)
    out = greedy_on_off(model, cache, tok, 1, 124, lambda fold: {"fold_kv_append": fold, "attn_kv_chunk": 256})
    for _, _, step in out.values():
        # the staged segment: runtime/tilec/ops_attention.cuh attn_staged_seg (4 queries, D = Dv = 32)
        floats = smem.scratch_bytes(step.program.plan.graph) // 4
        seg = min(256, (floats - 4 * 256 - 32 - 4 * (39 + 19)) // (4 + 4 // 2 + (32 + 32 + 16) // 2))
        assert 124 < seg <= 133, f"segment of {seg} positions: positions 124..133 no longer cross one"
    assert_on_off_bitwise(out, 124)


def test_repeatable_bitwise():
    model = make_model("llama-3.2-1b", torch.bfloat16, DEV, layers=2)
    cache, tok = prefill(model, 1, 64, 80, DEV)
    step = compile_decode_step(model, cache, 1)
    first = step(tok, 64)
    runs = 1000

    def again():
        step.seek(64)  # re-decode the same position
        return step(tok, 64)

    same = sum(int(torch.equal(again(), first)) for _ in range(runs))
    assert same == runs  # no floating-point atomics in the default plan (the combine fold's count arrivals): bitwise


def test_watchdog_then_recovery():
    """A stuck wait raises within the watchdog bound; the next step is correct. The plan has
    split-KV attention with the combine fold, so the abort leaves arrival counters mid-step too
    (the executor zeroes them with the events)."""
    from tilec.cuda import WatchdogError
    from tilec.plan import F

    model = make_model("llama-tiny", torch.bfloat16, DEV)
    cache, tok = prefill(model, 1, 8, 48, DEV)
    eager_cache = copy.deepcopy(cache)
    step = compile_decode_step(model, cache, 1, options=dict(watchdog_ms=200, workers=16, attn_kv_chunk=8))
    prog = step.program
    assert prog.plan.arrivals > 0
    pos_t = torch.tensor([8], device=DEV)
    state = [torch.tensor(8, device=DEV) if t.dim() == 0 else t for t in step.module.state()]
    tensors, p = prog.bind_args((tok, pos_t, *state))
    table = prog.plan.bind(tensors, p)
    bad = prog.plan.queues.clone()
    w = next(w for w in range(bad.shape[0]) if bad[w, 0, F["wait_event"][0]] >= 0)
    bad[w, 0, F["wait_count"][0]] += 1000  # unsatisfiable
    import time
    t0 = time.perf_counter()
    with pytest.raises(WatchdogError, match="watchdog: worker"):
        prog.executor.run(tensors, table, queues=bad)
    assert time.perf_counter() - t0 < 5.0
    want = eager_step(model, eager_cache, tok, 8)
    got = step(tok, 8)
    assert rel(got, want) < 2e-2


def test_threads_on_their_own_cuda_streams_are_ordered():
    """The per-call lock orders the host side only: threads each on a CUDA stream of their own released it once their
    launch was queued, and the next launch could run beside it on the device over the same counters, operand table
    and temporaries (a reviewer's reading). A call on another stream than the last one's now waits for that stream."""
    import threading

    model = make_model("llama-tiny", torch.bfloat16, DEV)
    cache, tok = prefill(model, 1, 8, 48, DEV)
    step = compile_decode_step(model, cache, 1, options=dict(watchdog_ms=200, workers=16, attn_kv_chunk=8))
    want = step(tok, 8).clone()
    turn = threading.Lock()  # a seek and its step together (the position is the test's, not the race)
    outs, errors = [], []

    def worker():
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(40):
                try:
                    with turn:
                        step.seek(8)
                        outs.append(step(tok, 8))
                except Exception as e:  # noqa: BLE001 - any error is the finding
                    errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors[:2]
    assert len(outs) == 120 and all(torch.equal(o, want) for o in outs)


def test_a_step_called_then_captured_in_a_cuda_graph():
    """After the stream ordering above, a step called on the default stream and then captured into a CUDA graph (on
    torch.cuda.graph's side stream) made the capture wait on a stream outside it, which CUDA refuses (found by
    decode.py's CUDA-graph row on an H100). Captured calls skip the wait; the replay's logits are the step's. A step
    compiled with check=True (a synchronize after each call) cannot be captured: a clear error, not CUDA's."""

    model = make_model("llama-tiny", torch.bfloat16, DEV)
    cache, tok = prefill(model, 1, 8, 48, DEV)
    checked = compile_decode_step(model, cache, 1, options=dict(watchdog_ms=200, workers=16, attn_kv_chunk=8))
    checked(tok, 8)
    with pytest.raises(TilecError, match=r"check=True synchronizes after each call.*check=False"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            checked.seek(8)
            checked(tok, 8)
    step = compile_decode_step(model, cache, 1, options=dict(watchdog_ms=200, workers=16, attn_kv_chunk=8,
                                                             check=False))
    step.seek(8)  # (the seek inside the refused capture was captured, not run)
    want = step(tok, 8).clone()
    outs = []

    def again():  # as benchmarks/decode.py times the step under a graph
        step.seek(8)
        outs.append(step(tok, 8))
        return outs[-1]

    graph = cuda_graph(again)  # (warm-up calls on a side stream, then the capture on another)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[-1], want)
    assert torch.equal(again(), want)  # and a plain call after the graph


def test_a_deep_copy_of_a_step_decodes_on_its_own():
    """copy.deepcopy of a step on the CUDA executor failed (ctypes cannot copy the loaded library); the copy shares
    the library, owns its counters and cache, and decodes as the step does, bitwise."""
    model = make_model("llama-tiny", torch.bfloat16, DEV)
    cache, tok = prefill(model, 1, 8, 48, DEV)
    step = compile_decode_step(model, cache, 1, options=dict(watchdog_ms=200, workers=16, attn_kv_chunk=8))
    twin = copy.deepcopy(step)
    ex, twin_ex = step.program.executor, twin.program.executor
    assert twin_ex.lib is ex.lib and twin_ex.counters.data_ptr() != ex.counters.data_ptr()
    got = twin(tok, 8)
    want = step(tok, 8)
    assert torch.equal(got, want)
    for pos in range(9, 13):  # each decodes its own cache on: the same tokens, the same logits
        tok = want[:, -1:].argmax(-1)
        got, want = twin(tok, pos), step(tok, pos)
        assert torch.equal(got, want), pos


def test_pickling_a_step_on_the_cuda_executor_is_a_clear_error():
    """pickle.dumps of a CUDA step raised ctypes' "objects containing pointers cannot be pickled"; it is a
    TilecError saying what works instead, and the step still decodes after it."""
    import pickle

    model = make_model("llama-tiny", torch.bfloat16, DEV)
    cache, tok = prefill(model, 1, 8, 48, DEV)
    step = compile_decode_step(model, cache, 1, options=dict(watchdog_ms=200, workers=16, attn_kv_chunk=8))
    want = step(tok, 8)
    with pytest.raises(TilecError, match=r"CUDA executor cannot be pickled.*copy\.deepcopy"):
        pickle.dumps(step)
    step.seek(8)
    assert torch.equal(step(tok, 8), want)


def test_a_deep_copy_of_an_artifacts_program_runs_on_its_own_memory(tmp_path):
    """A deep copy of a program without a parameter watch (an artifact's) kept the original's operand tables, whose
    addresses are the original's buffers: the copy's launch read the original's staged input (a reviewer's
    finding). The copy now binds its own; the original's results stay its own."""
    from tilec import artifact
    from tilec.api import compile_module

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).to(DEV).eval()
    x, y = torch.randn(4, 64, device=DEV), torch.randn(4, 64, device=DEV)
    artifact.save(tmp_path / "a", compile_module(m, (x,), options=dict(workers=2)), (x,))
    prog = artifact.load(tmp_path / "a").program(executor="cuda")
    want = prog(x).clone()
    twin = copy.deepcopy(prog)
    got = twin(y)
    with torch.no_grad():
        assert rel(got, m(y)) < 1e-5 and torch.equal(prog(x), want)
