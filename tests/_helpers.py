"""Shared test helpers (imported by the test modules; pytest puts ``tests/`` on ``sys.path``)."""
from __future__ import annotations

import collections
import contextlib
import signal
import threading

import torch


# Tiny configs of HF decoder families beyond Llama / Qwen3 (tests/test_hf_architectures.py on the CPU,
# tests/gpu/test_cuda_hf_families.py on the CUDA executor).
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, pad_token_id=0)

FAMILIES = {  # name: (config class, model class, config overrides; "attn": the attention implementation, SDPA by default)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=2.0, residual_multiplier=0.5,
                                                            attention_multiplier=0.2, logits_scaling=4.0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=4)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),  # layer 1 without RoPE
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=None)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(head_dim=16)),
    "hunyuan": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=16)),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(head_dim=16)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, attn="eager")),
    "llama_eager": ("LlamaConfig", "LlamaForCausalLM", dict(attn="eager")),  # attention written out in torch ops
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(head_dim=16)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=16)),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
}


def family_model(family: str, dtype: torch.dtype, device: str):
    """A tiny random model of ``FAMILIES[family]`` (seeded, eval mode, SDPA attention unless it says) in ``dtype``
    on ``device``; skips the test when this transformers has no such config class."""
    import pytest
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, cfg_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cfg_name}")
    torch.manual_seed(0)
    extra = dict(extra)
    attn = extra.pop("attn", "sdpa")
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    cfg._attn_implementation = attn
    return getattr(transformers, model_name)(cfg).eval().to(device=device, dtype=dtype)


class Fn(torch.nn.Module):
    """Wraps a function of (module, *inputs); ``params`` become registered parameters."""

    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            setattr(self, k, torch.nn.Parameter(v))

    def forward(self, *args):
        return self.fn(self, *args)


class LlamaRMSNorm(torch.nn.Module):
    """HF ``LlamaRMSNorm`` written out: float32 statistics, ``x * rsqrt(...)`` rounded to x's dtype, then
    the weight - the rounding tilec's rmsnorm op and its GEMV prologue implement. (``torch.nn.RMSNorm``
    on bf16 rows does not round before the weight: tilec plans it as an upcast and a float32 norm.)"""

    def __init__(self, d: int, eps: float = 1e-5, dtype=torch.bfloat16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


SPLIT = dict(workers=6, attn_kv_chunk=4)  # 4-position splits: every head's attention splits (fold tests)


def kinds(graph) -> "collections.Counter[str]":
    """How many ops of each kind ``graph`` (an OpGraph) has (0 for a kind it has none of)."""
    return collections.Counter(op.kind for op in graph.ops)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 error ``|a - e| / |e|`` in float64 (``|e|`` must be non-zero)."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    assert torch.isfinite(a).all(), "result has NaN/Inf (an element was never written?)"
    norm = e.norm()
    assert norm > 0, "reference is all zeros: the comparison would prove nothing"
    return float((a - e).norm() / norm)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4, what: str = "output") -> None:
    err = rel_l2(actual, expected)
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.0e}"


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fails the test (instead of hanging CI) if the block runs longer than ``seconds``."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s (hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class StageRecorder:
    """A pipeline hook collecting ``{stage name: IR}`` in call order."""

    def __init__(self):
        self.stages: dict[str, object] = {}
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, ir, seconds: float) -> None:
        self.stages[name] = ir
        self.seconds[name] = seconds

    def render(self, name: str) -> str:
        return self.stages[name].render()


def step_pair(name: str, dtype: torch.dtype, off: dict):
    """A tiny zoo model's decode step (2 sequences, context 6) compiled twice on the CPU (6 workers):
    with the default options and with the options ``off``. Returns ``(model, token, on, off)``, each
    step a ``(compiled step, its own copy of the cache)`` pair."""
    import copy

    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model(name, dtype, "cpu")
    cache, tok = prefill(model, 2, 6, 12, "cpu")
    cache_off = copy.deepcopy(cache)
    on = compile_decode_step(model, cache, 2, options=dict(workers=6))
    other = compile_decode_step(model, cache_off, 2, options=dict(workers=6, **off))
    return model, tok, (on, cache), (other, cache_off)


def assert_steps_bitwise_equal(a, b, tok: torch.Tensor, what: str, steps: int = 3, position: int = 6) -> None:
    """Runs the ``(step, cache)`` pairs ``a`` and ``b`` (from :func:`step_pair`) ``steps`` greedy steps
    from ``position``; their logits and caches must be bitwise equal."""
    (sa, ca), (sb, cb) = a, b
    for i in range(steps):
        x, y = sa(tok, position + i), sb(tok, position + i)
        assert torch.equal(x, y), f"step {i}: {what} logits differ"
        tok = x.argmax(-1)
    for la, lb in zip(ca.layers, cb.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def fold_pair(name: str, dtype: torch.dtype, on: dict, off: dict, hook=None):
    """A tiny zoo model's decode step (2 sequences, context 6, a 16-position cache) compiled on the CPU
    with the options ``on`` and ``off`` (the fold tests: ``SPLIT`` plus a fold switched). Returns
    ``(model, token, (on step, its cache), (off step, its cache), want)`` with ``want`` eager's logits at
    position 6 from a third copy of the cache; ``hook`` sees the ``on`` compile's stages."""
    import copy

    from tilec.hf import compile_decode_step
    from tilec.zoo import eager_step, make_model, prefill

    model = make_model(name, dtype, "cpu")
    cache, tok = prefill(model, 2, 6, 16, "cpu")
    eager_cache, cache_off = copy.deepcopy(cache), copy.deepcopy(cache)
    step_on = compile_decode_step(model, cache, 2, options=on, hook=hook)
    step_off = compile_decode_step(model, cache_off, 2, options=off)
    return model, tok, (step_on, cache), (step_off, cache_off), eager_step(model, eager_cache, tok, 6)


def assert_fold_pair_matches(tok, on, off, want, what: str, steps: int = 3) -> None:
    """``on``'s step at position 6 within relative L2 1e-5 (float32) / 2e-2 (bf16) of ``want``, then
    ``on`` and ``off`` (from :func:`fold_pair`) bitwise equal over ``steps`` greedy steps."""
    got = on[0](tok, 6)
    tol = 1e-5 if got.dtype == torch.float32 else 2e-2
    assert rel_l2(got, want) < tol
    on[0].seek(6)
    assert_steps_bitwise_equal(on, off, tok, what, steps=steps)


def attention_graph(b, hq, hkv, sq, s, d, dv, causal=True, scale=0.125, dtype=torch.float32):
    """One decode ``attention`` op: q [b, hq, sq, d] (input), k/v [b, hkv, s, d|dv] (caches)."""
    from tilec.ir import Buffer, BufferKind, Op, OpGraph, View

    bufs = {"q": Buffer("q", (b, hq, sq, d), dtype, BufferKind.INPUT),
            "k": Buffer("k", (b, hkv, s, d), dtype, BufferKind.STATE),
            "v": Buffer("v", (b, hkv, s, dv), dtype, BufferKind.STATE),
            "out": Buffer("out", (b, hq, sq, dv), dtype, BufferKind.OUTPUT)}
    w = {n: View.whole(x) for n, x in bufs.items()}
    op = Op("attn", "attention", (w["q"], w["k"], w["v"]), (w["out"],), (("causal", causal), ("scale", scale)))
    return OpGraph((op,), bufs, ("q", "k", "v", "<position>"), (w["out"],),
                   max_positions=s - sq + 1 if causal else 1)


def run_plan(plan, executor, tensors: dict, position: int, device) -> dict:
    """Runs ``plan`` once on ``executor`` at decode ``position`` over ``tensors`` (name -> tensor),
    adding every other buffer of the plan filled with NaN (so a read of an unwritten element
    shows); returns ``tensors``."""
    for name, buf in plan.graph.buffers.items():
        tensors.setdefault(name, torch.full(buf.shape, float("nan"), dtype=buf.dtype, device=device))
    executor.run(tensors, plan.bind(tensors, position))
    return tensors


def rope_append_graph(b, hq, hkv, sq, s, d, dv, dtype=torch.float32):
    """A decode step's attention with its cache writes: the queries' and the new keys' rotate-half
    RoPE (ops ``rope``; cos / sin [b, sq, d] inputs broadcast over the heads), the new keys and
    values written into the caches at the step's position (k through the rope op's output view,
    v by a ``cache_write``), then a causal ``attention`` over the caches - what
    ``fold_rope`` / ``fold_kv_append`` fold into the split-KV tiles. Inputs x [b, hq, sq, d],
    kx [b, hkv, sq, d], vx [b, hkv, sq, dv], cos, sin, and the caches k [b, hkv, s, d], v [b, hkv,
    s, dv] (state); output out [b, hq, sq, dv]."""
    from tilec.ir import Buffer, BufferKind, Op, OpGraph, View

    inp, state = BufferKind.INPUT, BufferKind.STATE
    bufs = {"x": Buffer("x", (b, hq, sq, d), dtype, inp), "kx": Buffer("kx", (b, hkv, sq, d), dtype, inp),
            "vx": Buffer("vx", (b, hkv, sq, dv), dtype, inp), "cos": Buffer("cos", (b, sq, d), dtype, inp),
            "sin": Buffer("sin", (b, sq, d), dtype, inp), "q": Buffer("q", (b, hq, sq, d), dtype, BufferKind.TEMP),
            "k": Buffer("k", (b, hkv, s, d), dtype, state), "v": Buffer("v", (b, hkv, s, dv), dtype, state),
            "out": Buffer("out", (b, hq, sq, dv), dtype, BufferKind.OUTPUT)}
    w = {n: View.whole(x) for n, x in bufs.items()}
    rot = {(n, h): View(n, (b, h, sq, d), (sq * d, 0, d, 1), 0, 0) for n in ("cos", "sin") for h in (hq, hkv)}
    cache = {n: View(n, (b, hkv, s, e), (hkv * s * e, s * e, e, 1), 0, 0) for n, e in (("k", d), ("v", dv))}
    slot = {n: View(n, (b, hkv, sq, e), (hkv * s * e, s * e, e, 1), 0, e) for n, e in (("k", d), ("v", dv))}
    style = (("style", 0),)
    ops = (Op("rope_q", "rope", (w["x"], rot["cos", hq], rot["sin", hq]), (w["q"],), style),
           Op("rope_k", "rope", (w["kx"], rot["cos", hkv], rot["sin", hkv]), (slot["k"],), style),
           Op("write_v", "cache_write", (w["vx"],), (slot["v"],)),
           Op("attn", "attention", (w["q"], cache["k"], cache["v"]), (w["out"],),
              (("causal", True), ("scale", d ** -0.5))))
    return OpGraph(ops, bufs, ("x", "kx", "vx", "cos", "sin", "k", "v", "<position>"), (w["out"],),
                   max_positions=s - sq + 1)


def rope_append_inputs(b, hq, hkv, sq, s, d, dv, dtype, device, seed=0):
    """Random inputs of :func:`rope_append_graph` (cos / sin of random angles, rotate-half
    layout: the two halves of a row share their angles)."""
    g = torch.Generator().manual_seed(seed)
    angles = (torch.randn(b, sq, d // 2, generator=g) * 3).repeat(1, 1, 2)
    t = {"x": torch.randn(b, hq, sq, d, generator=g), "kx": torch.randn(b, hkv, sq, d, generator=g),
         "vx": torch.randn(b, hkv, sq, dv, generator=g), "cos": angles.cos(), "sin": angles.sin(),
         "k": torch.randn(b, hkv, s, d, generator=g), "v": torch.randn(b, hkv, s, dv, generator=g)}
    return {n: x.to(dtype).to(device) for n, x in t.items()}


# (batch, Hq, Hkv, Sq, S, D, Dv, dtype, attn_kv_chunk, positions): appended rows spanning two
# splits or (where the split is longer than a staged segment) two segments, D != Dv, fp16, several
# passes of 4 queries (G x Sq = 12, 8), short splits
APPEND_CASES = [
    (2, 8, 2, 3, 300, 32, 32, torch.bfloat16, 256, (125, 126, 127, 128, 254, 255)),
    (1, 8, 2, 3, 300, 96, 32, torch.bfloat16, 256, (60, 126, 254)),
    (2, 8, 2, 3, 300, 64, 64, torch.float16, 256, (40, 126, 127, 254)),
    (1, 16, 2, 2, 300, 64, 64, torch.bfloat16, 200, (63, 127, 198, 199)),
    (2, 12, 4, 3, 100, 32, 32, torch.bfloat16, 8, (6, 7, 50)),
]


def append_fold_results(case, executor: str, device: str):
    """For each position of an :data:`APPEND_CASES` case, the buffers ``out``, ``k``, ``v`` after
    one run of the plan with ``fold_kv_append`` on and off (``{True: {...}, False: {...}}``), on
    ``executor`` ("reference" or "cuda"), 16 workers."""
    from tilec.options import Options
    from tilec.pipeline import compile_opgraph

    b, hq, hkv, sq, s, d, dv, dtype, chunk, positions = case
    inputs = rope_append_inputs(b, hq, hkv, sq, s, d, dv, dtype, device)
    runs = {}
    for fold in (True, False):
        plan = compile_opgraph(rope_append_graph(b, hq, hkv, sq, s, d, dv, dtype),
                               Options(executor=executor, workers=16, attn_kv_chunk=chunk,
                                       fold_kv_append=fold)).plan
        if executor == "cuda":
            from tilec.cuda import CudaExecutor
            ex = CudaExecutor(plan, Options(executor="cuda"), torch.device(device))
        else:
            from tilec.refexec import ReferenceExecutor
            ex = ReferenceExecutor(plan)
        appends = [op for op in plan.graph.ops if op.kind == "attention_partial" and op.attr("append")]
        assert len(appends) == (1 if fold else 0), "the case must (only) fold with fold_kv_append"
        runs[fold] = (plan, ex)
    out = []
    for p in positions:
        res = {}
        for fold, (plan, ex) in runs.items():
            t = run_plan(plan, ex, {n: x.clone() for n, x in inputs.items()}, p, device)
            res[fold] = {n: t[n] for n in ("out", "k", "v")}
        out.append((p, res))
    return out


def gemv_groups_graph(**options):
    """llama-tiny's OpGraph after the gemv_groups stage (2 layers, float32, prefilled to 4 of 12
    positions, ``SPLIT``'s split-KV attention) compiled with ``options`` on top of ``SPLIT``."""
    from tilec.hf import compile_decode_step
    from tilec.zoo import make_model, prefill

    model = make_model("llama-tiny", torch.float32, "cpu")
    cache, _ = prefill(model, 1, 4, 12, "cpu")
    rec = StageRecorder()
    compile_decode_step(model, cache, 1, options=dict(SPLIT, **options), hook=rec)
    return rec.stages["gemv_groups"]


def greedy_generate(model, compiled: bool, new_tokens: int, options: dict | None = None, **kw):
    """HF greedy ``generate()`` of ``new_tokens`` with a static cache, through
    ``torch.compile(model.forward, backend="tilec", options=...)`` when ``compiled`` (forward and
    Dynamo's caches restored after)."""
    import tilec.backend  # noqa: F401  (registers backend="tilec" when run from the source tree)

    forward = model.forward
    if compiled:
        model.forward = torch.compile(forward, backend="tilec", options=options, dynamic=False)
    try:
        return model.generate(**kw, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                              pad_token_id=0, disable_compile=True)  # on a GPU HF would wrap tilec in Inductor
    finally:
        model.forward = forward
        torch._dynamo.reset()


class TransposedCacheStep(torch.nn.Module):
    """A toy decode step over caches kept [B, L, H, D] and passed transposed, [B, H, L, D] views (a fresh user's)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)

    def forward(self, x, pos, kc, vc):
        b = x.shape[0]
        q, k, v = self.qkv(x).view(b, 1, 3, self.heads, self.dh).unbind(2)
        q, k, v = [t.transpose(1, 2) for t in (q, k, v)]
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v)
        mask = (torch.arange(kc.shape[2]) <= pos).view(1, 1, 1, -1)
        a = torch.nn.functional.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        return x + self.o(a.transpose(1, 2).reshape(b, 1, -1))


class ScaledLayer(torch.nn.Module):
    """A Linear [width -> width] times a buffer ``scale`` [width] of value ``s`` (a buffer tilec folds)."""

    def __init__(self, s: float, width: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.register_buffer("scale", torch.full((width,), s))

    def forward(self, x):
        return self.lin(x) * self.scale
