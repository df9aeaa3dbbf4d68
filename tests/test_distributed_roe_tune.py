"""`moectl roe tune` on two processes (accelerate, gloo): one Optuna study in a journal file, two trials at a time."""

from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from _distributed import check, launch

optuna = pytest.importorskip("optuna")
runner = CliRunner()
TEXTS = ["The quick brown fox.", "Experts route tokens.", "A cat sat on the mat.", "Rivers run to the sea."]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune-dp")
    (root / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    args = ["roe", "tune", "--tiny", "olmoe", "--data", "val.jsonl", "--k", "2", "--trials", "6",
            "--max-length", "32", "--out", "profile.json", "--json", "tune.json"]  # fmt: skip
    check(launch(args, cwd=root))
    return root


def _trials(root):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(root / "profile.optuna.journal")))
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).trials


def test_two_processes_share_one_study_and_its_budget(study):
    trials = _trials(study)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 6  # the budget, not 2 × 6
    taus = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(taus)) == 6  # each process samples with its own seed: no trial proposed twice
    assert sum(all(v == 0.0 for v in t.params.values()) for t in trials) == 1  # τ = 0 once, enqueued once
    # two at a time: some trial started before another had finished
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials)
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans))


def test_rank_zero_writes_the_profile_of_every_trial(study):
    profile = json.loads((study / "profile.json").read_text())
    result = json.loads((study / "tune.json").read_text())
    assert profile["trials"] == 6 and len(profile["history"]) == 6
    best = min(_trials(study), key=lambda t: t.value)
    assert profile["value"] == pytest.approx(best.value) == result["value"]


def test_several_processes_need_a_study_file():
    import moectl
    from moectl.distributed import Ranks
    from moectl.models.load import ByteTokenizer
    from moectl.roe.score_data import LMItem
    from moectl.roe.tune import tune

    model = moectl.tiny("olmoe", vocab_size=ByteTokenizer.vocab_size)
    with pytest.raises(ValueError, match="share one study through a file"):
        tune(model, ByteTokenizer(), [LMItem("", "x")], K=2, trials=2, processes=Ranks(rank=0, world=2))
