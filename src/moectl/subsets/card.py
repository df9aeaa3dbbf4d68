"""The model card (README.md) of an exported expert subset: what the folder holds, not its parent.

``moectl subset export`` copies a checkpoint folder's side files, the parent's README.md among them,
whose "32 routed experts" no longer describes the weights. :func:`write_subset_card` writes a card
of the subset instead, every figure read from files: the export's ``moectl_subset.json`` (kept
experts per MoE layer, parent model, subset file, selection method, calibration data, the size
report) and the exported folder's ``config.json`` and safetensors headers
(:func:`moectl.reporting.model_card.read_model`). The YAML front matter follows the Hub's model card
metadata (``huggingface_hub.ModelCardData``): ``base_model`` is the parent, ``license`` the parent
card's (the weights are the parent's, cut), ``library_name: transformers`` (plain transformers
loads the folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moectl.io.atomic import write_text_atomic

CARD = "README.md"
TAGS = ("moectl", "mixture-of-experts", "expert-subset")


def domain_of(meta: dict[str, Any]) -> str | None:
    """The subset's domain: ``calibration["domain"]`` where recorded, else the calibration file's
    name (``math.jsonl`` → ``math``, as ``moectl subset gate`` reads it)."""
    calibration = meta.get("calibration") or {}
    if calibration.get("domain"):
        return str(calibration["domain"])
    data = calibration.get("data")
    return (Path(str(data)).stem or None) if data else None


def parent_card_metadata(parent: Path | None) -> dict[str, Any]:
    """The parent folder's card front matter ({} without one or where it does not parse)."""
    if parent is None or not (parent / CARD).is_file():
        return {}
    from huggingface_hub.repocard import metadata_load

    try:
        return metadata_load(parent / CARD) or {}
    except ValueError:  # a README without (valid) front matter
        return {}


def base_model_of(spec: str) -> str | None:
    """The card's ``base_model``: a hub id as given, a local folder by its name, none for tiny:."""
    if spec.startswith("tiny:"):
        return None
    path = Path(spec).expanduser()
    return path.resolve().name if path.is_dir() else spec


def _size_rows(report: dict[str, Any]) -> list[str]:
    before, after = report.get("before", {}), report.get("after", {})
    rows = []
    for key, label in (("parameters", "parameters"), ("tensor_bytes", "tensor bytes"), ("disk_bytes", "bytes on disk")):
        if key in after:
            was = before.get(key)
            parent, ratio = (f"{was:,}", f"{after[key] / was:.3f}") if was else ("-", "-")
            rows.append(f"| {label} | {parent} | {after[key]:,} | {ratio} |")
    return rows


def subset_card_text(folder: Path, meta: dict[str, Any], parent: Path | None) -> str:
    """README.md of the exported subset ``folder`` (written, with its ``moectl_subset.json`` = ``meta``)."""
    from huggingface_hub import ModelCardData

    from moectl.reporting.model_card import read_model

    facts = read_model(folder)
    spec = str(meta.get("model") or "an unnamed model")
    report = meta.get("report", {})
    keep = {int(k): v for k, v in meta["keep"].items()}
    before = sorted({int(v) for v in report.get("experts_before", {}).values()})
    kept = len(next(iter(keep.values())))
    of = f" of its {before[0]}" if len(before) == 1 else ""
    domain = domain_of(meta)
    calibration = meta.get("calibration") or {}
    parent_meta = parent_card_metadata(parent)
    name = Path(report.get("out") or folder).name  # written in a temporary folder renamed to "out"
    model_type = facts.config.get("model_type")
    data = ModelCardData(
        model_name=name,
        base_model=base_model_of(spec),
        license=parent_meta.get("license"),
        library_name="transformers",
        pipeline_tag="text-generation",
        language=parent_meta.get("language"),
        tags=[*TAGS, *([model_type] if model_type else []), *([f"domain:{domain}"] if domain else [])],
    )
    method = meta.get("method") or "an unrecorded method"
    subset_file = meta.get("subset_file")
    chosen_on = (
        f" on {domain} text (`{calibration['data']}`: {calibration.get('documents', '?')} documents, "
        f"{calibration.get('tokens', '?')} tokens)" if calibration.get("data") else ""
    )  # fmt: skip
    copied = sorted(
        p.name for p in folder.iterdir()
        if p.is_file() and (p.suffix in (".jsonl", ".png") or p.name.startswith("moectl_train"))
    )  # fmt: skip
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {data.model_name}",
        "",
        f"An expert subset{f' for {domain}' if domain else ''} of **{spec}**: every MoE layer keeps {kept}{of} "
        f"routed experts, chosen by the `{method}` method{chosen_on} (EMO §4.2). "
        f"Architecture {model_type}: {facts.num_experts} routed experts per MoE layer, top-{facts.top_k}; "
        f"{facts.parameters:,} parameters ({facts.active_parameters:,} active per token), weights in {facts.dtype}. "
        "Plain `transformers` loads it (no moectl needed).",
        "",
        "Nothing was trained: the other experts' weights and router rows were cut out of the parent, so this model's "
        "outputs equal the parent's routed under the subset's expert mask (`moectl.ExpertMask(keep, "
        'renorm="pruned")`: softmax over the kept experts, then the parent\'s top-k).',
        "",
        "## Size",
        "",
        "| | parent | subset | subset / parent |",
        "|---|---:|---:|---:|",
        *_size_rows(report),
        "",
        "## Experts kept per MoE layer",
        "",
        "Expert ids are the parent's; in this checkpoint they are renumbered 0.."
        f"{kept - 1} in this order.",
        "",
        "| MoE layer | kept experts (parent's ids) |",
        "|---:|---|",
        *[f"| {layer} | {' '.join(map(str, ids))} |" for layer, ids in sorted(keep.items())],
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        "```",
        "",
        "## Provenance",
        "",
        f"- parent model: `{spec}`" + (" (its own card describes its training data and licence)" if parent_meta else ""),
        f"- subset file: `{subset_file}`" if subset_file else "- subset file: not recorded",
        f"- selection: `{method}`" + (f", calibration `{calibration['data']}`" if calibration.get("data") else ""),
        "- `moectl_subset.json`: the kept experts, the subset's provenance and the size report, machine-readable",
        *([f"- copied from the parent folder, about the parent's training: {', '.join(f'`{c}`' for c in copied)}"]
          if copied else []),
        "",
        "Written by `moectl subset export`.",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def write_subset_card(folder: str | Path, meta: dict[str, Any], parent: str | Path | None = None) -> Path:
    """Write ``folder/README.md`` for the subset exported there (``meta``: its moectl_subset.json),
    replacing a card copied from the parent folder ``parent``."""
    folder = Path(folder)
    parent = Path(parent).expanduser() if parent is not None and Path(parent).expanduser().is_dir() else None
    return write_text_atomic(folder / CARD, subset_card_text(folder, meta, parent))
