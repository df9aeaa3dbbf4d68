"""Serving straight from a checkpoint's shards: experts never loaded, read on demand into slots."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _serve_helpers import greedy
from moectl.cli.serve_offload import serve_app
from moectl.models.lazy import load_skeleton
from moectl.models.load_lazy import is_checkpoint_folder, load_lazy
from moectl.models.shapes import make_checkpoint
from moectl.offload import OffloadConfig, offload
from moectl.offload.plan import MemoryPlan, check_plan, memory_limit, preflight
from moectl.offload.runtime import BudgetError

SPEC = "shape:olmoe-1b-7b@2~w64"  # 2 MoE layers, 64 experts, top-8, full vocabulary, narrow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("lazy-serve") / "olmoe"
    make_checkpoint(SPEC, out, max_shard_bytes=2_000_000)  # several shards, experts split across them
    yield out
    shutil.rmtree(out, ignore_errors=True)


def _eager(model):
    model.set_experts_implementation("eager")  # offloading runs the experts' own eager forward
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 250, (1, 7), generator=torch.Generator().manual_seed(1))


def _experts_on_meta(model) -> bool:
    names = [n for n, p in model.named_parameters() if ".experts." in n]
    return bool(names) and all(p.is_meta for n, p in model.named_parameters() if ".experts." in n)


@pytest.fixture(scope="module")
def reference(ckpt) -> torch.Tensor:
    full, _ = load_skeleton(ckpt, load_experts=True)
    return greedy(_eager(full), _ids(), n=6)


@pytest.mark.parametrize(
    ("budget", "policy", "async_loads"), [(8, "lru", False), (12, "lru", True), (16, "option:12", False)]
)
def test_lazy_model_served_from_shards_equals_the_loaded_model(ckpt, reference, budget, policy, async_loads):
    model, _, reader = load_lazy(ckpt)
    _eager(model)
    assert is_checkpoint_folder(ckpt) and _experts_on_meta(model)
    before = reader.stats.bytes
    config = OffloadConfig(budget, policy, async_loads=async_loads)
    with offload(model, config, reader=reader) as rt:
        assert rt.store_kind == "checkpoint" and rt.lazy
        out = greedy(model, _ids(), n=6)
        totals = rt.totals()
    assert torch.equal(out, reference)  # same weights, same kernels: the same tokens
    assert _experts_on_meta(model)  # never loaded, and back on meta after the block
    per_expert = totals["expert_bytes"][0]
    assert totals["resident_expert_bytes"] == 2 * budget * per_expert
    assert reader.stats.bytes - before == totals["loads"] * per_expert  # only the experts loaded were read
    reader.close()


def test_checkpoint_store_for_a_loaded_model_frees_and_restores_its_experts(ckpt, reference):
    model, _ = load_skeleton(ckpt, load_experts=True)
    _eager(model).config.name_or_path = str(ckpt)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    with offload(model, OffloadConfig(8, store="checkpoint")) as rt:
        assert rt.store_kind == "checkpoint" and not rt.lazy
        assert not any(".experts." in n for n, _ in model.named_parameters() if "inner" not in n)
        out = greedy(model, _ids(), n=6)
    assert torch.equal(out, reference)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_lazy_model_needs_the_checkpoint_store(ckpt):
    model, _, reader = load_lazy(ckpt)
    _eager(model)
    with pytest.raises(BudgetError, match="never loaded"):
        offload(model, OffloadConfig(8, store="host")).__enter__()
    full, _ = load_skeleton(ckpt, load_experts=True)
    _eager(full).config.name_or_path = ""
    with pytest.raises(BudgetError, match="not loaded from one"):
        offload(full, OffloadConfig(8, store="checkpoint")).__enter__()
    reader.close()


def test_cli_serves_a_checkpoint_folder_without_loading_its_experts(ckpt, tmp_path):
    out = tmp_path / "r.json"
    args = [str(ckpt), "--budget", "8", "--max-new-tokens", "3", "--json", str(out)]
    result = CliRunner().invoke(serve_app, args)
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert r["store"] == "checkpoint" and r["read_method"] == "direct"
    assert r["model_bytes_in_memory"] == r["non_expert_bytes"]  # the experts were never in memory
    assert r["resident_expert_bytes"] == 2 * 8 * r["expert_bytes_per_expert"][0]
    assert r["shard_read_bytes"] >= r["bytes_moved"] > 0
    assert r["time_to_first_token_s"] > 0 and r["generated_tokens"] == 3 * len(r["texts"])


def test_cli_refuses_a_budget_below_top_k_before_loading(ckpt, monkeypatch):
    import moectl.models.load_lazy as lazy_module

    def never(*args, **kwargs):
        raise AssertionError("loaded before the budget was checked")

    monkeypatch.setattr(lazy_module, "load_lazy", never)
    result = CliRunner().invoke(serve_app, [str(ckpt), "--budget", "4"])
    assert result.exit_code == 2
    assert "too small" in result.output and "at least 8" in result.output
    result = CliRunner().invoke(serve_app, ["--tiny", "olmoe", "--store", "checkpoint"])
    assert result.exit_code == 2 and "checkpoint folder" in result.output


def _plan(limit: int | None) -> MemoryPlan:
    return MemoryPlan(
        non_expert_bytes=1000,
        expert_bytes=[100, 100],
        budget_experts=[8, 8],
        min_experts=[2, 2],
        headroom_bytes=0,
        limit_bytes=limit,
    )


def test_memory_plan_names_the_minimum_and_what_fits():
    assert _plan(None).planned_bytes == 1000 + 2 * 8 * 100 and _plan(None).minimum_bytes == 1400
    check_plan(_plan(2600))  # fits
    with pytest.raises(MemoryError, match=r"at most 5 experts per layer fit"):
        check_plan(_plan(2000))  # 1400 minimum + 600 spare = 3 more experts in each of 2 layers
    with pytest.raises(MemoryError, match="needs at least"):
        check_plan(_plan(1300))
    limit = memory_limit()
    assert limit is None or limit > 0


def test_preflight_on_meta_reads_nothing(ckpt):
    from moectl.models.meta_model import build_meta, load_config

    meta = build_meta(load_config(ckpt))
    plan = preflight(meta, 8, None)
    assert plan.budget_experts == [8, 8] and plan.min_experts == [8, 8]
    from moectl.io.shards import ShardReader

    with ShardReader(ckpt, meta) as reader:
        assert plan.expert_bytes == [layer.expert_bytes for layer in reader.layers]  # bf16 model, bf16 file
        state = set(meta.state_dict())
        computed = sum(b.numel() * b.element_size() for n, b in meta.named_buffers() if n not in state)
        assert (
            plan.non_expert_bytes == reader.non_expert_bytes + computed
        )  # + rotary inv_freq, not in the file
    with pytest.raises(BudgetError, match="at least 8"):
        preflight(meta, 0.1, None)  # 6 of 64


def test_load_for_offload_keeps_a_checkpoints_experts_in_its_shards(ckpt):
    """serve-offload and serve --budget load through moectl.offload.loading: a checkpoint folder lazily
    (a shard reader, expert weights on meta until offloaded), --store host whole, and a too-small
    budget refused before any weight is read."""
    from moectl.offload.loading import load_for_offload
    from moectl.offload.offload_config import OffloadConfig

    model, _, reader = load_for_offload(str(ckpt), OffloadConfig(16, store="disk"))
    try:
        assert reader is not None and any(p.is_meta for p in model.parameters())
    finally:
        reader.close()
    model, _, reader = load_for_offload(str(ckpt), OffloadConfig(16, store="host"))
    assert reader is None and not any(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="is too small"):
        load_for_offload(str(ckpt), OffloadConfig(4, store="disk"))
    with pytest.raises(ValueError, match="needs a checkpoint folder"):
        load_for_offload("tiny:olmoe", OffloadConfig(4, store="checkpoint"))
