"""The TE-MoE benchmark scripts: training curves (Fig. 5), accuracy screening and the headline end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import moectl
from _eval_data import small_cache
from moectl.eval.multiple_choice import MCItem
from moectl.models.load import load_model
from moectl.options.controller import build_controller
from moectl.options.random_options import RandomOptions
from moectl.reporting import option_curves as options_curves_lib
from moectl.routing import ExpertMask

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import options_accuracy
import options_curves
import options_headline


def _log(run: Path, rewards: list[float], switch: list[float]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    rows = [
        {"step": i + 1, "reward": r, "switch_rate": s, "teacher_ppl": 50.0 + i, "seconds": 2.0,
         "switch_rate_per_layer": [s, s / 2]}
        for i, (r, s) in enumerate(zip(rewards, switch, strict=True))
    ]  # fmt: skip
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


# -- options_curves.py (moectl.reporting.option_curves) ------------------------------------------------------
def test_read_log_skips_a_half_written_last_row_and_refuses_a_broken_one(tmp_path):
    run = _log(tmp_path / "r", [-1.0, -0.5], [0.1, 0.2])
    with (run / "log.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')  # the trainer is appending right now
    assert [r["step"] for r in options_curves_lib.read_log(run)] == [1, 2]
    (run / "log.jsonl").write_text('{"step": 1, "rew\n' + json.dumps({"step": 2}) + "\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        options_curves_lib.read_log(run)
    with pytest.raises(ValueError, match=r"no log\.jsonl"):
        options_curves_lib.read_log(tmp_path / "missing")


def test_running_mean_and_bootstrap_band():
    values = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert np.allclose(options_curves_lib.running_mean(values, 2), [1.0, 1.5, 2.5, 3.5, 4.5])
    low, high = options_curves_lib.bootstrap_band(np.full(7, 0.3), 3)
    assert np.allclose(low, 0.3) and np.allclose(high, 0.3)  # nothing to resample
    noisy = np.random.default_rng(0).normal(size=40)
    low, high = options_curves_lib.bootstrap_band(noisy, 20)
    mean = options_curves_lib.running_mean(noisy, 20)
    assert low[0] == high[0] == noisy[0]  # a window of one value
    assert np.all(low <= mean + 1e-12) and np.all(mean <= high + 1e-12) and np.all(high[5:] > low[5:])


def test_curves_script_draws_every_run_and_summarises(tmp_path, capsys):
    rewards = list(np.linspace(-0.8, -0.3, 30))
    a = _log(tmp_path / "std-k8-eta0.02", rewards, [0.05] * 30)
    b = _log(tmp_path / "std-k16-eta0.02", [-0.2] * 12, [0.4] * 12)
    png, out = tmp_path / "curves.png", tmp_path / "curves.json"
    assert options_curves.main(["--runs", str(a), str(b), "--out", str(png), "--json", str(out)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = {s["run"]: s for s in json.loads(out.read_text())["runs"]}
    k8, k16 = summary["k8-eta0.02"], summary["k16-eta0.02"]  # the runs' common prefix left out
    assert k8["steps_logged"] == 30 and k8["last_step"] == 30
    assert k8["reward"]["last_20"]["mean"] == pytest.approx(np.mean(rewards[-20:]))
    assert k8["kl"]["last_20"]["mean"] == pytest.approx(-np.mean(rewards[-20:]))  # KL = −reward
    assert k8["reward"]["first_20"]["mean"] == pytest.approx(np.mean(rewards[:20]))
    assert k8["switch_rate_per_layer_last"] == [0.05, 0.025]
    assert k16["switch_rate"]["last_12"]["mean"] == pytest.approx(0.4)  # fewer steps than the window
    # bad input: exit 2, one line naming the problem, nothing written
    assert options_curves.main(["--runs", str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no log.jsonl" in err[0] and not (tmp_path / "x.png").exists()


# -- options_accuracy.py ---------------------------------------------------------------------------
def test_chance_is_the_larger_of_uniform_and_majority_answer():
    def item(answers: list[str], gold: int, context: str = "q") -> MCItem:
        return MCItem([(context, a) for a in answers], gold, [len(a) for a in answers])

    own = [item([f"a{i}", f"b{i}"], i % 2) for i in range(2)] + [item([f"c{i}"] * 4, 1) for i in range(2)]
    odds = options_accuracy.chance(options_accuracy.EvalSet("x", own), 100)
    assert odds["uniform"] == pytest.approx(0.375) and odds["majority"] == 0.25 and odds["chance"] == 0.375
    yes_no = [item([" no", " yes"], 1, f"q{i}") for i in range(3)] + [item([" no", " yes"], 0)]
    assert options_accuracy.chance(options_accuracy.EvalSet("boolq", yes_no), 100)["chance"] == 0.75
    same = [item([" x", " x"], i % 2, f"q{i}") for i in range(4)]  # one answer text for both choices
    assert options_accuracy.chance(options_accuracy.EvalSet("wino", same), 100)["majority"] == 0.0
    assert options_accuracy.chance(options_accuracy.EvalSet("lambada_openai", None), 8)["chance"] == 0.125
    entry = {"metric": "acc", "value": 0.5, "ci95": [0.4, 0.6], "n": 100}
    assert options_accuracy.screen(entry, {"chance": 0.35})["above_chance"]
    assert not options_accuracy.screen(entry, {"chance": 0.45})["above_chance"]  # the lower bound decides


@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory):
    cache = small_cache(tmp_path_factory.mktemp("evals"), n=6)
    model, tok = load_model("tiny:qwen2_moe", dtype="float32")
    sets = options_accuracy.load_sets(["arc_easy"], cache, 6)
    return cache, model, tok, sets


def test_score_set_is_moectl_evals_score_under_each_routing(tiny_eval):
    from moectl.eval.eval_run import EvalConfig, evaluate
    from moectl.eval.policy_file import setup_routing

    cache, model, tok, sets = tiny_eval
    info = moectl.inspect(model)
    fixed = ExpertMask.everywhere(info, [0, 1, 2, 3])
    full = options_accuracy.score_set(model, tok, setup_routing(model), sets["arc_easy"], 5, cache)
    assert full["metric"] == "acc_norm" and full["n"] == 5 and full["switch_rate"] is None
    masked = options_accuracy.score_set(model, tok, setup_routing(model, [fixed]), sets["arc_easy"], 5, cache)
    assert masked["switch_rate"] == 0.0  # a fixed mask never switches
    rand = setup_routing(model, [RandomOptions(4, 0)], seed=3)
    assert options_accuracy.score_set(model, tok, rand, sets["arc_easy"], 5, cache)["switch_rate"] > 0.2
    config = EvalConfig("tiny", ["arc_easy"], limit=5, policy=[fixed], engine="moectl", cache=cache)
    doc = evaluate(config, model_and_tokenizer=(model, tok), progress=False)
    assert {k: v["value"] for k, v in doc["tasks"]["arc_easy"]["metrics"].items()} == {
        k: v["value"] for k, v in masked["metrics"].items()
    }


# -- options_headline.py ---------------------------------------------------------------------------
def test_run_folders_and_controller_overrides(tmp_path):
    assert options_headline.run_dir(Path("runs"), "std", 8, 0.02) == Path("runs/std-k8-eta0.02")
    run = tmp_path / "std-k8-eta0.02"
    (run / "checkpoints" / "step-000040").mkdir(parents=True)
    (run / "checkpoints" / "step-000040" / "controller.json").write_text("{}")
    torch.save(
        {"step": 40}, run / "checkpoints" / "step-000040" / "trainer_state.pt"
    )  # a complete checkpoint
    (run / "checkpoints" / "latest").write_text("step-000040")
    assert options_headline.controller_folder(run) is None  # unfinished: skipped unless --latest
    latest = options_headline.controller_folder(run, latest=True)
    assert latest is not None and options_headline.folder_step(latest) == 40
    (run / "final").mkdir()
    (run / "final" / "controller.json").write_text("{}")
    (run / "final" / "options.json").write_text(json.dumps({"steps": 300}))
    assert options_headline.controller_folder(run, latest=True) == run / "final"
    assert options_headline.folder_step(run / "final") == 300
    assert options_headline.folder_step(tmp_path / "std-k16-eta0.02-step-000120") == 120  # a copy set aside
    kept = tmp_path / "kept" / "std-k16-eta0.02"  # a checkpoint copied aside under the run's name
    kept.mkdir(parents=True)
    (kept / "options.json").write_text(json.dumps({"steps": 300}))
    torch.save({"step": 120}, kept / "trainer_state.pt")
    assert options_headline.folder_step(kept) == 120  # its trainer state, not the planned 300
    card = (
        tmp_path / "models" / "controller-k16"
    )  # `moectl options card`: no trainer state, the log up to its step
    card.mkdir(parents=True)
    (card / "options.json").write_text(json.dumps({"steps": 300}))
    (card / "training_log.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 120)))
    assert options_headline.folder_step(card) == 120
    assert options_headline.parse_overrides([f"k16-eta0.02={latest}"]) == {(16, 0.02): latest}
    with pytest.raises(ValueError, match="expected kK-etaE=PATH"):
        options_headline.parse_overrides(["16=x"])
    with pytest.raises(ValueError, match=r"holds no controller\.json"):
        options_headline.parse_overrides([f"k16-eta0.02={tmp_path}"])


def test_headline_end_to_end_on_a_tiny_model(tiny_eval, corpus, tmp_path, capsys):
    cache, model, _, _ = tiny_eval
    folder = tmp_path / "ctrl"
    build_controller(moectl.inspect(model), 4).save(
        folder
    )  # an untrained controller: the path, not the skill
    out = tmp_path / "headline.json"
    common = ["--model", "tiny:qwen2_moe", "--corpus", str(corpus), "--cache", str(cache), "--k-hat", "4",
              "--eta", "0.02", "--runs", str(tmp_path / "runs"), "--tasks", "arc_easy", "--screen-limit", "6",
              "--limit", "4", "--all-sets", "--max-docs", "1", "--max-length", "24", "--prompts", "2",
              "--max-new-tokens", "4", "--calib-docs", "2", "--calib-length", "24", "--out", str(out)]  # fmt: skip
    argv = [*common, "--baselines", "frequency", "random", "--controller", f"k4-eta0.02={folder}"]
    assert options_headline.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["screening"]["arc_easy"]["n"] == 6 and doc["accuracy_sets"] == ["arc_easy"]
    rows = {r["method"]: r for r in doc["rows"]}
    assert list(rows) == ["base model", "frequency", "random", "controller η=0.02"]
    assert all(r["accuracy"]["arc_easy"]["n"] == 4 and r["k_hat"] == 4 for r in rows.values())
    assert rows["base model"]["kl"] == 0.0 and rows["base model"]["switch_source"] == "router"
    assert (
        rows["frequency"]["switch_rate"] == 0.0
        and rows["frequency"]["accuracy"]["arc_easy"]["switch_rate"] == 0.0
    )
    assert rows["random"]["switch_rate"] > 0.2 and rows["random"]["kl"] > 0.0
    ctrl = rows["controller η=0.02"]
    assert ctrl["checkpoint"] == str(folder) and ctrl["switch_source"] == "allowed"
    assert set(ctrl["per_domain"]) == set(rows["random"]["per_domain"]) and all(
        "ppl_ratio" in d for d in ctrl["per_domain"].values()
    )
    # bad input: exit 2 with one line, before any work
    capsys.readouterr()
    assert options_headline.main([*common, "--k-hat", "99"]) == 2
    assert options_headline.main([*common, "--limit", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "k-hat = 99" in err[0] and "--limit (7)" in err[1]


def test_headline_quantized_merges_each_controller_before_quantizing(
    tiny_eval, corpus, tmp_path, monkeypatch
):
    """``--quantize int4``: the base model quantized, the trained controller (LoRA on attention and
    experts, trained routers) merged into a fresh float32 model and only then quantized, baselines
    as masks on the quantized model; the JSON records the scheme and what quantizing costs."""
    from moectl.options.trainer import OptionsConfig, train_options

    cache, _, _, _ = tiny_eval
    lm, tok = load_model("tiny:qwen2_moe", dtype="float32")
    cfg = OptionsConfig(k_hat=4, steps=1, batch_size=2, max_new_tokens=4, lora_r=4, lora_alpha=4)
    train_options(lm, tok, ["hello there", "a cat"], cfg, tmp_path / "run", progress=False)
    folder = tmp_path / "run" / "final"
    assert (folder / "adapter.safetensors").exists()  # adapters to merge, not only a controller
    calls = []
    real = options_headline.quantize_loaded

    def spy(model, scheme, **kwargs):
        calls.append((scheme, kwargs.get("group_size"), list(kwargs.get("merge_first", ()))))
        return real(model, scheme, **kwargs)

    monkeypatch.setattr(options_headline, "quantize_loaded", spy)
    out = tmp_path / "headline.json"
    argv = ["--model", "tiny:qwen2_moe", "--corpus", str(corpus), "--cache", str(cache), "--k-hat", "4",
            "--eta", "0.02", "--runs", str(tmp_path / "runs"), "--tasks", "arc_easy", "--screen-limit", "4",
            "--limit", "4", "--all-sets", "--max-docs", "1", "--max-length", "24", "--prompts", "2",
            "--max-new-tokens", "4", "--calib-docs", "2", "--calib-length", "24", "--out", str(out),
            "--baselines", "frequency", "wanda", "--controller", f"k4-eta0.02={folder}", "--quantize", "int4",
            "--group-size", "32"]  # fmt: skip
    assert options_headline.main(argv) == 0
    assert calls == [("int4", 32, []), ("int4", 32, [str(folder)])]  # the base model, then the controller's
    doc = json.loads(out.read_text())
    assert doc["setup"]["quantize"] == "int4" and doc["setup"]["group_size"] == 32
    quant = doc["quantization"]
    assert quant["scheme"] == "int4" and quant["group_size"] == 32 and quant["summary"]["experts_modules"] > 0
    cost = quant["base_vs_unquantized"]
    assert 0 < cost["kl"] < 0.05 and 0.9 < cost["ppl_ratio"] < 1.1  # int4 is close to, not equal to, float32
    rows = {r["method"]: r for r in doc["rows"]}
    assert list(rows) == ["base model", "frequency", "wanda", "controller η=0.02"]
    assert rows["base model"]["kl"] == 0.0  # the teacher is the quantized base model itself
    for row in rows.values():
        assert np.isfinite(row["kl"]) and row["kl"] >= 0 and np.isfinite(row["ppl_ratio"])
        assert row["accuracy"]["arc_easy"]["n"] == 4
    ctrl = rows["controller η=0.02"]
    assert ctrl["kl"] > 0 and ctrl["switch_source"] == "allowed" and ctrl["train_config"]["k_hat"] == 4
    assert rows["frequency"]["switch_rate"] == 0.0 and rows["frequency"]["kl"] > 0
    # bad scheme or group: exit 2 before any work
    assert options_headline.main([*argv[:-4], "--quantize", "int3"]) == 2
    assert options_headline.main([*argv[:-2], "--group-size", "48"]) == 2


def test_paired_kl_compares_controllers_with_baselines_on_the_same_documents():
    docs = [0.10, 0.20, 0.30, 0.40]
    rows = [
        {"method": "base model", "k_hat": 16, "kl_docs": [0.0] * 4},
        {"method": "wanda", "k_hat": 16, "kl_docs": docs},
        {"method": "controller η=0.02", "k_hat": 16, "kl_docs": [d - 0.05 for d in docs]},
        {"method": "wanda", "k_hat": 8, "kl_docs": docs},
    ]
    (p,) = options_headline.paired_kl(rows)
    assert (p["method"], p["against"], p["k_hat"], p["documents"]) == ("controller η=0.02", "wanda", 16, 4)
    assert p["difference"] == pytest.approx(-0.05)
    assert p["ci95"][0] == pytest.approx(-0.05) and p["ci95"][1] == pytest.approx(-0.05)  # a constant shift


def test_paired_kl_compares_a_later_controller_with_an_earlier_one():
    """η = 0.04 against η = 0.02 at the same k-hat (Table 3's two columns), once, in list order."""
    docs = [0.10, 0.20, 0.30, 0.40]
    rows = [
        {"method": "wanda", "k_hat": 8, "kl_docs": docs},
        {"method": "controller η=0.02", "k_hat": 8, "kl_docs": [d - 0.05 for d in docs]},
        {"method": "controller η=0.04", "k_hat": 8, "kl_docs": [d - 0.02 for d in docs]},
    ]
    pairs = {(p["method"], p["against"]): p for p in options_headline.paired_kl(rows)}
    assert set(pairs) == {
        ("controller η=0.02", "wanda"),
        ("controller η=0.04", "wanda"),
        ("controller η=0.04", "controller η=0.02"),
    }
    assert pairs["controller η=0.04", "controller η=0.02"]["difference"] == pytest.approx(0.03)
