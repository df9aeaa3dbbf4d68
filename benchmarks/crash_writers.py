"""The writers that ``benchmarks/crash_sweep.py`` kills mid-write, and how each one's result is read.

Each writer works in the current folder (the sweep runs it inside a fresh copy of its template):
pretraining (a whole run, resumed after the kill), one pretraining checkpoint written over another,
options training, subset export (in memory and streamed), GGUF export, tokenizer and corpus-sample
builds, RoE tau profiles / subset files / JSON results, a model card, RoE tuning (SQLite study) and an evaluation-set import.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIMING_KEYS = ("tokens_per_s", "seconds", "elapsed", "wall")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_of(root: Path, paths: list[str]) -> dict[str, str]:
    """``relative path -> sha256`` of every file at or under ``paths`` (inside ``root``), leaving out
    dot-named temporaries (``.tmp-*``, ``.NAME.*.tmp``: removed by the next write, never read)."""
    out: dict[str, str] = {}
    for rel in paths:
        path = root / rel
        found = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        for f in found:
            parts = f.relative_to(root).parts
            if f.is_file() and not any(p.startswith(".") for p in parts):
                out["/".join(parts)] = sha(f)
    return out


def log_figures(path: Path) -> list[dict[str, Any]]:
    """A run's log records without wall-clock timings (what must repeat bit for bit)."""
    from moectl.train.runlog import read_log

    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING_KEYS)} for r in read_log(path)]


@dataclass
class Writer:
    """One writer under test. Paths are relative to the working folder (the child runs inside it).

    ``setup`` makes the source and the destination's old state; ``write`` is the write that is killed;
    ``view`` the destination as a reader sees it; ``source`` the paths never to be modified;
    ``resume`` (training runs) finishes an interrupted run, and ``result`` is what it must equal;
    ``per_file``: each file of the view must be old or new on its own (writers of several independent
    files, each atomic)."""

    name: str
    setup: Callable[[], None]
    write: Callable[[], None]
    view: Callable[[], dict[str, str]]
    source: list[str] = field(default_factory=list)
    resume: Callable[[], None] | None = None
    result: Callable[[], Any] | None = None
    per_file: bool = False


# -- the writers -------------------------------------------------------------------------------------
MICRO = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "intermediate_size": 64,
}  # fmt: skip


def _small_corpus(out: Path, per_domain: int = 6) -> None:
    from moectl.data.sample import load_sample_corpus

    out.mkdir(parents=True, exist_ok=True)
    for split, docs in load_sample_corpus().items():
        keep, seen = [], {}
        for doc in docs:
            if seen.get(doc["domain"], 0) < (per_domain if split == "train" else 2):
                seen[doc["domain"]] = seen.get(doc["domain"], 0) + 1
                keep.append({**doc, "text": doc["text"][:3000]})
        (out / f"{split}.jsonl").write_text("\n".join(json.dumps(d) for d in keep))


def _train_config():
    from moectl.train.train_config import TrainConfig

    return TrainConfig(
        out="run", corpus="corpus", seq_len=64, micro_batch=2, max_steps=6, warmup_steps=1,
        checkpoint_every=3, log_every=1, model=MICRO, final_eval_batches=1, eval_every=3, eval_batches=1,
    )  # fmt: skip


def pretrain_writer() -> Writer:
    from moectl.train.loop import pretrain

    def result() -> Any:
        return {
            "final": files_of(Path("."), ["run/final/model.safetensors"]),
            "checkpoint": files_of(Path("."), ["run/checkpoints/step-000005/model.safetensors"]),
            "log": log_figures(Path("run/log.jsonl")),
        }

    return Writer(
        "pretrain",
        setup=lambda: _small_corpus(Path("corpus")),
        write=lambda: pretrain(_train_config(), progress=False),
        view=lambda: {},  # a run in progress has many states: judged by its resumption
        source=["corpus"],
        resume=lambda: pretrain(_train_config(), resume=True, progress=False),
        result=result,
    )


def pretrain_checkpoint_writer() -> Writer:
    """One checkpoint written over a run that has one: ``latest`` resolves to the old or the new."""
    import torch

    from moectl.train.checkpoint import latest_in, save_checkpoint

    def save(step: int, seed: int) -> None:
        from moectl.train.model import build_model

        model = build_model(
            _train_config().model_kwargs(),
            300,
            {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2},
            seed,
        )
        save_checkpoint(Path("run"), step, model, None, {"optimizer": {"seed": torch.tensor(seed)}}, keep=1)

    def view() -> dict[str, str]:
        path = latest_in(Path("run/checkpoints"))
        return {"latest": path.name, **files_of(Path("."), [str(path)])} if path else {}

    return Writer("pretrain-checkpoint", setup=lambda: save(2, 0), write=lambda: save(2, 1), view=view)


PROMPTS = ["The capital of France is", "One plus one is", "Water boils at"]


def options_writer() -> Writer:
    def train() -> None:
        from moectl.models.load import load_model
        from moectl.options.trainer import OptionsConfig, train_options

        cfg = OptionsConfig(
            k_hat=4, eta=0.5, steps=3, batch_size=3, max_new_tokens=4, save_every=1, lora_r=2, lora_alpha=2
        )
        model, tok = load_model("tiny:qwen2_moe")
        train_options(model, tok, PROMPTS, cfg, "opts", progress=False)

    def result() -> Any:
        return {"final": files_of(Path("."), ["opts/final"]), "log": log_figures(Path("opts/log.jsonl"))}

    return Writer(
        "options-train", setup=lambda: None, write=train, view=lambda: {}, resume=train, result=result
    )


def _saved_source() -> dict[int, list[int]]:
    import moectl

    model = moectl.tiny("olmoe")
    model.save_pretrained("src")
    return {layer.index: [0, 2] for layer in moectl.inspect(model).layers}


KEEP: dict[int, list[int]] = {}


def subset_export_writer(streamed: bool) -> Writer:
    def setup() -> None:
        KEEP.update(_saved_source())
        Path("keep.json").write_text(json.dumps(KEEP))

    def write() -> None:
        keep = {int(k): v for k, v in json.loads(Path("keep.json").read_text()).items()}
        if streamed:
            from moectl.subsets.export_stream import export_checkpoint_subset

            export_checkpoint_subset("src", keep, "out")
        else:
            from transformers import AutoModelForCausalLM

            from moectl.subsets.export import export_subset

            export_subset(AutoModelForCausalLM.from_pretrained("src"), keep, "out", source="src")

    name = "subset-export-stream" if streamed else "subset-export"
    return Writer(name, setup=setup, write=write, view=lambda: files_of(Path("."), ["out"]), source=["src"])


def gguf_writer() -> Writer:
    def setup() -> None:
        import moectl
        from moectl.data.tokenizer_train import default_tokenizer_dir

        model = moectl.tiny("qwen2_moe", vocab_size=8192, tie_word_embeddings=True)  # the bundled tokenizer's
        model.save_pretrained("m")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_tokenizer_dir() / name, Path("m") / name)
        Path("m.gguf").write_bytes(b"an older export")

    def write() -> None:
        from moectl.export import write_gguf

        write_gguf("m", "m.gguf", overwrite=True)

    return Writer(
        "gguf", setup=setup, write=write, view=lambda: files_of(Path("."), ["m.gguf"]), source=["m"]
    )


def tokenizer_writer() -> Writer:
    from moectl.data.tokenizer_train import train_tokenizer

    def setup() -> None:
        _small_corpus(Path("corpus"))
        train_tokenizer("corpus", 600, "tok")

    return Writer(
        "tokenizer-build",
        setup=setup,
        write=lambda: train_tokenizer("corpus", 800, "tok"),
        view=lambda: files_of(Path("."), ["tok"]),
        source=["corpus"],
    )


def corpus_sample_writer() -> Writer:
    from moectl.data.sample import subsample_corpus

    budget = {"train": 4000, "validation": 1000, "test": 1000}

    def setup() -> None:
        _small_corpus(Path("corpus"))
        (Path("corpus") / "test.jsonl").write_text((Path("corpus") / "validation.jsonl").read_text())
        subsample_corpus("corpus", "sample", {k: v // 2 for k, v in budget.items()})

    return Writer(
        "corpus-sample",
        setup=setup,
        write=lambda: subsample_corpus("corpus", "sample", budget),
        view=lambda: files_of(Path("."), ["sample"]),
        source=["corpus"],
    )


def small_files_writer() -> Writer:
    """RoE tau profiles, subset files, eval-style JSON results: one file each, replaced."""
    from moectl.ensemble.roe_config import save_profile
    from moectl.io.atomic import write_text_atomic
    from moectl.subsets.files import save_subset

    def save(version: int) -> None:
        save_profile("tau.json", [1.0 + version, 0.5], k=4)
        save_subset("s.json", {0: [version, 3]}, model="tiny:olmoe")
        write_text_atomic("results.json", json.dumps({"version": version}))

    return Writer(
        "small-files",
        setup=lambda: save(0),
        write=lambda: save(1),
        view=lambda: files_of(Path("."), ["tau.json", "s.json", "results.json"]),
        per_file=True,
    )


def model_card_writer() -> Writer:
    from moectl.reporting.model_card import write_card
    from moectl.train.loop import pretrain

    def setup() -> None:
        _small_corpus(Path("corpus"))
        pretrain(_train_config(), progress=False)

    return Writer(
        "model-card",
        setup=setup,
        write=lambda: write_card("run/final", "run", corpus="corpus"),
        view=lambda: files_of(Path("."), ["run/final"]),
        source=["run/log.jsonl", "run/config.json", "run/checkpoints"],
        per_file=True,
    )


def roe_tune_writer() -> Writer:
    """RoE tau tuning into an SQLite study (Optuna commits each trial), then the profile and plots. A
    rerun resumes the study (by design with reseeded proposals, so its tau need not equal an
    uninterrupted run's): what must hold is a study that loads, the full budget of finished trials
    after the rerun, and a profile that is the old file or the new one."""
    trials = 4

    def tune_once() -> None:
        import moectl
        from moectl.roe.tune import tune

        model, tokenizer, _ = moectl.load("tiny:olmoe")
        tune(
            model, tokenizer, "val.jsonl", K=2, trials=trials, storage="study.db", out="tau.json",
            plot_dir="plots", batch_size=4, max_length=32, progress=False, model_name="tiny:olmoe",
        )  # fmt: skip

    def setup() -> None:
        lines = [
            json.dumps({"text": f"Document {i}: the quick brown fox jumps over the lazy dog."})
            for i in range(6)
        ]
        Path("val.jsonl").write_text("\n".join(lines) + "\n")

    def view() -> dict[str, str]:
        if not Path("tau.json").is_file():
            return {}
        profile = json.loads(Path("tau.json").read_text())
        kept = {k: v for k, v in profile.items() if k != "history"}  # history holds wall-clock seconds
        return {"tau.json": json.dumps(kept, sort_keys=True)}

    def result() -> Any:
        import optuna

        summaries = optuna.get_all_study_summaries("sqlite:///study.db")
        done = sum(
            t.state == optuna.trial.TrialState.COMPLETE
            for s in summaries
            for t in optuna.load_study(study_name=s.study_name, storage="sqlite:///study.db").trials
        )
        return {"complete_trials": done >= trials, "profile": Path("tau.json").is_file()}

    return Writer(
        "roe-tune",
        setup=setup,
        write=tune_once,
        view=view,
        source=["val.jsonl"],
        resume=tune_once,
        result=result,
    )


def _pro_rows(split: str, per_category: int) -> list[dict]:
    """MMLU-Pro-shaped rows (the user-supplied evaluation set moectl imports from files)."""
    rows = []
    for cat in ("biology", "math"):
        for k in range(per_category):
            i = len(rows)
            options = [f"option {j} of {i}" for j in range(4)]
            rows.append({
                "question_id": 1000 * (split == "validation") + i, "question": f"[{cat}] {split} {k}?",
                "options": options, "answer": "ABCD"[i % 4], "answer_index": i % 4,
                "cot_content": "" if split == "test" else f"A: ({'ABCD'[i % 4]})", "category": cat,
                "src": f"ori_mmlu-{cat}",
            })  # fmt: skip
    return rows


def eval_set_cache_writer() -> Writer:
    """An evaluation set imported over an older copy: the set's folder is swapped in whole, the
    manifest replaced after it (each file old or new; the two are separate files)."""
    from moectl.eval.set_fetch import fetch_evals

    def files(tag: str, per_category: int) -> list[str]:
        out = []
        for split in ("test", "validation"):
            path = Path(f"{tag}-{split}.jsonl")
            path.write_text("".join(json.dumps(r) + "\n" for r in _pro_rows(split, per_category)))
            out.append(str(path))
        return out

    def setup() -> None:
        files("new", 3)
        fetch_evals("evals", files={"mmlu_pro": files("old", 2)}, progress=False)

    def view() -> dict[str, str]:
        found = files_of(Path("."), ["evals/mmlu_pro"])
        manifest = Path("evals/manifest.json")
        if manifest.is_file():  # the user files' absolute paths differ between working folders
            text = json.dumps(_without(json.loads(manifest.read_text()), "file"), sort_keys=True)
            found["evals/manifest.json"] = hashlib.sha256(text.encode()).hexdigest()
        return found

    def write() -> None:
        new = ["new-test.jsonl", "new-validation.jsonl"]
        fetch_evals("evals", files={"mmlu_pro": new}, progress=False)

    return Writer(
        "eval-set-cache", setup=setup, write=write, view=view,
        source=["new-test.jsonl", "new-validation.jsonl"], per_file=True,
    )  # fmt: skip


def _without(data: Any, key: str) -> Any:
    if isinstance(data, dict):
        return {k: _without(v, key) for k, v in data.items() if k != key}
    if isinstance(data, list):
        return [_without(v, key) for v in data]
    return data


WRITERS: dict[str, Callable[[], Writer]] = {
    "pretrain": pretrain_writer,
    "pretrain-checkpoint": pretrain_checkpoint_writer,
    "options-train": options_writer,
    "subset-export": lambda: subset_export_writer(False),
    "subset-export-stream": lambda: subset_export_writer(True),
    "gguf": gguf_writer,
    "tokenizer-build": tokenizer_writer,
    "corpus-sample": corpus_sample_writer,
    "small-files": small_files_writer,
    "model-card": model_card_writer,
    "roe-tune": roe_tune_writer,
    "eval-set-cache": eval_set_cache_writer,
}
