"""Offloading experts that are already quantized (issue 40 item 2): the store holds int4 / int8
bytes, a miss reads them, and the outputs are exactly the quantized model's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import moectl
from moectl.offload import offload
from moectl.offload.runtime import BudgetError
from moectl.quant import quantize_checkpoint
from moectl.quant.checkpoint_store import QuantizedCheckpointStore
from moectl.quant.load_quantized import load_quantized, load_quantized_lazy

IDS = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _experts(model):
    return [m for m in model.modules() if callable(getattr(m, "expert_tensors", None))]


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("store", ["disk", "host"])
def test_offloaded_quantized_experts_compute_what_the_quantized_model_computes(scheme, store):
    model = moectl.load("tiny:olmoe", quantize=scheme).model
    before = _logits(model)
    tensors = {id(m): {n: t.clone() for n, t in m.expert_tensors().items()} for m in _experts(model)}
    with offload(model, budget=2, store=store) as rt:
        during = _logits(model)
        totals = rt.totals()
    assert torch.equal(during, before)
    assert totals["misses"] > 0 and totals["loads"] > 0
    quantized = sum(t[0].numel() * t.element_size() for t in next(iter(tensors.values())).values())
    assert totals["stored_expert_bytes"][0] == quantized, "the store holds the quantized bytes"
    for m in _experts(model):  # put back as buffers, bit for bit
        assert set(m.expert_tensors()) == set(tensors[id(m)])
        for name, t in m.expert_tensors().items():
            assert torch.equal(t, tensors[id(m)][name]), name
    assert torch.equal(_logits(model), before)


def test_int8_slots_of_quantized_experts_are_refused():
    model = moectl.load("tiny:olmoe", quantize="int4").model
    with pytest.raises(BudgetError, match="quantized already"), offload(model, budget=2, slot_dtype="int8"):
        pass
    assert torch.equal(_logits(model), _logits(moectl.load("tiny:olmoe", quantize="int4").model))


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "tiny-int4"
    quantize_checkpoint("tiny:olmoe", out, "int4", group_size=32)
    return out


def test_a_quantized_checkpoint_served_lazily_reads_only_quantized_experts(int4_checkpoint):
    whole, _ = load_quantized(int4_checkpoint, with_tokenizer=False)
    lazy, _, store = load_quantized_lazy(int4_checkpoint, with_tokenizer=False)
    try:
        assert all(t.is_meta for m in _experts(lazy) for t in m.expert_tensors().values())
        assert isinstance(store, QuantizedCheckpointStore) and len(store.layers) == len(_experts(lazy))
        for name, t in store.load(1, 3).items():  # one expert as the whole model holds it
            assert torch.equal(t, _experts(whole)[1].expert_tensors()[name][3]), name
        before = store.stats.bytes
        with offload(lazy, budget=2, reader=store) as rt:
            assert rt.store_kind == "checkpoint"
            assert torch.equal(_logits(lazy), _logits(whole))
            read = store.stats.bytes - before
        assert read == rt.totals()["loads"] * store.layers[0].expert_bytes  # the quantized bytes, no more
        assert all(t.is_meta for m in _experts(lazy) for t in m.expert_tensors().values()), "back on meta"
    finally:
        store.close()


def test_serve_offload_of_a_quantized_checkpoint(int4_checkpoint, tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "moectl", "serve-offload", str(int4_checkpoint), "--budget", "2",
           "--max-new-tokens", "8", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", **_env()})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["store"] == "checkpoint" and result["misses"] > 0
    whole, _ = load_quantized(int4_checkpoint, with_tokenizer=False)
    quantized = sum(t[0].numel() * t.element_size() for t in _experts(whole)[0].expert_tensors().values())
    assert result["bytes_moved"] == result["loads"] * quantized


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moectl", *args], capture_output=True, text=True, timeout=300, env=env)


def test_serve_offload_quantize_puts_quantized_experts_in_the_store(tmp_path):
    out = tmp_path / "r.json"
    done = _cli("serve-offload", "tiny:olmoe", "--quantize", "int4", "--budget", "2", "--max-new-tokens", "8",
                "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    model = moectl.load("tiny:olmoe", quantize="int4").model
    quantized = sum(t[0].numel() * t.element_size() for t in _experts(model)[0].expert_tensors().values())
    assert result["store"] == "disk" and result["bytes_moved"] == result["loads"] * quantized


@pytest.mark.parametrize(
    "args, says",
    [
        (["tiny:olmoe", "--quantize", "int4", "--slot-dtype", "int8"], "quantized already"),
        (["MODEL", "--quantize", "int4"], "quantize it once (moectl checkpoint quantize"),
        (["tiny:olmoe", "--quantize", "int3"], "--quantize must be one of"),
    ],
)
def test_quantized_offloading_usage_errors(args, says, int4_checkpoint, tmp_path):
    if args[0] == "MODEL":  # a bf16 checkpoint folder, whose experts would stay in bf16 shards
        folder = tmp_path / "bf16"
        moectl.load("tiny:olmoe").model.save_pretrained(folder)
        args = [str(folder), *args[1:]]
    done = _cli("serve-offload", *args, "--budget", "2", "--max-new-tokens", "4")
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_int4_codes_are_repacked_once_into_a_cache_beside_the_checkpoint(int4_checkpoint):
    from moectl.quant.checkpoint_store import KERNEL_CACHE, experts_modules

    lazy, _, first = load_quantized_lazy(int4_checkpoint, with_tokenizer=False)
    first.close()
    files = sorted((int4_checkpoint / KERNEL_CACHE).rglob("*.bin"))
    assert len(files) == 2 * len(first.layers) and first.repacked == {"gate_up.packed", "down.packed"}
    stamps = [f.stat().st_mtime_ns for f in files]
    args = (int4_checkpoint, experts_modules(lazy), "int4", torch.float32)
    again = QuantizedCheckpointStore(*args)  # reused, not written again
    assert [f.stat().st_mtime_ns for f in files] == stamps
    fresh = QuantizedCheckpointStore(*args)
    fresh.repacked = set()  # as in a read-only folder: the stored codes, repacked at each load
    for layer in fresh.layers:
        for name, entry in layer.entries.items():
            if name.endswith(".packed"):
                layer.entries[name] = again.layers[0].entries[name].__class__(
                    entry.key, *_stored(int4_checkpoint, entry.key)
                )
    for layer in range(len(again.layers)):
        for name, t in again.load(layer, 5).items():
            assert torch.equal(t, fresh.load(layer, 5)[name]), (layer, name)
    again.close()
    fresh.close()


def _stored(folder, key: str) -> tuple:
    from moectl.io.safetensors_index import CheckpointIndex

    e = CheckpointIndex(folder)[key]
    return e.file, e.offset, e.nbytes, e.dtype, e.shape
