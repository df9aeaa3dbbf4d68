"""Serving faults (issue 29): a failed expert load never leaves stale or shared slots behind, a
failed ``offload()`` entry leaves the model as it was, and the temporary store goes away."""

from __future__ import annotations

import pytest
import torch

from moectl.offload.expert_loader import SyncLoader, ThreadLoader
from moectl.offload.expert_store import ExpertStoreError, HostStore
from moectl.offload.resident import ResidentSet

torch.set_num_threads(1)
LOADERS = {"sync": SyncLoader, "thread": ThreadLoader}


class FlakyStore(HostStore):
    """A host store whose loads of the experts in ``fail`` raise once each."""

    def __init__(self, layers) -> None:
        super().__init__(layers)
        self.fail: set[int] = set()

    def load(self, layer: int, expert: int):
        if expert in self.fail:
            self.fail.discard(expert)
            raise OSError(f"injected read error, expert {expert}")
        return super().load(layer, expert)


def assert_slots_hold_their_experts(res: ResidentSet, weights: dict[str, torch.Tensor]) -> None:
    """The bookkeeping invariant: each mapped expert has its own slot holding exactly its bytes."""
    res.drain()
    slots = list(res.where.values())
    assert len(set(slots)) == len(slots), f"two experts share a slot: {dict(res.where)}"
    assert set(slots).isdisjoint(getattr(res, "_free", ()))
    for expert, slot in res.where.items():
        for name, w in weights.items():
            assert torch.equal(res.slots[name][slot], w[expert]), f"expert {expert} in slot {slot} is stale"


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_failed_load_leaves_no_stale_or_shared_slot(loader):
    weights = {"w": torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3)}
    store = FlakyStore([weights])
    res = ResidentSet(0, store, 2, {"w": weights["w"].to("meta")}, "cpu", LOADERS[loader]())
    res.access(0)
    res.access(1)
    store.fail = {2}
    with pytest.raises(ExpertStoreError, match="MoE layer 0, expert 2: the load failed: injected read error"):
        res.access(2)  # evicts expert 0, then its load fails
    assert 2 not in res.where
    assert_slots_hold_their_experts(res, weights)
    for expert in (3, 2, 4, 1, 5):  # every later access computes with its own expert's weights
        slot = res.access(expert)
        assert torch.equal(res.slots["w"][slot], weights["w"][expert])
        assert_slots_hold_their_experts(res, weights)
    res.loader.close()


def test_failed_prefetch_in_the_worker_is_unmapped_at_drain():
    weights = {"w": torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)}
    store = FlakyStore([weights])
    res = ResidentSet(0, store, 2, {"w": weights["w"].to("meta")}, "cpu", ThreadLoader())
    res.access(0)
    store.fail = {3}
    assert res.prefetch([3]) == 1
    with pytest.raises(ExpertStoreError, match="MoE layer 0, expert 3: the load failed"):
        res.drain()
    assert 3 not in res.where and 3 not in res.prefetched
    assert_slots_hold_their_experts(res, weights)
    slot = res.access(3)
    assert torch.equal(res.slots["w"][slot], weights["w"][3])
    res.loader.close()


def _expert_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}


def test_failed_offload_entry_restores_the_model_and_removes_the_store(tmp_path, monkeypatch):
    import importlib
    import tempfile

    import moectl

    offload_mod = importlib.import_module("moectl.offload.runtime")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = moectl.tiny("olmoe")
    before = _expert_params(model)
    made = []

    class FailingSecondLayer(ResidentSet):
        def __init__(self, layer, *args, **kwargs):
            if layer == 1:
                raise RuntimeError("injected: cannot allocate the slots of MoE layer 1")
            made.append(layer)
            super().__init__(layer, *args, **kwargs)

    monkeypatch.setattr(offload_mod, "ResidentSet", FailingSecondLayer)
    with pytest.raises(RuntimeError, match="MoE layer 1"), offload_mod.offload(model, 2, store="disk"):
        pass
    assert made == [0]  # layer 0 had been offloaded when layer 1 failed
    after = _expert_params(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert not any(type(m).__name__ == "OffloadedExperts" for m in model.modules())
    assert list(tmp_path.iterdir()) == []  # the temporary store is gone


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_unwind_and_remove_the_temporary_store(signame, tmp_path, monkeypatch):
    import signal
    import tempfile

    import moectl
    from moectl.offload import offload

    sig = getattr(signal, signame)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = moectl.tiny("olmoe")
    before = _expert_params(model)
    previous = signal.signal(sig, signal.SIG_DFL)  # as a terminal gives it (nohup starts SIGHUP ignored)
    try:
        _unwind(sig, model, tmp_path, offload, before)
    finally:
        signal.signal(sig, previous)


def _unwind(sig, model, tmp_path, offload, before) -> None:
    import os
    import signal

    with pytest.raises(SystemExit) as stop, offload(model, 2, store="disk"):
        assert [p.name[:14] for p in tmp_path.iterdir()] == ["moectl-experts"]
        os.kill(os.getpid(), sig)  # the default action would end the process, leaving the store
        pytest.fail("the signal did not interrupt the block")
    assert stop.value.code == 128 + sig
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(sig) is signal.SIG_DFL  # the handler is only installed while open
    after = _expert_params(model)
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_serve_offload_restores_the_experts_implementation_after_an_error(monkeypatch):
    import moectl
    from moectl.offload import OffloadConfig
    from moectl.server import offload_batch as runner

    model, tok, _ = moectl.load("tiny:olmoe")
    model.set_experts_implementation("grouped_mm")

    def broken(*args, **kwargs):
        raise RuntimeError("injected: generation failed")

    monkeypatch.setattr(runner.Engine, "generate", broken)  # generation runs through the engine
    with pytest.raises(RuntimeError, match="injected"):
        runner.serve_offload(model, tok, ["hello"], OffloadConfig(budget=2), max_new_tokens=2, progress=False)
    assert model.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_cli_refuses_a_load_timeout_that_is_not_positive_and_finite(value):
    from typer.testing import CliRunner

    from moectl.cli import app

    result = CliRunner().invoke(app, ["serve-offload", "--tiny", "olmoe", "--load-timeout", value])
    assert result.exit_code == 2
    assert " ".join(result.output.split()).startswith("error: load_timeout_s (--load-timeout) must be a finite")
