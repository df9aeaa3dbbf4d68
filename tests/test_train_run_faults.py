"""Issue #29, a training run folder: the packed-data cache keyed by its inputs, no pickled code run on
resume, a ``latest`` naming a lost folder, torn log lines, durable (synced) atomic writes."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import moectl.io.atomic as atomic
from moectl.train.checkpoint import latest_in, load_trainer_state
from moectl.train.loop import Trainer, load_tokenizer, pretrain, truncate_log
from moectl.train.packing import load_or_pack
from moectl.train.train_config import TrainConfig
from test_train import MICRO_MODEL

SRC = Path(__file__).resolve().parents[1] / "src" / "moectl"


def _config(out, corpus, **kw):
    values = dict(
        out=str(out), corpus=str(corpus), seq_len=64, micro_batch=2, max_steps=6, warmup_steps=1,
        checkpoint_every=3, log_every=1, model=MICRO_MODEL, final_eval_batches=1,
    )  # fmt: skip
    return TrainConfig(**{**values, **kw})


class _Planted:
    """A pickle that creates a file when unpickled: what a shared run folder could hide."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


# -- 2: the packed-data cache -------------------------------------------------------------------------
def test_the_packed_cache_is_rebuilt_for_another_seq_len_or_corpus(tmp_path, corpus):
    tokenizer = load_tokenizer(None)
    cache = tmp_path / "data" / "train.pt"
    assert load_or_pack(cache, corpus, "train", tokenizer, 64).ids.shape[1] == 64
    assert load_or_pack(cache, corpus, "train", tokenizer, 32).ids.shape[1] == 32  # was 64: reused
    other = tmp_path / "other"
    other.mkdir()
    docs = [json.loads(x) for x in (Path(corpus) / "train.jsonl").read_text().splitlines()][:3]
    (other / "train.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    rebuilt = load_or_pack(cache, other, "train", tokenizer, 32)
    assert rebuilt.rows < load_or_pack(tmp_path / "fresh.pt", corpus, "train", tokenizer, 32).rows


def test_overwrite_clears_the_packed_cache(tmp_path, corpus):
    stale = tmp_path / "run" / "data" / "stale.pt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    Trainer(_config(tmp_path / "run", corpus, max_steps=1), progress=False, overwrite=True)
    assert not stale.exists()


# -- 5: no code runs from a shared run folder ---------------------------------------------------------
def test_a_trainer_state_holding_a_pickled_call_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"step": 1, "rng": _Planted(marker)}, tmp_path / "trainer_state.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_trainer_state(tmp_path)
    assert not marker.exists()


def test_a_packed_cache_holding_a_pickled_call_is_rebuilt_not_run(tmp_path, corpus):
    tokenizer = load_tokenizer(None)
    marker = tmp_path / "ran"
    cache = tmp_path / "train.pt"
    torch.save({"ids": _Planted(marker)}, cache)
    assert load_or_pack(cache, corpus, "train", tokenizer, 64).ids.shape[1] == 64
    assert not marker.exists()


def test_every_torch_load_in_the_package_refuses_pickled_code():
    """Every ``torch.load`` call under src/ passes ``weights_only=True`` (tensors and plain containers)."""
    calls, unsafe = 0, []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            func = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "load"
                and getattr(func.value, "id", "") == "torch"
            ):
                calls += 1
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                if not safe:
                    unsafe.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert calls >= 3
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


# -- 9: `latest` naming a lost folder ------------------------------------------------------------------
def test_resume_falls_back_to_the_newest_complete_checkpoint_and_keeps_the_log(tmp_path, corpus):
    run = tmp_path / "run"
    pretrain(_config(run, corpus), progress=False)  # checkpoints at steps 2 and 5
    shutil.rmtree(run / "checkpoints" / "step-000005")  # `latest` still names it
    with pytest.warns(UserWarning, match="step-000002"):
        trainer = Trainer(_config(run, corpus), resume=True, progress=False)
    assert trainer.start_step == 3  # was 0: a silent restart
    steps = [json.loads(x)["step"] for x in (run / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # was: the log deleted


def test_resume_with_no_usable_checkpoint_says_so(tmp_path, corpus):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-000005")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        Trainer(_config(run, corpus), resume=True, progress=False)


def test_latest_in_finds_a_complete_step_folder_without_a_pointer(tmp_path):
    (tmp_path / "step-000004").mkdir()
    (tmp_path / "step-000004" / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "step-000007").mkdir()  # cut short: no trainer_state.pt
    assert latest_in(tmp_path) == tmp_path / "step-000004"


# -- 10: torn logs, synced writes ----------------------------------------------------------------------
def test_a_torn_last_log_line_is_dropped_with_a_warning(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 0}) + "\n" + json.dumps({"step": 1}) + "\n" + '{"step": 2, "ce')
    with pytest.warns(UserWarning, match="cut short"):
        truncate_log(log, 5)  # was: a bare JSONDecodeError
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [0, 1]
    log.write_text('{"st\n' + json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        truncate_log(log, 5)


def test_atomic_writes_sync_the_file_and_its_folder(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    atomic.write_text_atomic(tmp_path / "a.json", "{}")
    assert any(Path(p).name.startswith(".a.json.") for p in synced)  # the file, before its rename
    assert str(tmp_path) in synced  # the folder, after it
    synced.clear()
    with atomic.atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "w.bin").write_bytes(b"1")
    assert any(p.endswith("w.bin") for p in synced) and str(tmp_path) in synced


def test_atomic_dir_keeps_the_old_folder_when_the_new_one_fails(tmp_path):
    final = tmp_path / "final"
    with atomic.atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError), atomic.atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_text("half")
        raise RuntimeError("killed mid-write")
    assert (final / "model.safetensors").read_text() == "old"
    with atomic.atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # nothing left beside it
    assert (final / "model.safetensors").read_text() == "new"


def test_config_json_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    TrainConfig(out="x").save(path)
    real = Path.write_text

    def half_then_full_disk(self, text, *args, **kw):
        real(self, text[: len(text) // 2], *args, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full_disk)
    with pytest.raises(OSError):
        TrainConfig(out="y").save(path)
    assert json.loads(path.read_text())["out"] == "x"


# -- found by the crash sweep (benchmarks/crash_sweep.py) ---------------------------------------------
def test_a_run_resumed_after_its_last_step_logs_the_same_final_record(tmp_path, corpus):
    """Killed while writing final/ (its last checkpoint complete): the resumed run has no step left to
    train, and its final record must still carry the last step's figures (was: ce, lb, z null)."""
    run = tmp_path / "run"
    pretrain(_config(run, corpus), progress=False)
    before = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()][-1]
    shutil.rmtree(run / "final")
    pretrain(_config(run, corpus), resume=True, progress=False)
    after = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()][-1]
    assert after["final"] and after["ce"] is not None
    drop = ("tokens_per_s",)
    assert {k: v for k, v in after.items() if k not in drop} == {
        k: v for k, v in before.items() if k not in drop
    }
    assert (run / "final" / "model.safetensors").is_file()


def test_options_training_restarted_before_its_first_checkpoint_starts_a_new_log(tmp_path):
    """Killed after logging step 1 but before its checkpoint: the rerun starts at step 1 again, and its
    log must not keep the first attempt's step 1 (was: steps 1, 1, 2)."""
    from moectl.models.load import load_model
    from moectl.options.trainer import OptionsConfig, train_options

    cfg = OptionsConfig(
        k_hat=4, eta=0.5, steps=2, batch_size=3, max_new_tokens=2, save_every=100, lora_r=2, lora_alpha=2
    )
    prompts = ["The capital of France is", "One plus one is", "Water boils at"]
    model, tok = load_model("tiny:qwen2_moe")
    train_options(model, tok, prompts, cfg, tmp_path / "o", progress=False, stop_after=1)  # no checkpoint yet
    model, tok = load_model("tiny:qwen2_moe")
    result = train_options(model, tok, prompts, cfg, tmp_path / "o", progress=False)
    assert not result["resumed"]
    assert [json.loads(x)["step"] for x in (tmp_path / "o" / "log.jsonl").read_text().splitlines()] == [1, 2]


def test_plots_are_written_atomically(tmp_path, monkeypatch):
    """A plot redrawn after every checkpoint (loss_curve.png, curves.png) is the old one or the new,
    never a half-written PNG (was: savefig straight onto the target)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moectl.reporting.plots import plot_curves

    png = tmp_path / "loss_curve.png"
    plot_curves({"a": ([0, 1], [2.0, 1.0])}, png, xlabel="tokens", ylabel="loss")
    old = png.read_bytes()
    real = plt.Figure.savefig

    def torn(self, fname, *args, **kwargs):
        with open(fname, "wb") as fh:
            fh.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plt.Figure, "savefig", torn)
    with pytest.raises(OSError):
        plot_curves({"a": ([0, 1], [3.0, 1.0])}, png, xlabel="tokens", ylabel="loss")
    monkeypatch.setattr(plt.Figure, "savefig", real)
    assert png.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["loss_curve.png"]


def test_options_training_resumes_from_the_newest_complete_checkpoint_when_latest_is_lost(tmp_path):
    """The same fault in options training's checkpoints: ``latest`` names a folder that is gone."""
    from moectl.models.load import load_model
    from moectl.options.trainer import OptionsConfig, train_options

    cfg = OptionsConfig(
        k_hat=4, eta=0.5, steps=2, batch_size=3, max_new_tokens=2, save_every=1, lora_r=2, lora_alpha=2
    )
    prompts = ["The capital of France is", "One plus one is", "Water boils at"]
    model, tok = load_model("tiny:qwen2_moe")
    train_options(model, tok, prompts, cfg, tmp_path / "o", progress=False)  # keeps step-1 and step-2
    shutil.rmtree(tmp_path / "o" / "checkpoints" / "step-000002")
    model, tok = load_model("tiny:qwen2_moe")
    with pytest.warns(UserWarning, match="step-000001"):
        result = train_options(model, tok, prompts, cfg, tmp_path / "o", progress=False)
    assert result["resumed"]  # was: no checkpoint found (the run refused, or started afresh)
    steps = [json.loads(x)["step"] for x in (tmp_path / "o" / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
