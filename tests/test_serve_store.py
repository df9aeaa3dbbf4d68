"""The expert store loads exactly one expert and fails loudly on a missing or corrupted file."""

from __future__ import annotations

import json

import pytest
import torch

import moectl
from moectl.offload import DiskStore, ExpertStoreError, HostStore, offload
from moectl.offload.cost import deliberation_cost, measure_load_latency

torch.set_num_threads(1)


def _layers(e: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"gate_up_proj": torch.randn(e, 6, 4, generator=g), "down_proj": torch.randn(e, 4, 3, generator=g)}
        for _ in range(2)
    ]


def test_disk_and_host_store_return_exactly_one_expert(tmp_path):
    layers = _layers()
    disk, host = DiskStore.write(tmp_path, layers), HostStore(layers)
    for store in (disk, host):
        got = store.load(1, 2)
        assert got.keys() == layers[1].keys()
        for name, t in got.items():
            assert torch.equal(t, layers[1][name][2])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "layer_000.safetensors",
        "layer_001.safetensors",
        "manifest.json",
    ]


def test_missing_expert_file_fails_loudly(tmp_path):
    store = DiskStore.write(tmp_path, _layers())
    (tmp_path / "layer_001.safetensors").unlink()
    assert torch.equal(store.load(0, 0)["down_proj"], _layers()[0]["down_proj"][0])
    with pytest.raises(ExpertStoreError, match=r"layer_001\.safetensors.*missing"):
        store.load(1, 0)


def test_corrupted_expert_file_fails_loudly(tmp_path):
    store = DiskStore.write(tmp_path, _layers())
    path = tmp_path / "layer_000.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip a byte of the last tensor's data: same size, same header
    path.write_bytes(bytes(data))
    with pytest.raises(ExpertStoreError, match=r"checksum mismatch.*corrupted"):
        for e in range(4):
            store.load(0, e)


def test_truncated_file_and_wrong_shape_fail_loudly(tmp_path):
    DiskStore.write(tmp_path, _layers())
    path = tmp_path / "layer_000.safetensors"
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ExpertStoreError, match="bytes, the manifest says"):
        DiskStore(tmp_path).load(0, 0)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["layers"][1]["experts"][0]["down_proj"]["shape"] = [4, 4]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExpertStoreError, match=r"expected \[4, 4\]"):
        DiskStore(tmp_path).load(1, 0)


def test_generation_from_a_corrupted_store_raises_instead_of_computing(tmp_path):
    model = moectl.tiny("olmoe")
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    # the model cannot be restored from a corrupted store either: leaving the block raises too
    with pytest.raises(ExpertStoreError), offload(model, 2, "lru", store="disk", store_dir=tmp_path):
        for p in tmp_path.glob("layer_*.safetensors"):
            data = bytearray(p.read_bytes())
            data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)  # zero the second half
            p.write_bytes(bytes(data))
        with pytest.raises(ExpertStoreError, match="checksum mismatch"):
            model(ids)


def test_load_latency_and_deliberation_cost(tmp_path):
    store = DiskStore.write(tmp_path, _layers())
    lat = measure_load_latency(store, 0, [0, 1], repeats=2)
    assert lat["samples"] == 4 and lat["load_s"] > 0
    assert lat["expert_bytes"] == (6 * 4 + 4 * 3) * 4
    assert deliberation_cost(2e-3, 1e-2, 4) == pytest.approx(0.8)
    assert deliberation_cost(2e-3, 1e-2, 4, nats_per_token_delay=0.05) == pytest.approx(0.04)
    with pytest.raises(ValueError):
        deliberation_cost(1e-3, 0.0, 4)
