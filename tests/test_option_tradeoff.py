"""The switch-rate-against-KL figure's rows: controllers by η, baselines once, the router apart."""

from __future__ import annotations

from moectl.reporting.option_tradeoff import plot_tradeoff, tradeoff_rows


def _row(method, kl, switch, k_hat=8, **extra):
    return {"method": method, "k_hat": k_hat, "kl": kl, "kl_ci95": 0.01, "switch_rate": switch,
            "switch_rate_ci95": 0.02, **extra}  # fmt: skip


def test_rows_sorted_by_eta_with_baselines_once_and_the_router(tmp_path):
    first = {"rows": [_row("base model", 0.0, 0.84), _row("wanda", 0.48, 0.0), _row("controller η=0.04", 0.2, 0.35),
                      _row("controller η=0.02", 0.12, 0.59), _row("controller η=0.02", 0.3, 0.4, k_hat=16)]}
    second = {"rows": [_row("wanda", 0.48, 0.0), _row("random", 0.6, 1.0),
                       _row("controller η=0.64", 0.42, 0.055, train_step=215)]}  # fmt: skip
    rows = tradeoff_rows([first, second], 8)
    assert [c["eta"] for c in rows["controllers"]] == [0.02, 0.04, 0.64]
    assert rows["controllers"][-1]["step"] == 215
    assert [b["method"] for b in rows["baselines"]] == ["wanda", "random"]
    assert rows["router"]["switch"] == 0.84
    png = plot_tradeoff(rows, 8, tmp_path / "tradeoff.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
