"""``moectl card``: a Hugging Face model card for a tiny pretrain run, every figure read from files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from huggingface_hub import ModelCard
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.data.sample import iter_documents
from moectl.metrics.effective_experts import measure, report
from moectl.models.load import load_model
from moectl.subsets.calibrate import tokenize
from moectl.train.loop import Trainer
from moectl.train.train_config import TrainConfig

runner = CliRunner()
MICRO = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "intermediate_size": 64,
}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("card")
    config = TrainConfig(
        out=str(root / "run"), corpus=str(corpus), seq_len=64, micro_batch=4, max_steps=3, warmup_steps=1,
        log_every=1, checkpoint_every=0, eval_every=2, model=MICRO, final_eval_batches=2, lb_window=2,
    )  # fmt: skip
    Trainer(config, progress=False).fit()
    return root / "run"


def test_card_reads_every_figure_from_the_run_the_corpus_and_the_measurements(run, corpus, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(run / "final", model_dir)
    model, tok = load_model(str(model_dir))
    info = moectl.inspect(model)
    texts = [d["text"] for d in iter_documents(corpus, "validation")][:4]
    result = report(measure(model, [tokenize(tok, texts, 64)], info), info, str(model_dir))
    (tmp_path / "ee.json").write_text(json.dumps({"documents": {"all": len(texts)}, "results": [result]}))

    out = runner.invoke(app, ["card", str(model_dir), "--run", str(run), "--effective-experts",
                              str(tmp_path / "ee.json"), "--json", str(tmp_path / "card.json")])  # fmt: skip
    assert out.exit_code == 0, out.output
    card = ModelCard.load(model_dir / "README.md")  # the Hub's own parser reads the front matter
    meta = card.data.to_dict()
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "transformers"
    assert set(meta["datasets"]) == {d["source"] for d in iter_documents(corpus, "train")}
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    final = log[-1]
    assert final["final"]
    values = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert values["loss"] == pytest.approx(final["val_loss"], abs=1e-6)
    assert values["perplexity"] == pytest.approx(float(torch.tensor(final["val_loss"]).exp()), rel=1e-6)
    assert values["effective_experts_probs"] == pytest.approx(result["mean_over_layers"]["probs"], abs=1e-6)
    assert values["effective_experts_chosen"] == pytest.approx(result["mean_over_layers"]["chosen"], abs=1e-6)
    for domain, loss in final["val_loss_per_domain"].items():  # the body's table, from the final row
        assert f"| {domain} | {loss:.4f} |" in card.text
    assert f"{log[-2]['tokens']:,} tokens" in card.text
    assert (model_dir / "training_log.jsonl").read_bytes() == (run / "log.jsonl").read_bytes()
    # the recipe says how f was counted, and the retrain command repeats it
    assert "expert counts pooled over the previous 2 steps" in card.text and "--lb-window 2" in card.text
    assert (model_dir / "loss_curve.png").exists() and (model_dir / "moectl_train_config.json").exists()
    assert json.loads((tmp_path / "card.json").read_text())["card"] == str(model_dir / "README.md")


def test_an_unfinished_run_is_refused_and_nothing_is_written(run, tmp_path):
    partial = tmp_path / "run"
    shutil.copytree(run, partial, ignore=shutil.ignore_patterns("checkpoints", "data"))
    lines = (partial / "log.jsonl").read_text().splitlines()
    (partial / "log.jsonl").write_text("\n".join(line for line in lines if '"final"' not in line) + "\n")
    model_dir = tmp_path / "model"
    shutil.copytree(run / "final", model_dir)
    out = runner.invoke(app, ["card", str(model_dir), "--run", str(partial)])
    assert out.exit_code == 2
    assert out.output.startswith("error:") and "no final evaluation" in out.output
    assert len(out.output.strip().splitlines()) <= 2 and "Traceback" not in out.output
    assert not (model_dir / "README.md").exists() and not (model_dir / "training_log.jsonl").exists()


def test_a_malformed_result_file_is_one_line_and_nothing_is_written(run, tmp_path):
    """A field of an --eval result of another type (a value that is no number) used to reach the
    command as a bare ValueError; the card now refuses the file as malformed before writing."""
    model_dir = tmp_path / "model"
    shutil.copytree(run / "final", model_dir)
    bad = tmp_path / "eval.json"
    bad.write_text(json.dumps({"schema": "moectl.eval.results/1", "tasks": {"ppl": {"metrics": {"loss": {"value": "x"}}}}}))
    out = runner.invoke(app, ["card", str(model_dir), "--run", str(run), "--eval", str(bad)])
    assert out.exit_code == 2, out.output
    flat = " ".join(out.output.split())
    assert flat.startswith("error:") and "--eval is missing or malformed" in flat and "Traceback" not in flat
    assert not (model_dir / "README.md").exists() and not (model_dir / "training_log.jsonl").exists()
