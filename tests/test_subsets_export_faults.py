"""Issue #29 (1): ``subset export --out`` an existing folder, or the source folder itself, is refused
before anything is written, on every path (in memory with any --dtype, tiny models, streamed)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moectl
from moectl.cli.subset import subset_app
from moectl.io.atomic import CRASH_AFTER, writer_lock
from moectl.models.shapes import make_checkpoint
from moectl.subsets import save_subset
from moectl.subsets.export import export_subset


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture
def sharded(tmp_path):
    """A checkpoint of several shards and its subset file."""
    src = tmp_path / "olmoe"
    make_checkpoint("shape:olmoe-1b-7b@2~w64", src, max_shard_bytes=1_000_000)
    assert len(list(src.glob("*.safetensors"))) > 1
    subset = tmp_path / "s.json"
    save_subset(subset, {0: list(range(0, 64, 4)), 1: list(range(2, 64, 4))}, model=str(src))
    return src, subset


@pytest.mark.parametrize("extra", [["--no-stream"], ["--dtype", "float32"], ["--stream"]])
def test_exporting_into_the_source_folder_is_refused_and_leaves_it_whole(sharded, extra):
    src, subset = sharded
    before = _digest(src)
    result = CliRunner().invoke(
        subset_app, ["export", str(src), "--subset", str(subset), "--out", str(src), *extra]
    )
    assert result.exit_code == 2, result.output
    assert "not an empty folder" in result.output and "Traceback" not in result.output
    assert _digest(src) == before  # was: shards deleted, one model.safetensors, the old index left


def test_exporting_a_tiny_model_into_an_existing_checkpoint_is_refused(tmp_path):
    other = tmp_path / "other"
    moectl.tiny("olmoe").save_pretrained(other)
    before = _digest(other)
    info = moectl.inspect(moectl.tiny("olmoe"))
    subset = tmp_path / "s.json"
    save_subset(subset, {layer.index: [0, 1] for layer in info.layers}, model="tiny:olmoe")
    result = CliRunner().invoke(
        subset_app, ["export", "tiny:olmoe", "--subset", str(subset), "--out", str(other)]
    )
    assert result.exit_code == 2 and "--out" in result.output
    assert _digest(other) == before


def test_export_subset_refuses_a_non_empty_folder_and_fills_an_empty_one(tmp_path):
    model = moectl.tiny("olmoe")
    keep = {layer.index: [0, 1] for layer in moectl.inspect(model).layers}
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_bytes(b"old")
    with pytest.raises(ValueError, match="not an empty folder"):
        export_subset(model, keep, tmp_path / "full")
    assert (tmp_path / "full" / "model.safetensors").read_bytes() == b"old"
    (tmp_path / "empty").mkdir()
    export_subset(model, keep, tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]  # no temporary folder left


# -- issue #42 (6): what an export killed mid-way leaves, and a second export meanwhile ------------------
def test_the_next_export_into_the_folder_removes_what_a_killed_export_left_and_nothing_live(sharded):
    """Was: ``.tmp-a`` of an export killed mid-way (SIGKILL) stayed until an export into ``a`` itself."""
    src, subset = sharded
    parent = src.parent / "exports"
    parent.mkdir()
    tiny = src.parent / "tiny.json"
    save_subset(tiny, {0: [0, 1], 1: [0, 1], 2: [0, 1]}, num_experts=8)
    killed = subprocess.run(
        [sys.executable, "-m", "moectl", "subset", "export", "tiny:olmoe", "--subset", str(tiny),
         "--out", str(parent / "a")],
        env={**os.environ, CRASH_AFTER: "1"}, capture_output=True, text=True,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (parent / ".tmp-a" / "model.safetensors").is_file() and not (parent / "a").exists()
    (parent / ".tmp-old").mkdir()  # no lock file: an unlocked write (or an older moectl's), maybe live
    with writer_lock(parent / "live"):  # a live export: this process holds its lock
        (parent / ".tmp-live").mkdir()
        (parent / ".tmp-live" / "model.safetensors").write_bytes(b"being written")
        result = CliRunner().invoke(
            subset_app, ["export", str(src), "--subset", str(subset), "--out", str(parent / "b")]
        )
        assert result.exit_code == 0, result.output
        assert "streamed" in result.output
        assert _squash(f"removed {parent / '.tmp-a'}") in _squash(result.output)
        assert sorted(p.name for p in parent.iterdir()) == [".lock-live", ".tmp-live", ".tmp-old", "b"]
        assert (parent / ".tmp-live" / "model.safetensors").read_bytes() == b"being written"


def test_a_second_export_into_the_same_folder_meanwhile_is_refused(tmp_path):
    """Was: the second export deleted the first one's ``.tmp-o`` under it and wrote its own there."""
    subset = tmp_path / "s.json"
    save_subset(subset, {0: [0, 1], 1: [0, 1], 2: [0, 1]}, num_experts=8)
    args = ["export", "tiny:olmoe", "--subset", str(subset), "--out", str(tmp_path / "o")]
    (tmp_path / ".tmp-o").mkdir()
    (tmp_path / ".tmp-o" / "model.safetensors").write_bytes(b"being written")
    with writer_lock(tmp_path / "o"):
        result = CliRunner().invoke(subset_app, args)
    assert result.exit_code == 2, result.output
    assert _squash(f"being written by another process (pid {os.getpid()}") in _squash(result.output)
    assert (tmp_path / ".tmp-o" / "model.safetensors").read_bytes() == b"being written"
    result = CliRunner().invoke(subset_app, args)  # its writer gone (the lock let go): removed, and said
    assert result.exit_code == 0, result.output
    assert _squash(f"removed {tmp_path / '.tmp-o'}") in _squash(result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "s.json"]


def _squash(text: str) -> str:
    """``text`` without white space: rich wraps long lines anywhere."""
    return "".join(text.split())
