"""Shape presets of real MoE models: public dimensions, spec strings, streamed sharded checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import moectl.models.shape_checkpoint as shape_checkpoint
from moectl.models.load import load_model
from moectl.models.shapes import (
    MARKER,
    PRESETS,
    PUBLISHED,
    ShapeSpec,
    build_shape,
    check_checkpoint,
    known_shapes,
    make_checkpoint,
    parameter_counts,
    parse_shape_spec,
    shape_config,
    write_shape_checkpoint,
)

SMALL = "@2~w64"  # two layers at hidden size 64: every test below runs the full-width code paths

# Public figures per preset: hidden, layers, routed experts, top-k, MoE layers, expert width, vocab.
PUBLIC = {
    "olmoe-1b-7b": (2048, 16, 64, 8, 16, 1024, 50304),
    "qwen3-30b-a3b": (2048, 48, 128, 8, 48, 768, 151936),
    "gpt-oss-20b": (2880, 24, 32, 4, 24, 2880, 201088),
    "deepseek-v2-lite": (2048, 27, 64, 6, 26, 1408, 102400),
    "mixtral-8x7b": (4096, 32, 8, 2, 32, 14336, 32000),
    "phi-3.5-moe": (4096, 32, 16, 2, 32, 6400, 32064),
    "deepseek-v3": (7168, 61, 256, 8, 58, 2048, 129280),
    "emo-1b-14b": (2048, 16, 127, 7, 16, 1024, 100352),
}
MODEL_TYPES = {
    "olmoe-1b-7b": "olmoe",
    "qwen3-30b-a3b": "qwen3_moe",
    "gpt-oss-20b": "gpt_oss",
    "deepseek-v2-lite": "deepseek_v2",
    "mixtral-8x7b": "mixtral",
    "phi-3.5-moe": "phimoe",
    "deepseek-v3": "deepseek_v3",
    "emo-1b-14b": "qwen2_moe",
}
# One released-checkpoint name per preset, as the families' downloads spell it.
RELEASED_NAMES = {
    "olmoe-1b-7b": [
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.63.down_proj.weight",
    ],
    "qwen3-30b-a3b": [
        "model.layers.0.mlp.experts.127.up_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ],
    "gpt-oss-20b": ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.router.bias"],
    "deepseek-v2-lite": [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.63.up_proj.weight",
    ],
    "mixtral-8x7b": [
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
    ],
    "phi-3.5-moe": [
        "model.layers.0.block_sparse_moe.experts.15.w3.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
    ],
    "deepseek-v3": [
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
    ],
    "emo-1b-14b": [
        "model.layers.0.mlp.experts.126.gate_proj.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
    ],
}


def _figure(published: str) -> tuple[float, float]:
    """'6.9B' -> (6.9e9, 0.05e9): the value and half a unit of its last published digit."""
    number = published.removesuffix("B")
    decimals = len(number.partition(".")[2])
    return float(number) * 1e9, 0.5 * 10.0**-decimals * 1e9


def _expert_tensors(model) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if n.endswith(".experts.down_proj")]


def test_presets_cover_the_requested_models():
    assert set(known_shapes()) == set(PUBLIC) == set(PUBLISHED)
    assert {name: PRESETS[name]["model_type"] for name in PRESETS} == MODEL_TYPES
    assert "quantization_config" not in PRESETS["gpt-oss-20b"]


@pytest.mark.parametrize("name", list(PUBLIC))
def test_full_preset_on_meta_has_the_public_dimensions(name):
    hidden, layers, experts, top_k, moe_layers, width, vocab = PUBLIC[name]
    model = build_shape(name)  # meta device: no memory
    assert next(model.parameters()).device.type == "meta"
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (hidden, layers, vocab)
    assert config.tie_word_embeddings is False
    downs = _expert_tensors(model)
    assert len(downs) == moe_layers
    assert {d.shape[0] for d in downs} == {experts}
    assert {d.numel() // experts // hidden for d in downs} == {width}
    assert parameter_counts(model)["top_k"] == top_k


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_match_the_published_ones(name):
    published = PUBLISHED[name]
    counts = parameter_counts(build_shape(name))
    total, total_unit = _figure(published.total)
    assert abs(counts["total"] - total) <= max(0.02 * total, total_unit), (name, counts["total"])
    active, active_unit = _figure(published.active)
    measured = counts["active" if published.active_counts_embedding else "active_without_embedding"]
    assert abs(measured - active) <= max(published.active_tolerance * active, active_unit), (name, measured)


def test_mla_and_routing_knobs_of_the_deepseek_presets():
    v3 = shape_config("deepseek-v3")
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_rope_head_dim, v3.v_head_dim) == (1536, 512, 64, 128)
    assert (v3.n_group, v3.topk_group, v3.routed_scaling_factor, v3.norm_topk_prob) == (8, 4, 2.5, True)
    assert (v3.first_k_dense_replace, v3.n_shared_experts) == (3, 1)
    lite = shape_config("deepseek-v2-lite")
    assert (lite.q_lora_rank, lite.kv_lora_rank, lite.n_shared_experts) == (None, 512, 2)
    assert (lite.topk_method, lite.routed_scaling_factor, lite.norm_topk_prob) == ("greedy", 1.0, False)


def test_spec_strings_parse():
    assert parse_shape_spec("shape:olmoe-1b-7b") == ShapeSpec("olmoe-1b-7b")
    assert parse_shape_spec("shape:olmoe-1b-7b@2") == ShapeSpec("olmoe-1b-7b", 2)
    assert parse_shape_spec("shape:olmoe-1b-7b@2~w64") == ShapeSpec("olmoe-1b-7b", 2, 64)
    assert parse_shape_spec("OLMoE-1B-7B~w128") == ShapeSpec("olmoe-1b-7b", None, 128)
    for spec in ("shape:deepseek-v3@3~w64", "shape:phi-3.5-moe", "shape:gpt-oss-20b@1"):
        assert str(parse_shape_spec(spec)) == spec
    assert shape_config("shape:qwen3-30b-a3b@3").num_hidden_layers == 3
    for bad in ("shape:", "shape:olmoe-1b-7b@x", "shape:olmoe-1b-7b~64", "shape:olmoe-1b-7b@2@3"):
        with pytest.raises(ValueError, match=r"shape spec|unknown shape"):
            parse_shape_spec(bad)


def test_unknown_shape_lists_the_known_ones():
    for call in (lambda: parse_shape_spec("shape:llama-7b"), lambda: build_shape("llama-7b")):
        with pytest.raises(ValueError, match="unknown shape 'llama-7b'") as err:
            call()
        assert all(name in str(err.value) for name in known_shapes())
    with pytest.raises(ValueError, match="known shapes: olmoe-1b-7b"):
        load_model("shape:llama-7b")


def test_layers_keep_the_pattern_and_one_moe_layer():
    assert shape_config("gpt-oss-20b@3").layer_types == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    assert shape_config("deepseek-v3@2").first_k_dense_replace == 1
    assert len(_expert_tensors(build_shape("deepseek-v3@2"))) == 1
    assert shape_config("deepseek-v3@1").first_k_dense_replace == 0
    assert shape_config("deepseek-v3@70").first_k_dense_replace == 3
    with pytest.raises(ValueError, match="at least one layer"):
        shape_config("olmoe-1b-7b", num_layers=0)


def test_reduced_width_scales_widths_and_keeps_counts():
    full, small = shape_config("qwen3-30b-a3b"), shape_config("qwen3-30b-a3b~w64")
    assert small.hidden_size == 64 and small.head_dim == 8 and small.moe_intermediate_size == 24
    for key in (
        "num_attention_heads",
        "num_key_value_heads",
        "num_experts",
        "num_experts_per_tok",
        "vocab_size",
    ):
        assert getattr(small, key) == getattr(full, key)
    assert (
        shape_config("olmoe-1b-7b", width=64, num_layers=2).to_dict()
        == shape_config(f"olmoe-1b-7b{SMALL}").to_dict()
    )
    overridden = shape_config(f"mixtral-8x7b{SMALL}", num_experts_per_tok=1)  # set verbatim
    assert overridden.num_experts_per_tok == 1
    with pytest.raises(ValueError, match="multiple of 8"):
        shape_config("olmoe-1b-7b~w60")
    with pytest.raises(ValueError, match="32 attention heads"):
        shape_config("mixtral-8x7b~w72")


@pytest.mark.parametrize("name", list(PUBLIC))
def test_reduced_shape_builds_on_cpu_seeded_and_runs(name):
    model = build_shape(f"{name}{SMALL}", device="cpu")
    assert model.dtype == torch.bfloat16 and not model.training
    again = build_shape(f"{name}{SMALL}", device="cpu")
    other = build_shape(f"{name}{SMALL}", device="cpu", seed=1)
    ids = torch.randint(3, 259, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, again(ids).logits)
        assert not torch.equal(logits, other(ids).logits)
    assert logits.shape == (2, 7, model.config.vocab_size) and torch.isfinite(logits).all()
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)


@pytest.mark.parametrize("name", list(PUBLIC))
def test_inspect_and_self_test_on_the_reduced_shape(name):
    import moectl

    model = build_shape(f"{name}{SMALL}", device="cpu")
    try:
        info = moectl.inspect(model)
    except moectl.UnsupportedModelError:
        pytest.skip(f"no adapter for {MODEL_TYPES[name]} yet")
    moe_layers = len(_expert_tensors(model))  # DeepSeek's first layer is dense
    assert (info.num_experts, info.top_k, info.num_moe_layers) == (*PUBLIC[name][2:4], moe_layers)
    result = moectl.self_test(model, info)
    assert result.passed, result


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Iterator[dict[str, tuple[Path, dict]]]:
    """Every preset at reduced width written once, in small shards (several per checkpoint)."""
    root = tmp_path_factory.mktemp("shapes")
    yield {
        name: (
            root / name,
            write_shape_checkpoint(f"shape:{name}{SMALL}", root / name, max_shard_bytes=4_000_000),
        )
        for name in PUBLIC
    }
    shutil.rmtree(root)  # ~220 MB: not left for pytest to keep


@pytest.mark.parametrize("name", list(PUBLIC))
def test_checkpoint_is_hugging_face_sharded_with_released_names(written, name):
    path, summary = written[name]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count == summary["shards"] > 1
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [*files, "config.json", MARKER, "model.safetensors.index.json"]
    )
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    sizes = 0
    for file in files:
        with safe_open(str(path / file), "pt") as shard:
            keys = set(shard.keys())
            sizes += sum(_nbytes(shard, k) for k in keys)
        assert keys == {k for k, f in index["weight_map"].items() if f == file}
    assert index["metadata"]["total_size"] == sizes == summary["tensor_bytes"]
    assert set(RELEASED_NAMES[name]) <= set(index["weight_map"])
    assert check_checkpoint(path) == {
        "shards": count,
        "tensors": summary["tensors"],
        "bytes": summary["bytes"],
    }
    marker = json.loads((path / MARKER).read_text())
    assert marker["spec"] == f"shape:{name}{SMALL}" and "ByteTokenizer" in marker["tokenizer"]


def _nbytes(shard, key: str) -> int:
    tensor = shard.get_tensor(key)
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("name", list(PUBLIC))
def test_checkpoint_loads_into_fused_experts_with_the_same_logits(written, name, tmp_path):
    path, _ = written[name]
    loaded, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert loaded.dtype == torch.bfloat16
    model = build_shape(f"shape:{name}{SMALL}", device="cpu")
    ids = torch.randint(3, 259, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    # transformers' own save (which writes each family's original layout) has exactly our names
    model.save_pretrained(tmp_path)
    theirs = set()
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as shard:
            theirs |= set(shard.keys())
    assert theirs == set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


def test_make_checkpoint_summary(tmp_path):
    summary = make_checkpoint("shape:deepseek-v3@2~w64", tmp_path / "ck", max_shard_bytes=8_000_000)
    files = sorted((tmp_path / "ck").glob("model-*.safetensors"))
    assert summary["bytes"] == sum(f.stat().st_size for f in files) and summary["shards"] == len(files)
    assert summary["expert_bytes"] + summary["non_expert_bytes"] == summary["tensor_bytes"]
    params = summary["parameters"]
    assert summary["expert_bytes"] == 2 * params["routed_experts"]
    assert params["active"] == params["non_expert"] + params["routed_experts"] * 8 // 256
    weight_map = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())["weight_map"]
    assert summary["tensors"] == len(weight_map)
    assert sum(".mlp.experts." in key for key in weight_map) == 256 * 3  # one MoE layer, per expert
    assert summary["model_type"] == "deepseek_v3" and summary["num_layers"] == 2


def test_load_model_accepts_shape_specs_and_shape_checkpoints(written):
    model, tokenizer = load_model(f"shape:olmoe-1b-7b{SMALL}")
    assert model.dtype == torch.bfloat16 and tokenizer.vocab_size == 50304
    assert tokenizer.decode(tokenizer.encode("héllo wörld")) == "héllo wörld"
    batch = tokenizer(["héllo", "a"])
    with torch.no_grad():
        logits = model(**batch).logits
    again, tok = load_model(str(written["olmoe-1b-7b"][0]))
    assert tok.vocab_size == 50304 and again.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, logits)
    assert load_model(f"shape:mixtral-8x7b{SMALL}", with_tokenizer=False)[1] is None


def _two_shard_checkpoint(tmp_path: Path) -> tuple[Path, list[Path]]:
    path = tmp_path / "ck"
    write_shape_checkpoint(f"shape:olmoe-1b-7b{SMALL}", path, max_shard_bytes=4_000_000)
    return path, sorted(path.glob("model-*.safetensors"))


def test_missing_shard_fails_naming_the_file(tmp_path):
    path, shards = _two_shard_checkpoint(tmp_path)
    shards[1].unlink()
    for load in (check_checkpoint, lambda p: load_model(str(p))):
        with pytest.raises(ValueError, match=f"{shards[1].name}.*missing"):
            load(path)


def test_truncated_shard_fails_naming_the_file(tmp_path):
    path, shards = _two_shard_checkpoint(tmp_path)
    size = shards[0].stat().st_size
    os.truncate(shards[0], size - 100)
    for load in (check_checkpoint, lambda p: load_model(str(p))):
        with pytest.raises(ValueError, match=f"{shards[0].name}: truncated"):
            load(path)
    os.truncate(shards[0], 4)  # not even a header
    with pytest.raises(ValueError, match=f"{shards[0].name}: truncated"):
        check_checkpoint(path)


def test_write_is_atomic_and_refuses_to_clobber(tmp_path, monkeypatch):
    written_shards = []
    real = shape_checkpoint._write_shard

    def failing(path, tensors, seed):
        if written_shards:
            raise RuntimeError("disk on fire")
        written_shards.append(path)
        return real(path, tensors, seed)

    monkeypatch.setattr(shape_checkpoint, "_write_shard", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_shape_checkpoint(f"shape:olmoe-1b-7b{SMALL}", tmp_path / "ck", max_shard_bytes=4_000_000)
    assert written_shards and list(tmp_path.iterdir()) == []  # nothing half-written, no temp folder
    monkeypatch.setattr(shape_checkpoint, "_write_shard", real)
    write_shape_checkpoint(f"shape:mixtral-8x7b{SMALL}", tmp_path / "ck")
    with pytest.raises(FileExistsError, match="not empty"):
        write_shape_checkpoint(f"shape:olmoe-1b-7b{SMALL}", tmp_path / "ck")
    write_shape_checkpoint(f"shape:olmoe-1b-7b{SMALL}", tmp_path / "ck", overwrite=True)
    assert json.loads((tmp_path / "ck" / MARKER).read_text())["model_type"] == "olmoe"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


_PEAK_SCRIPT = """
import json, resource, sys
from moectl.models.shapes import build_shape, write_shape_checkpoint
build_shape(sys.argv[1])  # imports and the meta model, before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
summary = write_shape_checkpoint(sys.argv[1], sys.argv[2], max_shard_bytes=64_000_000)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth": (peak - base) * 1024, "bytes": summary["bytes"], "shards": summary["shards"]}))
"""


def test_writing_streams_instead_of_holding_the_model(tmp_path):
    """~250 MB of checkpoint; the writer's peak memory grows by about one 32 MB chunk."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, "shape:olmoe-1b-7b@3~w512", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(tmp_path / "ck")
    assert result["bytes"] > 200e6 and result["shards"] >= 4
    assert result["growth"] < 100e6, result
