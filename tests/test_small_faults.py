"""Small faults of issue 29: refused at construction, bounded, exact in fp16, no process-wide side effects."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from typer.testing import CliRunner

import moectl
from moectl import ExpertMask, GumbelTopK
from moectl.cli import app
from moectl.ensemble.roe_config import MAX_K, RoEConfig

torch.set_num_threads(1)


@pytest.mark.parametrize("tau", [math.inf, -1, -0.5, math.nan, [0.1, math.inf], {0: -1.0}, "hot", True])
def test_gumbel_refuses_bad_tau_at_construction(tau):
    with pytest.raises(ValueError, match=r"GumbelTopK: (temperatures tau must be >= 0 and finite|tau must be)"):
        GumbelTopK(tau)


@pytest.mark.parametrize("tau", [0.0, 0.3, [0.0, 0.1, 2.0], {1: 0.5}])
def test_gumbel_accepts_finite_non_negative_tau(tau):
    assert GumbelTopK(tau).tau_spec == tau


def test_expert_mask_with_fewer_than_top_k_experts_is_refused_when_made():
    _, _, info = moectl.load("tiny:olmoe")
    k = info.layers[0].top_k
    few = list(range(k - 1))
    with pytest.raises(ValueError, match=f"fewer than top-k = {k}"):
        ExpertMask.from_lists(info, {0: few})
    with pytest.raises(ValueError, match=f"fewer than top-k = {k}"):
        ExpertMask.from_dict({"type": "expert_mask", "experts": {"0": few}}, info)
    row = [1] * (k - 1) + [0] * (info.layers[0].num_experts - k + 1)
    with pytest.raises(ValueError, match=f"fewer than top-k = {k}"):
        ExpertMask.from_dict({"type": "expert_mask", "masks": {"0": [row]}}, info)
    ExpertMask.from_lists(info, {0: list(range(k))})  # exactly top-k is fine


@pytest.mark.parametrize("k", [MAX_K + 1, 100_000])
def test_roe_k_is_bounded(k):
    with pytest.raises(ValueError, match=rf"must be an integer >= 1 and <= {MAX_K}, got {k}"):
        RoEConfig(K=k)
    RoEConfig(K=MAX_K)


def test_roe_cli_refuses_a_huge_k_in_one_line():
    result = CliRunner().invoke(app, ["roe", "generate", "tiny:olmoe", "--k", "100000", "--prompt", "x"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and f"<= {MAX_K}, got 100000" in lines[0]


def test_int8_scales_of_small_fp16_weights_do_not_underflow():
    from moectl.offload.int8 import dequantize_rows, int8_linear, quantize_rows

    w = (torch.randn(16, 32, generator=torch.Generator().manual_seed(0)) * 1e-6).half()
    q, scale = quantize_rows(w)
    assert scale.dtype == torch.float32 and bool((scale > 0).all())
    back = dequantize_rows(q, scale, torch.float16)
    assert back.dtype == torch.float16
    assert bool(((back.float() - w.float()).abs() <= scale[:, None] * 0.5 + 1e-12).all())
    assert back.abs().amax() > 0
    x = (torch.randn(2, 32, generator=torch.Generator().manual_seed(1)) * 100).half()  # outputs ~1e-3: normal fp16
    out = int8_linear(x, q, scale)
    reference = x.float() @ dequantize_rows(q, scale).T
    assert out.dtype == torch.float16
    # within fp16 subnormal rounding of the ~1e-6 weights (before: the scales were 0, the output all zeros)
    assert bool(((out.float() - reference).abs() <= 2e-2 * reference.abs().amax()).all())


def test_default_mode_never_changes_the_umask():
    from moectl.io.atomic import default_mode

    old = os.umask(0o027)
    try:
        with mock.patch.object(os, "umask", side_effect=AssertionError("os.umask was called")):
            assert default_mode() == 0o640 and default_mode(directory=True) == 0o750
    finally:
        os.umask(old)


def test_shape_checkpoint_temporary_folder_reads_the_umask_without_setting_it(tmp_path):
    from moectl.models.shape_checkpoint import _temporary_folder_beside

    old = os.umask(0o027)
    try:
        with mock.patch.object(os, "umask", side_effect=AssertionError("os.umask was called")):
            tmp = _temporary_folder_beside(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert tmp.parent == tmp_path and tmp.stat().st_mode & 0o777 == 0o750


def test_importing_the_lm_eval_backend_leaves_hf_hub_offline_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = "import os, moectl.eval.lm_backend; print(os.environ.get('HF_HUB_OFFLINE'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None"


def test_hub_offline_is_scoped_to_the_task_run():
    from huggingface_hub import constants

    from moectl.eval.lm_tasks import hub_offline

    before = os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE
    with hub_offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True
    assert (os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE) == before


def test_datasets_offline_is_scoped_to_the_task_run(monkeypatch):
    """The task data is local: ``datasets`` is offline during the run, as the user set it after."""
    from datasets import config

    from moectl.eval.lm_tasks import hub_offline

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)  # a user online
    monkeypatch.setattr(config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(config, "HF_DATASETS_OFFLINE", False)
    before = os.environ.get("HF_DATASETS_OFFLINE"), config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE
    with hub_offline():
        assert os.environ["HF_DATASETS_OFFLINE"] == "1"
        assert config.HF_HUB_OFFLINE is True and config.HF_DATASETS_OFFLINE is True
    assert (os.environ.get("HF_DATASETS_OFFLINE"), config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE) == before
