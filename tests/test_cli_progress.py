"""Progress on long work (issue #43 item 3): a ``rich`` bar on an interactive terminal, i/N with
what is being done; nothing at all (not even a blank line) when the output is not a terminal.

A terminal is forced by replacing rich's global console (the one ``moectl.progress.progress_bar``
draws on) with one that says it is interactive; it still writes to ``sys.stdout``, which
``CliRunner`` captures. Without the fixture the console is pytest's captured, non-terminal stdout.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import rich
from rich.console import Console
from typer.testing import CliRunner

from _eval_data import small_cache
from moectl.cli import app
from moectl.progress import progress_bar, progress_shown

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def tty(monkeypatch):
    """rich's console as an interactive terminal, writing to whatever ``sys.stdout`` is."""
    monkeypatch.setattr(rich, "_console", Console(force_terminal=True, force_interactive=True, width=200))


@pytest.fixture
def no_tty(monkeypatch):
    """rich's console as a pipe or a file (what a redirected or captured run gets)."""
    monkeypatch.setattr(rich, "_console", Console(force_terminal=False, force_interactive=False, width=200))


def _text(output: str) -> str:
    return ANSI.sub("", output)


def _bar(output: str, label: str) -> bool:
    """Whether a bar labelled ``label`` (its done/total column after it) was drawn."""
    return re.search(re.escape(label) + r".*\b\d+/\d+\b", _text(output)) is not None


def test_a_bar_is_drawn_only_on_an_interactive_terminal(tty, monkeypatch, capsys):
    assert progress_shown(True) and not progress_shown(False)
    with progress_bar("counting", True) as bar:
        bar.advance(bar.add_task("count", total=2))
    assert _bar(capsys.readouterr().out, "counting")
    monkeypatch.setattr(rich, "_console", Console(force_terminal=False, force_interactive=False))
    assert not progress_shown(True)
    with progress_bar("counting", True) as bar:
        bar.advance(bar.add_task("count", total=2))
    assert capsys.readouterr().out == ""  # rich's blank line after a bar on a non-terminal too


def _trace(tmp_path, name="routed.npy", tokens=120, layers=2, k=2, experts=8):
    rng = np.random.default_rng(0)
    chosen = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(tokens)])
    np.save(tmp_path / name, chosen.astype(np.int32))
    return str(tmp_path / name)


def _simulate(tmp_path, *extra: str):
    traces = [_trace(tmp_path, "a.npy"), _trace(tmp_path, "b.npy")]
    args = ["offload", "simulate", *traces, "--num-experts", "8", "--budget", "2,4", "--policies", "lru,belady"]
    result = runner.invoke(app, [*args, *extra])
    assert result.exit_code == 0, result.output
    return result


def test_offload_simulate_shows_traces_and_replays_on_a_terminal(tmp_path, tty):
    out = _simulate(tmp_path).stdout
    assert _bar(out, "reading traces")
    assert _bar(out, "replaying belady B=4")  # the last replay, as the final refresh draws it
    assert "offload simulate:" in out  # the results as before


def test_offload_simulate_is_quiet_when_not_a_terminal(tmp_path, no_tty):
    result = _simulate(tmp_path, "--json", str(tmp_path / "r.json"))
    assert not _bar(result.stdout, "replaying") and not _bar(result.stdout, "reading traces")
    assert result.stdout.strip().startswith("offload simulate:")  # the table first: no bar ...
    assert not result.stdout.startswith("\n")  # ... nor the blank line rich leaves behind one
    assert len(json.loads((tmp_path / "r.json").read_text())["results"]) == 4


def _eval(tmp_path):
    cache = small_cache(tmp_path / "evals")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t, "domain": "d"}) + "\n" for t in ("A cat.", "x = 1")))
    args = ["eval", "tiny:olmoe", "--tasks", "arc_easy", "--limit", "4", "--cache", str(cache),
            "--engine", "moectl", "--perplexity", str(corpus), "--batch-size", "2"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_eval_names_the_task_in_its_bar_on_a_terminal(tmp_path, tty):
    out = _eval(tmp_path)
    assert _bar(out, "arc_easy choices")  # per request batch, the task named
    assert _bar(out, "perplexity")


def test_eval_is_quiet_when_not_a_terminal(tmp_path, no_tty):
    out = _eval(tmp_path)
    assert not _bar(out, "arc_easy choices") and "acc_norm" in out


def test_roe_tune_shows_trials_and_the_best_value_on_a_terminal(tmp_path, tty):
    pytest.importorskip("optuna")
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps({"text": t}) for t in ["The quick brown fox.", "Hello there."]))
    args = ["roe", "tune", "--tiny", "olmoe", "--k", "2", "--data", str(val), "--trials", "2",
            "--out", str(tmp_path / "profile.json")]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    text = _text(result.stdout)
    assert re.search(r"tuning per-layer K=2 ppl.*\b[12]/2\b.*best \d", text), text[-2000:]


@pytest.mark.parametrize("terminal", [True, False])
def test_options_train_shows_steps_on_a_terminal_only(tmp_path, monkeypatch, terminal):
    monkeypatch.setattr(rich, "_console", Console(force_terminal=terminal, force_interactive=terminal, width=200))
    out = tmp_path / "ctl"
    args = ["options", "train", "tiny:olmoe", "--k-hat", "4", "--steps", "2", "--batch-size", "2",
            "--max-new-tokens", "4", "--out", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    shown = re.search(r"options.*\b[12]/2\b.*reward -?\d", _text(result.stdout)) is not None
    assert shown == terminal
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the log is the record, bar or no bar


@pytest.mark.parametrize("terminal", [True, False])
def test_pretrain_shows_steps_on_a_terminal_only(tmp_path, monkeypatch, capsys, corpus, terminal):
    from moectl.train.loop import Trainer
    from moectl.train.train_config import TrainConfig
    from test_train import MICRO_MODEL

    monkeypatch.setattr(rich, "_console", Console(force_terminal=terminal, force_interactive=terminal, width=200))
    config = TrainConfig(
        out=str(tmp_path / "run"), corpus=str(corpus), seq_len=32, micro_batch=2, max_steps=2, warmup_steps=0,
        checkpoint_every=100, log_every=1, model=MICRO_MODEL, final_eval_batches=1,
    )  # fmt: skip
    Trainer(config, progress=True).fit()
    out = capsys.readouterr().out
    assert (re.search(r"standard.*\b[12]/2\b.*loss \d", _text(out)) is not None) == terminal
    if not terminal:
        assert out == ""
