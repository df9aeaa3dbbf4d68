"""Export: the sliced checkpoint loads with plain transformers and equals the masked full model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import moectl
from moectl.routing import ExpertMask, route
from moectl.subsets import export_subset
from moectl.subsets.export import METADATA, disk_bytes

GROUPED = ("deepseek_v3", "glm4_moe", "dots1")


def keep_lists(info, family: str) -> dict[int, list[int]]:
    """Four experts per MoE layer, different per layer; two per group for grouped routers."""
    if family in GROUPED:  # 8 experts in 2 groups of 4
        choices = [[0, 1, 4, 5], [1, 3, 6, 7], [0, 2, 5, 7]]
    else:
        choices = [[0, 2, 5, 7], [1, 3, 4, 6], [2, 3, 6, 7], [0, 1, 4, 5]]
    return {layer.index: choices[layer.index % len(choices)] for layer in info.layers}


@torch.no_grad()
def test_export_round_trips_and_equals_masked_model(family, tmp_path):
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    keep = keep_lists(info, family)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    with route(model, [ExpertMask.from_lists(info, keep, renorm="pruned")]):
        masked = model(ids).logits
    full = model(ids).logits

    report = export_subset(model, keep, tmp_path / "out", metadata={"method": "test"})

    assert moectl.inspect(model).num_experts == 8, "export must not modify the caller's model"
    torch.testing.assert_close(model(ids).logits, full, rtol=0, atol=0)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    loaded_info = moectl.inspect(loaded)
    assert loaded_info.num_experts == 4
    assert all(layer.num_experts == 4 for layer in loaded_info.layers)
    torch.testing.assert_close(loaded(ids).logits, masked, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(masked, full, atol=1e-4), "the mask should change this model's output"

    meta = json.loads((tmp_path / "out" / METADATA).read_text())
    assert {int(k): v for k, v in meta["keep"].items()} == keep
    assert meta["method"] == "test"
    assert report["after"]["parameters"] == sum(p.numel() for p in loaded.parameters())
    assert report["after"]["parameters"] < report["before"]["parameters"]
    assert report["after"]["tensor_bytes"] < report["before"]["tensor_bytes"]
    assert report["after"]["disk_bytes"] >= report["after"]["tensor_bytes"]  # weights + config on disk
    assert report["disk_bytes_with_metadata"] == disk_bytes(tmp_path / "out")


def test_export_removes_exactly_the_expert_parameters(tmp_path):
    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    hidden = model.config.hidden_size
    per_expert = sum(p[0].numel() for p in info.layers[0].block.experts.parameters()) + hidden  # + router row
    report = export_subset(model, {layer.index: [0, 1, 2, 3] for layer in info.layers}, tmp_path)
    removed = report["before"]["parameters"] - report["after"]["parameters"]
    assert removed == 4 * per_expert * info.num_moe_layers
    assert report["before"]["tensor_bytes"] - report["after"]["tensor_bytes"] == 4 * removed  # float32


def test_export_refuses_bad_keep(tmp_path):
    model = moectl.tiny("deepseek_v3")
    info = moectl.inspect(model)
    with pytest.raises(ValueError, match="same number of kept experts in every group"):
        export_subset(model, {layer.index: [0, 1, 2, 4] for layer in info.layers}, tmp_path)
    assert not (tmp_path / METADATA).exists()
