"""The decoding step over static buffers (moectl.lm.graph_decode): its uncaptured CPU twin.

The CUDA graphs replay exactly this step (the same tensor code over the same buffers); here, on the
CPU, it equals the model's forward per family over several steps (keys and values included), with
padded rows and columns buckets, a trimmed cache (a view of the buffers copied in) and a second
cache taking the buffers (the first keeps its own copy). Through the engine, ``graph_decode`` on
against the lean forward: the same tokens and switch rates while rows join and leave with routed
rows in the batch, several buckets' graphs, and a cache past the buffers decoding lean, the reason
counted. The captured path itself is in tests/test_cuda_paths.py (skipped without CUDA).
"""

from __future__ import annotations

import copy

import pytest
import torch

import moectl
from moectl.adapters.inspect import inspect
from moectl.lm.graph_decode import GraphDecode, bucket, buckets
from moectl.lm.step_weights import FAMILIES, step_weights
from moectl.models.grouped_mm import expert_counts
from moectl.routing.kv_cache import with_cache
from test_compiled_decode import _run, same
from test_lean_decode import _prefilled


def _step_both(model, step: GraphDecode, ours, theirs, mask, positions, token):
    with torch.no_grad():
        want = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, **with_cache(theirs),
                     use_cache=True).logits[:, -1]  # fmt: skip
        got = step(token, mask.bool(), positions, ours)
    return got, want


def _grow(mask, positions):
    return torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1), positions + 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("opaque", [False, True])
def test_static_step_equals_the_models_forward_step_after_step(family, batch, opaque, monkeypatch):
    """Three steps, one copy into the buffers: the logits, the experts and the cache as the model's."""
    if opaque:
        monkeypatch.setattr("moectl.lm.step_ops.KERNEL_BYTES", 0)
    model, _, _ = moectl.load(f"tiny:{family}", dtype="float32")
    weights, why = step_weights(model, inspect(model))
    assert weights is not None, why
    step = GraphDecode(weights, max_rows=4, max_len=32, capture=False)
    cache, mask, positions = _prefilled(model, batch)
    ours, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
    for _ in range(3):
        token = torch.randint(3, 60, (batch,))
        got, want = _step_both(model, step, ours, theirs, mask, positions, token)
        torch.testing.assert_close(got.logits, want, rtol=1e-5, atol=1e-5)
        assert got.chosen.shape == (len(inspect(model).layers), batch, weights.top_k)
        assert torch.equal(got.greedy, got.logits.argmax(-1))
        mask, positions = _grow(mask, positions)
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=1e-6, atol=1e-6)
    assert step.copies_in == 1  # the later steps found their own views
    assert step.compiles == 1  # rows bucket 1 or 4 (3 rows padded to 4), columns bucket 16..32


def test_buckets():
    assert buckets(1, 8) == [1, 2, 4, 8] and buckets(1, 6) == [1, 2, 4, 6] and buckets(64, 64) == [64]
    assert buckets(64, 300) == [64, 128, 256, 300]
    assert bucket([1, 2, 4, 8], 3) == 4 and bucket([64, 128], 64) == 64


def test_a_trimmed_cache_and_a_second_cache_keep_their_numbers():
    """A cache trimmed to its last columns (a view of the buffers) is copied out, then in; a second
    cache stepping through the buffers leaves the first its own copy, which then steps on equal."""
    model, _, _ = moectl.load("tiny:olmoe", dtype="float32")
    weights, _ = step_weights(model, inspect(model))
    step = GraphDecode(weights, max_rows=4, max_len=32, capture=False)
    cache, mask, positions = _prefilled(model, 2)
    ours, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
    token = torch.tensor([5, 7])
    _step_both(model, step, ours, theirs, mask, positions, token)
    mask, positions = _grow(mask, positions)
    for layers in (ours.layers, theirs.layers):  # the engine's trim (``engine/kv.py``): the last columns
        for layer in layers:
            layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]
    mask = mask[:, 2:]
    got, want = _step_both(model, step, ours, theirs, mask, positions, token)
    torch.testing.assert_close(got.logits, want, rtol=1e-5, atol=1e-5)
    mask, positions = _grow(mask, positions)

    other, other_mask, other_positions = _prefilled(model, 3)  # another cache takes the buffers
    step(torch.tensor([3, 4, 5]), other_mask.bool(), other_positions, copy.deepcopy(other))
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-6, atol=1e-6)
    got, want = _step_both(model, step, ours, theirs, mask, positions, token)
    torch.testing.assert_close(got.logits, want, rtol=1e-5, atol=1e-5)
    assert step.copies_in == 4


def test_what_the_buffers_do_not_hold_is_named():
    model, _, _ = moectl.load("tiny:olmoe", dtype="float32")
    weights, _ = step_weights(model, inspect(model))
    cache, _, _ = _prefilled(model, 3)
    assert "largest batch (2)" in GraphDecode(weights, max_rows=2, max_len=64, capture=False).covers(cache)
    length = cache.layers[0].keys.shape[2]
    assert "longer than the CUDA graphs' buffers" in GraphDecode(weights, 4, length, capture=False).covers(cache)
    assert GraphDecode(weights, 4, length + 1, capture=False).covers(cache) is None


def test_expert_counts_without_a_host_read_equal_bincount():
    flat = torch.tensor([3, 0, 3, 1, 3, 0])
    want = torch.bincount(flat, minlength=5)
    assert torch.equal(expert_counts(flat, 5), want)
    counts = torch.zeros(5, dtype=torch.long).index_add_(0, flat, torch.ones_like(flat))  # the non-CPU branch's
    assert torch.equal(counts, want)


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_engine_static_step_and_lean_agree_as_rows_join_and_leave(family):
    model, tok, _ = moectl.load(f"tiny:{family}", dtype="float32")
    order = [None, "mask", None, "gumbel", None, "mask"]
    got, got_stats, graphs = _run(model, tok, True, order, every=9, graph_decode=True)
    want, want_stats, _ = _run(model, tok, False, order, every=9)
    assert isinstance(graphs, GraphDecode) and not graphs.captured
    forward = got_stats["decode_forward"]
    assert "static buffers, uncaptured" in forward["path"]
    assert forward["compiled"] > 0 and set(forward["slow"]) == {
        "a request's routing policy (noise, pool, controller, replay)"
    }
    assert same(got, want)
    assert got_stats["switch_rate"] == want_stats["switch_rate"]
    buckets_seen = {key[:2] for key in graphs._graphs}
    assert len({b for b, _ in buckets_seen}) > 1 and len({c for _, c in buckets_seen}) > 1, buckets_seen
    assert any(key[2] is not None for key in graphs._graphs)  # the masked rows' graph


def test_engine_past_the_buffers_decodes_lean_and_counts_why():
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    got, stats, _ = _run(model, tok, True, [None, None], every=9, graph_decode=True, graph_columns=24)
    want, _, _ = _run(model, tok, False, [None, None], every=9)
    forward = stats["decode_forward"]
    assert same(got, want) and forward["compiled"] > 0
    assert list(forward["slow"]) == ["a cache longer than the CUDA graphs' buffers (24 columns)"]
