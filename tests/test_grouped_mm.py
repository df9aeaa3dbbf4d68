"""Grouped expert products: padding groups to repeat their sizes (for oneDNN's kernel cache on the CPU)
changes nothing but the layout — outputs and gradients are the unpadded ones."""

from __future__ import annotations

import pytest
import torch

from moectl.models.grouped_mm import combine, cpu_pad, group_by_expert, grouped_mm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_grouping_gives_the_same_outputs_and_gradients(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tokens, k, experts, d_in, d_out = 300, 4, 8, 16, 24
    index = torch.multinomial(torch.rand(tokens, experts) ** 3, k)  # uneven groups, one may be empty
    index[index == 7] = 6
    weights = torch.softmax(torch.randn(tokens, k), -1).requires_grad_()
    x = torch.randn(tokens, d_in, dtype=dtype, requires_grad=True)
    w = torch.randn(experts, d_in, d_out, dtype=dtype, requires_grad=True)
    results = []
    for pad in (1, 32):
        groups = group_by_expert(index, experts, pad)
        y = combine(grouped_mm(groups.gather(x), w, groups.offsets), weights, groups, tokens)
        results.append((y, *torch.autograd.grad(y.float().square().sum(), [x, w, weights])))
        if pad > 1:
            sizes = torch.diff(groups.offsets, prepend=groups.offsets.new_zeros(1))
            assert (sizes % pad == 0).all() and sizes[7] == 0
            assert groups.padded_rows == int(groups.offsets[-1]) > tokens * k
            assert (groups.row_experts()[groups.slots] == index.reshape(-1)[groups.order]).all()
        else:
            assert (groups.row_experts() == index.reshape(-1)[groups.order]).all()
    for plain, padded in zip(*results, strict=True):
        torch.testing.assert_close(padded, plain)  # the same products; a kernel may block by size


def test_cpu_pad_only_for_large_low_precision_cpu_batches() -> None:
    x = torch.zeros(1)
    choices = torch.zeros(64 * 32 // 4, 4, dtype=torch.long)  # T·k = 64 rows per expert of 32
    assert cpu_pad(x, torch.bfloat16, choices, 32) == 32
    assert cpu_pad(x, torch.bfloat16, choices.reshape(-1)[1:], 32) == 1  # decoding-sized: no padding
    assert cpu_pad(x, torch.float32, torch.zeros(10**6, 1), 32) == 1  # fp32 runs MKL, no per-size compile


def test_models_loaded_in_bf16_on_the_cpu_get_the_padded_forward(tmp_path) -> None:
    """``load_model`` gives a bf16 checkpoint on the CPU moectl's padded grouped forward instead of
    transformers' ``grouped_mm`` (same products); float32 and biased experts (gpt-oss) keep theirs."""
    import moectl
    from moectl.models.grouped_experts import NAME, prefer_on_cpu
    from moectl.models.load import load_model

    model = moectl.tiny("qwen2_moe").to(torch.bfloat16)
    model.set_experts_implementation("grouped_mm")
    model.save_pretrained(tmp_path / "m")
    loaded, _ = load_model(str(tmp_path / "m"), with_tokenizer=False)
    assert loaded.config._experts_implementation == NAME
    ids = torch.randint(3, 200, (4, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded(input_ids=ids).logits.float()
        loaded.set_experts_implementation("grouped_mm")
        theirs = loaded(input_ids=ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)  # bf16: summation order differs
    fp32, _ = load_model(str(tmp_path / "m"), dtype="float32", with_tokenizer=False)
    assert fp32.config._experts_implementation == "grouped_mm"
    biased = moectl.tiny("gpt_oss").to(torch.bfloat16)
    biased.set_experts_implementation("grouped_mm")
    assert prefer_on_cpu(biased) is None and biased.config._experts_implementation == "grouped_mm"


def test_grouped_experts_cpu_benchmark_writes_both_timings(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "r.json"
    command = [sys.executable, str(root / "benchmarks" / "grouped_experts_cpu.py"), "--model",
               str(root / "models" / "moectl-small-standard"), "--batches", "2", "--rounds", "1",
               "--min-len", "64", "--max-len", "96", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert set(record["median_s"]) == {"transformers grouped_mm", "moectl padded grouped"}
    assert record["speedup"] > 0 and len(record["lengths"]) == 2
    assert "speed-up" in done.stdout
