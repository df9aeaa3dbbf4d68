"""Quantized weights dequantised by moectl's C loops (moectl.kernels.unpack) for many-row products.

The values equal ``int4_groups.dequantize``'s bit for bit (AVX-512 and plain-C builds), the weight
comes back as the [N, K] view of a [K, N] tensor, ``int4_linear`` takes it from
``INT4_UNPACK_MIN_ROWS`` bf16 rows on (within bf16 rounding of the dequantised weight's product),
and it stays out where it does not apply (float32 rows, fp16 scales, output rows not a multiple of
64, the kernels switched off).
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from moectl.kernels import bf16_rows, unpack
from moectl.kernels import kernel_build as build
from moectl.quant import int4_groups

SHAPES = [(128, 256, 64), (192, 512, 128), (64, 96, 32), (256, 512, 256)]


def _weight(n: int, k: int, group: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return int4_groups.quantize(w, group, torch.bfloat16)


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.delenv("MOECTL_CPU_KERNELS", raising=False)
    bf16_rows.refresh()
    if unpack._lib() is None:
        pytest.skip("no C compiler: the kernel is not built")
    yield
    bf16_rows.refresh()


@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_unpacked_equals_dequantize_bit_for_bit(n, k, group, kernels_on):
    packed, scale_zero, g = _weight(n, k, group)
    assert unpack.int4_applies(packed, scale_zero) and int4_groups.layout_known(*packed.shape[:1], packed.shape[1] * 2)
    got = unpack.int4_unpacked(packed, scale_zero, g)
    want = int4_groups.dequantize(packed, scale_zero, g, packed.shape[0], packed.shape[1] * 2, torch.bfloat16)
    assert got.shape == want.shape and got.stride() == (1, got.shape[0])  # a [K, N] tensor, seen as [N, K]
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [int4_groups.INT4_UNPACK_MIN_ROWS, 40])
def test_many_bf16_rows_take_it_and_agree(rows, kernels_on, monkeypatch):
    n, k, group = 192, 200, 64  # k padded to the group inside
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    packed, scale_zero, g = int4_groups.quantize(w, group, torch.bfloat16)
    calls = []
    real = unpack.int4_unpacked
    monkeypatch.setattr(unpack, "int4_unpacked", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = int4_groups.int4_linear(x, packed, scale_zero, g, n, k)
    ref = x.double() @ int4_groups.dequantize(packed, scale_zero, g, n, k, torch.float64).T
    assert calls and got.shape == (rows, n)
    assert (got.double() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()  # bf16 products
    fewer = int4_groups.int4_linear(x[: int4_groups.INT4_UNPACK_MIN_ROWS - 1], packed, scale_zero, g, n, k)
    assert len(calls) == 1 and fewer.shape == (int4_groups.INT4_UNPACK_MIN_ROWS - 1, n)  # the kernel below


def test_where_it_does_not_apply(kernels_on, monkeypatch):
    packed, scale_zero, _ = _weight(128, 256, 64)
    assert not unpack.int4_applies(packed, scale_zero.half())  # scales of an fp16 model
    tail, tail_sz, _ = _weight(80, 256, 64)  # 80 output rows: a last block of 16
    assert not unpack.int4_applies(tail, tail_sz)
    monkeypatch.setenv("MOECTL_CPU_KERNELS", "0")
    bf16_rows.refresh()
    assert not unpack.int4_applies(packed, scale_zero)


def _plain_c(tmp_path) -> ctypes.CDLL:
    """``moectl/kernels/unpack.c`` as machines without AVX-512 build it (plain x86-64)."""
    source = Path(unpack.__file__).with_name("unpack.c")
    lib_path = tmp_path / "unpack.so"
    done = subprocess.run([build._compiler(), "-O2", "-march=x86-64", "-std=c11", "-fopenmp", "-shared", "-fPIC",
                           str(source), "-o", str(lib_path)], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(lib_path))


def test_the_plain_c_path_computes_the_same(tmp_path, kernels_on):
    lib = _plain_c(tmp_path)
    for n, k, group in SHAPES:
        packed, scale_zero, g = _weight(n, k, group, seed=5)
        out = torch.empty(k, n, dtype=torch.bfloat16)
        lib.moectl_int4_unpack(
            ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(scale_zero.data_ptr()), ctypes.c_int64(n),
            ctypes.c_int64(k), ctypes.c_int64(g), ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(n), ctypes.c_int(1),
        )  # fmt: skip
        assert torch.equal(out.t(), int4_groups.dequantize(packed, scale_zero, g, n, k, torch.bfloat16))


def test_int8_unpacked_equals_dequantize_rows_and_many_rows_take_it(kernels_on, monkeypatch):
    """The int8 twin (``unpack.c``'s ``moectl_int8_unpack``): ``int8.dequantize_rows``'s values bit for bit
    (K not a multiple of 16 included), and ``int8_linear`` takes it from ``UNPACK_MIN_ROWS`` bf16 rows."""
    from moectl.offload import int8

    for n, k in [(96, 256), (33, 70)]:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        q, scale = int8.quantize_rows(w)
        assert unpack.int8_applies(q, scale)
        assert torch.equal(unpack.int8_unpacked(q, scale), int8.dequantize_rows(q, scale, torch.bfloat16))
    calls = []
    real = unpack.int8_unpacked
    monkeypatch.setattr(unpack, "int8_unpacked", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(int8.UNPACK_MIN_ROWS, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    got = int8.int8_linear(x, q, scale)
    ref = x.double() @ int8.dequantize_rows(q, scale, torch.float64).T
    assert calls and (got.double() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
    int8.int8_linear(x[:-1], q, scale)
    assert len(calls) == 1  # fewer rows: moectl's int8 kernel
    assert not unpack.int8_applies(q, scale.double()) and not unpack.int8_applies(q.t(), scale)


def test_int8_plain_c_path_computes_the_same(tmp_path, kernels_on):
    from moectl.offload import int8

    lib = _plain_c(tmp_path)
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, scale = int8.quantize_rows(w)
    out = torch.empty(40, 70, dtype=torch.bfloat16)
    lib.moectl_int8_unpack(
        ctypes.c_void_p(q.data_ptr()), ctypes.c_int64(70), ctypes.c_void_p(scale.data_ptr()), ctypes.c_int64(40),
        ctypes.c_int64(70), ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(70), ctypes.c_int(1),
    )  # fmt: skip
    assert torch.equal(out, int8.dequantize_rows(q, scale, torch.bfloat16))
