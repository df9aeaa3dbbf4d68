"""A quantized checkpoint's experts as an expert store: a miss reads quantized bytes (issue 40 item 2).

``moectl serve-offload DIR`` / ``moectl serve DIR --budget B`` of a quantized checkpoint
(``moectl.quant.checkpoint_format``) builds the model with its experts left unread
(``load_quantized_lazy``) and serves them from this store: each
``load(layer, expert)`` reads that expert's slice of the stored tensors — its int4 codes and
scales, about a quarter of its bf16 bytes — with ``moectl.io.range_read`` (``O_DIRECT`` by
default, so the page cache does not fill a memory cap with bytes already copied into slots).

It returns the tensors under the names ``QuantizedExperts.expert_tensors`` gives (int4:
``gate_up.packed``, ``gate_up.scale_zero``, ``down.packed``, ``down.scale_zero``; int8:
``*.codes``, ``*.scale``), in the form the kernels take: int4 codes repacked from the portable
layout for this machine (``portable_int4.to_kernel``, one expert at a time: ~1-3 ms an OLMoE
expert, one thread) and scales in the activations' dtype; int8 codes and float32 scales as stored.
Repacking costs more than the read (an OLMoE-1B-7B expert, one thread, load ~5: 2.5 ms to read
its 3.4 MiB, 11 ms to repack), so each int4 code tensor is repacked once, whole, into a file of
this machine's layout beside the checkpoint (``KERNEL_CACHE``/<torch version>-<CPU capability>/;
the layout depends on both), written atomically and reused at every later start; misses then read
the kernel's bytes as they are. Where the folder is not writable, codes are repacked at each load.

It has the interface the offloading runtime reads a checkpoint through (``layers`` with each MoE
layer's experts module name, ``load``, ``close``; ``moectl.io.shards.ShardReader`` is the bf16 one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from moectl.errors import FileFormatError
from moectl.io.range_read import DEFAULT_READ_METHOD, RangeReader
from moectl.io.safetensors_index import CheckpointIndex, TensorEntry
from moectl.quant import portable_int4
from moectl.quant.checkpoint_format import EXPERTS_PARTS, STORED

KERNEL_CACHE = ".moectl-int4-kernel"
SLOT_NAMES = {"int4": ("packed", "scale_zero"), "int8": ("codes", "scale")}
"""The names ``Int4Weights`` / ``Int8Weights`` give their buffers, in ``STORED``'s order."""


@dataclass(frozen=True)
class QuantizedLayer:
    """One MoE layer's quantized experts: the experts module's name and its stored tensors."""

    index: int
    module: str
    num_experts: int
    entries: dict[str, TensorEntry]  # slot name (``gate_up.packed``) -> the stored [E, ...] tensor

    @property
    def expert_bytes(self) -> int:
        """Bytes one expert takes in the checkpoint (what a miss reads)."""
        return sum(e.row_bytes for e in self.entries.values())


def _bytes(t: Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class QuantizedCheckpointStore:
    """Expert store over a moectl quantized checkpoint's experts (one expert's slices per load)."""

    kind = "checkpoint"

    def __init__(
        self,
        folder: str | Path,
        experts: list[tuple[str, int]],
        scheme: str,
        dtype: torch.dtype,
        method: str = DEFAULT_READ_METHOD,
    ) -> None:
        """``experts``: (module name, number of experts) of each MoE layer, in order; ``dtype``: the
        activations' (int4 scales are returned in it)."""
        self.folder, self.scheme, self.dtype = Path(folder), scheme, dtype
        index = CheckpointIndex(self.folder)
        self.layers: list[QuantizedLayer] = []
        for i, (module, num) in enumerate(experts):
            entries = {}
            for part in EXPERTS_PARTS:
                for stored, slot in zip(STORED[scheme], SLOT_NAMES[scheme], strict=True):
                    key = f"{module}.{part}.{stored}"
                    if key not in index:
                        raise FileFormatError(f"{self.folder}: the quantized checkpoint lacks tensor {key}")
                    entry = index[key]
                    if not entry.shape or entry.shape[0] != num:
                        raise FileFormatError(
                            f"{self.folder}: tensor {key} is {list(entry.shape)}, not one slice for each of {num} experts"
                        )
                    entries[f"{part}.{slot}"] = entry
            self.layers.append(QuantizedLayer(i, module, num, entries))
        self.io = RangeReader(method, identities=index.identities)
        self.repacked: set[str] = set()  # slot names whose entries already hold the kernel's layout
        if scheme == "int4":
            self._kernel_cache()

    def _kernel_cache(self) -> None:
        """Point every int4 code entry at a file of this machine's layout, writing it if missing."""
        folder = (
            self.folder / KERNEL_CACHE / f"torch{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}"
        )
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return  # a read-only checkpoint: repacked at each load
        for layer in self.layers:
            for name, entry in list(layer.entries.items()):
                if not name.endswith(".packed"):
                    continue
                path = folder / f"{entry.key}.bin"
                if not path.is_file() or path.stat().st_size != entry.nbytes:
                    try:
                        self._write_repacked(entry, path)
                    except OSError:
                        return
                layer.entries[name] = TensorEntry(entry.key, path, 0, entry.nbytes, entry.dtype, entry.shape)
        self.repacked = {n for n in self.layers[0].entries if n.endswith(".packed")} if self.layers else set()

    def _write_repacked(self, entry: TensorEntry, path: Path) -> None:
        from moectl.io.atomic import atomic_path

        stored = torch.empty(entry.shape, dtype=entry.dtype)
        self.io.read(entry.file, [(entry.offset, _bytes(stored))])
        packed = portable_int4.to_kernel(stored).contiguous()
        with atomic_path(path) as tmp:
            tmp.write_bytes(_bytes(packed))

    @property
    def method(self) -> str:
        """How the checkpoint is read (``moectl.io.range_read.READ_METHODS``)."""
        return self.io.method

    @property
    def stats(self):
        """Bytes and seconds read so far (``moectl.io.range_read.ReadStats``)."""
        return self.io.stats

    def _read(self, entry: TensorEntry, expert: int) -> Tensor:
        out = torch.empty(entry.shape[1:], dtype=entry.dtype)
        self.io.read(entry.file, [(entry.offset + expert * entry.row_bytes, _bytes(out))])
        return out

    def _form(self, name: str, t: Tensor) -> Tensor:
        """A stored tensor (one expert's slice or the whole [E, ...] stack) as the module holds it."""
        if name.endswith(".packed") and name not in self.repacked:  # portable codes: repack for this machine
            return portable_int4.to_kernel(t if t.dim() == 3 else t.unsqueeze(0)).reshape(t.shape)
        if name.endswith(".scale_zero"):
            return t.to(self.dtype)
        if name.endswith(".scale"):
            return t.float()
        return t

    def read_layer(self, layer: int) -> dict[str, Tensor]:
        """Every expert of MoE layer ``layer`` at once ([E, ...] per name): loading the model whole."""
        out = {}
        for name, entry in self.layers[layer].entries.items():
            t = torch.empty(entry.shape, dtype=entry.dtype)
            self.io.read(entry.file, [(entry.offset, _bytes(t))])
            out[name] = self._form(name, t)
        return out

    def load(self, layer: int, expert: int) -> dict[str, Tensor]:
        """Expert ``expert`` of MoE layer ``layer`` as its quantized module holds it."""
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"MoE layer {layer} out of range: the model has {len(self.layers)} MoE layers")
        return {name: self._form(name, self._read(e, expert)) for name, e in self.layers[layer].entries.items()}

    def close(self) -> None:
        self.io.close()


def experts_modules(model: nn.Module) -> list[tuple[str, int]]:
    """(name, number of experts) of every quantized experts module of ``model``, in model order."""
    return [
        (name, int(module.num_experts))
        for name, module in model.named_modules()
        if callable(getattr(module, "expert_tensors", None))
    ]
