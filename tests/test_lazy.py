"""Build on meta, load only what is asked (moectl.models.lazy)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import moectl
from moectl.models.lazy import load_skeleton
from moectl.models.meta_buffers import materialize_buffers
from moectl.models.shapes import make_checkpoint

SMALL = "@2~w64"


@functools.cache
def _shape_dir(root: str, name: str) -> Path:
    out = Path(root) / name
    make_checkpoint(f"shape:{name}{SMALL}", out, max_shard_bytes=300_000)
    return out


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("lazy")
    yield str(root)
    shutil.rmtree(root, ignore_errors=True)  # checkpoints of every preset: ~200 MB


def _ids() -> torch.Tensor:
    return torch.randint(3, 250, (2, 11), generator=torch.Generator().manual_seed(0))


def _realigned(model: nn.Module) -> nn.Module:
    """``from_pretrained``'s tensors view the memory-mapped file at 8-byte offsets; CPU matmul
    kernels round differently with the data's alignment (1e-7 apart in float32). Copies into
    ordinary (aligned) memory make the comparison about values, not addresses."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return model


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "gpt-oss-20b", "mixtral-8x7b", "phi-3.5-moe", "deepseek-v3"])
def test_skeleton_with_experts_is_from_pretrained(shapes_root, name):
    path = _shape_dir(shapes_root, name)
    ref = AutoModelForCausalLM.from_pretrained(path)
    model, reader = load_skeleton(path, load_experts=True)
    assert type(model) is type(ref) and not model.training
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    for (key, value), (_, expected) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        assert value.dtype == expected.dtype and torch.equal(value, expected), key  # inv_freq included
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, _realigned(ref)(_ids()).logits)
    assert reader.non_expert_bytes + reader.expert_bytes == reader.index.nbytes


def test_experts_stay_on_meta(shapes_root):
    path = _shape_dir(shapes_root, "qwen3-30b-a3b")
    model, reader = load_skeleton(path)
    meta = {name for name, p in model.named_parameters() if p.is_meta}
    assert meta == set(reader.expert_names) and meta
    assert all(not b.is_meta for b in model.buffers())
    ref = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    # the runtime's path: experts read on demand from the same shards, straight into their slots
    with torch.no_grad():
        for layer in reader.layers:
            experts = model.get_submodule(layer.module)
            for param, source in layer.params.items():
                fused = torch.empty(source.shape, dtype=source.dtype)
                for e in range(layer.num_experts):
                    reader.read_expert(layer.index, e, out={param: fused[e]})
                experts._parameters[param] = nn.Parameter(fused, requires_grad=False)
        assert torch.equal(model(_ids()).logits, _realigned(ref)(_ids()).logits)


def test_dtype_override_and_fp32_plan(shapes_root):
    path = _shape_dir(shapes_root, "deepseek-v3")
    ref = AutoModelForCausalLM.from_pretrained(path)
    model, _ = load_skeleton(path, dtype="float32", load_experts=True)
    assert model.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight.float())
    bf16, _ = load_skeleton(path)  # dtype "auto": bf16, the router's correction bias kept in float32
    bias = next(b for n, b in bf16.named_buffers() if n.endswith("e_score_correction_bias"))
    assert bf16.dtype == torch.bfloat16 and bias.dtype == torch.float32


def test_tied_embeddings_stay_tied(tmp_path):
    tiny = moectl.tiny("olmoe", tie_word_embeddings=True)
    tiny.save_pretrained(tmp_path)
    model, _ = load_skeleton(tmp_path, load_experts=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tiny.lm_head.weight)
    ref = _realigned(AutoModelForCausalLM.from_pretrained(tmp_path))  # sdpa, as ours (tiny() runs eager)
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, ref(_ids()).logits)
    assert model.generation_config.eos_token_id == tiny.generation_config.eos_token_id


def test_bad_checkpoints_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_skeleton(tmp_path)
    tiny = moectl.tiny("mixtral")
    tiny.save_pretrained(tmp_path)
    shard = tmp_path / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 8)
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated"):
        load_skeleton(tmp_path)
    shard.unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_skeleton(tmp_path)


def test_unfillable_buffer_is_an_error():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.empty(4, device="meta"), persistent=False)

    model = nn.Sequential(Odd())
    with pytest.raises(RuntimeError, match=r"non-persistent buffer 0\.table of Odd"):
        materialize_buffers(model)


_RSS_PROBE = textwrap.dedent(
    """
    import gc, json, sys
    from moectl.models.lazy import load_skeleton
    from moectl.models.meta_model import build_meta, load_config

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    build_meta(load_config(sys.argv[1]))  # imports the family's modeling code: not the load's memory
    gc.collect()
    before = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM, the peak RSS
    model, reader = load_skeleton(sys.argv[1], method=sys.argv[2])
    print(json.dumps({"growth": status("VmHWM:") - before, "non_expert": reader.non_expert_bytes,
                      "expert": reader.expert_bytes, "bounce": reader.io.bounce_bytes}))
    """
)


@pytest.fixture(scope="module")
def rss_checkpoint(tmp_path_factory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("rss") / "checkpoint"
    make_checkpoint("shape:olmoe-1b-7b@4~w512", path)  # 300 MB, 64% experts
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.mark.parametrize("method", ["direct", "fadvise"])
def test_peak_rss_is_the_non_expert_bytes(rss_checkpoint, method):
    """In a fresh process: loading the skeleton of a checkpoint whose experts are 64% of it grows
    the peak RSS by the non-expert bytes plus a small margin (plus the O_DIRECT bounce buffer)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc")
    path = rss_checkpoint
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(path), method],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    margin = 32 * 2**20 + (figures["bounce"] if method == "direct" else 0)
    print(
        f"{method}: peak RSS growth {figures['growth'] / 2**20:.1f} MiB, non-expert {figures['non_expert'] / 2**20:.1f} MiB, experts {figures['expert'] / 2**20:.1f} MiB"
    )
    assert figures["growth"] <= figures["non_expert"] + margin, figures
    assert figures["growth"] < figures["non_expert"] + figures["expert"] / 2, figures
