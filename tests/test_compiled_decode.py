"""The compiled decoding step (moectl.lm.compiled_decode) computes what the model's forward computes.

Its eager twin (``compile=False``, the same tensor code) equals the model's forward per family in
float32 to rounding, with left padding, and extends the cache the same way. Through the engine,
``compile_decode`` on against off: the same tokens, log-probabilities and switch rates while rows
join and leave, with routed requests in the batch (their steps take the lean forward and the engine
counts why). One test compiles for real (one row and several: two graphs, whatever the lengths).
"""

from __future__ import annotations

import copy

import pytest
import torch

import moectl
from moectl.adapters.inspect import inspect
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.lm.compiled_decode import CompiledDecode
from moectl.lm.step_weights import FAMILIES, step_weights
from moectl.routing.kv_cache import with_cache
from test_lean_decode import MASK, PROMPTS, _prefilled


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("opaque", [False, True])
def test_eager_twin_equals_the_models_forward(family, batch, opaque, monkeypatch):
    """``opaque``: every product through ``moectl::linear`` / ``moectl::routed_experts`` (what large
    models take), else traced products and gathered experts (what small ones take)."""
    if opaque:
        monkeypatch.setattr("moectl.lm.step_ops.KERNEL_BYTES", 0)
    model, _, _ = moectl.load(f"tiny:{family}", dtype="float32")
    weights, why = step_weights(model, inspect(model))
    assert weights is not None, why
    assert all(w.kernel_experts == opaque for w in weights.layers if w.gate_up is not None)
    step = CompiledDecode(weights, compile=False)
    cache, mask, positions = _prefilled(model, batch)
    token = torch.randint(3, 60, (batch,))
    ours, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
    with torch.no_grad():
        want = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, **with_cache(theirs),
                     use_cache=True).logits[:, -1]  # fmt: skip
        got, chosen, _, _ = step(token, mask, positions, ours)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert chosen.shape == (len(inspect(model).layers), batch, weights.top_k)
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=1e-6, atol=1e-6)


def test_what_it_does_not_cover_is_named():
    model, tok, _ = moectl.load("tiny:deepseek_v3", dtype="float32")
    weights, why = step_weights(model, inspect(model))
    assert weights is None and "deepseek_v3" in why
    with Engine(model, tok, EngineConfig(compile_decode=True)) as engine:
        assert "no compiled step" in engine.stats()["decode_forward"]["path"]


def test_offloading_builds_no_compiled_step():
    """Experts left in a checkpoint's shards (meta tensors until the offload runtime reads them) are
    named, and an offloading engine builds no compiled step at all: every step runs the experts' own
    modules, and a warm-up would compile (and fail on the meta experts) for nothing."""
    from moectl.offload.offload_config import OffloadConfig

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    layer = model.model.layers[1].mlp.experts
    real = layer.gate_up_proj
    layer.gate_up_proj = torch.nn.Parameter(torch.empty(real.shape, device="meta"), requires_grad=False)
    weights, why = step_weights(model, inspect(model))
    assert weights is None and "layer 1's experts are not in memory" in why
    layer.gate_up_proj = real
    engine = Engine(model, tok, EngineConfig(compile_decode=True, offload=OffloadConfig(budget=0.5)))
    with engine:
        assert engine.runner.compiled is None
        engine.generate(["hello"], SamplingParams(max_tokens=3, temperature=0))
        assert "failed" not in engine.stats()["decode_forward"]["path"]


def _run(model, tok, compile_decode: bool, order, eager_twin: bool = False, every: int = 3, **config):
    """Requests joining at different steps and leaving at different lengths (a batch that changes):
    request i decodes 4 + ``every`` * i tokens; each event's tokens and log-probabilities."""
    config = EngineConfig(max_batch=3, compile_decode=compile_decode, **config)
    routings = {"mask": MASK, "opt": "option:4", "gumbel": {"type": "gumbel", "tau": 1.0, "seed": 5}}
    engine = Engine(model, tok, config, routings=routings)
    if eager_twin and engine.runner.compiled is not None:
        engine.runner.compiled = CompiledDecode(engine.runner.compiled.weights, compile=False)
    out: dict[int, list] = {}
    with engine:
        for i, routing in enumerate(order):
            params = SamplingParams(max_tokens=4 + every * i, ignore_eos=True, seed=i, temperature=0.8, logprobs=2)

            def keep(event, i=i):
                out.setdefault(i, []).append((event.token_ids, [x.logprob for x in event.logprobs or []]))

            engine.submit(PROMPTS[i % len(PROMPTS)], params, routing, keep)
            engine.step()
        while engine.stats()["running"] or engine.stats()["waiting"]:
            engine.step()
        stats = engine.stats()
    return out, stats, engine.runner.compiled


def same(got: dict[int, list], want: dict[int, list]) -> bool:
    """``_run``'s outputs: the same tokens, log-probabilities within float32 rounding."""
    assert got.keys() == want.keys()
    for i in got:
        assert [t for t, _ in got[i]] == [t for t, _ in want[i]], i
        assert [x for _, lp in got[i] for x in lp] == pytest.approx([x for _, lp in want[i] for x in lp], abs=1e-4)
    return True


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
@pytest.mark.parametrize(
    ("order", "slow"),
    [
        ([None, None, "mask", None, "mask", None], set()),  # masked rows decode compiled too
        ([None, "mask", None, "opt", None, "gumbel"], {"option:K routing (its lens reads the router's "
         "distribution)", "a request's routing policy (noise, pool, controller, replay)"}),
    ],
)  # fmt: skip
def test_engine_compiled_and_lean_agree_with_routed_rows_joining_and_leaving(family, order, slow):
    model, tok, _ = moectl.load(f"tiny:{family}", dtype="float32")
    got, got_stats, _ = _run(model, tok, True, order, eager_twin=True)
    want, want_stats, _ = _run(model, tok, False, order)
    forward = got_stats["decode_forward"]
    assert forward["compiled"] > 0 and "compiled" not in want_stats["decode_forward"]
    assert set(forward["slow"]) == slow and (forward.get("lean", 0) > 0) == bool(slow)
    assert same(got, want)
    assert got_stats["switch_rate"] == want_stats["switch_rate"]


def test_recording_takes_the_lean_forward_and_says_so():
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with Engine(model, tok, EngineConfig(record=True, compile_decode=True)) as engine:
        engine.runner.compiled = CompiledDecode(engine.runner.compiled.weights, compile=False)
        done = engine.generate(PROMPTS[:2], params)
        forward = engine.stats()["decode_forward"]
    assert all(c.trace is not None for c in done)
    assert "compiled" not in forward and forward["slow"] == {"recording the routing (traces, routed experts)": 4}


def test_compiled_for_real_one_graph_per_batch_class_whatever_the_lengths():
    """torch.compile itself: rows join and leave and the cache grows; one graph for one row, one for
    several (``torch.compile`` specialises a size of 1), one for several with a mask's rows; the same
    tokens as the lean forward."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    order = [None, None, "mask", None]
    got, stats, compiled = _run(model, tok, True, order)
    want, _, _ = _run(model, tok, False, order)
    assert same(got, want)
    assert stats["decode_forward"]["compiled"] > 0 and stats["decode_forward"]["slow"] == {}
    assert compiled.compiles == counters["stats"]["unique_graphs"] == 3


def test_each_completion_says_why_its_steps_left_the_compiled_step():
    """A batch of a plain and an ``option:K`` request decodes through the lean forward (the lens reads
    the router): both completions name the reason; a plain request alone names none."""
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    engine = Engine(model, tok, EngineConfig(compile_decode=True), routings={"opt": "option:4"})
    engine.runner.compiled = CompiledDecode(engine.runner.compiled.weights, compile=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with engine:
        alone = engine.generate(PROMPTS[:1], params)
        mixed = engine.generate(PROMPTS[:2], params, routing=[None, "opt"])
    assert alone[0].slow_reasons == []
    reason = "option:K routing (its lens reads the router's distribution)"
    assert [c.slow_reasons for c in mixed] == [[reason], [reason]]
    without, tok2, _ = moectl.load("tiny:deepseek_v3", dtype="float32")
    with Engine(without, tok2, EngineConfig(compile_decode=True)) as engine:
        assert engine.generate(PROMPTS[:1], params)[0].slow_reasons is None  # no compiled step at all


def test_a_compiler_failure_falls_back_to_the_lean_forward(monkeypatch):
    """A machine where torch.compile cannot build (no C++ compiler): the engine opens, decodes through
    the lean forward, and its path says why; a failure at a later step does the same mid-run."""
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = Engine(model, tok).generate(PROMPTS[:2], params)
    monkeypatch.setattr(CompiledDecode, "warm_up", broken)
    with Engine(model, tok, EngineConfig(compile_decode=True)) as engine:
        got = engine.generate(PROMPTS[:2], params)
        assert engine.runner.compiled is None and "no C++ compiler" in engine.stats()["decode_forward"]["path"]
    assert [c.token_ids for c in got] == [c.token_ids for c in want] and got[0].slow_reasons is None
    monkeypatch.undo()
    engine = Engine(model, tok, EngineConfig(compile_decode=True))
    engine.runner.compiled = CompiledDecode(engine.runner.compiled.weights, compile=False)
    with engine:
        assert engine.runner.compiled is not None  # opened (warmed up) fine; then a step fails
        monkeypatch.setattr(CompiledDecode, "__call__", broken)
        got = engine.generate(PROMPTS[:2], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want] and engine.runner.compiled is None


def test_greedy_token_is_the_first_largest_logit():
    """The step's fused argmax (two vectorised reductions) picks what ``argmax`` picks, ties to the
    lowest index, and a token id even where the logits are NaN."""
    from moectl.lm.decode_step import _argmax

    logits = torch.randn(5, 300).bfloat16()
    logits[1, [7, 250]] = 40.0  # a tie: the first
    logits[2, -1] = 50.0
    assert torch.equal(_argmax(logits), logits.argmax(-1))
    assert _argmax(torch.full((1, 9), float("nan"))).item() == 8


def test_omega_is_the_chosen_experts_as_a_mask():
    from moectl.lm.decode_step import _omega

    chosen = torch.tensor([[[0, 3]], [[2, 1]]])  # [L=2, B=1, k=2]
    omega = _omega(chosen, 5)
    assert omega.shape == (1, 2, 5) and omega.dtype == torch.bool
    assert omega[0, 0].tolist() == [True, False, False, True, False]
    assert omega[0, 1].tolist() == [False, True, True, False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,columns", [(8, 4, 1), (8, 4, 37), (4, 4, 9), (16, 2, 64)])
def test_compiled_attention_as_sums_equals_aten_attention(dtype, heads, kv_heads, columns):
    """One query's attention written as sums (what the compiled step traces: ``decode_step._attend``)
    gives aten's attention within rounding: grouped queries, left padding masked, a single column."""
    from moectl.lm.decode_step import _attend

    g = torch.Generator().manual_seed(columns)
    b, d = 3, 32
    q = torch.randn(b, heads, 1, d, generator=g).to(dtype)
    keys = torch.randn(b, kv_heads, columns, d, generator=g).to(dtype)
    values = torch.randn(b, kv_heads, columns, d, generator=g).to(dtype)
    mask = torch.ones(b, 1, 1, columns, dtype=torch.bool)
    mask[1, ..., : columns // 2] = False  # a left-padded row (its last column, the new token, is real)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d**-0.5,
                                                            enable_gqa=kv_heads != heads)  # fmt: skip
    torch._dynamo.reset()
    got = torch.compile(_attend, backend="eager", fullgraph=True)(q, keys, values, mask, d**-0.5)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(_attend(q, keys, values, mask, d**-0.5), want)  # eager: aten's own


@pytest.mark.parametrize("way", ["sum", "product"])
def test_compiled_small_products_as_sums_or_products_equal_the_eager_step_in_bf16(way, monkeypatch):
    """torch.compile for real, bf16: small weights' products fused as multiply-and-sums (or BLAS
    calls) give the eager twin's logits within bf16 rounding, the greedy tokens of those logits and
    ω of the experts chosen, at one row and at three."""
    from moectl.lm import decode_step

    monkeypatch.setattr(decode_step, "SMALL_PRODUCTS", way)
    torch._dynamo.reset()
    model, _, _ = moectl.load("tiny:qwen2_moe", dtype="bfloat16")
    weights, why = step_weights(model, inspect(model))
    assert weights is not None, why
    compiled, eager = CompiledDecode(weights), CompiledDecode(weights, compile=False)
    for batch in (1, 3):
        cache, mask, positions = _prefilled(model, batch)
        token = torch.randint(3, 60, (batch,), generator=torch.Generator().manual_seed(batch))
        ours, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
        with torch.inference_mode():
            got, got_experts, greedy, omega = compiled(token, mask, positions, ours)
            want = eager(token, mask, positions, theirs).logits
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
        assert torch.equal(greedy, got.argmax(-1))  # (experts may differ where bf16 rounding ties)
        assert torch.equal(omega, decode_step._omega(got_experts, weights.num_experts))


def test_a_server_engine_builds_its_graphs_for_the_loops_thread_counts(monkeypatch):
    """``moectl serve`` opens the engine with one torch thread and steps with more (re-picked under
    load): dynamo guards on the count, so the warm-up builds the graphs for every count the loop
    may use and the first requests compile nothing, nor does a cache outgrowing its buffers (the
    counter is dynamo's own)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(model, tok, EngineConfig(compile_decode=True, adapt_threads=True, threads=2))
        assert engine._step_threads() == (1, 2)
        with engine:
            built = int(counters["stats"]["unique_graphs"])
            assert built == 4  # one row and several, at one thread and at two
            torch.set_num_threads(2)  # the loop's count
            # 40 tokens: the cache outgrows its first buffers (``lm/kv_buffers``), a graph still serves it
            engine.generate(PROMPTS[:2], SamplingParams(max_tokens=40, ignore_eos=True))
            engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True))
            assert int(counters["stats"]["unique_graphs"]) == built
            assert engine.stats()["decode_forward"]["compiled"] > 0
    finally:
        torch.set_num_threads(before)


def test_a_server_opens_first_and_its_loop_thread_builds_the_graphs(monkeypatch):
    """``moectl serve`` opens the engine (to report what cannot be installed) and then starts it: the
    graphs are built in the loop thread, never in the opening one (an OpenMP pool of the loop's size
    left there slowed every step 2x; ``server/serve_run.py``)."""
    import threading

    from moectl.server.serve_config import ServeConfig
    from moectl.server.serve_run import open_engine

    where = []
    real = CompiledDecode.warm_up
    monkeypatch.setattr(CompiledDecode, "warm_up", lambda self, *a: where.append(threading.current_thread().name)
                        or real(self, *a))  # fmt: skip
    engine, _ = open_engine(ServeConfig(model="tiny:olmoe", compile_decode=True, threads=1), 1)
    try:
        assert where == [] and engine.runner.compiled is not None
        engine.start()
        engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True))
        assert where == ["moectl-engine"]
    finally:
        engine.shutdown()
        engine.close()


def test_small_products_are_sums_but_at_several_rows_on_one_thread(monkeypatch):
    from moectl.lm import decode_step

    assert decode_step.sums_for(1, 1) and decode_step.sums_for(1, 2) and decode_step.sums_for(8, 2)
    assert not decode_step.sums_for(8, 1)  # the generated loops would compute per row what BLAS shares
    monkeypatch.setattr(decode_step, "SMALL_PRODUCTS", "product")
    assert not decode_step.sums_for(1, 2)


def test_after_its_first_step_a_graph_class_runs_unguarded_and_falls_back_to_the_guarded_call():
    """A class's first step is dynamo's guarded call (it builds the graph); later steps run dynamo's
    code for the class without the guard check; inputs not laid out as traced are refused (the
    guarded call takes them); ``guards=True`` always takes the guarded call; all give one result."""
    torch._dynamo.reset()
    model, _, _ = moectl.load("tiny:olmoe", dtype="float32")
    weights, why = step_weights(model, inspect(model))
    assert weights is not None, why
    step = CompiledDecode(weights)
    calls: list[str] = []
    guarded = step._fn
    step._fn = lambda *a: calls.append("guarded") or guarded(*a)
    cache, mask, positions = _prefilled(model, 2)
    token = torch.tensor([5, 9])
    with torch.inference_mode():
        first = step(token, mask, positions, copy.deepcopy(cache))
        assert calls == ["guarded"] and len(step._unguarded) == 1 and None not in step._unguarded.values()
        second = step(token, mask, positions, copy.deepcopy(cache))
        assert calls == ["guarded"]  # unguarded
        transposed = [torch.zeros(2, 2, 8, 4).transpose(2, 3)]  # a layout the graph was not traced with
        assert not step._unguarded_inputs(token, positions.reshape(-1), mask.bool(), transposed, [], None)
        assert not step._unguarded_inputs(token.int(), positions.reshape(-1), mask.bool(), [], [], None)
        step.guards = True
        third = step(token, mask, positions, copy.deepcopy(cache))
    assert calls == ["guarded", "guarded"]
    for other in (second, third):
        torch.testing.assert_close(other.logits, first.logits)
        assert torch.equal(other.chosen, first.chosen) and torch.equal(other.greedy, first.greedy)
