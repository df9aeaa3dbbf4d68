"""Streamed subset export of a checkpoint folder equals the in-memory export, tensor for tensor."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import moectl
from moectl.cli.subset import subset_app
from moectl.models.shapes import MARKER, make_checkpoint
from moectl.routing import ExpertMask, route
from moectl.subsets import save_subset
from moectl.subsets.export import export_subset
from moectl.subsets.export_stream import export_checkpoint_subset


def _keep(model) -> dict[int, list[int]]:
    info = moectl.inspect(model)
    n = info.layers[0].num_experts
    return {layer.index: list(range(1, n, 2)) for layer in info.layers}


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "gpt_oss", "mixtral", "deepseek_v3"])
def test_streamed_export_equals_the_in_memory_export(tmp_path, family):
    model = moectl.tiny(family)
    model.save_pretrained(tmp_path / "src")
    keep = _keep(model)
    report = export_checkpoint_subset(tmp_path / "src", keep, tmp_path / "streamed")
    export_subset(AutoModelForCausalLM.from_pretrained(tmp_path / "src"), keep, tmp_path / "memory")
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").state_dict()
    memory = AutoModelForCausalLM.from_pretrained(tmp_path / "memory").state_dict()
    assert streamed.keys() == memory.keys()
    assert all(torch.equal(streamed[k], memory[k]) for k in streamed)
    assert report["streamed"] and report["experts_after"] == len(keep[0])
    assert 0 < report["after"]["tensor_bytes"] < report["before"]["tensor_bytes"]
    meta = json.loads((tmp_path / "streamed" / "moectl_subset.json").read_text())
    assert meta["keep"] == {str(k): v for k, v in keep.items()}


def test_sharded_checkpoint_exports_shard_by_shard_and_equals_the_pruned_mask(tmp_path):
    src = tmp_path / "olmoe"
    make_checkpoint("shape:olmoe-1b-7b@2~w64", src, max_shard_bytes=1_000_000)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 1
    full = AutoModelForCausalLM.from_pretrained(src).float()
    keep = {0: list(range(0, 64, 4)), 1: list(range(2, 64, 4))}
    export_checkpoint_subset(src, keep, tmp_path / "sub")
    out = sorted(p.name for p in (tmp_path / "sub").glob("*.safetensors"))
    assert all(p.stat().st_mode & 0o044 for p in (tmp_path / "sub").iterdir())  # readable by others, as any file
    assert len(out) == len(shards) and (tmp_path / "sub" / "model.safetensors.index.json").is_file()
    sub = AutoModelForCausalLM.from_pretrained(tmp_path / "sub").float()
    assert sub.config.num_experts == 16
    ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    info = moectl.inspect(full)
    with torch.no_grad(), route(full, ExpertMask.from_lists(info, keep, renorm="pruned")):
        expected = full(ids).logits
    with torch.no_grad():
        got = sub(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (tmp_path / "sub" / MARKER).is_file()  # a shape checkpoint stays one: the byte tokenizer loads


def test_bad_input_writes_nothing(tmp_path):
    model = moectl.tiny("olmoe")
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty folder"):
        export_checkpoint_subset(tmp_path / "src", _keep(model), tmp_path / "busy")
    uneven = {0: [0, 1, 2], 1: [0, 1], 2: [0, 1]}
    with pytest.raises(ValueError, match="same number"):
        export_checkpoint_subset(tmp_path / "src", uneven, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "src"]  # no partial folder left


def test_cli_streams_a_checkpoint_folder(tmp_path):
    model = moectl.tiny("olmoe")
    model.save_pretrained(tmp_path / "src")
    save_subset(tmp_path / "s.subset.json", _keep(model))
    args = ["export", str(tmp_path / "src"), "--subset", str(tmp_path / "s.subset.json")]
    result = CliRunner().invoke(
        subset_app, [*args, "--out", str(tmp_path / "sub"), "--json", str(tmp_path / "r.json")]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r.json").read_text())["streamed"] is True
    result = CliRunner().invoke(subset_app, [*args, "--out", str(tmp_path / "sub")])
    assert result.exit_code == 2 and "not an empty folder" in result.output
    result = CliRunner().invoke(subset_app, [*args, "--out", str(tmp_path / "mem"), "--no-stream"])
    assert result.exit_code == 0, result.output
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "sub").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "mem").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
