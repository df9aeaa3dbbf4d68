"""Aggregation of the K samples (RoE §3.1: probability averaging) and the sample-keyed Gumbel noise (§2.1)."""

from __future__ import annotations

import math

import pytest
import torch

from moectl.ensemble.noise import hashed_gumbel, layer_keys
from moectl.roe import aggregate


@pytest.mark.parametrize("how", ["prob_mean", "logprob_mean"])
@pytest.mark.parametrize("seed", range(4))
def test_aggregate_is_a_proper_distribution(how, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 300, generator=g) * (1 + 4 * seed)  # [B, K, V], up to very peaked
    logp = aggregate(logits, how)
    p = logp.exp()
    assert logp.shape == (3, 300)
    assert torch.isfinite(logp).all()
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(3), atol=1e-5, rtol=0)


def test_prob_mean_is_the_average_of_the_sample_distributions():
    logits = torch.randn(2, 4, 50, generator=torch.Generator().manual_seed(1))
    want = logits.softmax(-1).mean(1)
    torch.testing.assert_close(aggregate(logits, "prob_mean").exp(), want, atol=1e-6, rtol=0)
    # logprob_mean: normalised geometric mean
    geo = logits.log_softmax(-1).mean(1).exp()
    torch.testing.assert_close(
        aggregate(logits, "logprob_mean").exp(), geo / geo.sum(-1, keepdim=True), atol=1e-6, rtol=0
    )


def test_one_sample_or_identical_samples_change_nothing():
    logits = torch.randn(2, 1, 40, generator=torch.Generator().manual_seed(2))
    for how in ("prob_mean", "logprob_mean"):
        torch.testing.assert_close(aggregate(logits, how), logits[:, 0].log_softmax(-1), atol=1e-6, rtol=0)
        same = logits.expand(2, 7, 40)
        torch.testing.assert_close(aggregate(same, how), logits[:, 0].log_softmax(-1), atol=1e-5, rtol=0)


def test_aggregate_rejects_unknown_method():
    with pytest.raises(ValueError, match="prob_mean' or 'logprob_mean"):
        aggregate(torch.zeros(1, 2, 3), "median")


def test_hashed_gumbel_has_gumbel_statistics():
    keys = torch.tensor(layer_keys(0, [0, 1]))
    sample = torch.arange(64)[:, None]
    position = torch.arange(256)[None, :]
    g = hashed_gumbel(keys, sample, position, 16)  # [2, 64, 256, 16] = 524k draws
    assert g.shape == (2, 64, 256, 16) and torch.isfinite(g).all()
    euler_gamma = 0.5772156649
    assert abs(float(g.mean()) - euler_gamma) < 0.01
    assert abs(float(g.std()) - math.pi / math.sqrt(6)) < 0.01
    # Gumbel-max: argmax of logits + G samples softmax(logits) (RoE §2.1)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    choice = (logits + hashed_gumbel(keys[:1], sample, position, 4)[0]).argmax(-1).flatten()
    freq = torch.bincount(choice, minlength=4).float() / choice.numel()
    torch.testing.assert_close(freq, logits.softmax(-1), atol=0.01, rtol=0)


def test_hashed_gumbel_is_keyed_not_sequenced():
    keys = torch.tensor(layer_keys(7, [0, 1, 2]))
    full = hashed_gumbel(keys, torch.arange(4)[:, None], torch.arange(10)[None, :], 8)
    one = hashed_gumbel(keys, torch.tensor([[2]]), torch.tensor([[5]]), 8)
    assert torch.equal(full[:, 2:3, 5:6], one)  # same (layer, sample, position) → same draw, any layout
    assert not torch.equal(full[0], full[1])  # layers differ
    assert not torch.equal(full[:, 0], full[:, 1])  # samples differ
    other_seed = hashed_gumbel(
        torch.tensor(layer_keys(8, [0, 1, 2])), torch.tensor([[2]]), torch.tensor([[5]]), 8
    )
    assert not torch.equal(one, other_seed)
