"""A Hugging Face model card (README.md with YAML front matter) for a model moectl pretrained.

Every figure on the card is read from files, none typed in:

- the run folder (``moectl pretrain --out RUN``): ``config.json`` (objective, preset, schedule),
  ``log.jsonl`` (tokens trained, throughput, validation losses along the way, and the final
  evaluation row: the whole validation split, per domain) and ``loss_curve.png``;
- the model folder: ``config.json`` (architecture) and the safetensors headers (parameter counts);
- the corpus the run trained on (``config.json``'s ``corpus``, or ``corpus=``): ``stats.json``'s
  per-source table (packages, versions, licences, documents, tokens), or else the ``source`` and
  ``licence`` recorded on every document of its train split;
- optionally ``benchmarks/effective_experts.py --json`` (effective experts per document, per MoE
  layer) and ``moectl eval --json`` results (``moectl.eval.results/1``).

The front matter follows the Hub's model card metadata (``huggingface_hub.ModelCardData``):
``license``, ``library_name``, ``tags``, ``datasets`` (the corpus sources), ``language`` and a
``model-index`` with the measured metrics. :func:`write_card` also copies the training log and
the loss curve (and the effective-experts figure) beside the weights, so the card's links resolve.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError, FileFormatError, MoectlError, MoectlFileError
from moectl.io.atomic import atomic_path, write_text_atomic

CARD = "README.md"
LOG_NAME = "training_log.jsonl"
CONFIG_NAME = "moectl_train_config.json"
CURVE_NAME = "loss_curve.png"
EFFECTIVE_NAME = "effective_experts.png"
EVAL_SCHEMA = "moectl.eval.results/1"


@dataclass
class Run:
    """What a pretraining run folder says about itself."""

    path: Path
    config: dict[str, Any]
    train: list[dict[str, Any]]  # logged training steps
    evals: list[dict[str, Any]]  # logged steps with a (limited) validation loss
    final: dict[str, Any]  # the final evaluation (whole validation split)

    @property
    def tokens(self) -> int:
        return int(self.train[-1]["tokens"])

    @property
    def steps(self) -> int:
        return int(self.final.get("step", self.train[-1]["step"])) + 1

    @property
    def tokens_per_s(self) -> float | None:
        rates = [r["tokens_per_s"] for r in self.train if r.get("tokens_per_s")]
        return statistics.median(rates) if rates else None


def read_run(run: str | Path) -> Run:
    """Read a finished run folder; ValueError / FileNotFoundError naming what is missing."""
    run = Path(run)
    for name in ("config.json", "log.jsonl"):
        if not (run / name).is_file():
            raise MoectlFileError(f"--run {run}: no {name} there (not a `moectl pretrain` run folder)")
    config = _read_json(run / "config.json")
    rows = []
    for n, line in enumerate((run / "log.jsonl").read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise FileFormatError(f"{run / 'log.jsonl'}:{n}: not JSON ({err})") from None
    final = next((r for r in reversed(rows) if r.get("final")), None)
    train = [r for r in rows if "ce" in r and "tokens" in r and not r.get("final")]
    if final is None or "val_loss" not in final:
        raise ConfigError(
            f"--run {run}: log.jsonl has no final evaluation yet (a run logs one when it reaches "
            f"max_steps = {config.get('max_steps')}; last logged step {train[-1]['step'] if train else 'none'})"
        )
    if not train:
        raise ConfigError(f"--run {run}: log.jsonl has no training steps")
    return Run(run, config, train, [r for r in train if "val_loss" in r], final)


# -- the model ---------------------------------------------------------------------------------
@dataclass
class ModelFacts:
    config: dict[str, Any]
    parameters: int
    expert_parameters: int
    dtype: str
    num_experts: int
    top_k: int

    @property
    def active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts, plus top-k / E of those."""
        share = self.top_k / self.num_experts if self.num_experts else 1.0
        return round(self.parameters - self.expert_parameters * (1 - share))


def read_model(model_dir: str | Path) -> ModelFacts:
    """Architecture (config.json) and parameter counts (safetensors headers) of a model folder."""
    from moectl.io.safetensors_index import CheckpointIndex

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise MoectlFileError(f"{model_dir}: no config.json (give the folder of a saved model)")
    config = _read_json(model_dir / "config.json")
    entries = CheckpointIndex(model_dir).entries
    if not entries:
        raise FileFormatError(f"{model_dir}: no safetensors weights")
    total = sum(math.prod(e.shape) for e in entries.values())
    experts = sum(math.prod(e.shape) for k, e in entries.items() if ".experts." in k)
    dtypes = sorted({str(e.dtype).removeprefix("torch.") for e in entries.values()})
    e = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0
    return ModelFacts(
        config, total, experts, "/".join(dtypes), int(e), int(config.get("num_experts_per_tok") or 0)
    )


# -- the corpus --------------------------------------------------------------------------------
def corpus_sources(corpus: str | Path | None) -> tuple[list[dict[str, Any]], str]:
    """(one row per corpus source, where the rows were read from).

    Rows: ``name, domain, packages, versions, licence, documents, approx_tokens`` (None where the
    files do not say)."""
    if corpus is None:
        raise ConfigError("the run's config.json names no corpus; give the corpus folder (--corpus)")
    corpus = Path(corpus)
    stats = corpus / "stats.json"
    if stats.is_file():
        data = _read_json(stats)
        sources = (data.get("sources") if isinstance(data, dict) else None) or {}
        if sources:
            rows = [
                {"name": name, "domain": s.get("domain"), "packages": s.get("packages") or [],
                 "versions": s.get("versions") or [], "licence": s.get("licence"),
                 "documents": s.get("documents"), "approx_tokens": s.get("approx_tokens")}
                for name, s in sources.items()
            ]  # fmt: skip
            return rows, "the corpus's `stats.json`, written by `moectl corpus build`"
    from moectl.data.sample import iter_documents

    seen: dict[str, dict[str, Any]] = {}
    try:
        for doc in iter_documents(corpus, "train"):
            name = str(doc.get("source") or "unknown")
            row = seen.setdefault(name, {"name": name, "domain": doc.get("domain"), "packages": [], "versions": [],
                                         "licence": doc.get("licence"), "documents": 0, "approx_tokens": None})  # fmt: skip
            row["documents"] += 1
    except FileNotFoundError:
        raise MoectlFileError(
            f"{corpus}: neither a stats.json with sources nor a train split to read them from"
        ) from None
    return list(seen.values()), "the `source` and `licence` of every document of the corpus's train split"


# -- measured results ------------------------------------------------------------------------
def _read_json(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except ValueError as err:
        raise FileFormatError(f"{path}: not JSON ({err})") from None
    except OSError as err:  # a folder, no permission
        raise MoectlFileError(f"{path} cannot be read: {err.strerror or err}") from None


def read_effective_experts(path: str | Path, model_dir: Path) -> dict[str, Any]:
    """The result for ``model_dir`` in a ``benchmarks/effective_experts.py --json`` file (the only
    result when there is one; otherwise the one whose model path is this folder)."""
    data = _read_json(path)
    results = data.get("results") or [] if isinstance(data, dict) else []
    if not results or "layers" not in results[0]:
        raise FileFormatError(f"{path}: not an effective-experts result (benchmarks/effective_experts.py --json)")
    mine = [r for r in results if _same_path(r.get("model"), model_dir)]
    if len(results) == 1:
        mine = results
    if not mine:
        names = ", ".join(str(r.get("model")) for r in results)
        raise ConfigError(f"{path}: no result for {model_dir} (it has {names})")
    return {**mine[0], "documents": data.get("documents")}


def _same_path(spec: Any, folder: Path) -> bool:
    try:
        return spec is not None and Path(str(spec)).resolve() == folder.resolve()
    except OSError:
        return False


def read_eval(path: str | Path) -> dict[str, Any]:
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("schema") != EVAL_SCHEMA:
        raise FileFormatError(f"{path}: not a `moectl eval --json` result (schema {EVAL_SCHEMA})")
    return data


@dataclass
class Metric:
    task: str
    dataset: str
    split: str
    metric: str
    value: float
    ci95: list[float] | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def metrics_of(run: Run, effective: dict[str, Any] | None, evals: list[dict[str, Any]]) -> list[Metric]:
    """Every number the card reports in its model-index, each read from a file above."""
    out = [
        Metric("text-generation", "moectl corpus", "validation", "loss", run.final["val_loss"],
               name=f"validation cross-entropy (nats/token, full model, {_eval_scope(run.config)})"),
        Metric("text-generation", "moectl corpus", "validation", "perplexity", math.exp(run.final["val_loss"]),
               name="validation perplexity"),
    ]  # fmt: skip
    if effective is not None:
        for source, label in (("probs", "router probabilities"), ("chosen", "chosen experts")):
            out.append(Metric("text-generation", "moectl corpus", "validation", f"effective_experts_{source}",
                              effective["mean_over_layers"][source],
                              name=f"effective experts per document, mean over MoE layers ({label})"))  # fmt: skip
    for data in evals:
        for task, res in data.get("tasks", {}).items():
            for metric, m in res.get("metrics", {}).items():
                if metric == "tokens" or m.get("value") is None:
                    continue
                out.append(Metric("text-generation", task, str(res.get("split") or "test"), metric,
                                  float(m["value"]), m.get("ci95"), name=f"{task} {metric}"))  # fmt: skip
    return out


# -- the card ------------------------------------------------------------------------------------
def _eval_scope(config: dict[str, Any]) -> str:
    """What the final evaluation covered (the loop's ``final_eval_batches``: 0 = the whole split)."""
    batches = config.get("final_eval_batches") or 0
    return f"{batches} batches of the validation split" if batches else "the whole validation split"


def package_license() -> str:
    """moectl's own licence, lower-cased for a card's ``license:`` (``other`` if unknown)."""
    try:
        text = metadata.metadata("moectl").get("License") or "other"
    except metadata.PackageNotFoundError:
        text = "other"
    return text.lower()


def _languages(domains: list[str]) -> list[str]:
    """Two-letter domains are languages (de, fr, es); the other domains' text is English."""
    langs = sorted({d for d in domains if len(d) == 2})
    return ["en", *[d for d in langs if d != "en"]] if any(len(d) != 2 for d in domains) else langs


def _n(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:g}"


def card_text(
    model_dir: Path,
    run: Run,
    model: ModelFacts,
    sources: tuple[list[dict[str, Any]], str],
    effective: dict[str, Any] | None,
    evals: list[dict[str, Any]],
    name: str,
    license: str,
    files: dict[str, str],
) -> str:
    from huggingface_hub import EvalResult, ModelCardData

    rows, sources_from = sources
    c, cfg = model.config, run.config
    metrics = metrics_of(run, effective, evals)
    domains = sorted(run.final.get("val_loss_per_domain", {}))
    data = ModelCardData(
        model_name=name,
        license=license,
        library_name="transformers",
        pipeline_tag="text-generation",
        language=_languages(domains) or None,
        datasets=[r["name"] for r in rows],
        tags=[
            "moectl",
            "mixture-of-experts",
            c.get("model_type", "moe"),
            "emo" if cfg.get("objective") == "emo" else "standard-moe",
        ],
        eval_results=[
            EvalResult(
                task_type=m.task,
                dataset_type="moectl-corpus" if m.dataset == "moectl corpus" else m.dataset,
                dataset_name=m.dataset,
                dataset_split=m.split,
                metric_type=m.metric,
                metric_value=round(m.value, 6),
                metric_name=m.name,
            )
            for m in metrics
        ],
    )
    objective = (
        "EMO's document-pool objective (routing restricted per document to a pool of its top-d experts)"
        if cfg.get("objective") == "emo" else "the standard MoE objective"
    )  # fmt: skip
    e, k = model.num_experts, model.top_k
    shared = c.get("shared_expert_intermediate_size")
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {name}",
        "",
        f"A {c.get('model_type')} mixture-of-experts language model ({c.get('num_hidden_layers')} layers, hidden "
        f"{c.get('hidden_size')}, {e} routed experts, top-{k}"
        + (", one shared expert" if shared else "")
        + f", vocabulary {c.get('vocab_size')}) pretrained by moectl with {objective} on "
        f"{run.tokens:,} tokens ({run.steps:,} steps) of moectl's offline multi-domain corpus. "
        f"{_n(model.parameters)} parameters, {_n(model.active_parameters)} active per token; weights in {model.dtype}.",
        "",
        "## Results",
        "",
        f"Validation cross-entropy of the full model on {_eval_scope(cfg)}: **{run.final['val_loss']:.4f} "
        f"nats/token** (perplexity {math.exp(run.final['val_loss']):.1f}, {run.final.get('val_tokens', 0):,} tokens).",
        "",
        "| domain | validation loss | perplexity |",
        "|---|---:|---:|",
        *[f"| {d} | {v:.4f} | {math.exp(v):.1f} |" for d, v in sorted(run.final.get("val_loss_per_domain", {}).items())],
        "",
    ]  # fmt: skip
    if effective is not None:
        docs = effective.get("documents") or {}
        lines += [
            "### Effective experts per document",
            "",
            f"exp of the entropy of a document's mean routing distribution, per MoE layer, over {sum(docs.values())} "
            f"validation documents ({len(docs)} domains): {e} for a router that has not learned to route, {k} when a "
            "document keeps to top-k experts. Mean over documents"
            + (" [95% interval]." if next(iter(effective["layers"].values()))["probs"].get("ci95") else "."),
            "",
            "| MoE layer | router probabilities | chosen experts |",
            "|---:|---:|---:|",
        ]

        def cell(v: dict[str, Any]) -> str:
            ci = v.get("ci95")
            return f"{v['mean']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")

        for layer in sorted(effective["layers"], key=int):
            row = effective["layers"][layer]
            lines.append(f"| {layer} | {cell(row['probs'])} | {cell(row['chosen'])} |")
        mean = effective["mean_over_layers"]
        lines += [f"| mean | {mean['probs']:.2f} | {mean['chosen']:.2f} |", ""]
        if "effective" in files:
            lines += [f"![effective experts per document]({files['effective']})", ""]
    for data_eval in evals:
        lines += [f"### Evaluation (`moectl eval`, {data_eval.get('created', '')})", "",
                  "| task | split | metric | value | 95% interval |", "|---|---|---|---:|---|"]  # fmt: skip
        for task, res in data_eval.get("tasks", {}).items():
            for metric, m in res.get("metrics", {}).items():
                if metric == "tokens" or m.get("value") is None:
                    continue
                ci = m.get("ci95")
                interval = f"[{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""
                lines.append(
                    f"| {task} | {res.get('split', '')} | {metric} | {m['value']:.4g} | {interval} |"
                )
        lines.append("")
    rate = run.tokens_per_s
    lines += [
        "## Training",
        "",
        f"`moectl pretrain` run `{run.path.name}`: objective `{cfg.get('objective')}`, preset `{cfg.get('preset')}`, "
        f"{run.steps:,} steps of {cfg.get('micro_batch')} × {cfg.get('grad_accum', 1)} (micro-batch × accumulation) "
        f"sequences of {cfg.get('seq_len')} tokens, AdamW (lr {cfg.get('lr')}, betas {cfg.get('betas')}, weight decay {cfg.get('weight_decay')}), "
        f"{cfg.get('warmup_steps')} warmup steps then cosine decay to {cfg.get('min_lr_ratio')} × lr, "
        f"load-balancing loss × {cfg.get('lb_coef')} ({cfg.get('lb_scope')}"
        + (f", expert counts pooled over the previous {cfg['lb_window']} steps" if cfg.get("lb_window") else "")
        + f"), router z-loss × {cfg.get('z_coef')}, "
        f"{'bf16 autocast' if cfg.get('bf16') else 'float32'}, seed {cfg.get('seed')}."
        + (f" Median throughput {rate:,.0f} tokens/s." if rate else ""),
        "",
    ]  # fmt: skip
    if run.evals:
        lines += ["| step | tokens | train CE | validation loss |", "|---:|---:|---:|---:|"]
        lines += [
            f"| {r['step'] + 1:,} | {r['tokens']:,} | {r['ce']:.4f} | {r['val_loss']:.4f} |"
            for r in run.evals
        ]
        lines += [
            f"| {run.steps:,} (final) | {run.tokens:,} | {run.train[-1]['ce']:.4f} | {run.final['val_loss']:.4f} |",
            "",
        ]
    if "log" in files:
        lines += [f"Training log (one JSON line per logged step, the final evaluation last): [`{files['log']}`]({files['log']}); "
                  f"the run's configuration: [`{files['config']}`]({files['config']}).", ""]  # fmt: skip
    if "curve" in files:
        lines += [f"![training and validation loss]({files['curve']})", ""]
    lines += [
        "Retrain (the corpus first: `moectl corpus build --out data/corpus`):",
        "",
        "```",
        f"moectl pretrain --objective {cfg.get('objective')} --preset {cfg.get('preset')} --corpus CORPUS --out RUN "
        f"--max-steps {cfg.get('max_steps')} --warmup-steps {cfg.get('warmup_steps')} --micro-batch {cfg.get('micro_batch')} "
        f"--seq-len {cfg.get('seq_len')} --seed {cfg.get('seed')}"
        + (f" --lb-window {cfg['lb_window']}" if cfg.get("lb_window") else ""),
        "```",
        "",
        "## Training data",
        "",
        f"moectl's offline corpus: {len(rows)} sources in {len({r['domain'] for r in rows})} domains, each text "
        f"under its own licence (read from {sources_from}). The model's `license` above is moectl's; the "
        "texts keep theirs, some of them copyleft — check them before you redistribute outputs or derivatives.",
        "",
        "| source | domain | package (version) | licence | documents | ≈ tokens |",
        "|---|---|---|---|---:|---:|",
    ]  # fmt: skip
    for r in rows:
        pkgs = ", ".join(f"{p} ({v})" if v else p for p, v in zip(r["packages"], r["versions"] or [None] * len(r["packages"]), strict=False))  # fmt: skip
        docs = f"{r['documents']:,}" if r["documents"] is not None else ""
        toks = f"{r['approx_tokens']:,}" if r["approx_tokens"] is not None else ""
        lines.append(f"| {r['name']} | {r['domain']} | {pkgs} | {r['licence']} | {docs} | {toks} |")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{model_dir.as_posix()}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{model_dir.as_posix()}")',
        "```",
        "",
        f"or as `MODEL` in any moectl verb (`moectl eval {model_dir.as_posix()} ...`).",
        "",
        "## Limitations",
        "",
        f"A research model for measuring routing methods (EMO subsets, TE-MoE controllers, RoE ensembles) at small "
        f"scale: {_n(model.parameters)} parameters trained on {_n(run.tokens)} tokens of documentation, code, "
        "prose and reference text. It is not instruction-tuned and its text is not reliable.",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def write_card(
    model_dir: str | Path,
    run: str | Path,
    *,
    effective_experts: str | Path | None = None,
    effective_plot: str | Path | None = None,
    evals: list[str | Path] = (),
    corpus: str | Path | None = None,
    name: str | None = None,
    license: str | None = None,
    copy_files: bool = True,
) -> dict[str, Any]:
    """Write ``model_dir/README.md`` (and copy the log and curves beside it); returns what was written.

    Everything is read and checked first; nothing is written when an input is missing or malformed.
    """
    model_dir = Path(model_dir)
    facts = read_run(run)
    model = read_model(model_dir)
    sources = corpus_sources(corpus if corpus is not None else facts.config.get("corpus"))
    effective = read_effective_experts(effective_experts, model_dir) if effective_experts else None
    results = [read_eval(p) for p in evals]
    copies = {
        "log": (facts.path / "log.jsonl", LOG_NAME),
        "config": (facts.path / "config.json", CONFIG_NAME),
    }
    if (facts.path / "loss_curve.png").is_file():
        copies["curve"] = (facts.path / "loss_curve.png", CURVE_NAME)
    if effective_plot is not None:
        if not Path(effective_plot).is_file():
            raise MoectlFileError(f"{effective_plot}: no such figure")
        copies["effective"] = (Path(effective_plot), EFFECTIVE_NAME)
    files = {key: target for key, (_, target) in copies.items()} if copy_files else {}
    try:  # the fields of the log and the results files, read here: a missing or mistyped one is theirs
        text = card_text(model_dir, facts, model, sources, effective, results, name or model_dir.name,
                         license or package_license(), files)  # fmt: skip
        metrics = [m.__dict__ for m in metrics_of(facts, effective, results)]
    except (KeyError, ValueError) as err:
        if isinstance(err, MoectlError):
            raise
        raise FileFormatError(
            f"a field of --run's log.jsonl, --effective-experts or --eval is missing or malformed: {err!r}"
        ) from err
    written = []
    if copy_files:
        for source, target in copies.values():
            with atomic_path(model_dir / target) as tmp:
                shutil.copyfile(source, tmp)
            written.append(str(model_dir / target))
    written.append(str(write_text_atomic(model_dir / CARD, text)))
    return {
        "card": str(model_dir / CARD),
        "written": written,
        "metrics": metrics,
        "sources_from": sources[1],
    }
