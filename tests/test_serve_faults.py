"""Serving faults (issue 29): a failed expert load never leaves stale or shared slots behind, a
failed ``offload()`` entry leaves the model as it was, and the temporary store goes away."""

from __future__ import annotations

import pytest
import torch

from moectl.serve.loader import SyncLoader, ThreadLoader
from moectl.serve.resident import ResidentSet
from moectl.serve.store import HostStore

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
    with pytest.raises(OSError, match="expert 2"):
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
    with pytest.raises(OSError, match="expert 3"):
        res.drain()
    assert 3 not in res.where and 3 not in res.prefetched
    assert_slots_hold_their_experts(res, weights)
    slot = res.access(3)
    assert torch.equal(res.slots["w"][slot], weights["w"][3])
    res.loader.close()
