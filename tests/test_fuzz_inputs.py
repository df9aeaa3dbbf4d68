"""Fuzzed inputs (issue 29): every kind of file moectl reads, mutated, random or of the wrong JSON
type, through the real CLI entry in process (typer's CliRunner). Each run must either succeed
(the input happened to be valid) or leave with exit code 2 and one ``error:`` message — never a
traceback, never another exit code. Formats without a CLI entry (routing traces) go through their
loader, which must raise ``ValueError`` / ``OSError`` with a one-line message.

Bounded for CI: ``MOECTL_FUZZ_EXAMPLES`` examples per format (default 8), derandomized; set
``MOECTL_FUZZ_RANDOM=1`` to explore new inputs. Counts of inputs tried, accepted and refused per
format are printed (``pytest -s``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import moectl
from moectl import ExpertMask, GumbelTopK
from moectl.cli import app
from moectl.ensemble.roe_config import save_profile
from moectl.options.controller import build_controller
from moectl.options.options_config import OptionsConfig
from moectl.routing import route
from moectl.routing.pool import DocumentPool
from moectl.routing.trace import RoutingTrace
from moectl.train.train_config import TrainConfig

torch.set_num_threads(1)
EXAMPLES = int(os.environ.get("MOECTL_FUZZ_EXAMPLES", "8"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("MOECTL_FUZZ_RANDOM"),  # CI: the same inputs on every run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
runner = CliRunner()
COUNTS: dict[str, Counter] = {}

# -- strategies --------------------------------------------------------------------------------------
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.sampled_from([0, 1, -1, 2, 7, 8, 9, 1000, 10**12])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8
)


def _slots(data, path=()):
    """Every (path) to a value inside nested dicts/lists, the root included."""
    yield path
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _slots(v, (*path, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _slots(v, (*path, i))


def _set(data, path, value):
    if not path:
        return value
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return data


def _delete(data, path):
    if not path:
        return data
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return data


@st.composite
def mutated(draw, valid):
    """``valid`` (a JSON value) with 1-3 values replaced, deleted or given a sibling."""
    data = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_slots(data))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if op == "replace":
            data = _set(data, path, draw(json_values))
        elif op == "delete":
            data = _delete(data, path)
        else:
            target = data
            for key in path:
                target = target[key]
            if isinstance(target, dict):
                target[draw(st.text(max_size=6))] = draw(json_values)
            elif isinstance(target, list):
                target.append(draw(json_values))
    return data


def json_file(valid) -> st.SearchStrategy[bytes]:
    """Contents of a JSON file: mutated valid ones, cut-off text, other JSON values, random bytes."""
    text = json.dumps(valid)
    return st.one_of(
        mutated(valid).map(lambda d: json.dumps(d).encode()),
        mutated(valid).map(lambda d: json.dumps(d).encode()),
        st.integers(0, len(text)).map(lambda n: text[:n].encode()),
        json_values.map(lambda d: json.dumps(d).encode()),
        st.binary(max_size=64),
    )


def jsonl_file(valid_row) -> st.SearchStrategy[bytes]:
    """Contents of a JSONL file: lines of mutated rows, other JSON values, text; or random bytes."""
    line = st.one_of(
        st.just(valid_row).map(json.dumps),
        mutated(valid_row).map(json.dumps),
        json_values.map(json.dumps),
        st.text(max_size=20).filter(lambda s: "\n" not in s and "\r" not in s),
    )
    return st.one_of(
        st.lists(line, min_size=0, max_size=4).map(lambda rows: "\n".join(rows).encode()),
        st.binary(max_size=64),
    )


# -- checks ------------------------------------------------------------------------------------------
def _count(fmt: str, outcome: str) -> None:
    COUNTS.setdefault(fmt, Counter())[outcome] += 1


def check_cli(fmt: str, args: list[str]) -> None:
    """Exit 0, or exit 2 with exactly one ``error:`` message; never a traceback."""
    result = runner.invoke(app, args)
    if result.exit_code == 0:
        _count(fmt, "accepted")
        return
    detail = f"{fmt}: exit {result.exit_code}, {result.exception!r}\n{result.output[-1500:]}"
    assert result.exit_code == 2, detail
    assert isinstance(result.exception, SystemExit), detail
    flat = " ".join(result.output.split())
    assert flat.startswith("error:") and flat.count("error:") == 1, detail
    assert "Traceback" not in result.output, detail
    _count(fmt, "refused")


def check_loader(fmt: str, load) -> None:
    """A loader without a CLI entry: returns, or raises ValueError / OSError with a one-line message."""
    try:
        load()
    except (ValueError, OSError) as err:
        assert str(err) and "\n" not in str(err), f"{fmt}: {err!r}"
        _count(fmt, "refused")
    else:
        _count(fmt, "accepted")


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    for fmt, c in sorted(COUNTS.items()):
        print(f"fuzz {fmt}: {sum(c.values())} inputs, {c['accepted']} accepted, {c['refused']} refused")


# -- valid samples -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model, _, info = moectl.load("tiny:olmoe")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there", "category": "chat"}) + "\n")
    controller = root / "controller"
    build_controller(info, 4).save(controller)
    (controller / "options.json").write_text(json.dumps(asdict(OptionsConfig(k_hat=4))))  # the run's settings
    profile = save_profile(root / "profile.json", [0.1] * len(info.layers), K=2, aggregation="prob_mean", seed=0)
    subset = root / "subset.json"
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"some text number {i} here"}) + "\n" for i in range(3)))
    out = runner.invoke(
        app, ["subset", "select", "tiny:olmoe", "--data", str(corpus), "--keep", "4", "--out", str(subset)]
    )
    assert out.exit_code == 0, out.output
    folder = root / "model"
    model.save_pretrained(folder)
    with route(model, [], record=True) as session:
        model(input_ids=torch.randint(3, 200, (1, 6)))
    trace = session.trace.save(root / "trace")
    return {
        "root": root,
        "prompts": prompts,
        "mask": ExpertMask.from_lists(info, {0: [0, 1, 2], 2: [3, 4]}).to_dict(),
        "gumbel": GumbelTopK(0.3).to_dict(),
        "pool": DocumentPool(4).to_dict(),
        "subset": json.loads(subset.read_text()),
        "controller": controller,
        "controller_json": json.loads((controller / "controller.json").read_text()),
        "options_json": json.loads((controller / "options.json").read_text()),
        "train_config": asdict(TrainConfig.from_preset("tiny", out="run")),
        "profile": json.loads(Path(profile).read_text()),
        "corpus_row": {"text": "some text here"},
        "prompt_row": {"prompt": "hello there", "category": "chat"},
        "model": folder,
        "trace": trace,
        "trace_json": json.loads(trace.with_suffix(".json").read_text()),
    }


def _write(root: Path, name: str, content: bytes) -> Path:
    path = root / name
    path.write_bytes(content)
    return path


def _switch_rate(samples, policy: Path, prompts: Path | None = None) -> list[str]:
    prompts = prompts or samples["prompts"]
    return ["switch-rate", "--tiny", "olmoe", "--prompts", str(prompts), "--max-new-tokens", "1", "--policy", str(policy)]


# -- one test per format -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mask", "gumbel", "pool", "subset"])
def test_policy_files(samples, kind):
    @FUZZ
    @given(content=json_file(samples[kind]))
    def run(content):
        path = _write(samples["root"], f"{kind}.json", content)
        check_cli(f"policy:{kind}", _switch_rate(samples, path))

    run()


@pytest.mark.parametrize(("name", "sample"), [("controller.json", "controller_json"), ("options.json", "options_json")])
def test_controller_folder_files(samples, name, sample):
    """A trained controller folder: the controller's shapes and the options run's settings."""

    @FUZZ
    @given(content=json_file(samples[sample]))
    def run(content):
        folder = samples["root"] / "ctrl"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(samples["controller"], folder)
        (folder / name).write_bytes(content)
        check_cli(name, _switch_rate(samples, folder))

    run()


def test_pretrain_run_config(samples):
    """A ``moectl pretrain`` run's config.json, as ``pretrain --resume`` reads it (``TrainConfig.load``;
    through the loader: a valid config would start training)."""

    @FUZZ
    @given(content=json_file(samples["train_config"]))
    def run(content):
        path = _write(samples["root"], "config.json", content)
        check_loader("pretrain config.json", lambda: TrainConfig.load(path))

    run()


def test_roe_tau_profiles(samples):
    @FUZZ
    @given(content=json_file(samples["profile"]))
    def run(content):
        path = _write(samples["root"], "tau.json", content)
        args = ["roe", "generate", "tiny:olmoe", "--temperatures", str(path), "--prompt", "x", "--max-new-tokens", "1"]
        check_cli("roe-profile", args)

    run()


def test_prompts_jsonl(samples):
    @FUZZ
    @given(content=jsonl_file(samples["prompt_row"]))
    def run(content):
        path = _write(samples["root"], "p.jsonl", content)
        args = ["switch-rate", "--tiny", "olmoe", "--prompts", str(path), "--max-new-tokens", "1"]
        check_cli("prompts.jsonl", args)

    run()


def test_corpus_jsonl(samples):
    @FUZZ
    @given(content=jsonl_file(samples["corpus_row"]))
    def run(content):
        path = _write(samples["root"], "c.jsonl", content)
        out = samples["root"] / "out.json"
        args = ["subset", "select", "tiny:olmoe", "--data", str(path), "--keep", "4", "--out", str(out)]
        check_cli("corpus.jsonl", args)

    run()


def _safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


@st.composite
def shard_contents(draw, original: bytes):
    """A safetensors file with its header mutated (or random header bytes), the data kept."""
    (n,) = struct.unpack("<Q", original[:8])
    header, data = json.loads(original[8 : 8 + n]), original[8 + n :]
    choice = draw(st.integers(0, 3))
    if choice == 0:
        head = json.dumps(draw(mutated(header))).encode()
    elif choice == 1:
        head = draw(st.binary(max_size=64))
    elif choice == 2:
        head = json.dumps(draw(json_values)).encode()
    else:
        return original[: draw(st.integers(0, len(original) - 1))]
    length = draw(st.one_of(st.just(len(head)), st.integers(0, 2**64 - 1)))
    return struct.pack("<Q", length) + head + data


def test_safetensors_headers(samples):
    original = (samples["model"] / "model.safetensors").read_bytes()

    @FUZZ
    @given(content=shard_contents(original))
    def run(content):
        folder = samples["root"] / "m"
        if not folder.exists():
            shutil.copytree(samples["model"], folder)
        (folder / "model.safetensors").write_bytes(content)
        check_cli("safetensors:inspect", ["inspect", str(folder)])
        args = ["serve-offload", str(folder), "--budget", "2", "--max-new-tokens", "1", "--prompts", str(samples["prompts"])]
        check_cli("safetensors:serve-offload", args)

    run()


def test_routing_traces(samples):
    trace = samples["trace"]
    tensors = trace.read_bytes()

    @FUZZ
    @given(meta=json_file(samples["trace_json"]), data=st.one_of(st.just(tensors), shard_contents(tensors)))
    def run(meta, data):
        folder = samples["root"] / "t"
        folder.mkdir(exist_ok=True)
        (folder / "trace.json").write_bytes(meta)
        (folder / "trace.safetensors").write_bytes(data)

        def load():
            t = RoutingTrace.load(folder / "trace")
            t.chosen  # noqa: B018 - the loaded tensors are read, not only the header
            t.probs  # noqa: B018

        check_loader("trace", load)

    run()
