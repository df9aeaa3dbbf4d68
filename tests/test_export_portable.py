"""Exports every loader reads (#43 item 6): a checkpoint moectl writes carries both spellings of
the expert count, ``rope_theta`` at the top level, ``torch_dtype`` beside ``dtype`` and a tokenizer
class transformers 4.x knows (``moectl.io.portable_config``), for each MoE family users serve, and
transformers 5 still loads it as before. Loading the files with transformers 4.x itself (a venv of
its own) is ``benchmarks/export_loaders.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

import moectl
from moectl.io.portable_config import make_portable, portable_config, portable_tokenizer_config
from moectl.subsets import export_subset
from moectl.subsets.export_stream import export_checkpoint_subset

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "models" / "moectl-small-standard"
SHIPPED = sorted(p for p in (ROOT / "models").iterdir() if (p / "config.json").is_file())
FAMILIES = ("olmoe", "qwen2_moe", "qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REFERENCE)


def _read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def _assert_portable(folder: Path, experts: int) -> None:
    config = _read(folder, "config.json")
    assert config["num_experts"] == config["num_local_experts"] == experts
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["torch_dtype"] == config["dtype"]
    assert _read(folder, "tokenizer_config.json")["tokenizer_class"] == "PreTrainedTokenizerFast"


def _keep(model) -> dict[int, list[int]]:
    return {layer.index: [0, 2, 5, 7] for layer in moectl.inspect(model).layers}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_subset_export_carries_both_spellings_and_a_known_tokenizer_class(family, tokenizer, tmp_path):
    model = moectl.tiny(family)
    export_subset(model, _keep(model), tmp_path / "out", tokenizer=tokenizer)
    _assert_portable(tmp_path / "out", 4)
    loaded = AutoConfig.from_pretrained(tmp_path / "out")  # transformers 5 reads it as it wrote it
    assert moectl.inspect(moectl.load(str(tmp_path / "out"), dtype="float32")[0]).num_experts == 4
    assert loaded.model_type == family
    again = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "The mixture of experts <|eos|> routes each token"
    assert again.encode(text) == tokenizer.encode(text)
    assert again.special_tokens_map == tokenizer.special_tokens_map


def test_a_streamed_export_patches_the_files_it_copies(tokenizer, tmp_path):
    model = moectl.tiny("qwen3_moe")
    model.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")  # as transformers 5 writes them: TokenizersBackend
    assert _read(tmp_path / "src", "tokenizer_config.json")["tokenizer_class"] == "TokenizersBackend"
    assert "num_experts" not in _read(tmp_path / "src", "config.json")
    export_checkpoint_subset(tmp_path / "src", _keep(model), tmp_path / "out")
    _assert_portable(tmp_path / "out", 4)


def test_training_checkpoints_and_shape_checkpoints_are_portable(tokenizer, tmp_path):
    from moectl.models.shapes import make_checkpoint
    from moectl.train.checkpoint import save_checkpoint

    saved = save_checkpoint(tmp_path / "run", 0, moectl.tiny("mixtral"), tokenizer, state={})
    _assert_portable(saved, 8)
    make_checkpoint("shape:olmoe-1b-7b@2~w64", tmp_path / "shape")
    config = _read(tmp_path / "shape", "config.json")
    assert config["num_experts"] == config["num_local_experts"] and config["rope_theta"] > 0


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_models_are_portable_and_load(folder, tmp_path):
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.png", "*.jsonl"))
    assert make_portable(copy) == [], (
        "models/ holds files written before portable_config: re-run make_portable"
    )
    _assert_portable(folder, _read(folder, "config.json")["num_experts"])
    model, tok, info = moectl.load(str(folder), dtype="float32")
    assert type(tok).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert info.num_experts == _read(folder, "config.json")["num_experts"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([tok.encode("Hello")])).logits).all()


def test_the_count_transformers_5_reads_wins_and_other_families_are_left_alone():
    mixtral = portable_config({"model_type": "mixtral", "num_local_experts": 4, "num_experts": 8})
    assert (
        mixtral["num_experts"] == mixtral["num_local_experts"] == 4
    )  # MixtralConfig holds num_local_experts
    qwen2 = portable_config({"model_type": "qwen2_moe", "num_local_experts": 8, "num_experts": 4})
    assert qwen2["num_experts"] == qwen2["num_local_experts"] == 4  # Qwen2MoeConfig holds num_experts
    deepseek = {"model_type": "deepseek_v3", "n_routed_experts": 8, "num_experts_per_tok": 2}
    assert portable_config(deepseek) == deepseek  # counted in n_routed_experts by every loader
    nested = portable_config(
        {"model_type": "x", "text_config": {"model_type": "qwen3_moe", "num_local_experts": 6}}
    )
    assert nested["text_config"]["num_experts"] == 6


def test_a_scaled_rope_is_spelled_for_older_readers_too():
    params = {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    config = portable_config({"model_type": "qwen3_moe", "rope_parameters": params, "dtype": "bfloat16"})
    assert config["rope_theta"] == 1e6 and config["torch_dtype"] == "bfloat16"
    assert config["rope_scaling"] == {
        "rope_type": "yarn", "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
    }  # fmt: skip
    assert config["rope_parameters"] == params  # transformers 5's own spelling is kept


def test_only_transformers_5s_generic_tokenizer_class_is_replaced():
    assert (
        portable_tokenizer_config({"tokenizer_class": "TokenizersBackend"})["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )
    assert (
        portable_tokenizer_config({"tokenizer_class": "Qwen2Tokenizer"})["tokenizer_class"]
        == "Qwen2Tokenizer"
    )
    no_json = portable_tokenizer_config({"tokenizer_class": "TokenizersBackend"}, fast=False)
    assert no_json["tokenizer_class"] == "TokenizersBackend"  # no tokenizer.json: nothing a fast class reads
