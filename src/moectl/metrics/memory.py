"""Measured memory: live tensor bytes (exact, by storage) and the process's peak resident set.

:class:`TensorMemory` is a ``TorchDispatchMode``: every ATen op run inside it reports its output
tensors; each *storage* seen for the first time is counted with its byte size and uncounted when
it is freed (a ``weakref.finalize`` on the storage object, which PyTorch keeps alive exactly as
long as the storage itself). Views and in-place results share their storage and count once; a
storage resized by an op is re-counted at its new size. ``peak`` is the most bytes alive at once,
``largest`` the biggest single storage. Exact to the byte for what it sees: storages made by ops
inside the block (an output sharing an input's storage is a view or an in-place result, not an
allocation: views of weights never count twice). Not seen: buffers a kernel allocates and frees internally (e.g. a fused
attention's scratch space) and allocations outside PyTorch's dispatcher; tensors that existed
before the block count from ``baseline`` (give the bytes the caller already holds, e.g. weights).

The process's peak resident set (allocator slack, the interpreter and the libraries included) is
read by :mod:`moectl.io.peak_rss`.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """``with TensorMemory(baseline=weights) as mem: ...`` — then ``mem.peak``, ``mem.largest``, ``mem.live``."""

    def __init__(self, baseline: int = 0) -> None:
        super().__init__()
        self.baseline = int(baseline)
        self.live = self.baseline  # bytes of the counted storages alive now, plus the baseline
        self.peak = self.baseline
        self.largest = 0
        self.sizes: dict[int, int] = {}  # storage key -> counted bytes
        self.ops = 0

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def _see(self, tensor: Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        nbytes = storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            if key in inputs:  # a view of (or in place on) a tensor made before the block
                return
            self.sizes[key] = nbytes
            self.live += nbytes
            weakref.finalize(storage, self._free, key)
        elif old != nbytes:  # resized in place
            self.sizes[key] = nbytes
            self.live += nbytes - old
        self.largest = max(self.largest, nbytes)
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = {
            leaf.untyped_storage()._cdata
            for leaf in tree_leaves((args, kwargs))
            if isinstance(leaf, Tensor) and leaf.device.type != "meta"
        }
        out = func(*args, **kwargs)
        self.ops += 1
        for leaf in tree_leaves(out):
            if isinstance(leaf, Tensor) and leaf.device.type != "meta":
                self._see(leaf, inputs)
        return out
