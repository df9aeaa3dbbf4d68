"""TE-MoE Figure 2 as a user sees it: the option drawn, its switches, which sequence, which model;
a legend entry only for what is drawn."""

from __future__ import annotations

import torch

import moectl

BLUE = (0.62, 0.78, 0.95)


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def _has_blue(ax) -> bool:
    image = torch.as_tensor(ax.get_images()[0].get_array().data)
    return bool((image - torch.tensor(BLUE)).abs().sum(-1).lt(1e-3).any())


def _traced(policies=None):
    from moectl.generate import generate_traced

    model, tok, info = moectl.load("tiny:olmoe", dtype="float32")
    prompts = ["The history of the city of", "def f(x):"]
    return generate_traced(model, tok, prompts, 12, progress=False, policies=policies)[1], info


def test_figure_2_draws_the_recorded_option_under_a_policy(tmp_path, figures):
    """Under a policy that records ω (a document pool here) and no k-hat, Fig. 2 shades ω, ticks its
    switches and says which sequence it shows and the ω's size."""
    from moectl.reporting import plots

    trace, _ = _traced({"type": "document_pool", "d": 4})
    plots.plot_expert_activation(trace, tmp_path / "a.png", layer=1, model="runs/deep/tiny-olmoe/final")
    strip, ax = figures[-1].axes
    title = strip.get_title(loc="left")
    assert "ω recorded by the policy (k-hat = 4)" in title and "sequence 0" in title
    assert "tiny-olmoe/final" in title and "runs/deep" not in title  # the last two path parts
    assert "option ω (recorded mask)" in _legend(ax) and _has_blue(ax)
    assert ("switch of ω" in _legend(ax)) == bool(strip.collections[0].get_segments())


def test_figure_2_legend_has_no_entry_for_what_is_not_drawn(tmp_path, figures):
    """k-hat = top-k: ω is the activated experts, no cell is blue, so the legend has one black entry
    naming ω, not a second 'ω' swatch; a fixed mask never switches: no 'switch' entry."""
    from moectl.reporting import plots
    from moectl.routing import ExpertMask

    trace, info = _traced()
    plots.plot_expert_activation(trace, tmp_path / "b.png", layer=1, k_hat=2, label="the prompt")
    strip, ax = figures[-1].axes
    assert "k-hat = 2" in strip.get_title(loc="left") and "the prompt" in strip.get_title(loc="left")
    assert _legend(ax) == ["activated = option ω (k-hat = 2)", "switch of ω"] and not _has_blue(ax)

    masked, _ = _traced(ExpertMask.everywhere(info, range(4)))
    plots.plot_expert_activation(masked, tmp_path / "c.png", layer=0)
    strip, ax = figures[-1].axes
    assert "0 switches" in strip.get_title(loc="left")
    assert [t.get_text() for t in strip.texts] == ["ω never switches"]
    assert _legend(ax) == ["activated", "option ω (recorded mask)"] and _has_blue(ax)


def test_figure_2_without_k_hat_or_policy_draws_the_router_as_option(tmp_path, figures):
    """No recorded ω and no k-hat: the router with k-hat = top-k (switch_rate's default), not a
    figure with an empty switch strip."""
    from moectl.reporting import plots

    trace, _ = _traced()
    plots.plot_expert_activation(trace, tmp_path / "d.png", layer=0)
    strip, _ = figures[-1].axes
    assert f"k-hat = {trace.top_k}:" in strip.get_title(loc="left")


def test_demo_draws_figure_2_under_its_document_pool(tmp_path, figures):
    """The demo's second Fig. 2 shows the pool it recorded as ω; both name the model and the prompt."""
    from moectl.demo import run_demo

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    result = run_demo(model, tok, "tiny:olmoe", max_new_tokens=8, out_dir=str(tmp_path))
    assert [p.rsplit("/", 1)[-1] for p in result["plots"]] == [
        "expert_activation_layer0.png",
        "expert_activation_layer0_document_pool.png",
    ]
    plain, pooled = figures[-2:]
    for fig in (plain, pooled):
        title = fig.axes[0].get_title(loc="left")
        assert "tiny:olmoe" in title and "prompt 0 (" in title
    assert "ω recorded by the policy" in pooled.axes[0].get_title(loc="left") and _has_blue(pooled.axes[1])
    assert not _has_blue(plain.axes[1])  # k-hat = top-k


def test_titles_break_paths_at_separators_never_mid_word():
    from moectl.reporting.plots import model_label, wrap_title

    assert model_label("/data/users/me/runs/olmoe-math/final") == "olmoe-math/final"
    assert model_label("allenai/OLMoE-1B-7B-0924") == "allenai/OLMoE-1B-7B-0924"
    assert model_label("tiny:olmoe") == "tiny:olmoe" and model_label("./ckpt/") == "ckpt"
    title = "Switch rate per MoE layer, /very/long/path/to/a/checkpoint-folder/of-some-length/final (k-hat = 8)"
    wrapped = wrap_title(title, 30)
    assert all(len(line) <= 30 for line in wrapped.splitlines())
    assert wrapped.replace("\n", "").replace(" ", "") == title.replace(" ", "")
    words = set(title.replace("/", " ").split())
    for line in wrapped.splitlines():  # every line holds whole words (and path parts)
        assert set(line.replace("/", " ").split()) <= words
    assert wrap_title("a" * 50, 20) == "a" * 50  # no break in it: whole
