"""Shared fixtures: tiny random models of every family, built once per test session."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from hypothesis import settings

import moectl
from moectl.data.sample import load_sample_corpus

os.environ.setdefault("HF_HUB_OFFLINE", "1")
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")  # CI: the same examples every run; locally: new ones each run
torch.set_num_threads(1)  # tiny models: threads only add contention on a shared 2-core machine
# verbs run in process (CliRunner) pick their threads with moectl.threads.pick_threads, which honours
# this: the test process keeps one thread (and a forked crash-test child never meets an OpenMP pool)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@functools.cache
def _tiny(family: str):
    return moectl.tiny(family)


@pytest.fixture(params=moectl.FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def model(family):
    return _tiny(family)


@pytest.fixture
def olmoe():
    return _tiny("olmoe")


def random_ids(batch: int = 2, length: int = 12, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save (moectl draws on ``Figure`` objects, never pyplot)."""
    from matplotlib.figure import Figure

    kept = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: kept.append(fig) or savefig(fig, *a, **k))
    return kept


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few documents of every domain of the shipped sample, as a corpus folder."""
    root = tmp_path_factory.mktemp("corpus")
    sample = load_sample_corpus()
    for split, docs in sample.items():
        keep, seen = [], {}
        for doc in docs:
            if seen.get(doc["domain"], 0) < (6 if split == "train" else 2):
                seen[doc["domain"]] = seen.get(doc["domain"], 0) + 1
                keep.append({**doc, "text": doc["text"][:3000]})
        (root / f"{split}.jsonl").write_text("\n".join(json.dumps(d) for d in keep))
    return root


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    tiny models are fastest on one thread, and two threads stall badly on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
