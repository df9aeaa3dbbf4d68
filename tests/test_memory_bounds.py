"""Memory by design (issue 13): chunked RoE scoring, per-layer noise, streamed calibration, no host syncs.

Each bounded path is checked against the unbounded definition it replaces: RoE span scoring
against an all-positions, all-samples [B, K, T, V] reference (float64); per-layer noise against
the stacked hash draws; streamed calibration statistics against the statistics of all tokens
captured at once. Memory itself is measured with ``moectl.metrics.memory.TensorMemory``.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import moectl
from moectl.ensemble.masks import attention_kinds, teacher_forced_masks
from moectl.ensemble.noise import NoiseLayout, SampleGumbel, hashed_gumbel, layer_gumbel, layer_keys
from moectl.lm.padding import left_padded
from moectl.metrics.memory import TensorMemory
from moectl.roe import RoEConfig
from moectl.roe.parallel import (
    Budget,
    RoEScoringInputs,
    ensemble_token_scores,
    parallel_log_probs,
    parallel_token_logprobs,
    parallel_token_scores,
)
from moectl.routing import route
from moectl.routing.kv_cache import cache_out, with_cache
from moectl.routing.routing_state import RouteContext, RoutingState
from moectl.subsets import select_subset
from moectl.subsets.calibrate import capture, collect
from moectl.subsets.methods import easy_ep_scores, frequency_scores, router_scores, wanda_scores
from moectl.subsets.scores import top_experts
from moectl.subsets.stats import NEEDS, scores_of


def _batch(
    length: int = 11, seed: int = 0, vocab: int = 200, pad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (3, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if pad:
        mask[0, :4] = 0  # left padding
        mask[1, :1] = 0
    return ids, mask


# -- RoE: span scoring == the unchunked definition -------------------------------------------------
@torch.no_grad()
def unchunked_roe_log_probs(model, ids, mask, config: RoEConfig, info) -> torch.Tensor:
    """The definition, all at once: K full logits tensors [B, K, T, V] (float64), aggregated.

    Sample 0: one clean forward filling a KV cache; sample k ≥ 1: all positions teacher-forced over
    that cache (query t sees the clean keys before t and its own key), noise on every query.
    """
    kinds, as_dict = attention_kinds(model.config)
    valid, left_pad, position = left_padded(mask)
    noise = SampleGumbel(config.taus(info.num_moe_layers), seed=config.seed)
    dtype = next(model.parameters()).dtype
    samples = []
    with route(model, [noise], info=info):
        out = model(input_ids=ids, attention_mask=mask, position_ids=position,
                    **with_cache(DynamicCache()), use_cache=True)  # fmt: skip
        samples.append(out.logits.double())
        masks = teacher_forced_masks(kinds, as_dict, valid, left_pad, dtype)
        for k in range(1, config.K):
            cache = DynamicCache()
            for i, layer in enumerate(cache_out(out).layers):
                cache.update(layer.keys.clone(), layer.values.clone(), i)
            noise.layout = NoiseLayout(torch.tensor([[k]]), position, torch.ones(1, 1, dtype=torch.bool))
            logits = model(input_ids=ids, attention_mask=masks, position_ids=position,
                           **with_cache(cache), use_cache=True).logits  # fmt: skip
            noise.layout = None
            samples.append(logits.double())
    logp = torch.log_softmax(torch.stack(samples, 1), dim=-1)  # [B, K, T, V]
    if config.aggregation == "prob_mean":
        return torch.logsumexp(logp, 1) - math.log(config.K)
    return torch.log_softmax(logp.mean(1), dim=-1)


BUDGETS = [Budget(), Budget(head_bytes=1, span_tokens=3), Budget(head_bytes=20_000, span_tokens=8)]


# float64 on full rows (the routing core computes router weights in float32, so agreement stops at
# float32 rounding of the weights: ~1e-8 here, 1e-7 allowed); float32 with left padding
# (transformers' float64 padding masks turn padded rows to NaN, which attention then spreads)
PRECISIONS = [(torch.float64, False, 1e-7), (torch.float32, True, 2e-5)]


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "granitemoe", "deepseek_v2", "llama4_text"])
@pytest.mark.parametrize("aggregation", ["prob_mean", "logprob_mean"])
@pytest.mark.parametrize(("dtype", "pad", "atol"), PRECISIONS)
def test_span_scoring_equals_the_unchunked_reference(family, aggregation, dtype, pad, atol):
    model = moectl.tiny(family).to(dtype)
    info = moectl.inspect(model)
    ids, mask = _batch(pad=pad)
    config = RoEConfig(K=5, tau=0.8, aggregation=aggregation, seed=3)
    ref = unchunked_roe_log_probs(model, ids, mask, config, info)
    valid = mask.bool()
    target = torch.nn.functional.pad(ref[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0)) * valid
    greedy = torch.nn.functional.pad(ref[:, :-1].argmax(-1) == ids[:, 1:], (1, 0), value=True) | ~valid
    for budget in BUDGETS:  # one span and one head call; a position or token at a time; in between
        inputs = RoEScoringInputs(model, ids, mask, config, info)
        full = parallel_log_probs(inputs, budget=budget)
        torch.testing.assert_close(full[valid].double(), ref[valid], rtol=0, atol=atol)
        lp = parallel_token_logprobs(inputs, budget=budget)
        torch.testing.assert_close(lp.double(), target, rtol=0, atol=atol)
        scores = parallel_token_scores(inputs, budget=budget)
        torch.testing.assert_close(scores.logprob.double(), target, rtol=0, atol=atol)
        assert torch.equal(scores.greedy, greedy)
    # with tau > 0 the samples really differ: the ensemble is not the clean model
    plain = torch.log_softmax(model(input_ids=ids, attention_mask=mask,
                                    position_ids=left_padded(mask)[2]).logits.double(), -1)  # fmt: skip
    assert (plain[valid] - ref[valid]).abs().max() > 1e-6


def test_stepwise_token_scores_agree_with_the_span_path():
    model = moectl.tiny("olmoe").double()
    info = moectl.inspect(model)
    ids, mask = _batch(length=7, pad=False)
    config = RoEConfig(K=3, tau=0.5, seed=1)
    spans = ensemble_token_scores(RoEScoringInputs(model, ids, mask, config, info))
    steps = ensemble_token_scores(RoEScoringInputs(model, ids, mask, config.with_(cache="none"), info))
    torch.testing.assert_close(steps.logprob.double(), spans.logprob.double(), rtol=0, atol=1e-6)
    assert torch.equal(steps.greedy, spans.greedy)


@torch.no_grad()
def test_roe_scoring_memory_does_not_grow_with_K_T_V():
    """The largest tensor stays below a bound set by the head budget, not by K · T · V; the peak
    grows with T by far less than the [K, T, V] logits the unchunked path would hold."""
    vocab, K = 16384, 8
    model = moectl.tiny("olmoe", vocab_size=vocab)
    info = moectl.inspect(model)
    config = RoEConfig(K=K, tau=0.5)
    budget = Budget(head_bytes=1 << 20)
    peaks, largest = {}, {}
    for length in (64, 256):
        ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        with TensorMemory() as mem:
            inputs = RoEScoringInputs(model, ids, torch.ones_like(ids), config, info)
            parallel_token_logprobs(inputs, budget=budget)
        peaks[length], largest[length] = mem.peak, mem.largest
    ktv = {t: K * t * vocab * 4 for t in peaks}  # float32 logits of all samples
    assert largest[256] <= budget.head_bytes, largest
    assert largest[256] < ktv[256] / 16
    assert peaks[256] - peaks[64] < (ktv[256] - ktv[64]) / 16, (peaks, ktv)


# -- noise: drawn per layer, same draws ------------------------------------------------------------
def test_per_layer_noise_equals_the_stacked_draws():
    tau, seed = [0.3, 0.0, 1.5], 11
    policy = SampleGumbel(tau, seed=seed)
    b, t, e = 2, 7, 6
    sample = torch.tensor([[0], [3]])
    position = torch.arange(t)[None, :] + 5
    scale = torch.tensor([[False], [True]])
    policy.layout = NoiseLayout(sample, position, scale)
    stacked = hashed_gumbel(torch.tensor(layer_keys(seed, [0, 1, 2])), sample, position, e)  # [L, B, T, E]
    for layer in (0, 2):
        logits = torch.zeros(b, t, e)
        noise = policy.noise(layer, logits)
        want = stacked[layer] * (tau[layer] * scale.float())[..., None]
        assert torch.equal(noise, want)
        state = RoutingState(layer, logits, rule=None, ctx=RouteContext(b, t))  # type: ignore[arg-type]
        policy.apply(state)
        assert torch.equal(state.noise, want)
    state = RoutingState(1, torch.zeros(b, t, e), rule=None, ctx=RouteContext(b, t))  # type: ignore[arg-type]
    policy.apply(state)
    assert state.noise is None  # tau = 0: untouched


def test_layer_gumbel_is_chunk_and_dtype_independent():
    key = layer_keys(5, [2])[0]
    sample, position = torch.arange(4)[:, None].expand(4, 50), torch.arange(50)[None, :].expand(4, 50)
    whole = layer_gumbel(key, sample, position, 9)
    assert whole.dtype == torch.float32 and whole.shape == (4, 50, 9)
    assert torch.equal(layer_gumbel(key, sample, position, 9, chunk=10), whole)
    assert torch.equal(layer_gumbel(key, sample, position, 9, dtype=torch.bfloat16), whole.bfloat16())


# -- calibration: streamed statistics == all tokens at once -----------------------------------------
@torch.no_grad()
def test_streamed_calibration_equals_all_at_once(family):
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    ids, mask = _batch(length=10)
    inputs = capture(model, info, ids, mask)  # every token, one forward (the previous way)
    old = {
        "router": lambda layer, x, r: router_scores(layer, x),
        "frequency": lambda layer, x, r: frequency_scores(layer, x),
        "wanda": lambda layer, x, r: wanda_scores(layer, x),
        "easy_ep": lambda layer, x, r: easy_ep_scores(layer, x, r),
    }
    for method, reference in old.items():
        for batch_size in (1, 2):
            stats = collect(model, info, ids, mask, NEEDS[method], batch_size=batch_size)
            for layer in info.layers:
                got = inputs[layer.index]
                want = reference(layer, got.x, got.residual).double()
                streamed = scores_of(layer, stats[layer.index], method).double()
                torch.testing.assert_close(
                    streamed, want, rtol=1e-5, atol=1e-7, msg=f"{method} {layer.index}"
                )
                assert stats[layer.index].tokens == int(mask.sum())
                if method != "easy_ep":  # Easy-EP's s_t is rounding noise where h_t is the block input
                    k = max(layer.top_k, 4)
                    assert top_experts(layer, streamed, k) == top_experts(layer, want, k), method
    stats = collect(model, info, ids, mask, NEEDS["reconstruction"], batch_size=1, max_tokens=1000)
    same_batches = capture(model, info, ids, mask, batch_size=1)
    for layer in info.layers:  # fewer tokens than max_tokens: the sample is every token, in order
        sample = stats[layer.index].sample.x.float()
        assert torch.equal(sample, same_batches[layer.index].x)
        torch.testing.assert_close(sample, inputs[layer.index].x, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_select_subset_streams_batches_and_bounds_the_reconstruction_sample():
    model = moectl.tiny("qwen3_moe")
    info = moectl.inspect(model)
    ids, mask = _batch(length=12)
    for method in ("router", "frequency", "wanda", "easy_ep", "reconstruction"):
        whole = select_subset(model, ids, 4, method, mask, info=info, batch_size=3)
        assert select_subset(model, ids, 4, method, mask, info=info, batch_size=1) == whole, method
    small = {bs: collect(model, info, ids, mask, NEEDS["reconstruction"], batch_size=bs, max_tokens=7)
             for bs in (1, 3)}  # fmt: skip
    for layer in info.layers:
        one, three = small[1][layer.index].sample, small[3][layer.index].sample
        assert one.x.shape[0] == 7 and torch.equal(one.index, three.index)  # the same tokens
        torch.testing.assert_close(one.x, three.x, rtol=1e-5, atol=1e-6)  # up to batch numerics
        assert torch.equal(one.index, one.index.sort().values)  # kept in the original token order


# -- no host synchronisation on the hot paths ------------------------------------------------------
class _SyncCounter(TensorMemory):
    """Counts device-to-host reads (``aten._local_scalar_dense``: ``bool()``, ``int()``, ``item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@torch.no_grad()
def test_controller_scan_reads_nothing_back_from_the_device():
    from moectl.options import ControllerPolicy, build_controller

    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    policy = ControllerPolicy(build_controller(info, k_hat=4), mode="sample")
    ids, mask = _batch(length=24)
    with route(model, policy, info=info):
        model(input_ids=ids, attention_mask=mask)  # warm: first calls may cache
        counter = _SyncCounter()
        state = RoutingState(
            0,
            torch.randn(3, 24, info.layers[0].num_experts),
            info.layers[0].rule,
            RouteContext(3, 24, 0, mask.bool()),
            hidden=torch.randn(3, 24, model.config.hidden_size),
        )
        with counter:
            policy.apply(state)  # fmt: skip
    assert counter.syncs == 0


@torch.no_grad()
def test_trace_keeps_a_call_on_its_device_until_the_next_one(olmoe):
    ids, mask = _batch(length=6)
    with route(olmoe, record=True) as session:
        olmoe(input_ids=ids, attention_mask=mask)
        trace = session.trace
        assert trace._call is not None and trace._call.records  # not yet moved
        first = trace.chosen[0].clone()  # reading moves it
        assert not trace._call.records
        olmoe(input_ids=ids, attention_mask=mask)  # a second sequence batch: a new segment
    assert trace.chosen[0].shape[:2] == (6, 6)
    assert torch.equal(trace.chosen[0][:3], first) and torch.equal(trace.chosen[0][3:], first)
