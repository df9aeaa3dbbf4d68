"""Selection methods: k distinct valid experts, deterministic, and equal to hand computations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import moectl
from moectl.routing import route
from moectl.subsets import METHODS, select_subset
from moectl.subsets.calibrate import block_inputs, capture
from moectl.subsets.experts import routed_output, router_logits, select
from moectl.subsets.methods import easy_ep_scores, frequency_scores, router_scores, wanda_scores
from moectl.subsets.reconstruction import reconstruction_keep, subset_loss

GROUPED = ("deepseek_v3", "glm4_moe", "dots1")


def calibration(batch: int = 3, length: int = 10, seed: int = 0):
    ids = torch.randint(3, 200, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding on the first row
    mask[1, :1] = 0
    return ids, mask


@torch.no_grad()
def test_every_method_keeps_k_distinct_valid_experts(family):
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    ids, mask = calibration()
    k = 4
    for method in METHODS:
        keep = select_subset(model, ids, k, method, attention_mask=mask, info=info)
        assert sorted(keep) == [layer.index for layer in info.layers], method
        for layer in info.layers:
            ids_kept = keep[layer.index]
            assert len(ids_kept) == len(set(ids_kept)) == k, (method, ids_kept)
            assert all(0 <= e < layer.num_experts for e in ids_kept), (method, ids_kept)
            assert ids_kept == sorted(ids_kept)
            if family in GROUPED:  # two groups of four: two kept in each
                assert [sum(e // 4 == g for e in ids_kept) for g in range(2)] == [2, 2], (method, ids_kept)
        again = select_subset(model, ids, k, method, attention_mask=mask, info=info)
        assert again == keep, f"{method} is not deterministic"
    moectl.adapters.slicing.check_keep(info, keep)  # exportable as is


@torch.no_grad()
def test_random_depends_on_seed_and_layerwise_mode_runs():
    model = moectl.tiny("qwen3_moe")
    ids, mask = calibration()
    picks = {
        tuple(map(tuple, select_subset(model, ids, 3, "random", mask, seed=s).values())) for s in range(6)
    }
    assert len(picks) > 1
    for method in ("router", "reconstruction"):
        flat = select_subset(model, ids, 3, method, mask)
        layered = select_subset(model, ids, 3, method, mask, layerwise=True)
        assert layered[0] == flat[0], "the first MoE layer sees the same inputs in both modes"
        assert all(len(v) == 3 for v in layered.values())


@torch.no_grad()
def test_layerwise_inputs_come_from_the_pruned_earlier_layers():
    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    ids, mask = calibration()
    full = block_inputs(model, info, ids, mask)
    pruned = block_inputs(model, info, ids, mask, keep={0: [0, 1]})
    assert full[0].shape[0] == int(mask.sum()), "padding positions must be dropped"
    torch.testing.assert_close(pruned[0], full[0], rtol=0, atol=0)
    assert not torch.allclose(pruned[1], full[1])


@torch.no_grad()
def test_router_and_frequency_match_the_recorded_trace(family):
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    ids, mask = calibration()
    inputs = block_inputs(model, info, ids, mask)
    with route(model, [], record=True) as session:
        model(input_ids=ids, attention_mask=mask)
    valid = mask.bool()
    for layer in info.layers:
        probs = session.trace.probs[layer.index][valid]
        torch.testing.assert_close(
            router_scores(layer, inputs[layer.index]), probs.mean(0), rtol=1e-5, atol=1e-6
        )
        chosen = session.trace.chosen[layer.index][valid]
        counts = torch.bincount(chosen.reshape(-1), minlength=layer.num_experts).double() / valid.sum()
        torch.testing.assert_close(frequency_scores(layer, inputs[layer.index]), counts)


@torch.no_grad()
def test_residual_stream_is_what_the_decoder_layer_adds_the_block_output_to(family):
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    ids, mask = calibration()
    outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for layer in info.layers:
        decoder = model.get_submodule(layer.name.split(".layers.")[0] + f".layers.{layer.layer_idx}")

        def save(i, part):
            def hook(module, args, out):
                out = out[0] if isinstance(out, tuple) else out
                outputs.setdefault(i, {})[part] = out.reshape(*mask.shape, -1)[mask.bool()].float()

            return hook

        hooks += [
            layer.block.register_forward_hook(save(layer.index, "block")),
            decoder.register_forward_hook(save(layer.index, "layer")),
        ]
    captured = capture(model, info, ids, mask)
    for hook in hooks:
        hook.remove()
    for layer in info.layers:
        got = captured[layer.index]
        out = outputs[layer.index]
        if family in ("flex_olmo", "minimax"):  # the block reads / is added to the stream itself
            torch.testing.assert_close(got.residual, got.x, rtol=0, atol=0)
            if family == "minimax":
                decoder = model.get_submodule(layer.name.split(".layers.")[0] + f".layers.{layer.layer_idx}")
                expected = got.x * decoder.mlp_alpha_factor + out["block"] * decoder.mlp_beta_factor
                torch.testing.assert_close(expected, out["layer"], rtol=1e-5, atol=1e-5)
            continue
        assert not torch.allclose(got.residual, got.x), "pre-norm: the residual stream is the norm's input"
        if family.startswith("granitemoe"):
            continue  # residual_multiplier and a shared MLP outside the block
        torch.testing.assert_close(got.residual + out["block"], out["layer"], rtol=1e-5, atol=1e-5)


# ---- hand computations on a 4-expert OLMoE (softmax -> top-2, no renormalisation) -------------
@pytest.fixture(scope="module")
def toy():
    model = moectl.tiny("olmoe", num_experts=4, num_experts_per_tok=2)
    info = moectl.inspect(model)
    ids, mask = calibration(batch=2, length=6)
    return info.layers[0], block_inputs(model, info, ids, mask, layers=[0])[0]


def hand_expert(layer, x: torch.Tensor, i: int) -> torch.Tensor:
    """E_i(x) = down_i (silu(gate_i x) * up_i x), written out from the 3-D weights."""
    gate_up = layer.block.experts.gate_up_proj[i]  # [2I, H]
    down = layer.block.experts.down_proj[i]  # [H, I]
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


def hand_layer(layer, x: torch.Tensor, subset: list[int]) -> torch.Tensor:
    """Pruned OLMoE layer: softmax over the subset's logits, top-min(2, |S|), weights not renormalised."""
    logits = x @ layer.router.weight.T
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = torch.softmax(logits[t, subset], dim=-1)
        order = sorted(range(len(subset)), key=lambda j: -float(p[j]))[: min(2, len(subset))]
        for j in order:
            out[t] += p[j] * hand_expert(layer, x[t : t + 1], subset[j])[0]
    return out


@torch.no_grad()
def test_hand_layer_equals_the_model_block(toy):
    layer, x = toy
    torch.testing.assert_close(
        hand_layer(layer, x, [0, 1, 2, 3]), layer.block(x[None])[0], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("with_residual", [False, True])
@torch.no_grad()
def test_easy_ep_matches_hand_computation(toy, with_residual):
    layer, x = toy
    residual = x * 3 + 0.5 if with_residual else None  # any stream: h_t need not be the block input
    logits = x @ layer.router.weight.T
    expected = torch.zeros(4, dtype=torch.float64)
    for t in range(x.shape[0]):
        p = torch.softmax(logits[t], dim=-1)
        top = sorted(range(4), key=lambda i: -float(p[i]))[:2]
        outs = {i: hand_expert(layer, x[t : t + 1], i)[0] for i in top}
        h_bar = sum(p[i] * outs[i] for i in top)
        h = x[t] if residual is None else residual[t]
        s = 1 - F.cosine_similarity(h, h + h_bar, dim=0)
        for i in top:
            expected[i] += float(p[i] * outs[i].norm() * s)
    torch.testing.assert_close(easy_ep_scores(layer, x, residual), expected, rtol=1e-5, atol=1e-9)
    assert (expected > 0).sum() >= 2


@torch.no_grad()
def test_reconstruction_matches_hand_enumeration(toy):
    layer, x = toy
    full = hand_layer(layer, x, [0, 1, 2, 3])
    logits = router_logits(layer, x)
    target = routed_output(layer, x, *select(layer, logits))
    losses = {}
    for subset in itertools.combinations(range(4), 2):
        losses[subset] = float((hand_layer(layer, x, list(subset)) - full).pow(2).sum())
        assert math.isclose(subset_loss(layer, x, logits, target, list(subset)), losses[subset], rel_tol=1e-4)
    best = min(losses, key=losses.get)
    keep, loss = reconstruction_keep(layer, x, 2)
    assert keep == list(best) and math.isclose(loss, losses[best], rel_tol=1e-4)
    # greedy forward selection (exhaustive search disabled), by hand: add the best expert 3 times
    chosen: list[int] = []
    for _ in range(3):
        trial = {
            e: float((hand_layer(layer, x, [*chosen, e]) - full).pow(2).sum())
            for e in range(4)
            if e not in chosen
        }
        chosen.append(min(trial, key=trial.get))
    greedy, greedy_loss = reconstruction_keep(layer, x, 3, exhaustive_limit=0)
    assert greedy == sorted(chosen)
    assert math.isclose(greedy_loss, min(trial.values()), rel_tol=1e-4)
    assert reconstruction_keep(layer, x, 4)[1] < 1e-8  # all experts: nothing lost


@torch.no_grad()
def test_wanda_matches_hand_computation(toy):
    layer, x = toy
    norms = x.double().norm(dim=0)
    weights = layer.block.experts.gate_up_proj.double()
    expected = torch.tensor(
        [
            sum(
                float(weights[i, r, c].abs() * norms[c])
                for r in range(weights.shape[1])
                for c in range(weights.shape[2])
            )
            for i in range(4)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(wanda_scores(layer, x), expected, rtol=1e-9, atol=1e-9)


def test_bad_requests_are_refused():
    model = moectl.tiny("olmoe")
    ids, mask = calibration()
    with pytest.raises(ValueError, match="unknown selection method 'magic'"):
        select_subset(model, ids, 4, "magic", mask)
    with pytest.raises(ValueError, match="top-k = 2 <= k <= 8"):
        select_subset(model, ids, 1, "router", mask)
    with pytest.raises(ValueError, match="multiple of 2"):
        select_subset(moectl.tiny("deepseek_v3"), ids, 3, "router", mask)
    with pytest.raises(ValueError, match="no real tokens"):
        select_subset(model, ids, 4, "router", torch.zeros_like(mask))
