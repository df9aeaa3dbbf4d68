"""benchmarks/gpu_check.py's dry run on the CPU: both decoding paths, the same tokens, a read floor."""

from __future__ import annotations

from _bench_helpers import bench, run_json

gpu_check = bench("gpu_check")


def test_dry_run_times_both_paths_beside_the_read_floor(tmp_path, monkeypatch):
    args = ["--device", "cpu", "--model", "tiny:olmoe", "--tokens", "6", "--batch", "1,3", "--budget", "0"]
    rows = run_json(gpu_check, args, tmp_path, monkeypatch)["rows"]
    assert [(r["path"], r["batch"]) for r in rows] == [("lean", 1), ("lean", 3), ("graphs", 1), ("graphs", 3)]
    graphs = [r for r in rows if r["path"] == "graphs"]
    # (the counts include the warm-up request's steps)
    assert all(r["forwards"]["compiled"] >= r["decode_steps"] and "lean" not in r["forwards"] for r in graphs)
    assert all(0 < r["read_floor_ms"] < r["step_ms"] and r["step_over_floor"] > 1 for r in rows)
    floors = {r["batch"]: r["read_floor_ms"] for r in graphs}
    assert floors[3] > floors[1]  # more rows touch more experts


def test_step_bytes_counts_k_experts_at_one_row():
    import moectl

    model, _, info = moectl.load("tiny:olmoe", dtype="float32")
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    experts = sum(p.numel() * p.element_size() for layer in info.layers for p in layer.block.experts.parameters())
    k_over_e = info.layers[0].top_k / info.layers[0].num_experts
    want = every - embed.numel() * embed.element_size() + embed[0].numel() * embed.element_size() - experts * (1 - k_over_e)
    assert abs(gpu_check.step_bytes(model, info, 1) - want) < 1e-6 * want


def test_the_compiled_path_decodes_compiled(tmp_path, monkeypatch):
    """``--paths compiled``: the CPU's serving path (``compile_decode``, no graphs); here its eager twin
    (``torch.compile`` replaced by the function itself: the test checks the path, not the compiler)."""
    monkeypatch.setattr("moectl.lm.compiled_decode.torch.compile", lambda fn, **_: fn)
    args = ["--device", "cpu", "--model", "tiny:olmoe", "--tokens", "4", "--batch", "2", "--paths", "compiled",
            "--budget", "0"]  # fmt: skip
    result = run_json(gpu_check, args, tmp_path, monkeypatch)
    (row,) = result["rows"]
    assert row["path"] == "compiled" and row["forwards"]["compiled"] >= row["decode_steps"]
    assert result["read_gb_per_s"] > 0


def test_the_read_speed_is_a_read():
    import torch

    speed = gpu_check.read_speed(torch.device("cpu"), gib=1 / 16)
    assert 1e8 < speed < 1e13  # bytes per second, of a plausible size
