"""Subset fine-tuning (EMO appendix C): prompt masking, the loop, saving, bad data, the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import moectl
from moectl.adapters.slicing import slice_experts
from moectl.cli.subset import subset_app
from moectl.models.load import ByteTokenizer, load_model
from moectl.subsets.export import export_subset
from moectl.subsets.finetune import FinetuneConfig, finetune_subset, save_finetuned
from moectl.subsets.finetune_data import IGNORE, Example, collate, encode_example, read_examples

runner = CliRunner()
TOK = ByteTokenizer()
EXAMPLES = [{"prompt": f"Q: {i} + {i} =", "response": f" {2 * i}"} for i in range(6)] + [
    {"text": "the cat sat on the mat"},
    {"prompt": "Say hi:", "completion": " hi"},
]


def _subset_model():
    """A tiny OLMoE sliced to 4 of 8 experts per layer (what `moectl subset export` writes)."""
    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    return slice_experts(model, {layer.index: [1, 3, 4, 6] for layer in info.layers}, info)


def test_prompt_tokens_are_masked_from_the_loss():
    ids, labels = encode_example(TOK, Example("Q: 2+2=", " 4"), max_length=64)
    prompt, response = TOK.encode("Q: 2+2="), TOK.encode(" 4")
    assert ids == [*prompt, *response, TOK.eos_token_id]
    assert labels == [IGNORE] * len(prompt) + [*response, TOK.eos_token_id]
    _, text_labels = encode_example(TOK, Example("", "plain text"), max_length=64)
    assert IGNORE not in text_labels  # {"text"}: loss on every token

    batch = collate([(ids, labels), encode_example(TOK, Example("", "ab"), 64)], TOK.pad_token_id)
    assert batch["input_ids"].shape == (2, len(ids))
    assert batch["labels"][0, : len(prompt)].eq(IGNORE).all()
    assert batch["labels"][1, 3:].eq(IGNORE).all() and batch["attention_mask"][1].tolist()[:4] == [1, 1, 1, 0]


def test_truncation_drops_prompt_tokens_first():
    ids, labels = encode_example(TOK, Example("a long prompt here", " yes"), max_length=6)
    assert len(ids) == 6 and labels[-5:] == [*TOK.encode(" yes"), TOK.eos_token_id]
    assert labels[0] == IGNORE and ids[0] == TOK.encode("e")[0]  # the prompt's last token survives


def test_a_few_steps_lower_the_loss_and_the_result_loads_with_transformers(tmp_path):
    model = _subset_model()
    log = finetune_subset(
        model, TOK, EXAMPLES, lr=3e-3, epochs=6, batch_size=len(EXAMPLES), micro_batch_size=3
    )
    losses = [step["loss"] for step in log["steps"]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3  # full batch: every step sees the same data
    assert log["steps"][0]["lr"] == pytest.approx(3e-3) and log["steps"][-1]["lr"] < 3e-3  # linear decay
    assert log["output_tokens"] == sum(len(e.get("response", e.get("completion", e.get("text")))) + 1
                                       for e in EXAMPLES) - 1  # fmt: skip  # the text's first token
    out = save_finetuned(model, TOK, tmp_path / "ft", log)
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "finetune.json",
        "loss_curve.png",
    }
    assert not list(tmp_path.glob(".tmp-*"))
    assert json.loads((out / "finetune.json").read_text())["steps"][-1]["loss"] == losses[-1]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()  # no moectl involved
    ids = torch.tensor([TOK.encode("Q: 3 + 3 =")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_micro_batch_size_does_not_change_the_update():
    # float64: Adam's first step is ~lr·sign(g), so where |g| ~ eps a float32 reduction-order
    # difference (which varies with the BLAS thread count) flips an update of size lr; in float64
    # the gradients agree to ~1e-16 and the updates to far below the tolerance.
    base = _subset_model().double()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    log_a = finetune_subset(a, TOK, EXAMPLES, lr=1e-3, batch_size=8, micro_batch_size=8, max_steps=1)
    log_b = finetune_subset(b, TOK, EXAMPLES, lr=1e-3, batch_size=8, micro_batch_size=3, max_steps=1)
    assert log_a["steps"][0]["loss"] == pytest.approx(log_b["steps"][0]["loss"], rel=1e-5)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_is_merged_into_plain_weights():
    model = _subset_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    log = finetune_subset(
        model, TOK, EXAMPLES, lora=2, lr=1e-2, batch_size=4, micro_batch_size=4, max_steps=2
    )
    assert log["trainable_parameters"] < sum(v.numel() for v in before.values()) / 4
    after = model.state_dict()
    assert set(after) == set(before)  # no adapter tensors left
    assert not torch.equal(after["model.layers.0.mlp.experts.gate_up_proj"],
                           before["model.layers.0.mlp.experts.gate_up_proj"])  # fmt: skip
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"prompt": "q"}', 'exactly one of "response" or "completion"'),
        ('{"prompt": "q", "response": "a", "completion": "b"}', 'exactly one of "response" or "completion"'),
        ('{"prompt": "q", "response": 3}', "must both be strings"),
        ('{"prompt": "q", "response": "  "}', 'empty "response"'),
        ('{"text": "a", "prompt": "q", "response": "a"}', 'either "text" or "prompt"'),
        ('{"body": "a"}', 'needs a string "text"'),
    ],
)
def test_bad_data_lines_are_refused_with_the_line_number(tmp_path, line, message):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        read_examples(path)
    assert f"{path}:3" in str(err.value)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="micro batch size"):
        FinetuneConfig(batch_size=4, micro_batch_size=8)
    with pytest.raises(ValueError, match="schedule must be one of"):
        FinetuneConfig(schedule="exponential")
    no_eos = ByteTokenizer()
    no_eos.eos_token_id = None
    with pytest.raises(ValueError, match="no example has an output token"):
        finetune_subset(_subset_model(), no_eos, ["x"])  # one token and no EOS: nothing to predict


def test_cli_finetunes_an_export(tmp_path):
    model, _ = load_model("tiny:olmoe")
    keep = {layer.index: [0, 2, 5, 7] for layer in moectl.inspect(model).layers}
    export_subset(model, keep, tmp_path / "sub", metadata={"model": "tiny:olmoe"})
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(e) for e in EXAMPLES) + "\n")
    args = ["finetune", str(tmp_path / "sub"), "--data", str(data), "--out", str(tmp_path / "ft"),
            "--lr", "1e-3", "--batch-size", "4", "--micro-batch-size", "2", "--no-progress",
            "--json", str(tmp_path / "ft.json")]  # fmt: skip
    result = runner.invoke(subset_app, args)
    assert result.exit_code == 0, result.output
    assert "byte tokenizer" in result.output and "final loss" in result.output
    log = json.loads((tmp_path / "ft.json").read_text())
    assert len(log["steps"]) == 2 and log["config"]["lr"] == 1e-3 and log["config"]["schedule"] == "linear"
    assert json.loads((tmp_path / "ft" / "moectl_subset.json").read_text())["keep"]["0"] == [0, 2, 5, 7]

    again = runner.invoke(subset_app, args)  # --out exists
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert runner.invoke(subset_app, [*args, "--overwrite"]).exit_code == 0
    assert log["config"]["master_weights"] is True
    assert runner.invoke(subset_app, [*args, "--overwrite", "--no-master-weights"]).exit_code == 0
    assert json.loads((tmp_path / "ft.json").read_text())["config"]["master_weights"] is False
    data.write_text('{"prompt": "q"}\n')
    bad = runner.invoke(subset_app, [*args, "--overwrite"])
    assert bad.exit_code == 2 and "train.jsonl:1" in bad.output


def test_a_bf16_model_is_fine_tuned_through_float32_masters():
    """Without masters most bf16 updates of ≈ lr round away; with them the bf16 model follows the
    float32 run (on the reference model, benchmarks/master_weights.py: 93% of the entries whose bf16
    rounding the float32 run moved, against 36%)."""
    settings = dict(lr=1e-5, batch_size=4, micro_batch_size=4, max_steps=6, schedule="constant")
    reference = _subset_model()
    half = copy.deepcopy(reference).to(torch.bfloat16)
    start = {n: p.detach().clone() for n, p in half.named_parameters()}
    finetune_subset(reference, TOK, EXAMPLES, **settings)
    target = {n: p.detach().bfloat16() for n, p in reference.named_parameters()}
    moved = {n: target[n] != start[n] for n in target}
    agree = {}
    for masters in (False, True):
        model = copy.deepcopy(half)
        log = finetune_subset(model, TOK, EXAMPLES, master_weights=masters, **settings)
        assert log["config"]["master_weights"] is masters
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        same = sum(((p.detach() == target[n]) & moved[n]).sum().item() for n, p in model.named_parameters())
        agree[masters] = same / sum(m.sum().item() for m in moved.values())
    assert agree[True] > agree[False] + 0.1, agree
