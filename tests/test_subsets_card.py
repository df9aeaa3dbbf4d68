"""An exported subset's folder carries a model card of the subset, not its parent's."""

from __future__ import annotations

from huggingface_hub.repocard import metadata_load
from typer.testing import CliRunner

import moectl
from moectl.cli.subset import subset_app
from moectl.subsets import save_subset
from moectl.subsets.export import export_subset

PARENT_CARD = "---\nlicense: mit\nlanguage:\n- en\n---\n\n# parent\n\nAn OLMoE with 8 routed experts.\n"


def _parent(tmp_path):
    """A saved tiny OLMoE (8 experts per MoE layer) with a card of its own, and a math subset file."""
    model = moectl.tiny("olmoe")
    src = tmp_path / "runs" / "parent-olmoe"
    model.save_pretrained(src)
    (src / "README.md").write_text(PARENT_CARD)
    info = moectl.inspect(model)
    keep = {layer.index: [1, 3, 4, 6] if layer.index else [0, 2, 5, 7] for layer in info.layers}
    calibration = {"data": str(tmp_path / "math.jsonl"), "documents": 3, "tokens": 40}
    subset = save_subset(tmp_path / "math.subset.json", keep, str(src), "router", calibration, 8)
    return model, src, subset, keep


def _check(card: str, out, keep) -> None:
    front = metadata_load(out / "README.md")
    assert front["base_model"] == "parent-olmoe" and front["license"] == "mit"  # the parent's licence
    assert front["model_name"] == out.name and front["library_name"] == "transformers"
    assert {"expert-subset", "mixture-of-experts", "domain:math"} <= set(front["tags"])
    assert "An OLMoE with 8 routed experts" not in card  # the parent's card is gone
    assert "keeps 4 of its 8 routed experts" in card and "parent-olmoe" in card and "for math" in card
    assert "Architecture olmoe: 4 routed experts per MoE layer, top-2" in card
    for layer, ids in keep.items():
        assert f"| {layer} | {' '.join(map(str, ids))} |" in card


def test_streamed_export_writes_a_card_of_the_subset(tmp_path):
    """``subset export`` of a checkpoint folder (streamed) copied the parent's README.md unchanged."""
    _, src, subset, keep = _parent(tmp_path)
    out = tmp_path / "math-4"
    result = CliRunner().invoke(subset_app, ["export", str(src), "--subset", str(subset), "--out", str(out)])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    _check(card, out, keep)
    assert f"subset file: `{subset}`" in card


def test_in_memory_export_writes_a_card_of_the_subset(tmp_path):
    model, src, subset, keep = _parent(tmp_path)
    out = tmp_path / "math-4-memory"
    meta = {"model": str(src), "subset_file": str(subset), "method": "router",
            "calibration": {"data": str(tmp_path / "math.jsonl")}}  # fmt: skip
    export_subset(model, keep, out, metadata=meta, source=src)
    _check((out / "README.md").read_text(), out, keep)
