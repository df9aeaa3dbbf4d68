"""Crash consistency (issue #29): every writer killed at every step of its write leaves the old state
or the new, never its source touched, and a training run resumed after the kill ends bit for bit as
an uninterrupted one. The harness is ``benchmarks/crash_sweep.py`` (``--json``: the full sweep);
here, each cheap writer at every crash point and pretraining at its last, bounded to well under a minute."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import moectl.io.atomic as atomic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import crash_sweep
from crash_writers import WRITERS

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the harness forks its writers")
EVERY_POINT = ["small-files", "pretrain-checkpoint", "subset-export", "subset-export-stream",
               "tokenizer-build", "corpus-sample", "gguf", "eval-set-cache"]  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet():
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    yield


@pytest.mark.parametrize("name", EVERY_POINT)
def test_a_kill_at_any_step_leaves_the_old_state_or_the_new(tmp_path, name):
    row = crash_sweep.sweep(WRITERS[name](), tmp_path)
    assert row["steps"] >= 3 and row["tried"] == row["steps"]  # the write went through the hooks
    assert row["damaged"] == 0, row["damage"]


def test_pretraining_killed_mid_write_resumes_to_the_uninterrupted_run(tmp_path):
    """In a fresh interpreter: the harness forks training runs, and autograd refuses to run in a child
    forked from a process that has run a backward pass already (another test file's, where files
    share a worker process)."""
    import json
    import subprocess

    code = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import crash_sweep; "
        "from crash_writers import WRITERS; "
        "print(json.dumps(crash_sweep.sweep(WRITERS['pretrain'](), Path(sys.argv[2]), limit=1)))"
    )
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    done = subprocess.run([sys.executable, "-c", code, bench, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])  # the last step: final/ written
    assert row["steps"] >= 20 and row["tried"] == 1
    assert row["damaged"] == 0, row["damage"]


def test_the_harness_finds_damage_where_a_folder_is_swapped_in_two_renames(tmp_path, monkeypatch):
    """The negative control: without the one-step exchange and the recovery of ``.old-NAME`` (the
    checkpoint writer before this fix), a kill between the two renames loses the checkpoint."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    monkeypatch.setattr(atomic, "recover_dir", lambda final: Path(final))
    monkeypatch.setattr("moectl.train.checkpoint.recover_dir", lambda final: Path(final))
    row = crash_sweep.sweep(WRITERS["pretrain-checkpoint"](), tmp_path)
    assert row["damaged"] >= 1
    assert any("neither old nor new" in p for d in row["damage"] for p in d["problems"])


def test_sweep_points_include_the_first_and_last_step():
    assert crash_sweep.points(27, 2) == [1, 27]
    assert crash_sweep.points(5, None) == [1, 2, 3, 4, 5]
    assert crash_sweep.points(9, 3) == [1, 5, 9]


def test_the_command_line_refuses_unknown_writers(capsys):
    with pytest.raises(SystemExit) as stop:
        crash_sweep.main(["--writers", "nope"])
    assert stop.value.code == 2 and "unknown nope" in capsys.readouterr().err
