"""Subset files: round trip, and bad files refused with a message naming the problem."""

from __future__ import annotations

import json

import pytest

import moectl
from moectl.errors import ConfigError, FileFormatError, MoectlError
from moectl.subsets import load_subset, save_subset


@pytest.fixture(scope="module")
def info():
    return moectl.inspect(moectl.tiny("olmoe"))  # 3 MoE layers, 8 experts, top-2


@pytest.fixture(scope="module")
def grouped_info():
    return moectl.inspect(moectl.tiny("deepseek_v3"))  # 2 MoE layers, 2 groups of 4 experts


def write(tmp_path, keep, **extra):
    path = tmp_path / "s.subset.json"
    path.write_text(json.dumps({"model": "tiny:olmoe", "method": "router", "keep": keep, **extra}))
    return path


def test_round_trip(tmp_path, info):
    keep = {0: [7, 1, 2], 1: [0, 1, 2], 2: [3, 4, 5]}
    path = save_subset(
        tmp_path / "a" / "m.json", keep, model="tiny:olmoe", method="router", calibration={"documents": 3}
    )
    loaded = load_subset(path, info)
    assert loaded.keep == {0: [1, 2, 7], 1: [0, 1, 2], 2: [3, 4, 5]}
    assert (loaded.model, loaded.method, loaded.calibration) == ("tiny:olmoe", "router", {"documents": 3})
    raw = json.loads(path.read_text())
    assert raw["keep"] == {"0": [1, 2, 7], "1": [0, 1, 2], "2": [3, 4, 5]}


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (
            {"0": [1, 2], "1": [1, 2], "2": [1, 2], "5": [1, 2]},
            r"MoE layers \[5\]; the model has MoE layers 0..2",
        ),
        ({"0": [1, 2], "1": [1, 2]}, r"missing layers \[2\]"),
        ({"0": [1, 2], "1": [1, 2], "2": [1, 9]}, r"MoE layer 2: expert ids must lie in 0..7"),
        ({"0": [1], "1": [1, 2], "2": [1, 2]}, r"MoE layer 0: keeps 1 experts, fewer than top-k = 2"),
        ({"0": [1, 2, 3], "1": [1, 2], "2": [1, 2]}, r"same number of experts; got counts \[2, 3\]"),
    ],
)
def test_refused_against_the_model(tmp_path, info, keep, message):
    with pytest.raises(ValueError, match=message) as err:
        load_subset(write(tmp_path, keep), info)
    assert "does not fit the model" in str(err.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"keep": {"0": [1, 2, 2]}}', r"MoE layer 0: duplicate experts \[2\]"),
        ('{"keep": {"x": [1, 2]}}', r"layer key 'x' is not an integer"),
        ('{"keep": {"0": [1, "2"]}}', "list of integer expert ids"),
        ('{"keep": {"0": [-1, 2]}}', "negative expert ids"),
        ('{"keep": {"0": [1, 2], "00": [1, 2]}}', "MoE layer 0 is listed twice"),
        ('{"model": "m"}', 'needs a "keep" object'),
        ("{not json", "not valid JSON"),
    ],
)
def test_malformed_files_refused_without_a_model(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        load_subset(path)
    assert str(path) in str(err.value)


def test_grouped_router_needs_balanced_groups(tmp_path, grouped_info):
    with pytest.raises(ValueError, match=r"same number of kept experts in every group.*\[3, 1\] per group"):
        load_subset(write(tmp_path, {"0": [0, 1, 2, 4], "1": [0, 1, 4, 5]}), grouped_info)
    assert load_subset(write(tmp_path, {"0": [0, 1, 4, 5], "1": [2, 3, 6, 7]}), grouped_info).keep[1] == [
        2,
        3,
        6,
        7,
    ]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_subset(tmp_path / "nope.json")


# -- issue #42 (6): files that cannot be read, and files made for another model -----------------------
def _unreadable(tmp_path, kind):
    if kind == "not UTF-8":
        path = tmp_path / "latin1.json"
        path.write_bytes(b'{"keep": {"0": [1, 2]}, "method": "r\xe9gion"}')
        return path, r"not valid JSON \(not UTF-8 text"
    path = tmp_path / "a-folder"
    path.mkdir()
    if kind == "an exported folder":
        (path / "moectl_subset.json").write_text("{}")
        return path, r"is a folder: give a JSON file \(this folder's is .*moectl_subset.json\)"
    return path, "is a folder: give a JSON file"


@pytest.mark.parametrize("kind", ["not UTF-8", "a folder", "an exported folder"])
def test_a_subset_file_that_cannot_be_read_is_one_moectl_error(tmp_path, info, kind):
    """Was a raw UnicodeDecodeError / IsADirectoryError: a traceback on the command line."""
    path, message = _unreadable(tmp_path, kind)
    for read in (lambda: load_subset(path, info), lambda: moectl.load_policy(f"static:{path}", info)):
        with pytest.raises(MoectlError, match=message) as err:
            read()
        assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("recorded", "error", "message"),
    [
        (32, ConfigError, r"made for tiny:olmoe \(32 experts per MoE layer\), not for this model \(8 experts per MoE layer\).*--force"),
        ("8", FileFormatError, '"num_experts" must be a positive integer .*got \'8\''),
        (0, FileFormatError, '"num_experts" must be a positive integer'),
    ],
)
def test_a_subset_file_for_another_expert_count_is_refused(tmp_path, info, recorded, error, message):
    """Was loaded (load_subset; load_policy only warned): its ids name other experts on this model."""
    path = write(tmp_path, {"0": [1, 2], "1": [1, 2], "2": [1, 2]}, num_experts=recorded)
    readers = [lambda: load_subset(path, info), lambda: moectl.load_policy(path, info)]
    readers.append(lambda: moectl.load_policy(f"static:{path}", info))
    for read in readers:
        with pytest.raises(error, match=message) as err:
            read()
        assert str(path) in str(err.value)


def test_a_subset_file_of_the_model_s_expert_count_or_none_recorded_loads(tmp_path, info):
    keep = {"0": [1, 2], "1": [1, 2], "2": [1, 2]}
    assert load_subset(write(tmp_path, keep, num_experts=8), info).num_experts == 8
    assert load_subset(write(tmp_path, keep, num_experts=None), info).num_experts is None
    assert moectl.load_policy(write(tmp_path, keep, num_experts=8), info).expert_lists()[2] == [1, 2]
