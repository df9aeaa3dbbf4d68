"""moectl.kernels: the bf16 CPU products built for this machine, against float64 and PyTorch."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moectl.kernels import bf16_rows, cpu_linear
from moectl.kernels import kernel_build as build
from moectl.models.grouped_mm import grouped_mm

needs_kernel = pytest.mark.skipif(not bf16_rows.available(), reason="no C compiler: the kernel is not built")


@pytest.fixture
def kernels_on(monkeypatch):
    """The kernels in use whatever the CPU (on one with native bf16 products they are off by default)."""
    monkeypatch.setenv("MOECTL_CPU_KERNELS", "1")
    bf16_rows.refresh()
    yield
    monkeypatch.delenv("MOECTL_CPU_KERNELS")
    bf16_rows.refresh()


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within bf16 rounding of the float64 product (one bf16 ulp of the largest output)."""
    ref = F.linear(x.double(), w.double())
    assert got.dtype == torch.bfloat16
    tol = ref.abs().max().item() * 2**-7
    assert (got.double() - ref).abs().max().item() <= tol


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 48])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (37, 100), (130, 16)])  # edges: N % 4, K % 16
def test_linear_matches_float64(rows, n, k):
    x, w = _bf16(rows, k, seed=1), _bf16(n, k, seed=2)
    _close(bf16_rows.linear(x, w), x, w)


@needs_kernel
def test_a_row_does_not_depend_on_the_rows_beside_it():
    x, w = _bf16(11, 256, seed=3), _bf16(96, 256, seed=4)
    together = bf16_rows.linear(x, w)
    for i in range(11):
        assert torch.equal(bf16_rows.linear(x[i : i + 1], w), together[i : i + 1])


@needs_kernel
def test_many_rows_cast_blocks_to_fp32(monkeypatch):
    x, w = _bf16(bf16_rows.FEW_ROWS + 9, 64, seed=5), _bf16(200, 64, seed=6)
    whole = bf16_rows.linear(x, w)
    _close(whole, x, w)
    monkeypatch.setattr(bf16_rows, "WIDE_BLOCK_BYTES", 4 * 64 * 30)  # 30 weight rows a block
    assert torch.equal(bf16_rows.linear(x, w), whole)


@needs_kernel
def test_bias_and_leading_dims():
    x, w, b = _bf16(2, 3, 32, seed=7), _bf16(24, 32, seed=8), _bf16(24, seed=9)
    got = bf16_rows.linear(x, w, b)
    assert got.shape == (2, 3, 24)
    ref = F.linear(x.double(), w.double(), b.double())
    assert (got.double() - ref).abs().max().item() <= ref.abs().max().item() * 2**-7


@needs_kernel
@pytest.mark.parametrize("sizes", [[1, 0, 2, 0, 1], [0, 0, 3, 0, 0], [20, 0, 31, 9, 1]])
def test_grouped_matches_each_groups_product(sizes):
    k, n = 64, 40
    w = _bf16(len(sizes), n, k, seed=10)
    x = _bf16(sum(sizes), k, seed=11)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = bf16_rows.grouped(x, w, offsets)
    start = 0
    for e, size in enumerate(sizes):
        if size:
            _close(got[start : start + size], x[start : start + size], w[e])
        start += size


@needs_kernel
def test_grouped_output_feeds_torchs_grouped_mm():
    """A rank-4 LoRA chain (``options/expert_lora.py``): x·A by the kernel, then ·B by ``F.grouped_mm``,
    which wants 16-byte row strides: the kernel's 4-wide output keeps them."""
    offsets = torch.tensor([2, 3], dtype=torch.int32)
    a = _bf16(2, 4, 32, seed=14)  # [E, r, in]
    h = bf16_rows.grouped(_bf16(3, 32, seed=15), a, offsets)
    assert h.shape == (3, 4) and (h.stride(0) * 2) % 16 == 0
    out = F.grouped_mm(h, _bf16(2, 4, 8, seed=16), offs=offsets)
    assert out.shape == (3, 8)


@needs_kernel
def test_grouped_mm_takes_the_kernel_for_transposed_bf16(monkeypatch, kernels_on):
    """``models.grouped_mm`` (what every moectl experts forward runs) calls the kernel for inference
    and PyTorch's ``grouped_mm`` when a gradient is wanted."""
    w = _bf16(3, 16, 32, seed=12)
    x = _bf16(4, 32, seed=13)
    offsets = torch.tensor([1, 1, 4], dtype=torch.int32)
    calls = []
    real = bf16_rows.grouped
    monkeypatch.setattr(bf16_rows, "grouped", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        fast = grouped_mm(x, w.transpose(-2, -1), offsets)
    assert calls == [1]
    w.requires_grad_(True)
    slow = grouped_mm(x, w.transpose(-2, -1), offsets)
    assert calls == [1] and slow.requires_grad
    assert (fast.float() - slow.detach().float()).abs().max().item() <= slow.abs().max().item() * 2**-7


def test_applies_only_to_bf16_cpu_inference(kernels_on):
    x, w = _bf16(2, 32), _bf16(8, 32)
    assert bf16_rows.applies(x, w) == bf16_rows.available()
    assert not bf16_rows.applies(x.float(), w.float())
    assert not bf16_rows.applies(x, w.t().contiguous().t())  # rows not contiguous
    assert not bf16_rows.applies(x, w.clone().requires_grad_(True))
    with torch.no_grad():
        assert bf16_rows.applies(x, w.clone().requires_grad_(True)) == bf16_rows.available()


def test_install_changes_only_plain_bf16_cpu_linears():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).bfloat16(), nn.Embedding(4, 8).bfloat16())
    model.append(type("Other", (nn.Linear,), {})(8, 8).bfloat16())
    assert cpu_linear.install(model) == 1
    assert cpu_linear.install(model) == 0  # idempotent
    assert type(model[1]) is cpu_linear.CpuBf16Linear and isinstance(model[1], nn.Linear)
    assert type(model[0]) is nn.Linear and type(model[3]).__name__ == "Other"
    keys = list(model.state_dict())
    twin = copy.deepcopy(model)
    assert list(twin.state_dict()) == keys and type(twin[1]) is cpu_linear.CpuBf16Linear


def test_installed_linear_keeps_gradients(kernels_on):
    layer = nn.Linear(16, 8).bfloat16()
    cpu_linear.install(nn.Sequential(layer))
    x = _bf16(3, 16).requires_grad_(True)
    layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        out = layer(_bf16(3, 16))
    ref = F.linear(_bf16(3, 16).double(), layer.weight.double(), layer.bias.double())
    assert (out.double() - ref).abs().max().item() <= ref.abs().max().item() * 2**-7


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("MOECTL_CPU_KERNELS", "0")
    bf16_rows.refresh()
    try:
        assert not bf16_rows.available() and not bf16_rows.applies(_bf16(2, 16), _bf16(8, 16))
        layer = nn.Linear(16, 8).bfloat16()
        cpu_linear.install(nn.Sequential(layer))
        with torch.no_grad():
            assert torch.equal(layer(_bf16(2, 16)), F.linear(_bf16(2, 16), layer.weight, layer.bias))
    finally:
        monkeypatch.delenv("MOECTL_CPU_KERNELS")
        bf16_rows.refresh()


def test_cpus_with_native_bf16_run_the_kernel_for_few_rows_and_pytorch_for_many(monkeypatch):
    """Measured 2026-11-29 on an AMX CPU: the kernel reads 1.6-2.1x oneDNN's bytes/s for one row, so it
    runs there too; past FEW_ROWS rows PyTorch's bf16 product (AMX), not the fp32 blocks."""
    monkeypatch.delenv("MOECTL_CPU_KERNELS", raising=False)
    monkeypatch.setattr(bf16_rows, "native_bf16", lambda: True)
    bf16_rows.refresh()
    try:
        w = _bf16(8, 16)
        assert bf16_rows.wanted() and bf16_rows.applies(_bf16(2, 16), w) == bf16_rows.available()
        many = _bf16(bf16_rows.FEW_ROWS + 1, 16)
        assert torch.equal(bf16_rows._many(many, w), F.linear(many, w).float())
        # there the kernel takes only a few rows: oneDNN's product barely grows with them (module doc)
        large = torch.empty(1024, 256, dtype=torch.bfloat16)  # 512 KiB
        assert bf16_rows.few(bf16_rows.NATIVE_FEW_ROWS, large) and not bf16_rows.few(bf16_rows.NATIVE_FEW_ROWS + 1, large)
        assert bf16_rows.few(bf16_rows.NATIVE_SMALL_ROWS, w) and not bf16_rows.few(bf16_rows.NATIVE_SMALL_ROWS + 1, w)
        if bf16_rows.available():
            x, big = _bf16(8, 256, seed=1), _bf16(1024, 256, seed=2)
            assert torch.equal(bf16_rows.linear(x, big), F.linear(x, big))  # PyTorch's product, as it is
    finally:
        monkeypatch.undo()
        bf16_rows.refresh()
    monkeypatch.setattr(bf16_rows, "native_bf16", lambda: False)
    try:  # without native bf16 the kernel keeps every row up to FEW_ROWS
        assert bf16_rows.few(bf16_rows.FEW_ROWS, large) and not bf16_rows.few(bf16_rows.FEW_ROWS + 1, large)
    finally:
        monkeypatch.undo()
        bf16_rows.refresh()


def test_build_caches_atomically(tmp_path, monkeypatch):
    if build._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MOECTL_KERNEL_CACHE", str(tmp_path))
    source = tmp_path / "src" / "twice.c"
    source.parent.mkdir()
    source.write_text("int moectl_twice(int v) { return 2 * v; }\n")
    first = build.build(source)
    assert first is not None and first.parent == tmp_path and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert build.build(source) == first and first.stat().st_mtime_ns == stamp  # cached
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no half-built file
    source.write_text("int moectl_twice(int v) { return v + v; }\n")
    assert build.build(source) != first  # a changed source builds anew


def test_a_broken_source_or_no_compiler_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("MOECTL_KERNEL_CACHE", str(tmp_path))
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    if build._compiler() is not None:
        assert build.build(source) is None
        assert [p for p in tmp_path.iterdir() if p.suffix == ".so"] == []
    monkeypatch.setenv("CC", os.path.join(str(tmp_path), "no-such-compiler"))
    assert build.build(source) is None


@pytest.mark.parametrize("flags", [["-mavx2", "-mfma"], ["-march=x86-64"]], ids=["avx2", "scalar"])
def test_the_other_cpus_paths_compute_the_same(tmp_path, flags):
    """The AVX2 and plain-C paths of ``bf16_rows.c`` (what machines without AVX-512 build), compiled
    here with those flags, against float64: N % 4 and K % 8 edges, 1 to 6 rows, bf16 and int8 weights."""
    import ctypes
    import subprocess
    from pathlib import Path

    cc = build._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    source = Path(bf16_rows.__file__).with_name("bf16_rows.c")
    lib_path = tmp_path / "k.so"
    done = subprocess.run([cc, "-O2", *flags, "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(lib_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(lib_path))
    for rows, n, k in [(1, 37, 100), (5, 64, 130), (6, 9, 7)]:
        x, w = _bf16(rows, k, seed=20), _bf16(n, k, seed=21)
        x32, y = x.float().contiguous(), torch.empty(rows, n)
        lib.moectl_bf16_linear(
            ctypes.c_void_p(x32.data_ptr()), ctypes.c_int64(k), ctypes.c_int64(rows),
            ctypes.c_void_p(w.data_ptr()), ctypes.c_int64(k), ctypes.c_int64(n), ctypes.c_int64(k),
            ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(n), ctypes.c_int(1),
        )  # fmt: skip
        _close(y.bfloat16(), x, w)
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(22))
        scale = torch.rand(n, generator=torch.Generator().manual_seed(23)) + 0.5  # int8 rows (the int8 paths)
        lib.moectl_int8_linear(
            ctypes.c_void_p(x32.data_ptr()), ctypes.c_int64(k), ctypes.c_int64(rows),
            ctypes.c_void_p(q.data_ptr()), ctypes.c_int64(k), ctypes.c_void_p(scale.data_ptr()), ctypes.c_int64(n),
            ctypes.c_int64(k), ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(n), ctypes.c_int(1),
        )  # fmt: skip
        ref = x.double() @ (q.double() * scale.double()[:, None]).T
        assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
