"""The interval statistics of the EMO benchmarks (Figure 3: subset retention; Figure 6 + §5.3: domain
similarity): with every document drawn once they equal the library's figures, and they behave as
bootstrap statistics should. No model is trained; the tiny model only checks that one forward
serves both routing sources."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import moectl
from moectl.eval.intervals import bootstrap_interval
from moectl.models.load import ByteTokenizer
from moectl.subsets.clusters import document_purity
from moectl.subsets.similarity import (
    document_statistics,
    document_vectors,
    document_vectors_by_source,
    domain_similarity,
)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their shared helper (bench_args)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


retention = _load("subset_retention")
similarity = _load("domain_similarity")


def test_relative_statistic_is_the_mean_over_domains_of_the_loss_ratio():
    rng = np.random.default_rng(0)
    groups = {d: (rng.uniform(1, 3, n), rng.uniform(1, 3, n)) for d, n in (("a", 4), ("b", 7), ("c", 5))}
    stat = retention.relative_statistic(groups)
    expected = np.mean([sub.sum() / full.sum() - 1 for sub, full in groups.values()])
    assert stat(np.ones((1, 16)))[0] == pytest.approx(expected)
    # a document drawn twice counts twice; a domain drawn zero times is left out of the mean
    counts = np.zeros((1, 16))
    counts[0, [0, 0 + 1, 4]] = [2, 1, 1]  # domain a: documents 0 (twice) and 1; b: document 4
    a_sub, a_full = groups["a"]
    b_sub, b_full = groups["b"]
    ratio_a = (2 * a_sub[0] + a_sub[1]) / (2 * a_full[0] + a_full[1]) - 1
    assert stat(counts)[0] == pytest.approx((ratio_a + b_sub[0] / b_full[0] - 1) / 2)
    # a subset that changes nothing: a point interval at 0
    same = retention.relative_statistic({d: (full, full) for d, (_, full) in groups.items()})
    assert bootstrap_interval(same, 16, 200) == pytest.approx((0.0, 0.0))
    lo, hi = bootstrap_interval(stat, 16, 200)
    assert lo < expected < hi


def _documents(rng, domains=(5, 4, 6), layers=2, experts=8):
    """Per layer, per domain [docs, E] routing distributions, each domain leaning on its own experts."""
    out = {}
    for layer in range(layers):
        per_domain = []
        for d, n in enumerate(domains):
            logits = rng.normal(size=(n, experts))
            logits[:, d * 2 : d * 2 + 2] += 1.5
            p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
            per_domain.append(torch.tensor(p))
        out[layer] = per_domain
    return out


def test_similarity_and_pair_statistics_equal_the_library_figures():
    rng = np.random.default_rng(1)
    docs = _documents(rng)
    vectors = np.stack([torch.cat(v).numpy() for _, v in sorted(docs.items())])  # [L, N, E]
    domain = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs[0])])
    whole = np.ones((1, len(domain)))
    matrices = domain_similarity({i: torch.stack([d.mean(0) for d in v]) for i, v in docs.items()})
    off = ~torch.eye(3, dtype=torch.bool)
    expected = np.mean([float(m[off].mean()) for m in matrices.values()])
    assert similarity.similarity_statistic(vectors, domain)(whole)[0] == pytest.approx(expected)
    stats = document_statistics(docs)
    pairs = similarity.pair_statistics(vectors, domain)
    for key in ("within_domain", "across_domains"):
        assert pairs[key](whole)[0] == pytest.approx(np.mean([s[key] for s in stats.values()]))
    effective = np.mean([s["effective_experts"] for s in stats.values()])
    assert similarity.effective_statistic(vectors)(whole)[0] == pytest.approx(effective)
    # a resample that misses a domain leaves its pairs out instead of counting cosine 0
    counts = np.ones((1, len(domain)))
    counts[0, domain == 2] = 0
    only_two = similarity.similarity_statistic(vectors[:, domain != 2], domain[domain != 2])
    assert similarity.similarity_statistic(vectors, domain)(counts)[0] == pytest.approx(
        only_two(np.ones((1, int((domain != 2).sum()))))[0]
    )


def test_purity_statistics_equal_the_library_figures():
    rng = np.random.default_rng(2)
    doc_ids = np.repeat(np.arange(6), [5, 3, 4, 6, 2, 5])
    labels = rng.integers(0, 4, len(doc_ids))
    doc_domain = ["a", "a", "b", "b", "c", "c"]
    stats = similarity.purity_statistics(labels, doc_ids, np.array(doc_domain))
    whole = np.ones((1, 6))
    assert stats["document_purity"](whole)[0] == pytest.approx(
        document_purity(torch.tensor(labels), torch.tensor(doc_ids))
    )
    assert stats["domain_purity"](whole)[0] == pytest.approx(
        similarity.domain_purity(torch.tensor(labels), torch.tensor(doc_ids), doc_domain)
    )


def test_purity_interval_brackets_the_value_and_basic_interval_reflects_the_percentile_one():
    rng = np.random.default_rng(3)
    doc_ids = np.repeat(np.arange(40), 20)
    domain = np.repeat(np.array(["a", "b", "c", "d"]), 10)
    # tokens mostly in their domain's cluster, some noise: a majority re-taken per resample drifts up
    labels = np.where(rng.random(800) < 0.4, np.repeat(np.arange(40) // 10, 20), rng.integers(0, 8, 800))
    stats = similarity.purity_statistics(labels, doc_ids, domain)
    out = similarity.intervals(stats, 40, 500, 0)
    for entry in out.values():
        assert entry["ci95"][0] <= entry["value"] <= entry["ci95"][1]
    shift = {"s": lambda c: (c @ np.arange(40.0)) / c.sum(1) ** 2}  # any statistic
    lo, hi = bootstrap_interval(shift["s"], 40, 200, 5)
    value = float(shift["s"](np.ones((1, 40)))[0])
    basic = similarity.intervals(shift, 40, 200, 5, basic=["s"])["s"]
    assert basic["ci95"] == pytest.approx([2 * value - hi, 2 * value - lo])
    assert basic["ci_method"] == "basic bootstrap"


def test_model_labels_name_the_run_not_its_final_folder():
    assert similarity.label("models/moectl-small-emo") == "moectl-small-emo"
    assert similarity.label("runs/emo-small/final") == "emo-small/final"
    assert similarity.label("tiny:qwen2_moe") == "tiny:qwen2_moe"


def test_one_forward_serves_both_routing_sources_in_any_batch_size():
    model = moectl.tiny("qwen3_moe", vocab_size=ByteTokenizer.vocab_size)
    texts = {"math": ["1 + 1 = 2", "x^2 - 4 = 0", "3 * 3"], "code": ["def f(x): return x", "import os"]}
    both = document_vectors_by_source(model, ByteTokenizer(), texts, batch_size=2)
    for source in ("probs", "chosen"):
        alone = document_vectors(model, ByteTokenizer(), texts, source=source, batch_size=16)
        for layer, per_domain in alone.items():
            for mine, theirs in zip(both[source][layer], per_domain, strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_retention_plot_writes_a_png(tmp_path):
    def cell(v):
        return {"relative": v, "ci95": [v - 0.01, v + 0.01]}

    summary = {}
    for f, k, s, e in ((1.0, 32, 0.0, 0.0), (0.25, 8, 0.2, 0.05), (0.125, 4, 0.4, 0.1)):
        entry = {"fraction": f, "k": k, "standard": cell(s), "emo": cell(e), "difference": cell(s - e)}
        if f < 1:
            entry["finetuned"] = {"domains": ["code"], "standard": cell(s / 2), "emo": cell(e / 2),
                                  "difference": cell((s - e) / 2),
                                  "not_finetuned": {"standard": cell(s), "emo": cell(e)}}  # fmt: skip
        summary[f"{f:g}"] = entry
    path = tmp_path / "fig.png"
    retention.plot(summary, {"standard": "std", "emo": "emo"}, ["code", "math"], 32, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fractions", "1,2"], "--fractions must be comma-separated fractions in (0, 1]"),
        (["--finetune", "--ft-fractions", "0.3"], "--ft-fractions 0.3 must be among --fractions"),
        (["--plot", "out.svg"], "--plot must name a .png file"),
    ],
)
def test_retention_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        retention.main(["--models", "a", "b", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_benchmarks_need_their_inputs_and_replot_needs_a_results_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        retention.main([])
    assert exit_.value.code == 2 and "--models STANDARD EMO is required" in capsys.readouterr().err
    bogus = tmp_path / "other.json"
    bogus.write_text('{"results": []}')
    with pytest.raises(SystemExit) as exit_:
        retention.main(["--replot", str(bogus), "--plot", str(tmp_path / "fig.png")])
    assert exit_.value.code == 2 and "not a subset_retention --json file" in capsys.readouterr().err
    assert not (tmp_path / "fig.png").exists()
    with pytest.raises(SystemExit) as exit_:
        similarity.main(["--replot", str(bogus), "--plot", str(tmp_path / "fig.png")])
    assert exit_.value.code == 2 and "not a domain_similarity --json file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        similarity.main(["--models", "tiny:olmoe"])
    assert exit_.value.code == 2 and "--data is required" in capsys.readouterr().err
