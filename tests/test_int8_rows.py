"""moectl.kernels.int8_rows: int8 weight products of a few rows, against float64 and each other."""

from __future__ import annotations

import pytest
import torch

import moectl
from moectl.kernels import bf16_rows, int8_rows
from moectl.offload.int8 import dequantize_rows, int8_linear, quantize_rows
from moectl.quant.quantized_experts import QuantizedExperts

needs_kernel = pytest.mark.skipif(not bf16_rows.available(), reason="no C compiler: the kernel is not built")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(n: int, k: int, seed: int, experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(*((experts,) if experts else ()), n, k, generator=_gen(seed))
    return quantize_rows(w)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 17, 48])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (37, 100), (130, 16), (9, 7)])  # edges: N % 4, K % 16
def test_linear_matches_float64(rows, n, k):
    q, scale = _int8(n, k, seed=1)
    x = torch.randn(rows, k, generator=_gen(2))
    ref = x.double() @ dequantize_rows(q, scale.double()).T
    got = int8_rows.linear(x, q, scale)
    assert got.dtype == torch.float32
    assert (got.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    bf = int8_rows.linear(x.bfloat16(), q, scale)  # bf16 rows: the result rounded to bf16 once
    ref_bf = x.bfloat16().double() @ dequantize_rows(q, scale.double()).T
    assert bf.dtype == torch.bfloat16 and (bf.double() - ref_bf).abs().max().item() <= ref_bf.abs().max().item() * 2**-7


@needs_kernel
def test_a_row_does_not_depend_on_the_rows_beside_it():
    q, scale = _int8(70, 96, seed=3)
    x = torch.randn(11, 96, generator=_gen(4)).bfloat16()
    together = int8_rows.linear(x, q, scale)
    for r in range(11):
        assert torch.equal(int8_rows.linear(x[r : r + 1], q, scale), together[r : r + 1])


@needs_kernel
@pytest.mark.parametrize("sizes", [[2, 0, 1, 3], [0, 0, 5, 0], [1, 1, 1, 1]])
def test_grouped_equals_each_experts_product(sizes):
    q, scale = _int8(40, 48, seed=5, experts=len(sizes))
    x = torch.randn(sum(sizes), 48, generator=_gen(6)).bfloat16()
    offsets = torch.tensor(sizes).cumsum(0)
    got = int8_rows.grouped(x, q, scale, offsets)
    start = 0
    for e, size in enumerate(sizes):
        if size:
            assert torch.equal(got[start : start + size], int8_rows.linear(x[start : start + size], q[e], scale[e]))
        start += size


@needs_kernel
def test_applies_to_few_rows_on_the_cpu_without_gradients(monkeypatch):
    q, _ = _int8(16, 32, seed=7)
    assert int8_rows.applies(torch.zeros(3, 32), q)
    assert not int8_rows.applies(torch.zeros(bf16_rows.FEW_ROWS + 1, 32), q)
    assert not int8_rows.applies(torch.zeros(1, 32, requires_grad=True), q)
    assert not int8_rows.applies(torch.zeros(1, 32), q.float())
    monkeypatch.setenv("MOECTL_CPU_KERNELS", "0")
    bf16_rows.refresh()
    try:
        assert not int8_rows.applies(torch.zeros(3, 32), q)
    finally:
        monkeypatch.delenv("MOECTL_CPU_KERNELS")
        bf16_rows.refresh()


@needs_kernel
def test_int8_linear_takes_the_kernel_and_agrees_with_pytorchs(monkeypatch):
    """``offload.int8.int8_linear`` (slots and ``Int8Weights``) runs the kernel; with the kernels off
    it runs PyTorch's int8 product: the two agree within bf16 rounding."""
    q, scale = _int8(64, 128, seed=8)
    x = torch.randn(4, 128, generator=_gen(9)).bfloat16()
    ours = int8_linear(x, q, scale)
    assert torch.equal(ours, int8_rows.linear(x, q, scale))
    monkeypatch.setenv("MOECTL_CPU_KERNELS", "0")
    bf16_rows.refresh()
    try:
        theirs = int8_linear(x, q, scale)
    finally:
        monkeypatch.delenv("MOECTL_CPU_KERNELS")
        bf16_rows.refresh()
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2 * theirs.abs().max().item())


@needs_kernel
def test_int8_experts_in_one_call_equal_one_call_per_expert(monkeypatch):
    """``QuantizedExperts`` at int8 multiplies every hit expert in one kernel call a projection; the
    loop over experts (taken where ``grouped`` gives None) computes the same."""
    model, _, _ = moectl.load("tiny:olmoe", dtype="bfloat16", quantize="int8")
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    hidden = torch.randn(6, experts.hidden_dim, generator=_gen(10)).bfloat16()
    index = torch.randint(0, experts.num_experts, (6, 2), generator=_gen(11))
    weights = torch.rand(6, 2, generator=_gen(12)).bfloat16()
    with torch.no_grad():
        one_call = experts(hidden, index, weights)
        monkeypatch.setattr(type(experts.gate_up), "grouped", lambda self, x, offsets: None)
        per_expert = experts(hidden, index, weights)
    assert torch.equal(one_call, per_expert)
