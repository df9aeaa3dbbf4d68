"""``serve_offload`` and ``moectl serve-offload``: measured figures, JSON and the load timeline."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from moectl.cli.serve_offload import serve_app
from moectl.models.load import load_model
from moectl.offload.offload_config import OffloadConfig
from moectl.server.offload_batch import serve_offload

torch.set_num_threads(1)


def test_serve_offload_reports_measured_figures(tmp_path):
    model, tok = load_model("tiny:olmoe")
    r = serve_offload(
        model,
        tok,
        ["hello world", "def f(x):"],
        OffloadConfig(0.25, "lru", "host"),
        6,
        plot=tmp_path,
        progress=False,
    )
    json.dumps(r)  # JSON-ready
    expert = (192 * 64 + 64 * 96) * 4
    assert r["expert_bytes_per_expert"] == [expert] * 3
    assert r["resident_expert_bytes"] == 3 * 2 * expert  # 3 MoE layers x 2 of 8 experts
    assert r["total_expert_bytes"] == 3 * 8 * expert
    assert r["bytes_moved"] == r["loads"] * expert
    assert r["decode_bytes_moved"] == r["decode_loads"] * expert
    assert r["generated_tokens"] == 12 and r["bytes_moved_per_token"] == r["decode_bytes_moved"] / 12
    assert 0 <= r["hit_rate"] <= 1 and r["hits"] + r["misses"] >= 12 * 3 * 2
    assert r["peak_rss_bytes"] > r["non_expert_bytes"] > 0
    assert r["tokens_per_s"] > 0 and r["load_s"] > 0 and r["expert_compute_s"] > 0
    assert len(r["timeline"]["loads"]) == r["loads"]
    assert (tmp_path / "offload_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_serve_offload_writes_json(tmp_path):
    subset = tmp_path / "subset.json"
    subset.write_text(json.dumps({"0": [0, 1], "1": [2, 3], "2": [4, 5]}))
    out = tmp_path / "out.json"
    args = ["--tiny", "olmoe", "--budget", "2", "--policy", f"static:{subset}", "--max-new-tokens", "3"]
    result = CliRunner().invoke(serve_app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["policy"] == "static" and data["loads"] == 6 and data["decode_loads"] == 0
    bad = CliRunner().invoke(serve_app, ["--tiny", "olmoe", "--budget", "1", "--max-new-tokens", "2"])
    assert bad.exit_code == 2 and "too small" in bad.output


def test_policy_and_budget_specs_are_parsed_or_refused_clearly(tmp_path):
    import pytest

    from moectl.cli.serve_offload import parse_budget
    from moectl.offload import offload, parse_policy
    from moectl.offload.runtime import BudgetError

    assert parse_budget("0.25") == 0.25 and parse_budget("4") == 4
    assert parse_policy("option:8").k_hat == 8 and parse_policy("lru").name == "lru"
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policy("fifo")
    with pytest.raises(ValueError, match="integer k-hat"):
        parse_policy("option:x")
    with pytest.raises(FileNotFoundError, match="subset file"):
        parse_policy(f"static:{tmp_path / 'none.json'}")
    model, _ = load_model("tiny:olmoe")
    with offload(model, 2, "lru", store="host"), pytest.raises(BudgetError, match="already offloaded"):
        offload(model, 2, "lru").__enter__()


def test_serve_offload_batches_prompts_through_the_engine():
    """--max-batch 3: the same greedy texts as one prompt at a time, fewer forwards, one resident set;
    decode tokens count every row of a batched step."""
    model, tok = load_model("tiny:olmoe")
    prompts = ["hello world", "def f(x):", "2 + 2 =", "abc"]
    config = OffloadConfig(4, "lru", "host")
    one = serve_offload(model, tok, prompts, config, 5, progress=False)
    three = serve_offload(model, tok, prompts, config, 5, progress=False, max_batch=3)
    assert three["texts"] == one["texts"]
    assert three["max_batch"] == 3 and one["max_batch"] == 1
    assert three["timeline"]["steps"] < one["timeline"]["steps"]  # 4 prefills + batched decodes
    assert one["timeline"]["steps"] == 4 * 5  # a prefill and 4 decodes per prompt
    assert three["switch_rate"] is None and three["decode_tokens_per_s"] > 0
