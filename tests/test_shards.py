"""Reading experts straight from a checkpoint's safetensors shards (moectl.io.shards)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import moectl
from moectl.io.page_cache import evict, file_cached_bytes
from moectl.io.range_read import ALIGN, READ_METHODS, RangeReader
from moectl.io.safetensors_index import CheckpointIndex, read_header
from moectl.io.shards import ShardReader
from moectl.models.lazy import checkpoint_reader
from moectl.models.meta_model import build_meta, load_config
from moectl.models.shapes import known_shapes, make_checkpoint

SMALL = "@2~w64"
SHARD_BYTES = 300_000  # several shards even at width 64


@functools.cache
def _shape_dir(root: str, name: str) -> Path:
    out = Path(root) / name
    make_checkpoint(f"shape:{name}{SMALL}", out, max_shard_bytes=SHARD_BYTES)
    return out


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("shards")
    yield str(root)
    shutil.rmtree(root, ignore_errors=True)  # checkpoints of every preset: ~200 MB


@functools.cache
def _reference(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- the index ---------------------------------------------------------------------------------------
def test_index_matches_safetensors_headers(shapes_root):
    path = _shape_dir(shapes_root, "olmoe-1b-7b")
    index = CheckpointIndex(path)
    assert len(index.files) > 1 and len(index) == len(
        json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    )
    for file in index.files:
        with safe_open(str(file), "pt") as f, open(file, "rb") as raw:
            for key in list(f.keys())[:20]:
                entry = index[key]
                assert entry.file == file
                raw.seek(entry.offset)
                data = torch.frombuffer(bytearray(raw.read(entry.nbytes)), dtype=entry.dtype).reshape(
                    entry.shape
                )
                assert torch.equal(data, f.get_tensor(key))


def test_single_file_checkpoint(tmp_path):
    model = moectl.tiny("olmoe")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    reader = checkpoint_reader(tmp_path)
    assert reader.index.files == [tmp_path / "model.safetensors"]
    for layer in reader.layers:
        for e in (0, layer.num_experts - 1):
            got = reader.read_expert(layer.index, e)
            for name, t in got.items():
                assert torch.equal(t, model.get_parameter(f"{layer.module}.{name}")[e])


# -- expert addressing, every family ---------------------------------------------------------------
@pytest.mark.parametrize("name", known_shapes())
def test_every_tensor_matches_from_pretrained(shapes_root, name):
    path = _shape_dir(shapes_root, name)
    ref = _reference(str(path))
    reader = checkpoint_reader(path)
    assert reader.layers and reader.map.unused == []
    released_fused = name.startswith("gpt-oss")  # gpt-oss is released with fused experts
    for layer in reader.layers:
        assert {s.layout for s in layer.params.values()} == {"whole" if released_fused else "per_expert"}
        for e in range(layer.num_experts):
            got = reader.read_expert(layer.index, e)
            for param, t in got.items():
                assert torch.equal(t, ref.get_parameter(f"{layer.module}.{param}")[e]), (param, e)
    params = dict(ref.named_parameters())
    for tensor in reader.map.sources:
        expected = params[tensor] if tensor in params else ref.get_buffer(tensor)
        got = reader.read_tensor(tensor)
        assert got.dtype == expected.dtype and torch.equal(got, expected), tensor
    assert reader.expert_bytes + reader.non_expert_bytes == reader.index.nbytes


@pytest.mark.parametrize("method", READ_METHODS)
def test_methods_read_the_same_bytes(shapes_root, method):
    path = _shape_dir(shapes_root, "mixtral-8x7b")
    ref = _reference(str(path))
    reader = checkpoint_reader(path, method=method)
    for layer in reader.layers:
        for e in range(layer.num_experts):
            for param, t in reader.read_expert(layer.index, e).items():
                assert torch.equal(t, ref.get_parameter(f"{layer.module}.{param}")[e])
    assert reader.stats.bytes == reader.expert_bytes


def test_released_layout_addresses_gate_then_up(shapes_root):
    """OLMoE's expert 7 of gate_up_proj: its gate tensor in rows 0..I, its up tensor in I..2I."""
    path = _shape_dir(shapes_root, "olmoe-1b-7b")
    reader = checkpoint_reader(path)
    segments = reader.expert_segments(1, 7)
    gate, up = segments["gate_up_proj"]
    (down,) = segments["down_proj"]
    prefix = "model.layers.1.mlp.experts.7"
    assert (gate.key, up.key, down.key) == (
        f"{prefix}.gate_proj.weight",
        f"{prefix}.up_proj.weight",
        f"{prefix}.down_proj.weight",
    )
    rows = reader.layers[1].expert_shape("gate_up_proj")[0]
    assert gate.index == (slice(0, rows // 2),) and up.index == (slice(rows // 2, rows),)
    for seg in (gate, up, down):
        entry = reader.index[seg.key]
        assert (seg.file, seg.offset, seg.nbytes) == (entry.file, entry.offset, entry.nbytes)


def test_mixtral_and_phi_renames(shapes_root):
    for name, keys in (("mixtral-8x7b", ("w1", "w3", "w2")), ("phi-3.5-moe", ("w1", "w3", "w2"))):
        reader = checkpoint_reader(_shape_dir(shapes_root, name))
        segments = reader.expert_segments(0, 3)
        got = [s.key for s in segments["gate_up_proj"] + segments["down_proj"]]
        assert got == [f"model.layers.0.block_sparse_moe.experts.3.{k}.weight" for k in keys]


def test_fused_checkpoint_is_sliced(tmp_path):
    """transformers' own save_pretrained(save_original_format=False) keeps experts fused."""
    model = moectl.tiny("qwen3_moe")
    model.save_pretrained(tmp_path, save_original_format=False)
    reader = checkpoint_reader(tmp_path)
    for layer in reader.layers:
        for param, source in layer.params.items():
            assert source.layout == "whole"
            (seg,) = reader.expert_segments(layer.index, 5)[param]
            assert seg.offset == source.entry.offset + 5 * source.entry.row_bytes
            assert seg.nbytes == source.entry.row_bytes
        for e in range(layer.num_experts):
            for param, t in reader.read_expert(layer.index, e).items():
                assert torch.equal(t, model.get_parameter(f"{layer.module}.{param}")[e])


@pytest.mark.parametrize("fused", [False, True])
def test_read_rows_reads_only_the_kept_experts(shapes_root, tmp_path, fused):
    """A subset's experts (any order) from per-expert tensors and from fused ones: equal to the
    whole tensor's rows, and only their bytes read (the GGUF export of a subset relies on it)."""
    if fused:
        model = moectl.tiny("qwen3_moe")
        model.save_pretrained(tmp_path, save_original_format=False)
        path = tmp_path
    else:
        path = _shape_dir(shapes_root, "olmoe-1b-7b")
    reader = checkpoint_reader(path)
    layer = reader.layers[0]
    rows = [5, 1, 3]
    for param in layer.params:
        name = f"{layer.module}.{param}"
        whole = reader.read_tensor(name)
        before = reader.stats.bytes
        got = reader.read_rows(name, rows)
        assert torch.equal(got, whole[rows])
        assert reader.stats.bytes - before == sum(s.nbytes for r in rows for s in reader.map[name].segments(r))
        assert reader.stats.bytes - before == whole[rows].numel() * whole.element_size()


def test_tied_embeddings(tmp_path):
    model = moectl.tiny("olmoe", tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    reader = checkpoint_reader(tmp_path)
    assert reader.map.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert torch.equal(reader.read_tensor("lm_head.weight"), model.model.embed_tokens.weight)


def test_moe_layers_numbered_as_inspect(tmp_path):
    model = moectl.tiny("deepseek_v3")  # leading dense layer: MoE layer 0 is decoder layer 1
    model.save_pretrained(tmp_path)
    reader = checkpoint_reader(tmp_path)
    names = {id(m): n for n, m in model.named_modules()}
    info = moectl.inspect(model)
    assert [layer.module for layer in reader.layers] == [
        names[id(layer.block.experts)] for layer in info.layers
    ]


# -- reading into the slot ---------------------------------------------------------------------------
def test_read_expert_fills_the_slot_in_place(shapes_root):
    path = _shape_dir(shapes_root, "qwen3-30b-a3b")
    ref = _reference(str(path))
    reader = checkpoint_reader(path)
    slot = reader.empty_expert(0)
    pointers = {k: t.data_ptr() for k, t in slot.items()}
    got = reader.read_expert(0, 11, out=slot)
    assert all(got[k] is slot[k] and slot[k].data_ptr() == pointers[k] for k in slot)
    assert torch.equal(slot["down_proj"], ref.model.layers[0].mlp.experts.down_proj[11])
    # another dtype (cast on the way) and a strided destination
    wide = {k: torch.empty(t.shape, dtype=torch.float32) for k, t in slot.items()}
    strided = {"down_proj": torch.empty(tuple(reversed(slot["down_proj"].shape)), dtype=torch.bfloat16).T}
    reader.read_expert(0, 11, out=wide)
    reader.read_expert(0, 11, out=strided)
    assert torch.equal(wide["gate_up_proj"], ref.model.layers[0].mlp.experts.gate_up_proj[11].float())
    assert torch.equal(strided["down_proj"], slot["down_proj"])


def test_read_expert_bad_arguments(shapes_root):
    reader = checkpoint_reader(_shape_dir(shapes_root, "olmoe-1b-7b"))
    with pytest.raises(IndexError, match="MoE layer 5"):
        reader.read_expert(5, 0)
    with pytest.raises(IndexError, match="expert 64"):
        reader.read_expert(0, 64)
    with pytest.raises(KeyError, match="w1"):
        reader.read_expert(0, 0, out={"w1": torch.empty(1)})
    with pytest.raises(ValueError, match="down_proj: destination is"):
        reader.read_expert(0, 0, out={"down_proj": torch.empty(3, 3, dtype=torch.bfloat16)})
    with pytest.raises(KeyError, match="not a parameter"):
        reader.read_tensor("model.nothing.weight")


# -- bad input ---------------------------------------------------------------------------------------
def test_missing_and_truncated_shards_name_the_file(shapes_root, tmp_path):
    path = _copy_checkpoint(_shape_dir(shapes_root, "olmoe-1b-7b"), tmp_path / "ck")
    shard = sorted(path.glob("*.safetensors"))[1]
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    with pytest.raises(ValueError, match=f"{shard.name}: truncated"):
        checkpoint_reader(path)
    os.truncate(shard, 4)
    with pytest.raises(ValueError, match=f"{shard.name}: truncated"):
        CheckpointIndex(path)
    shard.unlink()
    with pytest.raises(ValueError, match=f"{shard.name}: shard is missing"):
        checkpoint_reader(path)
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors\.index\.json and no model\.safetensors"):
        CheckpointIndex(path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 5) + b"nojso")
    with pytest.raises(ValueError, match=r"bad\.safetensors: unreadable safetensors header"):
        read_header(bad)


@pytest.mark.parametrize("method", READ_METHODS)
def test_shard_truncated_after_indexing(shapes_root, tmp_path, method):
    path = _copy_checkpoint(_shape_dir(shapes_root, "olmoe-1b-7b"), tmp_path / "ck")
    reader = checkpoint_reader(path, method=method)
    (seg,) = reader.expert_segments(1, 63)["down_proj"]
    os.truncate(seg.file, seg.offset + 10)
    with pytest.raises(ValueError, match=f"{seg.file.name}: truncated"):
        reader.read_expert(1, 63)


def _tiny_state(tmp_path: Path, family: str = "olmoe") -> tuple[Path, dict[str, torch.Tensor]]:
    model = moectl.tiny(family)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        return tmp_path, {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def test_missing_tensor_names_it(tmp_path):
    path, state = _tiny_state(tmp_path)
    del state["model.norm.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model tensor model\.norm\.weight \[64\] is not in the checkpoint"):
        checkpoint_reader(path)


def test_missing_expert_names_it(tmp_path):
    path, state = _tiny_state(tmp_path)
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj needs 8 .*up_proj.*expert 5 is missing",
    ):
        checkpoint_reader(path)


def test_wrong_shape_and_dtype_name_the_tensor(tmp_path):
    path, state = _tiny_state(tmp_path)
    state["model.layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(64, 95)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"checkpoint tensor model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight has shape \[64, 95\]",
    ):
        checkpoint_reader(path)  # the experts of one projection disagree
    path, state = _tiny_state(tmp_path)
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"q_proj\.weight has shape \[64, 32\]; model tensor .* needs \[64, 64\]"
    ):
        checkpoint_reader(path)
    path, state = _tiny_state(tmp_path)
    state["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"model\.norm\.weight is torch\.int32; model tensor model\.norm\.weight"
    ):
        checkpoint_reader(path)


def test_model_of_another_shape_names_the_tensor(shapes_root):
    path = _shape_dir(shapes_root, "olmoe-1b-7b")
    config = load_config(path)
    config.intermediate_size = 64
    with pytest.raises(ValueError, match=r"model tensor model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        ShardReader(path, build_meta(config))


# -- the range reader and the page cache -------------------------------------------------------------
def test_range_reader_scatters_unaligned_ranges(tmp_path):
    data = os.urandom(5 * ALIGN + 123)
    file = tmp_path / "blob"
    file.write_bytes(data)
    rng = random.Random(0)
    for method in READ_METHODS:
        with RangeReader(method, bounce_bytes=2 * ALIGN) as reader:  # several windows per run
            for _ in range(20):
                start = rng.randrange(len(data) - 1)
                cuts = sorted(rng.sample(range(start + 1, len(data) + 1), k=min(3, len(data) - start)))
                bounds = [start, *cuts]
                buffers = [bytearray(b - a) for a, b in itertools.pairwise(bounds)]
                reader.read(file, [(a, memoryview(buf)) for a, buf in zip(bounds, buffers, strict=False)])
                assert b"".join(buffers) == data[start : bounds[-1]]
    with pytest.raises(ValueError, match="read method"):
        RangeReader("mmap")


def test_direct_falls_back_where_unsupported():
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    file = shm / f"moectl-test-{os.getpid()}"
    file.write_bytes(b"x" * 10000)
    try:
        with RangeReader("direct") as reader:
            buf = bytearray(100)
            reader.read(file, [(50, memoryview(buf))])
            assert bytes(buf) == b"x" * 100
            assert reader.method_for(file) in ("direct", "fadvise")  # tmpfs: no O_DIRECT
    finally:
        file.unlink()


def test_page_cache_stays_bounded(tmp_path):
    """After reading every expert, direct and fadvise leave none of the checkpoint cached; plain does."""
    path = tmp_path / "ck"
    make_checkpoint("shape:olmoe-1b-7b@1~w256", path)
    cached = {}
    for method in READ_METHODS:
        reader = checkpoint_reader(path, method=method)
        files = reader.index.files
        for file in files:
            evict(file)
        slot = reader.empty_expert(0)
        for e in range(reader.layers[0].num_experts):
            reader.read_expert(0, e, out=slot)
        cached[method] = sum(file_cached_bytes(f) for f in files)
        reader.close()
    expert_bytes = checkpoint_reader(path).expert_bytes
    shutil.rmtree(path)
    assert cached["direct"] <= 2 * ALIGN, cached
    assert cached["fadvise"] <= 2 * ALIGN, cached
    assert cached["plain"] >= expert_bytes // 2, cached


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_full_size_models_map_on_meta(name):
    """Every layer of the full-size model, addressed from its planned checkpoint (nothing written)."""
    from moectl.io.checkpoint_map import map_checkpoint
    from moectl.io.safetensors_index import TensorEntry
    from moectl.models.shape_checkpoint import plan_tensors
    from moectl.models.shapes import build_shape

    meta = build_shape(name)
    entries, offset = {}, 0
    for planned in plan_tensors(meta):
        entries[planned.key] = TensorEntry(
            planned.key, Path("/planned"), offset, planned.nbytes, planned.dtype, planned.shape
        )
        offset += planned.nbytes
    mapped = map_checkpoint(meta, CheckpointIndex.from_entries("/planned", entries))
    assert mapped.unused == [] and len(mapped.sources) == len(dict(meta.named_parameters())) + sum(
        1 for n, _ in meta.named_buffers() if "rotary" not in n
    )
    expert_bytes = sum(s.nbytes for n, s in mapped.sources.items() if ".experts." in n)
    assert expert_bytes == sum(p.nbytes for p in plan_tensors(meta) if p.routed_expert)
    last = max(n for n in mapped.sources if n.endswith("experts.down_proj"))
    (seg,) = mapped.sources[last].segments(mapped.sources[last].num_experts - 1)
    assert seg.nbytes == mapped.sources[last].nbytes // mapped.sources[last].num_experts
