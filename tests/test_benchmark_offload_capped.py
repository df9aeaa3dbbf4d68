"""benchmarks/offload_capped.py end to end on the shipped reference model, uncapped: one row per
policy and slot dtype, each a real ``moectl serve-offload`` process whose JSON the row carries."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _module():
    spec = importlib.util.spec_from_file_location("offload_capped", ROOT / "benchmarks" / "offload_capped.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_per_policy_and_slot_dtype(tmp_path):
    out = tmp_path / "capped.json"
    args = ["--checkpoint", str(ROOT / "models" / "moectl-small-standard"), "--caps", "none", "--policies", "lru",
            "--slot-dtypes", "same,int8", "--tokens", "2", "--threads", "1", "--json", str(out)]  # fmt: skip
    assert _module().main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy_label"] for r in rows] == ["lru", "lru, int8 slots"]
    assert all(r["exit"] == 0 and r["generated_tokens"] == 2 for r in rows), rows
    assert [r["config"]["slot_dtype"] for r in rows] == ["same", "int8"]
    same, int8 = rows
    assert int8["resident_expert_bytes"] < 0.6 * same["resident_expert_bytes"]
    active = json.loads(out.read_text())["active_weight_bytes_per_token"]
    assert 0 < active < same["total_expert_bytes"] + same["non_expert_bytes"]
    for row in rows:  # GB/s of weights a decode step reads = active bytes per token x decode tokens/s
        assert row["weights_gb_per_s"] == active * row["decode_tokens_per_s"] / 1e9


def test_unknown_slot_dtype_is_refused(capsys):
    args = [
        "--checkpoint",
        str(ROOT / "models" / "moectl-small-standard"),
        "--caps",
        "none",
        "--slot-dtypes",
        "int4",
    ]
    assert _module().main(args) == 2
    assert "--slot-dtypes takes same and int8, got int4" in capsys.readouterr().err


def test_corpus_prompts_and_a_controller_row(tmp_path):
    """Prompts from a corpus's test split (documents per domain), and a trained controller as a policy:
    the table on the reference model where switch rates mean something (issue 18, item 4)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [{"text": f"{d} document {i} " * 40, "domain": d} for d in ("code", "math") for i in range(3)]
    (corpus / "test.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    module = _module()
    args = module.argparse.Namespace(corpus=corpus, prompt_docs=2)
    prompts = module.corpus_prompts(args)
    assert [p.split()[:2] for p in prompts] == [["code", "document"]] * 2 + [["math", "document"]] * 2
    assert all(len(p) == 200 for p in prompts)
    controller = ROOT / "models" / "moectl-small-standard-controller-k8-eta0.02"
    out = tmp_path / "ref.json"
    argv = ["--checkpoint", str(ROOT / "models" / "moectl-small-standard"), "--caps", "none",
            "--policies", f"controller:{controller}", "--budget", "0.5", "--corpus", str(corpus),
            "--prompt-docs", "1", "--tokens", "3", "--threads", "1", "--json", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["exit"] == 0, row
    assert row["generated_tokens"] == 2 * 3
    assert row["switch_rate"] is not None and 0.0 <= row["switch_rate"] <= 1.0


def test_missing_corpus_is_refused(tmp_path, capsys):
    argv = ["--checkpoint", str(ROOT / "models" / "moectl-small-standard"), "--caps", "none",
            "--corpus", str(tmp_path)]  # fmt: skip
    assert _module().main(argv) == 2
    assert "has no test.jsonl" in capsys.readouterr().err


def test_report_groups_by_cap_with_ratios_to_llama_cpp(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "offload_capped_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    base = {"checkpoint_bytes": 100, "cap_bytes": None}
    rows = [
        {**base, "system": "moectl", "policy_label": "lru", "cap_fraction": 0.45, "decode_tokens_per_s": 3.0,
         "budget_experts_per_layer": [16, 16], "num_experts": [64, 64]},
        {**base, "system": "llama.cpp", "policy_label": "mmap", "cap_fraction": 0.45, "decode_tokens_per_s": 1.5},
        {**base, "system": "moectl", "policy_label": "lru", "cap_fraction": None, "decode_tokens_per_s": 2.0,
         "budget_experts_per_layer": [16, 16], "num_experts": [64, 64]},
        {**base, "system": "moectl", "policy_label": "lru", "cap_fraction": 0.35, "status": "killed (out of memory)"},
    ]  # fmt: skip
    path = tmp_path / "capped.json"
    path.write_text(json.dumps({"rows": rows, "active_weight_bytes_per_token": 2e9}))
    assert report.main([str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[2:]
    assert [line.split(" | ")[3] for line in lines] == ["none", "45%", "45%", "35%"]
    assert lines[1].startswith("| llama.cpp") and "| 2.0× |" in lines[2] and "| 16 of 64 |" in lines[2]
    assert "| 6.0 |" in lines[2]  # weights GB/s = 2 GB per token x 3 tokens/s
    assert "killed (out of memory)" in lines[3]
    assert report.main([str(tmp_path / "nope.json")]) == 2


def test_a_quantized_folder_offloaded_and_whole(tmp_path):
    """Issue 40 item 5's rows: ``--moectl-checkpoint`` serves a quantized folder (its store reads int4),
    ``--whole`` adds the engine on the whole model, ``--cap-budgets`` gives the cap its budget."""
    from moectl.quant import quantize_checkpoint

    folder = tmp_path / "int4"
    quantize_checkpoint(str(ROOT / "models" / "moectl-small-standard"), folder, "int4")
    out = tmp_path / "capped.json"
    args = ["--checkpoint", str(ROOT / "models" / "moectl-small-standard"), "--moectl-checkpoint", str(folder),
            "--whole", "eager", "--caps", "none", "--cap-budgets", "none:8", "--policies", "lru", "--tokens", "3",
            "--threads", "1", "--json", str(out)]  # fmt: skip
    assert _module().main(args) == 0
    whole, offloaded = json.loads(out.read_text())["rows"]
    assert whole["system"] == "moectl (whole)" and whole["exit"] == 0 and whole["generated_tokens"] == 3
    assert (
        offloaded["policy_label"] == "lru"
        and offloaded["store"] == "checkpoint"
        and offloaded["budget"] == "8"
    )
    assert whole["served"] == offloaded["served"] == str(folder)
    assert "weights_gb_per_s" not in offloaded  # bf16 bytes would misstate an int4 row
