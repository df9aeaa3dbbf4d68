"""Load-balancing counts pooled over previous steps (train/lb_window.py): ring buffer, the loss it
gives, exact resume, and the config check."""

from __future__ import annotations

import pytest
import torch

from moectl.train.lb_window import CountWindow
from moectl.train.loop import Trainer
from moectl.train.pretrain_losses import expert_counts, load_balancing_loss
from moectl.train.train_config import TrainConfig
from test_train import _config


def test_window_keeps_the_last_w_steps():
    window = CountWindow(2, layers=1, experts=3)
    assert window.history()[1].item() == 0.0
    for step in range(3):  # steps 0, 1, 2: the window holds 1 and 2
        window.push(torch.full((1, 3), float(step + 1)), 10.0 * (step + 1))
    counts, tokens = window.history()
    assert counts.tolist() == [[5.0, 5.0, 5.0]] and tokens.item() == 50.0
    restored = CountWindow(2, layers=1, experts=3)
    restored.load_state_dict(window.state_dict())
    window.push(torch.ones(1, 3), 1.0)
    restored.push(torch.ones(1, 3), 1.0)
    assert torch.equal(window.history()[0], restored.history()[0])
    with pytest.raises(ValueError, match="window of shape"):
        CountWindow(3, layers=1, experts=3).load_state_dict(window.state_dict())


def test_zero_window_holds_nothing():
    window = CountWindow(0, layers=2, experts=4)
    window.push(torch.ones(2, 4), 8.0)
    counts, tokens = window.history()
    assert counts.shape == (2, 4) and counts.abs().sum().item() == 0.0 and tokens.item() == 0.0


def test_pooled_counts_balance_across_steps():
    """Two steps routed to opposite halves: within a step f is skewed, pooled over both it is uniform,
    so the windowed loss no longer pushes the second step's tokens away from its experts."""
    logits = torch.zeros(1, 8, 4)
    valid = torch.ones(1, 8, dtype=torch.bool)
    first = torch.tensor([0, 1]).repeat(1, 8, 1)
    second = torch.tensor([2, 3]).repeat(1, 8, 1)
    c1, c2 = expert_counts(first, valid, 4), expert_counts(second, valid, 4)
    local = load_balancing_loss(logits, valid, c2, 8.0)
    pooled = load_balancing_loss(logits, valid, c1 + c2, 16.0)
    # uniform P: L = n_r Σ f_i / n_r = Σ f_i = k either way; the gradients differ
    assert local.item() == pytest.approx(2.0) and pooled.item() == pytest.approx(2.0)
    g_local = torch.autograd.functional.jacobian(lambda x: load_balancing_loss(x, valid, c2, 8.0), logits)
    g_pooled = torch.autograd.functional.jacobian(
        lambda x: load_balancing_loss(x, valid, c1 + c2, 16.0), logits
    )
    assert g_local[0, 0, 2] > 0 and g_local[0, 0, 0] < 0  # local: away from the step's own experts
    assert torch.allclose(g_pooled, torch.zeros_like(g_pooled), atol=1e-7)  # pooled: balanced


def test_windowed_run_differs_after_the_first_step_and_resumes_exactly(tmp_path, corpus):
    plain = Trainer(_config(tmp_path / "plain", corpus, max_steps=5), progress=False)
    config = _config(tmp_path / "win", corpus, max_steps=5, lb_window=2)
    windowed = Trainer(config, progress=False)
    first = [plain.train_step(0)["lb"], windowed.train_step(0)["lb"]]
    assert first[0] == first[1]  # an empty window is EMO's formula
    second = [plain.train_step(1)["lb"], windowed.train_step(1)["lb"]]
    assert second[0] != second[1]
    windowed.train_step(2)
    windowed.save(2)
    expected = windowed.train_step(3)
    resumed = Trainer(config, resume=True, progress=False)
    assert resumed.lb_window.filled == 3
    got = resumed.train_step(3)
    assert got["loss"] == expected["loss"] and got["lb"] == expected["lb"]


def test_negative_window_refused():
    with pytest.raises(ValueError, match="lb_window must be >= 0"):
        TrainConfig(out="x", lb_window=-1)
