"""``moectl offload simulate``: JSON shape, the plot, a moectl trace as input, and bad input (exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import moectl
from moectl.cli import app

runner = CliRunner()


def _array(tmp_path, tokens=200, layers=3, k=2, experts=8, seed=0):
    rng = np.random.default_rng(seed)
    chosen = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(tokens)])
    path = tmp_path / "routed.npy"
    np.save(path, chosen.astype(np.int32))
    return path, chosen


def test_json_rows_and_plot(tmp_path):
    path, chosen = _array(tmp_path)
    out, plot = tmp_path / "sim.json", tmp_path / "plots"
    result = runner.invoke(
        app,
        ["offload", "simulate", str(path), "--num-experts", "8", "--budget", "2,4", "--expert-bytes", "1000",
         "--json", str(out), "--plot", str(plot), "--routing", "random test array"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["trace"]["accesses"] == chosen.size and doc["trace"]["routing"] == "random test array"
    expected = np.mean([len(set(chosen[t, layer]) & set(chosen[t - 1, layer])) / 2 for t in range(1, 200) for layer in range(3)])
    assert doc["trace"]["previous_token_overlap"] == pytest.approx(expected)
    rows = doc["results"]
    names = ["lru", "lfu", "lfuda", "arc", "s3fifo", "least-stale", "static", "belady"]
    assert [(r["policy"], r["budget"]) for r in rows] == [(n, b) for b in (2, 4) for n in names]
    for r in rows:
        assert r["hits"] + r["misses"] == chosen.size
        assert r["hit_rate"] == pytest.approx(r["hits"] / chosen.size)
        assert r["misses_per_token"] == pytest.approx(r["misses"] / 200)
        assert r["bytes_per_token"] == pytest.approx(1000 * r["misses"] / 200)
        assert r["gap_to_belady"] >= 0
    belady = {r["budget"]: r for r in rows if r["policy"] == "belady"}
    assert belady[2]["gap_to_belady"] == 0 and belady[4]["hit_rate"] > belady[2]["hit_rate"]
    png = plot / "hit_rate.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc["plot"] == str(png)


def test_moectl_trace_input(tmp_path):
    model = moectl.tiny("olmoe")
    ids = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(0))
    with moectl.route(model, record=True) as session:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    session.trace.save(tmp_path / "trace" / "t")
    out = tmp_path / "sim.json"
    result = runner.invoke(
        app, ["offload", "simulate", str(tmp_path / "trace"), "--policies", "lru,belady", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    trace = session.trace
    layers, k, experts = len(trace.chosen), trace.top_k, trace.num_experts  # 5 + 5 forwarded per row
    assert doc["trace"] == {**doc["trace"], "tokens": 2 * 10, "layers": layers, "top_k": k, "num_experts": experts}
    assert {r["budget"] for r in doc["results"]} == {min(m * k, experts) for m in (1, 2, 4)}  # the default


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-experts", "4"], "expert id 7 at token"),
        (["--num-experts", "8", "--budget", "1"], "budget 1 is below top-k = 2"),
        (["--num-experts", "8", "--budget", "9"], "budget 9 exceeds the 8 experts"),
        (["--num-experts", "8", "--policies", "lru,mru"], "unknown policy 'mru'"),
        (["--num-experts", "8", "--budget", "two"], "--budget must be counts"),
        ([], "--num-experts is required"),
        (["--num-experts", "8", "--expert-bytes", "0"], "--expert-bytes must be a positive"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    path, _ = _array(tmp_path)
    result = runner.invoke(app, ["offload", "simulate", str(path), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    "array, message",
    [
        (np.zeros((4, 2), dtype=np.int64), "expected an array [tokens, layers, top_k]"),
        (np.zeros((4, 2, 2), dtype=np.float32), "expert ids must be integers, got dtype float32"),
        (np.array([[[1, 1]]]), "lists expert 1 twice"),
    ],
)
def test_bad_arrays_exit_2(tmp_path, array, message):
    np.save(tmp_path / "bad.npy", array)
    result = runner.invoke(app, ["offload", "simulate", str(tmp_path / "bad.npy"), "--num-experts", "8"])
    assert result.exit_code == 2 and message in result.output, result.output


def test_missing_trace_exits_2(tmp_path):
    for path in (tmp_path / "none.npy", tmp_path / "none"):
        result = runner.invoke(app, ["offload", "simulate", str(path), "--num-experts", "8"])
        assert result.exit_code == 2 and str(path) in result.output, result.output


def test_static_file_too_large_for_the_budget(tmp_path):
    path, _ = _array(tmp_path)
    subset = tmp_path / "subset.json"
    subset.write_text(json.dumps({"keep": {"0": [0, 1, 2], "1": [0, 1, 2], "2": [0, 1, 2]}}))
    ok = runner.invoke(
        app, ["offload", "simulate", str(path), "--num-experts", "8", "--budget", "5", "--policies", f"static:{subset}"]
    )
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(
        app, ["offload", "simulate", str(path), "--num-experts", "8", "--budget", "4", "--policies", f"static:{subset}"]
    )
    assert bad.exit_code == 2 and "budget 4 is too small (give at least 5)" in bad.output, bad.output
