"""TE-MoE Figure 2 as a user sees it: the option drawn, its switches, which sequence."""

from __future__ import annotations

import moectl


def test_figure_2_draws_the_recorded_option_under_a_policy(tmp_path, monkeypatch):
    """Under a policy that records ω (a document pool here) and no k-hat, Fig. 2 shades ω, ticks its
    switches and says which sequence it shows; k-hat = top-k says ω is the activated experts."""
    import matplotlib.pyplot as plt

    from moectl.generate import generate_traced
    from moectl.reporting import plots

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    _, trace = generate_traced(
        model,
        tok,
        ["The history of the city of", "def f(x):"],
        12,
        progress=False,
        policies={"type": "document_pool", "d": 4},
    )
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plots.plot_expert_activation(trace, tmp_path / "a.png", layer=1)
    strip, ax = figures[-1].axes
    assert "ω recorded by the policy" in strip.get_title(loc="left") and "sequence 0" in strip.get_title(
        loc="left"
    )
    assert "option ω (recorded mask)" in [t.get_text() for t in ax.get_legend().get_texts()]
    plots.plot_expert_activation(trace, tmp_path / "b.png", layer=1, k_hat=2, label="the prompt")
    strip, ax = figures[-1].axes
    assert "k-hat = 2" in strip.get_title(loc="left") and "the prompt" in strip.get_title(loc="left")
    assert "ω = the activated experts" in [t.get_text() for t in ax.get_legend().get_texts()]
    monkeypatch.undo()
    for fig in figures:
        plt.close(fig)
