"""Where non-resident experts live: safetensors files on disk (memory-mapped) or host memory.

A store holds, per MoE layer, the expert parameters (``gate_up_proj``, ``down_proj`` and, for
gpt-oss, their biases) split into one tensor per expert. ``load(layer, expert)`` returns exactly
that expert's slices, nothing else. The disk store keeps one safetensors file per layer with one
tensor per (parameter, expert) and a manifest with each expert's shapes, dtypes, byte count and
CRC-32; a missing file, a wrong shape or a checksum mismatch raises ``ExpertStoreError`` — the
runtime never computes with zeros or stale weights.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from moectl.errors import MoectlError


class ExpertStoreError(MoectlError, RuntimeError):
    """An expert could not be loaded exactly as it was stored."""


def tensor_crc(t: Tensor) -> int:
    """CRC-32 of a tensor's raw bytes (any dtype)."""
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def _check(layer: int, expert: int, name: str, t: Tensor, meta: dict) -> None:
    where = f"MoE layer {layer}, expert {expert}, {name}"
    if list(t.shape) != meta["shape"] or str(t.dtype) != meta["dtype"]:
        raise ExpertStoreError(
            f"{where}: stored tensor is {list(t.shape)} {t.dtype}, expected {meta['shape']} {meta['dtype']}"
        )


class HostStore:
    """Experts in host memory (pinned when CUDA is available), one [E, ...] tensor per parameter."""

    kind = "host"

    def __init__(self, layers: list[dict[str, Tensor]]) -> None:
        pin = torch.cuda.is_available()
        self.layers = [
            {name: (p.detach().cpu().pin_memory() if pin else p.detach().cpu()) for name, p in params.items()}
            for params in layers
        ]

    def load(self, layer: int, expert: int) -> dict[str, Tensor]:
        return {name: p[expert] for name, p in self.layers[layer].items()}


class DiskStore:
    """Experts as safetensors on disk, one file per MoE layer, read through memory mapping."""

    kind = "disk"

    def __init__(self, root: str | Path, verify: bool = True) -> None:
        self.root = Path(root)
        manifest = self.root / "manifest.json"
        if not manifest.exists():
            raise ExpertStoreError(f"{manifest} is missing: {self.root} is not an expert store")
        self.manifest = json.loads(manifest.read_text())
        self.verify = verify
        self._handles: dict[int, object] = {}

    @classmethod
    def write(cls, root: str | Path, layers: list[dict[str, Tensor]], verify: bool = True) -> DiskStore:
        """Write every layer's experts to ``root`` and return the store reading them."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        manifest: dict = {"format": "moectl-expert-store/1", "layers": []}
        for i, params in enumerate(layers):
            tensors, experts = {}, []
            num_experts = next(iter(params.values())).shape[0]
            for e in range(num_experts):
                entry = {}
                for name, p in params.items():
                    t = p[e].detach().cpu().contiguous()
                    tensors[f"{name}.{e}"] = t
                    entry[name] = {"shape": list(t.shape), "dtype": str(t.dtype), "crc32": tensor_crc(t)}
                experts.append(entry)
            path = root / f"layer_{i:03d}.safetensors"
            save_file(tensors, str(path))
            manifest["layers"].append({"file": path.name, "bytes": path.stat().st_size, "experts": experts})
        (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
        return cls(root, verify=verify)

    def _handle(self, layer: int):
        if layer not in self._handles:
            meta = self.manifest["layers"][layer]
            path = self.root / meta["file"]
            if not path.exists():
                raise ExpertStoreError(f"expert file {path} (MoE layer {layer}) is missing")
            if path.stat().st_size != meta["bytes"]:
                raise ExpertStoreError(
                    f"expert file {path} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}"
                )
            try:
                self._handles[layer] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own error types on a bad header
                raise ExpertStoreError(f"expert file {path} cannot be read: {err}") from err
        return self._handles[layer]

    def load(self, layer: int, expert: int) -> dict[str, Tensor]:
        handle = self._handle(layer)
        meta = self.manifest["layers"][layer]["experts"][expert]
        out = {}
        for name, m in meta.items():
            try:
                t = handle.get_tensor(f"{name}.{expert}")
            except Exception as err:
                raise ExpertStoreError(f"MoE layer {layer}, expert {expert}, {name}: {err}") from err
            _check(layer, expert, name, t, m)
            if self.verify and tensor_crc(t) != m["crc32"]:
                raise ExpertStoreError(
                    f"MoE layer {layer}, expert {expert}, {name}: checksum mismatch, the expert file "
                    f"{self.root / self.manifest['layers'][layer]['file']} is corrupted"
                )
            out[name] = t
        return out

    def close(self) -> None:
        self._handles.clear()
