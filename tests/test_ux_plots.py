"""Figures as a reader sees them: switch-rate's per-layer plot names the model and k-hat, and the
options figure's heading, panel titles and legend neither overlap nor leave the figure."""

from __future__ import annotations

import moectl


def test_switch_rate_plots_name_the_model_k_hat_and_policy(tmp_path, figures):
    from moectl.reports import switch_rate_report

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    spec = str(tmp_path / "a" / "deep" / "path" / "to" / "olmoe-run")  # as a user's checkpoint folder
    result = switch_rate_report(model, tok, spec, k_hat=3, max_new_tokens=6, plot_dir=str(tmp_path), progress=False)
    fig2, per_layer = figures[-2:]
    title = per_layer.axes[0].get_title()
    assert "k-hat = 3" in title and "to/olmoe-run" in title and "path/to" not in title
    assert [t.get_text() for t in per_layer.axes[0].get_xticklabels()] == [str(i) for i in range(3)]
    assert "to/olmoe-run" in fig2.axes[0].get_title(loc="left") and len(result["plots"]) == 2

    switch_rate_report(
        model, tok, "tiny:olmoe", max_new_tokens=6, plot_dir=str(tmp_path), progress=False, policy="option:3"
    )
    fig2, per_layer = figures[-2:]
    assert "under option:3" in per_layer.axes[0].get_title() and "k-hat = 3" in per_layer.axes[0].get_title()
    assert "under option:3" in fig2.axes[0].get_title(loc="left")


def _extent(artist, renderer):
    return artist.get_window_extent(renderer)


def test_options_figure_heading_titles_and_legend_do_not_overlap(tmp_path, figures):
    """`options generate --plot`: the heading (title, model, prompt) stood over the first panel's
    title and the legend was cut at the figure's edge."""
    from moectl.generate import generate_traced
    from moectl.reporting.option_plots import plot_options

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    prompt = "The history of the city of " * 8  # longer than a line of the heading
    _, trace = generate_traced(model, tok, [prompt], 10, progress=False, policies={"type": "document_pool", "d": 4})
    plot_options(trace, tmp_path / "o.png", label=f"prompt 0: {prompt!r}", model="/x/y/runs/tiny-olmoe")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figures[-1]
    canvas = FigureCanvasAgg(fig)  # moectl's figures carry no pyplot canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    heading = _extent(fig._suptitle, renderer)
    assert "runs/tiny-olmoe" in fig._suptitle.get_text() and "/x/y" not in fig._suptitle.get_text()
    whole = fig.bbox
    legend = _extent(fig.legends[0], renderer)
    assert whole.x0 <= legend.x0 and legend.x1 <= whole.x1 and whole.y0 <= legend.y0
    assert whole.x0 <= heading.x0 and heading.x1 <= whole.x1 + 1 and heading.y1 <= whole.y1 + 1
    for ax in fig.axes:
        for text in (ax.title, ax._left_title):
            if text.get_text():
                assert not heading.overlaps(_extent(text, renderer)), text.get_text()
        assert not legend.overlaps(_extent(ax, renderer))
    assert not legend.overlaps(_extent(fig.axes[-1].xaxis.label, renderer))


def test_a_long_path_in_a_title_breaks_after_a_separator(tmp_path, figures):
    """`offload simulate --routing 'learned: /a/long/checkpoint/path' --plot`: the title's lines break
    after a '/', every path part whole, whole budgets on the axis."""
    from moectl.reporting.residency_plots import plot_hit_rate

    path = "/home/someone/checkpoints/experiments/2026-11/olmoe-math-finetune-with-a-long-name/final"
    rows = [{"policy": p, "budget": b, "hit_rate": b / 8} for p in ("lru", "belady") for b in (2, 4, 6)]
    plot_hit_rate(rows, tmp_path / "h.png", f"hit rate vs budget\nrouting: learned: {path}")
    ax = figures[-1].axes[0]
    lines = ax.get_title().splitlines()
    assert len(lines) == 3 and all(len(line) <= 75 for line in lines)
    assert "".join(lines[1:]).replace("routing: learned: ", "") == path
    figures[-1].canvas.draw()
    assert all(float(t.get_text()).is_integer() for t in ax.get_xticklabels() if t.get_text())
