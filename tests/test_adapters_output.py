"""Each adapter reads and rewrites its own router's output (polymorphism, not a format string): the
selection it reads is the router's, and a selection it writes back is the one read again."""

from __future__ import annotations

import pytest
import torch

import moectl
from moectl.adapters.linear_gate import GateRouter
from moectl.adapters.llama4 import Llama4Adapter
from moectl.adapters.registry import Adapter


@torch.no_grad()
def test_adapters_read_and_rewrite_their_routers_output(family):
    model = moectl.tiny(family)
    layer = moectl.inspect(model).layers[0]
    if isinstance(layer.router, GateRouter):
        pytest.skip("a remote-code gate: moectl drives the block, it rewrites no router output")
    adapter, k = layer.adapter, layer.top_k
    assert isinstance(adapter, Llama4Adapter) is (family.startswith("llama4"))
    size = model.config.get_text_config().hidden_size
    hidden = torch.randn(6, size, generator=torch.Generator().manual_seed(0), dtype=next(model.parameters()).dtype)
    output = layer.router(hidden)
    dense, idx = adapter.selection_of(output, k)  # [N, E], [N, k]
    assert dense.shape == (6, layer.num_experts) and idx.shape == (6, k)
    read = adapter.indices_of(output, k).reshape(6, k)
    assert torch.equal(read.sort(-1).values, idx.sort(-1).values)
    assert (dense != 0).sum(-1).le(k).all() and dense.gather(1, idx).ne(0).any(-1).all()
    new_idx = torch.stack([torch.randperm(layer.num_experts)[:k] for _ in range(6)])  # another selection
    new_w = torch.rand(6, k) + 0.1
    repacked = adapter.repack(output, new_w, new_idx)
    assert torch.equal(adapter.logits_of(repacked), adapter.logits_of(output))
    assert torch.equal(adapter.indices_of(repacked, k).reshape(6, k).sort(-1).values, new_idx.sort(-1).values)
    weights = adapter.selection_of(repacked, k)[0]
    torch.testing.assert_close(weights.gather(1, new_idx).float(), new_w.to(weights.dtype).float())


def test_only_llama4_overrides_the_output_methods():
    methods = ("logits_of", "indices_of", "selection_of", "repack", "routed_output")
    assert all(getattr(Llama4Adapter, m) is not getattr(Adapter, m) for m in methods)
    assert Llama4Adapter.experts_transposed and not Adapter.experts_transposed
