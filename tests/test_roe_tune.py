"""Temperature tuning (RoE §2.2): Optuna TPE over per-layer tau, profiles that load back, resumable studies."""

from __future__ import annotations

import functools
import json

import pytest

import moectl
from moectl.models.load import ByteTokenizer
from moectl.roe import RoEConfig, score, tune
from moectl.roe.score_data import ChoiceItem, LMItem

pytest.importorskip("optuna")

VAL = [LMItem("", "The quick brown fox."), LMItem("Hi", " there"), LMItem("", "Experts route tokens.")]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _model():
    return moectl.tiny("olmoe", vocab_size=ByteTokenizer.vocab_size, num_hidden_layers=4)


def test_tuning_writes_a_profile_that_loads_back(tmp_path):
    model, tokenizer = _model(), ByteTokenizer()
    out = tmp_path / "profile.json"
    result = tune(
        model, tokenizer, VAL, K=3, trials=4, max_tau=0.5, skip_layers=1, seed=0, out=out,
        storage=tmp_path / "study.db", plot_dir=tmp_path, progress=False,
    )  # fmt: skip
    assert result.trials == 4 and len(result.history) == 4
    assert result.history[0]["tau"] == [0.0] * 4  # the plain model is trial 0
    assert result.baseline == result.history[0]["value"]
    assert result.value <= result.baseline  # minimising perplexity: never worse than tau = 0 on validation
    assert result.tau[0] == 0.0 and result.tau[-1] == 0.0  # first and last L = 1 MoE layers held
    assert all(0.0 <= t <= 0.5 for t in result.tau)
    assert any(t > 0 for h in result.history[1:] for t in h["tau"])
    config = RoEConfig.from_profile(out)
    assert config.K == 3 and config.taus(4) == result.tau
    data = json.loads(out.read_text())
    assert data["objective"] == "ppl" and data["skip_layers"] == 1 and data["tuned_layers"] == [1, 2]
    # the profile's value is what scoring with it gives
    assert score(model, tokenizer, VAL, config).ppl == pytest.approx(result.value, rel=1e-6)
    heatmap = tmp_path / "tau_heatmap.png"
    assert heatmap.exists() and heatmap.read_bytes()[:4] == b"\x89PNG"


def test_tuning_resumes_from_sqlite(tmp_path):
    model, tokenizer = _model(), ByteTokenizer()
    kw = {"K": 2, "max_tau": 0.4, "storage": tmp_path / "study.db", "progress": False, "seed": 3}
    first = tune(model, tokenizer, VAL, trials=2, **kw)
    second = tune(model, tokenizer, VAL, trials=4, **kw)
    assert second.trials == 4
    assert second.history[:2] == first.history
    assert {tuple(h["tau"]) for h in second.history[2:]}.isdisjoint({tuple(h["tau"]) for h in first.history})
    again = tune(model, tokenizer, VAL, trials=4, **kw)  # budget reached: nothing new runs
    assert again.history == second.history


def test_uniform_sweep_draws_the_appendix_b_curve(tmp_path):
    model, tokenizer = _model(), ByteTokenizer()
    result = tune(
        model, tokenizer, VAL, K=2, uniform=True, max_tau=0.2, uniform_step=0.1, plot_dir=tmp_path,
        out=tmp_path / "u.json", progress=False,
    )  # fmt: skip
    swept = sorted(h["tau"][0] for h in result.history)
    assert swept == [0.0, 0.1, 0.2]
    assert all(len(set(h["tau"])) == 1 for h in result.history)  # one tau for every MoE layer
    assert (tmp_path / "uniform_tau.png").exists()


def test_accuracy_objective_on_multiple_choice(tmp_path):
    model, tokenizer = _model(), ByteTokenizer()
    items = [ChoiceItem("The sky is", [" blue", " green"], 0), ChoiceItem("Fire is", [" cold", " hot"], 1)]
    result = tune(model, tokenizer, items, K=2, objective="acc", trials=2, progress=False)
    assert 0.0 <= result.value <= 1.0
    assert result.value >= result.baseline  # maximising accuracy


def test_plain_strings_are_refused_with_a_message_that_says_so(tmp_path):
    """``tune`` takes items, not plain strings (``score`` alone converts them): the refusal must not
    claim plain strings are accepted (it did: "(or plain strings: texts)") and names the item to use."""
    from moectl.errors import ConfigError

    model, tokenizer = _model(), ByteTokenizer()
    with pytest.raises(ConfigError) as err:
        tune(model, tokenizer, ["The quick brown fox."], K=2, trials=1, progress=False, storage=tmp_path / "s.db")
    assert "plain strings" not in str(err.value) and "LMItem('', text)" in str(err.value)
