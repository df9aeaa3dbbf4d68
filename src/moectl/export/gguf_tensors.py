"""The GGUF tensors of a checkpoint: names, shapes, types, and where each one's values come from.

Names come from the ``gguf`` package's own tables: ``TensorNameMap`` maps a transformers tensor
name to the GGUF one, ``MODEL_TENSORS[arch]`` says which tensors the architecture has. Sources are
the model's tensors as transformers 5 holds them in memory (fused experts: ``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``), read by :class:`moectl.io.shards.ShardReader`
from the checkpoint's own shards whatever their on-disk layout (per-expert or fused).

- ``gate_up_proj`` is split into ``ffn_gate_exps`` (rows ``[:I]``) and ``ffn_up_exps`` (``[I:]``),
  the order transformers' experts use (``gate, up = linear(x, gate_up_proj[e]).chunk(2)``);
  ``down_proj`` is ``ffn_down_exps`` as it is. numpy's ``[E, I, H]`` is ggml's ``{H, I, E}``.
- A subset (``keep``) takes the kept experts' rows of the experts and of the router, in
  ascending id order: the same model ``moectl subset export`` writes.
- Tied embeddings: ``output.weight`` is read from the embedding when the architecture needs it.
- Types: 1-D tensors (norms, biases, the shared-expert gate) and the router stay float32, as
  llama.cpp's kernels expect for the former and so that routing decisions are not rounded for the
  latter; every other matrix is written as ``outtype`` (``auto``: the checkpoint's own dtype).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from moectl.errors import ConfigError
from moectl.export.gguf_arch import ArchSpec
from moectl.io.shards import ShardReader

QTYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
}
_TORCH = {
    gguf.GGMLQuantizationType.F32: torch.float32,
    gguf.GGMLQuantizationType.F16: torch.float16,
    gguf.GGMLQuantizationType.BF16: torch.bfloat16,
}
_FROM_TORCH = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
}
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_GATE_UP = "mlp.experts.gate_up_proj"


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: its name, numpy shape (row-major, as written), type, and source."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    source: str  # model tensor name
    rows: tuple[int, int] | None = None  # a [start, stop) slice of dim 1 (gate/up halves)
    experts: tuple[int, ...] | None = None  # kept experts (dim 0), for a subset

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * _TORCH[self.qtype].itemsize

    @property
    def qtype_numpy(self) -> type:
        """The numpy dtype the values travel in (bf16 as its int16 bits)."""
        return {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}.get(
            self.qtype, np.int16
        )


def resolve_outtype(outtype: str, reader: ShardReader) -> str:
    """``auto`` -> the dtype the checkpoint's matrices are stored in (float32 if another kind)."""
    if outtype != "auto":
        if outtype not in QTYPES:
            raise ConfigError(f"--outtype {outtype!r}; allowed: auto, {', '.join(QTYPES)}")
        return outtype
    dtypes = {s.dtype for s in reader.map.sources.values() if len(s.shape) >= 2}
    found = {_FROM_TORCH.get(d, "f32") for d in dtypes}
    return found.pop() if len(found) == 1 else "f32"


def plan(
    reader: ShardReader,
    spec: ArchSpec,
    n_layers: int,
    outtype: str,
    keep: Mapping[int, Sequence[int]] | None = None,
) -> list[Planned]:
    """Every tensor of the GGUF file, in model order; ``keep``: decoder layer -> kept experts.
    ``ValueError`` naming a model tensor the architecture has no GGUF tensor for."""
    names = gguf.TensorNameMap(spec.arch, n_layers)
    allowed = set(gguf.MODEL_TENSORS[spec.arch])
    matrix = QTYPES[outtype]
    out: list[Planned] = []
    for source, info in reader.map.sources.items():
        shape = tuple(info.shape)
        match = _LAYER.search(source)
        bid = int(match.group(1)) if match else None
        kept = tuple(keep[bid]) if keep is not None and bid in keep else None
        if source.endswith(_GATE_UP):
            half = shape[1] // 2
            for kind, rows in (
                (gguf.MODEL_TENSOR.FFN_GATE_EXP, (0, half)),
                (gguf.MODEL_TENSOR.FFN_UP_EXP, (half, shape[1])),
            ):
                rshape = (len(kept) if kept else shape[0], half, shape[2])
                out.append(
                    Planned(
                        gguf.TENSOR_NAMES[kind].format(bid=bid) + ".weight",
                        rshape,
                        matrix,
                        source,
                        rows,
                        kept,
                    )
                )
            continue
        found = names.get_type_and_name(source, try_suffixes=(".weight", ".bias"))
        if found is None or found[0] not in allowed:
            raise ConfigError(f"{source}: no tensor of llama.cpp's {spec.name} takes it")
        kind, name = found
        if not name.endswith((".weight", ".bias")):  # fused experts: "...experts.down_proj", no suffix
            name += ".weight"
        is_expert = kind in (
            gguf.MODEL_TENSOR.FFN_DOWN_EXP,
            gguf.MODEL_TENSOR.FFN_GATE_EXP,
            gguf.MODEL_TENSOR.FFN_UP_EXP,
        )
        is_router = kind == gguf.MODEL_TENSOR.FFN_GATE_INP
        experts = kept if (is_expert or is_router) else None
        if experts is not None:
            shape = (len(experts), *shape[1:])
        if kind == gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP:
            shape = (int(np.prod(shape)),)  # [1, H] -> llama.cpp's {H}
        qtype = gguf.GGMLQuantizationType.F32 if len(shape) == 1 or is_router else matrix
        out.append(Planned(name, shape, qtype, source, None, experts))
    if spec.needs_output and not any(p.name == "output.weight" for p in out):
        embed = next(p for p in out if p.name.startswith("token_embd"))
        out.append(Planned("output.weight", embed.shape, embed.qtype, embed.source))
    seen = [p.name for p in out]
    if len(set(seen)) != len(seen):
        raise ConfigError(
            f"two model tensors map to the same GGUF tensor: {sorted(n for n in seen if seen.count(n) > 1)[0]}"
        )
    return out


def arrays(reader: ShardReader, planned: Sequence[Planned]) -> Iterator[tuple[Planned, np.ndarray]]:
    """Each planned tensor's values as the numpy array the file stores (bf16 as its int16 bits).
    Holds one source tensor at a time (a MoE layer's fused experts at most, only the kept ones for a
    subset), reused by the two halves of ``gate_up_proj``."""
    last: tuple[tuple, torch.Tensor] | None = None
    for p in planned:
        key = (p.source, p.experts)
        if last is None or last[0] != key:  # a subset reads only its experts' bytes
            whole = p.experts is None
            last = (key, reader.read_tensor(p.source) if whole else reader.read_rows(p.source, p.experts))
        t = last[1]
        if p.rows is not None:
            t = t[:, p.rows[0] : p.rows[1]]
        t = t.reshape(p.shape).to(_TORCH[p.qtype]).contiguous()
        if p.qtype == gguf.GGMLQuantizationType.BF16:
            yield p, t.view(torch.int16).numpy()
        else:
            yield p, t.numpy()
