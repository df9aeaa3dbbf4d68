"""One row times an int4 weight by moectl's C loop (moectl.kernels.int4_row).

Its fp32 sums equal a float64 product of the dequantised weight within fp32 rounding (AVX-512 and
plain-C builds), ``int4_linear`` takes it for one row and only one, and it stays out where it does
not apply (several rows, output rows not a multiple of 64, fp16 scales, the kernels switched off).
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from moectl.kernels import bf16_rows, int4_row
from moectl.kernels import kernel_build as build
from moectl.quant import int4_groups
from test_quant_unpack import kernels_on  # noqa: F401 (a fixture)

SHAPES = [(128, 256, 64), (192, 512, 128), (64, 96, 32), (256, 512, 256)]  # (N, K, group): K 96 padded


def _weight(n: int, k: int, group: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return int4_groups.quantize(w, group, torch.bfloat16)


def _exact(x: torch.Tensor, packed, scale_zero, g: int, n: int, k: int) -> torch.Tensor:
    return x.double() @ int4_groups.dequantize(packed, scale_zero, g, n, k, torch.float64).T


@pytest.fixture
def kernel_on(kernels_on):  # noqa: F811 (the fixture imported above)
    if int4_row._lib() is None:
        pytest.skip("no AVX-512: the loop is not used here")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_row_equals_the_dequantised_product(kernel_on, dtype):
    for n, k, group in SHAPES:
        packed, scale_zero, g = _weight(n, k, group, seed=n + k)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        assert int4_row.applies(x, packed, scale_zero)
        got = int4_row.linear(x, packed, scale_zero, g, n)
        want = _exact(x, packed, scale_zero, g, n, k)
        assert got.shape == (1, n) and got.dtype == dtype
        step = 2**-7 if dtype == torch.bfloat16 else 1e-5  # the result's own rounding
        assert (got.double() - want).abs().max().item() <= step * want.abs().max().item()


def test_int4_linear_takes_it_for_one_row_only(kernel_on, monkeypatch):
    packed, scale_zero, g = _weight(128, 256, 64)
    calls = []
    real = int4_row.linear
    monkeypatch.setattr(int4_row, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    int4_groups.int4_linear(x[:1], packed, scale_zero, g, 128, 256)
    assert calls == [1]
    both = int4_groups.int4_linear(x, packed, scale_zero, g, 128, 256)  # two rows: PyTorch's kernel
    assert calls == [1]
    want = _exact(x, packed, scale_zero, g, 128, 256)
    assert (both.double() - want).abs().max().item() <= 2**-7 * want.abs().max().item()


def test_where_it_does_not_apply(kernel_on, monkeypatch):
    packed, scale_zero, _ = _weight(128, 256, 64)
    one = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert not int4_row.applies(torch.zeros(2, 256, dtype=torch.bfloat16), packed, scale_zero)
    assert not int4_row.applies(one, packed, scale_zero.half())
    tail, tail_sz, _ = _weight(80, 256, 64)  # 80 output rows: not whole blocks of 64
    assert not int4_row.applies(one, tail, tail_sz)
    monkeypatch.setenv("MOECTL_CPU_KERNELS", "0")
    bf16_rows.refresh()
    assert not int4_row.applies(one, packed, scale_zero)


def test_the_plain_c_loop_computes_the_same(tmp_path):
    if build._compiler() is None:
        pytest.skip("no C compiler")
    source = Path(int4_row.__file__).with_name("unpack.c")
    lib_path = tmp_path / "unpack.so"
    done = subprocess.run([build._compiler(), "-O2", "-march=x86-64", "-std=c11", "-fopenmp", "-shared", "-fPIC",
                           str(source), "-o", str(lib_path)], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    fn = ctypes.CDLL(str(lib_path)).moectl_int4_row
    for n, k, group in SHAPES:
        packed, scale_zero, g = _weight(n, k, group, seed=3)
        k_pad = packed.shape[1] * 2
        x = torch.zeros(1, k_pad)
        x[:, :k] = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
        for xs, step in ((x, 1e-5), (x.to(torch.bfloat16), 2**-7)):  # fp32, and bf16 in and out
            y = torch.empty(n, dtype=xs.dtype)
            fn(ctypes.c_void_p(xs.data_ptr()), ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(scale_zero.data_ptr()),
               ctypes.c_int64(n), ctypes.c_int64(k_pad), ctypes.c_int64(g), ctypes.c_void_p(y.data_ptr()),
               ctypes.c_int(xs.dtype == torch.bfloat16), ctypes.c_int(1))  # fmt: skip
            wanted = _exact(xs[:, :k].float(), packed, scale_zero, g, n, k)[0]
            assert (y.double() - wanted).abs().max().item() <= step * wanted.abs().max().item()


def test_bf16_dot_products_and_the_fp32_widening_agree(kernel_on):
    """A bf16 row takes AVX512-BF16 dot products where the CPU has them (``row_block_dp``), else the
    fp32 widening (``-DNO_DP_BF16`` builds that way here): both within one bf16 step of the exact product."""
    flags = build.cpu_flags().split()
    if "avx512_bf16" not in flags or "avx512vbmi" not in flags:
        pytest.skip("no AVX512-BF16 and VBMI: only the fp32 widening is built here")
    source = Path(int4_row.__file__).with_name("unpack.c")
    ways = [ctypes.CDLL(str(build.build(source, defines))).moectl_int4_row for defines in ((), ("NO_DP_BF16",))]
    for n, k, group in [*SHAPES, (2048, 1024, 64)]:
        packed, scale_zero, g = _weight(n, k, group, seed=7)
        k_pad = packed.shape[1] * 2
        x = torch.zeros(1, k_pad, dtype=torch.bfloat16)
        x[:, :k] = torch.randn(1, k, generator=torch.Generator().manual_seed(8))
        wanted = _exact(x[:, :k].float(), packed, scale_zero, g, n, k)[0]
        for fn in ways:
            y = torch.empty(n, dtype=torch.bfloat16)
            fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(scale_zero.data_ptr()),
               ctypes.c_int64(n), ctypes.c_int64(k_pad), ctypes.c_int64(g), ctypes.c_void_p(y.data_ptr()),
               ctypes.c_int(1), ctypes.c_int(2))  # fmt: skip
            assert (y.double() - wanted).abs().max().item() <= 2**-7 * wanted.abs().max().item()


def test_a_steps_experts_in_one_call_equal_the_row_loop(kernel_on, monkeypatch):
    """``Int4Weights.grouped``: rows sorted by expert (some experts with two rows, some with none),
    each row equal to the one-row loop's result bit for bit; the quantized experts' forward takes it."""
    from moectl.quant.packed_weights import Int4Weights

    w = torch.randn(6, 128, 192, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    weights = Int4Weights(w, 64)
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    offsets = torch.tensor([2, 2, 3, 3, 5, 5], dtype=torch.int32)  # experts 0, 2, 4 have rows
    got = weights.grouped(x, offsets)
    assert got is not None and got.shape == (5, 128)
    experts = [0, 0, 2, 4, 4]
    for row, e in enumerate(experts):
        assert torch.equal(got[row : row + 1], weights.linear(x[row : row + 1], e))
    assert weights.grouped(torch.zeros(int4_row.GROUPED_MAX_ROWS + 1, 192, dtype=torch.bfloat16), offsets) is None
    calls = []
    real = int4_row.grouped
    monkeypatch.setattr(int4_row, "grouped", lambda *a: calls.append(1) or real(*a))
    import moectl
    from moectl.quant.quantized_experts import QuantizedExperts

    _, _, info = moectl.load("tiny:olmoe", dtype="bfloat16", quantize="int4")
    experts_module = info.layers[0].block.experts
    assert isinstance(experts_module, QuantizedExperts)
    hidden = torch.randn(2, experts_module.hidden_dim, dtype=torch.bfloat16)
    index = torch.tensor([[0, 1], [1, 3]])
    out = experts_module(hidden, index, torch.full((2, 2), 0.5, dtype=torch.bfloat16))
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    # whether the tiny model's shapes take it (whole blocks of 64 output rows) decides the count
    takes = experts_module.gate_up.packed.shape[1] % int4_row.BLOCK == 0
    assert bool(calls) == takes
