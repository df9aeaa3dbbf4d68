"""RoE tuning on a fixed validation slice (``--max-docs``): items spread over the data, per-trial seconds."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.models.load import ByteTokenizer
from moectl.roe import RoEConfig, score, tune
from moectl.roe.score_data import LMItem
from moectl.roe.tune import spread

pytest.importorskip("optuna")


def test_spread_takes_evenly_spaced_items_first_and_last_included():
    assert spread(list(range(10)), 4) == [0, 3, 6, 9]
    assert spread(list(range(10)), 1) == [0]
    assert spread(list(range(3)), 5) == [0, 1, 2]
    with pytest.raises(ValueError, match="max_docs"):
        spread([1, 2], 0)


def test_tune_scores_the_fixed_slice_and_times_each_trial(tmp_path):
    # a domain-ordered split: the first 4 items are all "a"; the spread slice reaches every domain
    items = [LMItem("", f"{d} document number {i}.") for d in "abcd" for i in range(4)]
    model = moectl.tiny("olmoe", vocab_size=ByteTokenizer.vocab_size, num_hidden_layers=3)
    out = tmp_path / "profile.json"
    result = tune(model, ByteTokenizer(), items, K=2, trials=2, max_docs=4, out=out, progress=False)
    profile = json.loads(out.read_text())
    assert profile["validation_items"] == 4
    assert profile["validation_slice"] == {"limit": None, "max_docs": 4, "max_length": 256}
    assert all(h["seconds"] is not None and h["seconds"] > 0 for h in result.history)
    # the slice is the spread one: scoring exactly those items gives trial 0's value (tau = 0)
    picked = [items[0], items[5], items[10], items[15]]
    assert score(model, ByteTokenizer(), picked, RoEConfig(K=2, tau=0.0)).ppl == pytest.approx(
        result.history[0]["value"], rel=1e-6
    )


def test_cli_refuses_a_zero_slice_before_loading(tmp_path):
    data = tmp_path / "val.jsonl"
    data.write_text('{"text": "hello"}\n')
    out = CliRunner().invoke(app, ["roe", "tune", "--tiny", "olmoe", "--data", str(data), "--max-docs", "0"])
    assert out.exit_code == 2 and "--max-docs" in out.output
