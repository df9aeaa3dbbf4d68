"""RoutingTrace: a columnar record of routing per sample, token position and MoE layer.

For each MoE layer the trace holds ``probs`` [B, T, E] (router distribution p), ``chosen``
[B, T, k] (experts actually used) and, when a policy constrained routing, ``allowed`` [B, T, E];
``valid`` [B, T] marks real (non-padding) tokens and ``prompt_len`` the first position that was
generated rather than given. Forward calls that continue a sequence (KV-cache offset > 0) append
along T; a call at offset 0 starts a new segment; segments are stacked along B (padded with
``valid=False``). Metrics and plots read traces, never models. Saved as safetensors + JSON.

Recording never waits for the device: a forward's records stay where the model computed them
until the call is over; the next call (or the first read) moves them to the host in one go —
on CUDA one ``non_blocking`` copy per dtype into pinned memory, followed by an event that reading
waits on (PyTorch's rules: the copy is queued on the stream that produced the tensors, so the
device buffers may be freed at once; the pinned destination is kept until read).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from moectl.errors import FileFormatError, MoectlFileError
from moectl.io.atomic import atomic_path


@dataclass
class _Call:
    """One forward call's records, still on their device."""

    segment: _Segment
    valid: Tensor | None  # None once moved to the host
    records: list[tuple[str, int, Tensor]] = field(default_factory=list)  # (what, layer, tensor)


@dataclass
class _Segment:
    probs: dict[int, list[Tensor]] = field(default_factory=dict)
    chosen: dict[int, list[Tensor]] = field(default_factory=dict)
    allowed: dict[int, list[Tensor]] = field(default_factory=dict)
    valid: list[Tensor] = field(default_factory=list)
    prompt_len: int = 0


class RoutingTrace:
    """Routing record; index ``trace.chosen[layer]`` etc. by MoE layer index."""

    def __init__(
        self, num_layers: int, meta: dict[str, Any] | None = None, probs_dtype=torch.float32
    ) -> None:
        self.num_layers = num_layers
        self.meta: dict[str, Any] = dict(meta or {})
        self.probs_dtype = probs_dtype
        self._segments: list[_Segment] = []
        self._cache: dict[str, Any] = {}
        self._call: _Call | None = None  # the latest forward's records, not yet on the host
        self._copied: list[Any] = []  # CUDA events after the copies to the host not yet waited on

    @classmethod
    def join(cls, traces: list[RoutingTrace]) -> RoutingTrace:
        """One trace whose rows are the rows of ``traces`` in order (their segments stacked along B),
        as if their sequences had been recorded as one batch; meta from the first."""
        if not traces:
            raise ValueError("no traces to join")
        first = traces[0]
        joined = cls(first.num_layers, first.meta, first.probs_dtype)
        for trace in traces:
            if trace.num_layers != first.num_layers:
                raise ValueError(
                    f"cannot join traces of {trace.num_layers} and {first.num_layers} MoE layers"
                )
            trace._ready()
            joined._segments += trace._segments
        return joined

    # -- recording ---------------------------------------------------------------------------
    def begin_call(self, offset: int, valid: Tensor, prompt_len: int | None = None) -> None:
        """Start a forward call: a new segment at offset 0, else continue the current one.
        ``prompt_len``: the prompt's length when it is fed in several calls (default: this call's)."""
        self.flush()
        if offset == 0 or not self._segments:
            self._segments.append(_Segment(prompt_len=valid.shape[1] if prompt_len is None else prompt_len))
        self._call = _Call(self._segments[-1], valid.detach())
        self._cache.clear()

    def record(self, layer: int, probs: Tensor, chosen: Tensor, allowed: Tensor | None) -> None:
        """Keep one MoE layer's routing of the current call (on its device until ``flush``)."""
        if self._call is None:
            raise RuntimeError("RoutingTrace.record outside a forward call: call begin_call first")
        index = torch.int16 if probs.shape[-1] < 2**15 else torch.int64
        records = self._call.records
        records.append(("probs", layer, probs.detach().to(self.probs_dtype)))
        records.append(("chosen", layer, chosen.detach().to(index)))
        if allowed is not None:
            records.append(("allowed", layer, allowed.detach()))
        self._cache.clear()

    def flush(self) -> None:
        """Move the current call's records so far to the host (asynchronously from CUDA; see the
        module doc). The call stays open: later records of the same forward follow."""
        call = self._call
        if call is None or (call.valid is None and not call.records):
            return
        tensors = ([] if call.valid is None else [call.valid]) + [t for _, _, t in call.records]
        host = _to_host(tensors)
        for device in {t.device for t in tensors if t.is_cuda}:  # one event per device copied from
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._copied.append(event)
        seg = call.segment
        if call.valid is not None:
            seg.valid.append(host.pop(0))
        for (what, layer, _), tensor in zip(call.records, host, strict=True):
            getattr(seg, what).setdefault(layer, []).append(tensor)
        call.valid, call.records = None, []

    def _ready(self) -> None:
        """Records on the host and their copies complete (before any read)."""
        self.flush()
        for event in self._copied:
            event.synchronize()
        self._copied = []

    # -- reading -----------------------------------------------------------------------------
    def _stack(self, what: str) -> Any:
        self._ready()
        if what in self._cache:
            return self._cache[what]
        if not self._segments:
            raise ValueError("the trace is empty: nothing was recorded (was route(..., record=True) used?)")
        valids = [torch.cat(s.valid, dim=1) for s in self._segments]
        t_max = max(v.shape[1] for v in valids)
        if what == "valid":
            out = torch.cat([_pad_t(v, t_max, False) for v in valids])
        elif what == "prompt_len":
            out = torch.cat(
                [torch.full((v.shape[0],), s.prompt_len) for s, v in zip(self._segments, valids, strict=True)]
            )
        else:
            fill = {"probs": 0.0, "chosen": -1, "allowed": False}[what]
            out = {}
            for layer in range(self.num_layers):
                parts = []
                for seg in self._segments:
                    chunks = getattr(seg, what).get(layer)
                    if chunks is None:
                        break
                    parts.append(_pad_t(torch.cat(chunks, dim=1), t_max, fill))
                if len(parts) == len(self._segments):
                    out[layer] = torch.cat(parts).long() if what == "chosen" else torch.cat(parts)
        self._cache[what] = out
        return out

    @property
    def probs(self) -> dict[int, Tensor]:
        """``{layer: [B, T, E]}`` router distribution p."""
        return self._stack("probs")

    @property
    def chosen(self) -> dict[int, Tensor]:
        """``{layer: [B, T, k]}`` experts used (-1 at padding)."""
        return self._stack("chosen")

    @property
    def allowed(self) -> dict[int, Tensor]:
        """``{layer: [B, T, E]}`` allowed experts, for layers where a policy constrained routing."""
        return self._stack("allowed")

    @property
    def valid(self) -> Tensor:
        """[B, T] real tokens (False for padding and beyond a segment's end)."""
        return self._stack("valid")

    @property
    def prompt_len(self) -> Tensor:
        """[B] the length of the first forward call of each row's segment (the prompt)."""
        return self._stack("prompt_len")

    @property
    def num_experts(self) -> int:
        return next(iter(self.probs.values())).shape[-1]

    @property
    def top_k(self) -> int:
        return next(iter(self.chosen.values())).shape[-1]

    def chosen_mask(self, layer: int) -> Tensor:
        """[B, T, E] bool: which experts were used at each position."""
        chosen = self.chosen[layer]
        mask = torch.zeros(*chosen.shape[:2], self.num_experts + 1, dtype=torch.bool)
        mask.scatter_(-1, chosen.clamp(min=-1) % (self.num_experts + 1), True)
        return mask[..., : self.num_experts]

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write ``path`` (.safetensors) and ``path`` with .json metadata, atomically."""
        path = Path(path).with_suffix(".safetensors")
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"valid": self.valid.contiguous(), "prompt_len": self.prompt_len.contiguous()}
        for what in ("probs", "chosen", "allowed"):
            for layer, value in self._stack(what).items():
                tensors[f"{what}.{layer}"] = value.contiguous()
        meta = {"num_layers": self.num_layers, "meta": self.meta}
        _atomic(path, lambda tmp: save_file(tensors, tmp))
        _atomic(path.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTrace:
        """Read a trace ``save`` wrote; a damaged one raises ``ValueError`` naming the file."""
        path = Path(path).with_suffix(".safetensors")
        if not path.exists():
            raise MoectlFileError(f"no trace at {path}")
        meta_path = path.with_suffix(".json")
        if not meta_path.exists():
            raise MoectlFileError(f"no trace metadata at {meta_path} (a trace is a .safetensors and a .json)")
        try:
            meta = json.loads(meta_path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise FileFormatError(f"{meta_path}: not valid JSON ({type(err).__name__})") from None
        n = meta.get("num_layers") if isinstance(meta, dict) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise FileFormatError(f"{meta_path}: a trace's metadata needs 'num_layers', an integer >= 0")
        try:
            tensors = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types on a damaged file
            raise FileFormatError(
                f"{path}: not a readable safetensors file ({' '.join(str(err).split())[:200]})"
            ) from None
        _check_trace_tensors(path, tensors, n)
        trace = cls(n, meta.get("meta"))
        cache: dict[str, Any] = {"valid": tensors["valid"], "prompt_len": tensors["prompt_len"]}
        for what in ("probs", "chosen", "allowed"):
            cache[what] = {int(k.split(".")[1]): v for k, v in tensors.items() if k.startswith(what + ".")}
        trace._segments = [_Segment()]  # non-empty: reading goes through the cache
        trace._cache = cache
        return trace


def _check_trace_tensors(path: Path, tensors: dict[str, Tensor], num_layers: int) -> None:
    """What ``RoutingTrace.save`` writes: ``valid`` [B, T] bool, ``prompt_len`` [B] and
    ``probs.L`` / ``chosen.L`` / ``allowed.L`` [B, T, ...] for MoE layers L < num_layers."""
    valid, prompt_len = tensors.get("valid"), tensors.get("prompt_len")
    if valid is None or prompt_len is None or valid.dim() != 2 or tuple(prompt_len.shape) != valid.shape[:1]:
        raise FileFormatError(f"{path}: not a routing trace (needs 'valid' [B, T] and 'prompt_len' [B])")
    b, t = valid.shape
    for key, value in tensors.items():
        if key in ("valid", "prompt_len"):
            continue
        what, _, layer = key.partition(".")
        if what not in ("probs", "chosen", "allowed") or not layer.isdigit() or int(layer) >= num_layers:
            raise FileFormatError(
                f"{path}: unexpected tensor {key!r}; a trace holds valid, prompt_len and "
                f"probs.L / chosen.L / allowed.L for MoE layers L in 0..{num_layers - 1}"
            )
        if value.dim() != 3 or tuple(value.shape[:2]) != (b, t):
            raise FileFormatError(f"{path}: tensor {key} is {list(value.shape)}, expected [{b}, {t}, ...]")


def _to_host(tensors: list[Tensor]) -> list[Tensor]:
    """Host copies of ``tensors``: CPU ones as they are; CUDA ones through one pinned buffer per
    dtype, filled by a single ``non_blocking`` copy (valid once the stream has run it)."""
    out: list[Tensor | None] = [t if not t.is_cuda else None for t in tensors]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_cuda:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), members in groups.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in members])
        pinned = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
        pinned.copy_(flat, non_blocking=True)
        offset = 0
        for i in members:
            n = tensors[i].numel()
            out[i] = pinned[offset : offset + n].view(tensors[i].shape)
            offset += n
    return [t for t in out if t is not None]


def _pad_t(x: Tensor, t: int, fill: Any) -> Tensor:
    if x.shape[1] == t:
        return x
    pad = torch.full((x.shape[0], t - x.shape[1], *x.shape[2:]), fill, dtype=x.dtype)
    return torch.cat([x, pad], dim=1)


def _atomic(path: Path, write) -> None:
    with atomic_path(path) as tmp:
        write(str(tmp))
