"""Merging subset experts back into the full model (EMO §6): the inverse of export, and the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import moectl
from moectl.adapters.slicing import get_tensor, per_expert_tensors, slice_experts
from moectl.cli.subset import subset_app
from moectl.models.load import load_model
from moectl.routing import ExpertMask, route
from moectl.subsets.export import export_subset
from moectl.subsets.files import save_subset
from moectl.subsets.merge import merge_subset

runner = CliRunner()
FAMILIES = [
    "olmoe",
    "qwen2_moe",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "llama4_text",
    "ernie4_5_moe",
]


def _keep(info) -> dict[int, list[int]]:
    """Four of eight experts per MoE layer; two per group for grouped routers."""
    return {layer.index: [0, 2, 5, 7] if layer.rule.n_group > 1 else [1, 3, 4, 6] for layer in info.layers}


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_merging_an_unchanged_export_is_the_identity(family):
    full = moectl.tiny(family)
    info = moectl.inspect(full)
    keep = _keep(info)
    before = _state(full)
    report = merge_subset(full, slice_experts(copy.deepcopy(full), keep), keep, all_weights=True)
    after = full.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert report["expert_tensors_written"] == len(per_expert_tensors(full, info)) > 0
    assert all(row["max_change"] == 0 for row in report["layers"].values())


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "gpt_oss"])
def test_a_changed_expert_lands_at_its_full_index(family):
    full = moectl.tiny(family)
    info = moectl.inspect(full)
    keep = _keep(info)
    sub = slice_experts(copy.deepcopy(full), keep)
    before = _state(full)
    expert_tensors = [e for e in per_expert_tensors(sub).values() if e.layer == 1 and e.part == "experts"]
    with torch.no_grad():
        for entry in expert_tensors:
            get_tensor(sub, entry.name).select(entry.dim, 2).add_(1.0)  # subset expert 2 of MoE layer 1
    merge_subset(full, sub, keep, router=False)
    changed = {k for k, v in full.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {e.name for e in expert_tensors}
    target = keep[1][2]
    for entry in expert_tensors:
        diff = (get_tensor(full, entry.name) - before[entry.name]).movedim(entry.dim, 0)
        assert torch.allclose(diff[target], torch.ones_like(diff[target]))
        assert diff[[e for e in range(8) if e != target]].abs().max() == 0


def test_router_rows_and_shared_weights_follow_the_flags():
    full = moectl.tiny("deepseek_v3")
    info = moectl.inspect(full)
    keep = _keep(info)
    sub = slice_experts(copy.deepcopy(full), keep)
    router = info.layers[0].name  # model.layers.1.mlp.gate
    with torch.no_grad():
        get_tensor(sub, f"{router}.weight")[3] += 1.0
        get_tensor(sub, f"{router}.e_score_correction_bias")[3] += 1.0
        get_tensor(sub, "model.layers.0.self_attn.o_proj.weight").mul_(2.0)
    before = _state(full)

    no_router = copy.deepcopy(full)  # experts only: the experts are unchanged, so nothing differs
    merge_subset(no_router, sub, keep, router=False)
    assert all(torch.equal(no_router.state_dict()[k], before[k]) for k in before)

    merge_subset(full, sub, keep)  # default: experts + their router rows, shared weights untouched
    changed = {k for k, v in full.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {f"{router}.weight", f"{router}.e_score_correction_bias"}
    assert torch.equal(
        get_tensor(full, f"{router}.weight")[keep[0][3]], get_tensor(sub, f"{router}.weight")[3]
    )

    report = merge_subset(full, sub, keep, all_weights=True)
    assert torch.equal(full.state_dict()["model.layers.0.self_attn.o_proj.weight"],
                       sub.state_dict()["model.layers.0.self_attn.o_proj.weight"])  # fmt: skip
    assert report["shared_tensors_written"] > 0 and report["shared_max_change"] > 0


def test_merged_model_under_the_subset_mask_equals_the_subset():
    """With every weight taken, the merged model restricted to the kept experts *is* the subset."""
    full = moectl.tiny("qwen2_moe")
    info = moectl.inspect(full)
    keep = _keep(info)
    sub = slice_experts(copy.deepcopy(full), keep)
    with torch.no_grad():
        for p in sub.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a "fine-tuned" subset
    merge_subset(full, sub, keep, all_weights=True)
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), route(full, [ExpertMask.from_lists(info, keep, renorm="pruned")]):
        merged = full(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(merged, sub(ids).logits, rtol=1e-4, atol=1e-4)


def test_models_that_do_not_fit_are_refused():
    full = moectl.tiny("olmoe")
    info = moectl.inspect(full)
    sub = slice_experts(copy.deepcopy(full), _keep(info))
    wider = {layer.index: [0, 1, 2, 3, 4] for layer in info.layers}
    with pytest.raises(ValueError, match="experts per MoE layer"):
        merge_subset(full, sub, wider)
    qwen = moectl.tiny("qwen2_moe")
    other = slice_experts(qwen, _keep(moectl.inspect(qwen)))  # same names, smaller experts
    with pytest.raises(
        ValueError, match=r"the subset model's tensor is \[4, 64, 64\], expected \[4, 192, 64\]"
    ):
        merge_subset(full, other, _keep(info))


def test_cli_merge_round_trip_and_exit_codes(tmp_path):
    full, _ = load_model("tiny:olmoe")  # what the CLI builds from tiny:olmoe
    info = moectl.inspect(full)
    keep = _keep(info)
    subset = save_subset(tmp_path / "a.subset.json", keep, model="tiny:olmoe")
    export_subset(full, keep, tmp_path / "sub", metadata={"model": "tiny:olmoe"})
    out = tmp_path / "merged"
    result = runner.invoke(
        subset_app,
        ["merge", "tiny:olmoe", "--experts", str(tmp_path / "sub"), "--out", str(out), "--json", str(tmp_path / "m.json")],
    )  # fmt: skip  # the kept experts come from the export's moectl_subset.json
    assert result.exit_code == 0, result.output
    assert "experts written" in result.output
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(merged[k], v) for k, v in full.state_dict().items())
    assert json.loads((out / "moectl_merge.json").read_text())["layers"]["0"]["experts"] == keep[0]
    written = json.loads((tmp_path / "m.json").read_text())
    assert written["out"] == str(out) and written["router"] and not written["all_weights"]

    again = runner.invoke(
        subset_app, ["merge", "tiny:olmoe", "--experts", str(tmp_path / "sub"), "--out", str(out)]
    )
    assert again.exit_code == 2 and "--overwrite" in again.output
    base = ["merge", "tiny:olmoe", "--out", str(tmp_path / "m2")]
    missing = runner.invoke(subset_app, [*base, "--experts", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "not a checkpoint directory" in missing.output
    other = save_subset(tmp_path / "b.subset.json", {i: [0, 1, 2, 3] for i in keep}, model="tiny:olmoe")
    mismatch = runner.invoke(subset_app, [*base, "--experts", str(tmp_path / "sub"), "--subset", str(other)])
    assert mismatch.exit_code == 2 and "other experts" in mismatch.output
    ok = runner.invoke(
        subset_app, [*base, "--experts", str(tmp_path / "sub"), "--subset", str(subset), "--all-weights"]
    )
    assert ok.exit_code == 0, ok.output
    assert "shared weights" in ok.output
