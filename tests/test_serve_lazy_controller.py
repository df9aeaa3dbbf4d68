"""A controller whose adapters reach the experts, served from a checkpoint's shards: the experts are
never in memory, so their adapters cannot be merged; each expert's delta is added as it is loaded
(offload/delta_store.py). Served that way, the model computes exactly what the fully loaded model
with the adapters merged computes — before, the expert adapters were silently dropped (PyTorch's
"copying … to a meta parameter … is a no-op")."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import moectl
from moectl.models.lazy import load_skeleton
from moectl.models.load_lazy import load_lazy
from moectl.models.shapes import make_checkpoint
from moectl.offload import OffloadConfig, offload
from moectl.options.controller import build_controller
from moectl.options.option_state import load_controlled, save_folder
from moectl.options.teacher import add_lora

torch.set_num_threads(1)
SPEC = "shape:olmoe-1b-7b@2~w64"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("lazy-controller")
    ckpt = root / "olmoe"
    make_checkpoint(SPEC, ckpt, max_shard_bytes=2_000_000)
    model, _ = load_skeleton(ckpt, load_experts=True)
    info = moectl.inspect(model)
    peft_model, _ = add_lora(model, info, r=4, alpha=8)
    with torch.no_grad():  # adapters far from zero, so that dropping them would show
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    save_folder(root / "ctrl", build_controller(info, 8), peft_model, info, {"k_hat": 8})
    yield ckpt, root / "ctrl"
    shutil.rmtree(root, ignore_errors=True)


def _ids() -> torch.Tensor:
    return torch.randint(3, 250, (1, 9), generator=torch.Generator().manual_seed(2))


def _served_logits(model, slot_dtype: str, reader=None) -> torch.Tensor:
    model.set_experts_implementation("eager")
    config = OffloadConfig(budget=16, store="checkpoint" if reader else "host", slot_dtype=slot_dtype)
    with offload(model, config, reader=reader), torch.no_grad():
        return model(input_ids=_ids()).logits


@pytest.mark.parametrize("slot_dtype", ["same", "int8"])
def test_expert_adapters_reach_experts_read_from_the_shards(folders, slot_dtype):
    ckpt, ctrl = folders
    full, _ = load_skeleton(ckpt, load_experts=True)
    merged = _served_logits(load_controlled(full, ctrl)[0], slot_dtype)
    base, _ = load_skeleton(ckpt, load_experts=True)
    plain = _served_logits(base, slot_dtype)

    lazy, _, reader = load_lazy(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lazy = load_controlled(lazy, ctrl)[0]
    assert not [w for w in caught if "meta parameter" in str(w.message)]
    assert not [a for m in lazy.modules() for a in vars(m) if "moectl" in a]  # deltas kept beside the model
    try:
        served = _served_logits(lazy, slot_dtype, reader)
    finally:
        reader.close()
    assert not torch.allclose(merged, plain, atol=1e-2)  # the adapters change the model
    torch.testing.assert_close(
        served, merged, rtol=0, atol=0
    )  # the same merged weights, one expert at a time


def test_serve_offload_verb_with_the_controller_is_quiet_and_checks_k_hat(folders):
    """The pre-flight reads k-hat from controller.json instead of merging adapters into the meta
    model (which warned once per adapter tensor); a budget below k-hat is refused before loading."""
    from typer.testing import CliRunner

    from moectl.cli import app

    ckpt, ctrl = folders
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = CliRunner().invoke(app, ["serve-offload", str(ckpt), "--policy", f"controller:{ctrl}", "--budget", "8",
                                      "--max-new-tokens", "2"])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert not [w for w in caught if "meta parameter" in str(w.message)]
    small = CliRunner().invoke(
        app, ["serve-offload", str(ckpt), "--policy", f"controller:{ctrl}", "--budget", "7"]
    )
    assert small.exit_code == 2
    assert "at least 8 are needed" in " ".join(small.output.split())
