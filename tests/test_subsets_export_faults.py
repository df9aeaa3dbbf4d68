"""Issue #29 (1): ``subset export --out`` an existing folder, or the source folder itself, is refused
before anything is written, on every path (in memory with any --dtype, tiny models, streamed)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moectl
from moectl.cli.subset import subset_app
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
