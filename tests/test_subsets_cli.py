"""``moectl subset select`` / ``export`` end to end on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import moectl
from moectl.cli.common import MoectlGroup
from moectl.cli.modularity import modularity_cmd
from moectl.cli.subset import subset_app
from moectl.models.load import load_model
from moectl.routing import ExpertMask, route

runner = CliRunner()


def test_select_then_export(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text(
        "\n".join(json.dumps({"text": t}) for t in ["1 + 1 = 2", "x^2 - 4 = 0 so x = 2", ""]) + "\n"
    )
    subset = tmp_path / "math.subset.json"
    result = runner.invoke(
        subset_app,
        ["select", "tiny:qwen3_moe", "--data", str(data), "--keep", "4", "--method", "easy-ep", "--layerwise",
         "--out", str(subset), "--json", str(tmp_path / "select.json")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "easy_ep subset" in result.output
    saved = json.loads(subset.read_text())
    assert saved["method"] == "easy_ep" and saved["calibration"]["documents"] == 2
    assert saved["calibration"]["tokens"] == len("1 + 1 = 2") + len("x^2 - 4 = 0 so x = 2")
    assert all(len(v) == 4 for v in saved["keep"].values())
    assert json.loads((tmp_path / "select.json").read_text())["keep"] == saved["keep"]

    result = runner.invoke(
        subset_app,
        ["export", "tiny:qwen3_moe", "--subset", str(subset), "--out", str(tmp_path / "math-4"),
         "--json", str(tmp_path / "export.json")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "bytes on disk" in result.output and "parameters" in result.output
    report = json.loads((tmp_path / "export.json").read_text())
    assert report["after"]["parameters"] < report["before"]["parameters"]

    full, _ = load_model("tiny:qwen3_moe")
    keep = {int(k): v for k, v in saved["keep"].items()}
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), route(full, [ExpertMask.from_lists(moectl.inspect(full), keep)]):
        masked = full(ids).logits
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "math-4").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, masked, rtol=1e-4, atol=1e-4)


def test_errors_are_reported_clearly(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no text field"}\n')
    result = runner.invoke(
        subset_app,
        ["select", "tiny:olmoe", "--data", str(bad), "--keep", "4", "--out", str(tmp_path / "s.json")],
    )
    assert result.exit_code == 2
    assert 'needs a string "text" field' in result.output
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello"}\n')
    result = runner.invoke(
        subset_app,
        [
            "select",
            "tiny:olmoe",
            "--data",
            str(good),
            "--keep",
            "4",
            "--method",
            "magic",
            "--out",
            str(tmp_path / "s.json"),
        ],
    )
    assert result.exit_code == 2 and "unknown selection method" in result.output
    subset = tmp_path / "s.json"
    subset.write_text('{"keep": {"0": [0, 1], "1": [0, 1]}}')
    result = runner.invoke(
        subset_app, ["export", "tiny:olmoe", "--subset", str(subset), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "missing layers [2]" in result.output


def test_export_from_a_checkpoint_directory_reports_disk_size(tmp_path):
    full = tmp_path / "full"
    moectl.tiny("mixtral").save_pretrained(full)
    subset = tmp_path / "s.json"
    subset.write_text('{"keep": {"0": [1, 5], "1": [0, 7], "2": [2, 3]}}')
    result = runner.invoke(
        subset_app,
        [
            "export",
            str(full),
            "--subset",
            str(subset),
            "--out",
            str(tmp_path / "small"),
            "--json",
            str(tmp_path / "r.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["before"]["disk_bytes"] > report["after"]["disk_bytes"] > 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "small").config.num_local_experts == 2


def test_modularity_writes_heatmaps_and_similarity(tmp_path):
    app = typer.Typer(cls=MoectlGroup)  # the group whose invoke turns a MoectlError into one line
    app.command("modularity")(modularity_cmd)
    app.command("noop")(lambda: None)  # two commands: typer then expects the verb name
    domains = tmp_path / "domains"
    domains.mkdir()
    for name, texts in {
        "math": ["1 + 1 = 2", "x = 4"],
        "code": ["def f(): pass"],
        "prose": ["Once upon a time"],
    }.items():
        (domains / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = runner.invoke(
        app, ["modularity", "tiny:olmoe", "--data", str(domains), "--out", str(tmp_path / "report")]
    )
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "report" / "similarity.json").read_text())
    assert saved["domains"] == ["code", "math", "prose"] and saved["documents"]["math"] == 2
    assert len(saved["similarity"]) == 3 and all(len(m) == 3 for m in saved["similarity"].values())
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png")) == [
        f"similarity_layer{i}.png" for i in range(3)
    ]
    result = runner.invoke(
        app, ["modularity", "tiny:olmoe", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 2 and "at least two DOMAIN.jsonl files" in result.output


def test_modularity_groups_a_corpus_folder_by_domain(tmp_path):
    from moectl.data.domains import corpus_texts_by_domain
    from moectl.data.sample import sample_corpus_dir

    texts = corpus_texts_by_domain(sample_corpus_dir(), max_docs=2)
    assert len(texts) >= 2 and "validation" not in texts and "train" not in texts
    assert all(1 <= len(docs) <= 2 and all(isinstance(t, str) and t for t in docs) for docs in texts.values())
    app = typer.Typer(cls=MoectlGroup)  # the group whose invoke turns a MoectlError into one line
    app.command("modularity")(modularity_cmd)
    app.command("noop")(lambda: None)
    result = runner.invoke(
        app,
        [
            "modularity",
            "tiny:olmoe",
            "--data",
            str(sample_corpus_dir()),
            "--max-docs",
            "1",
            "--max-length",
            "32",
            "--out",
            str(tmp_path / "report"),
        ],
    )
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "report" / "similarity.json").read_text())
    assert saved["domains"] == sorted(texts)


# -- issue #42 (6): subset files that cannot be read, or were made for another model ------------------
def _bad_subset(tmp_path, kind):
    if kind == "folder":
        path = tmp_path / "subset-folder"
        path.mkdir()
        return path, "is a folder: give a JSON file"
    path = tmp_path / "latin1.subset.json"
    path.write_bytes(b'{"keep": {"0": [0, 1]}, "method": "r\xe9gion"}')
    return path, "not valid JSON (not UTF-8 text"


def _verbs(tmp_path, subset):
    """Each verb that reads a subset file, with ``subset`` where it goes."""
    checkpoint = tmp_path / "olmoe"
    if not checkpoint.exists():
        moectl.tiny("olmoe").save_pretrained(checkpoint)
        moectl.tiny("qwen3_moe").save_pretrained(tmp_path / "qwen3")  # GGUF: olmoe's k_norm is refused
        (tmp_path / "domains").mkdir()
        (tmp_path / "domains" / "math.jsonl").write_text('{"text": "1 + 1 = 2"}\n')
        (tmp_path / "experts").mkdir()
    return {
        "subset export": ["subset", "export", "tiny:olmoe", "--subset", str(subset),
                          "--out", str(tmp_path / "o")],
        "subset export --stream": ["subset", "export", str(checkpoint), "--subset", str(subset),
                                   "--out", str(tmp_path / "o")],
        "subset gate": ["subset", "gate", "tiny:olmoe", "--subset", str(subset),
                        "--data", str(tmp_path / "domains")],
        "subset merge": ["subset", "merge", "tiny:olmoe", "--subset", str(subset), "--experts",
                         str(tmp_path / "experts"), "--out", str(tmp_path / "merged")],
        "eval --policy": ["eval", "tiny:olmoe", "--policy", str(subset), "--perplexity",
                          str(tmp_path / "domains" / "math.jsonl")],
        "eval --policy static:": ["eval", "tiny:olmoe", "--policy", f"static:{subset}", "--perplexity",
                                  str(tmp_path / "domains" / "math.jsonl")],
        "serve-offload --policy static:": ["serve-offload", "tiny:olmoe", "--policy", f"static:{subset}"],
        "export gguf --subset": ["export", "gguf", str(tmp_path / "qwen3"), "--subset", str(subset),
                                 "--out", str(tmp_path / "o.gguf")],
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["not UTF-8", "folder"])
def test_a_subset_file_that_cannot_be_read_is_one_error_line_on_every_verb(tmp_path, kind):
    """Was a raw UnicodeDecodeError / IsADirectoryError traceback (exit 1) from the subset verbs."""
    from moectl.cli import app

    subset, message = _bad_subset(tmp_path, kind)
    for verb, args in _verbs(tmp_path, subset).items():
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (verb, result.output, result.exception)
        assert result.output.count("error:") == 1 and "Traceback" not in result.output, (verb, result.output)
        assert _squash(f"{subset}") in _squash(result.output), (verb, result.output)
        policy_folder = kind == "folder" and verb == "eval --policy"  # a policy may be a folder
        expected = "a folder with no policy in it" if policy_folder else message
        assert _squash(expected) in _squash(result.output), (verb, result.output)
        assert not any((tmp_path / name).exists() for name in ("o", "merged", "o.gguf")), verb


def _squash(text: str) -> str:
    """``text`` without white space: rich wraps long error lines anywhere."""
    return "".join(text.split())


@pytest.mark.parametrize("stream", [False, True])
def test_a_subset_file_for_another_model_is_refused_by_export(tmp_path, stream):
    """Was exported, exit 0, no warning: a file made for 32 experts per MoE layer on an 8-expert model."""
    from moectl.cli import app

    model = str(tmp_path / "olmoe") if stream else "tiny:olmoe"
    if stream:
        moectl.tiny("olmoe").save_pretrained(model)
    cases = {
        "num_experts": ({"0": [0, 1], "1": [0, 1], "2": [0, 1]}, 32,
                        f"made for another model (32 experts per MoE layer), not for {model} (8 experts per MoE layer)"),
        "expert id": ({"0": [0, 1], "1": [0, 1], "2": [0, 9]}, None, "expert ids must lie in 0..7"),
        "MoE layer": ({"0": [0, 1], "1": [0, 1], "2": [0, 1], "3": [0, 1]}, None,
                      "MoE layers [3]; the model has MoE layers 0..2"),
    }  # fmt: skip
    for name, (keep, recorded, message) in cases.items():
        subset = tmp_path / f"{name}.json"
        subset.write_text(json.dumps({"keep": keep, "num_experts": recorded}))
        args = ["subset", "export", model, "--subset", str(subset), "--out", str(tmp_path / "o")]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (name, result.output, result.exception)
        assert _squash(message) in _squash(result.output), (name, result.output)
        assert _squash(str(subset)) in _squash(result.output), (name, result.output)
        assert not (tmp_path / "o").exists()
