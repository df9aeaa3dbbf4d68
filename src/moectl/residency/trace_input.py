"""Read a recorded routing as ``[tokens, layers, top_k]`` expert ids, with one-line errors.

Two sources:

- a moectl trace (``RoutingTrace.save(path)`` writes ``path.safetensors`` + ``path.json``): give
  either file, the path without suffix, or a folder holding one trace; its rows (one per
  generated sequence) are replayed one after another, padding dropped;
- an ``.npy`` integer array ``[tokens, layers, top_k]``, the layout vLLM and SGLang return as
  ``routed_experts``: ``numpy.save("trace.npy", routed_experts)`` for one request, or
  ``numpy.concatenate`` of several requests' arrays in serving order. vLLM: start the engine with
  ``enable_return_routed_experts=True`` (``--enable-return-routed-experts``); each request's output
  carries its ``routed_experts`` array. SGLang: start the server with
  ``--enable-return-routed-experts`` and send ``"return_routed_experts": true``; the response's
  ``routed_experts`` is base64 of int32 ids, flattened:
  ``numpy.frombuffer(base64.b64decode(s), numpy.int32).reshape(-1, num_layers, top_k)``.

Several inputs are concatenated along tokens (they must agree on layers and top-k). Ids must lie
in ``[0, num_experts)`` and be distinct within a token's layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moectl.errors import ConfigError, FileFormatError, MoectlFileError


@dataclass(frozen=True)
class Accesses:
    """Expert ids ``chosen`` [T, L, k] (int64) and the number of experts per layer."""

    chosen: np.ndarray
    num_experts: int
    sources: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return self.chosen.shape[0]

    @property
    def layers(self) -> int:
        return self.chosen.shape[1]

    @property
    def top_k(self) -> int:
        return self.chosen.shape[2]

    @property
    def accesses(self) -> int:
        return int(self.chosen.size)


def read_array(path: Path) -> tuple[np.ndarray, int | None]:
    """An ``.npy`` routing array, checked for rank and dtype (the number of experts is not in it)."""
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise FileFormatError(f"{path}: not a readable .npy array ({err})") from None
    if array.ndim != 3:
        raise FileFormatError(
            f"{path}: expected an array [tokens, layers, top_k] (vLLM/SGLang routed_experts), got rank "
            f"{array.ndim} with shape {list(array.shape)}"
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise FileFormatError(f"{path}: expert ids must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False), None


def _trace_file(path: Path) -> Path:
    if path.is_dir():
        found = sorted(p for p in path.glob("*.safetensors") if p.with_suffix(".json").is_file())
        if len(found) != 1:
            raise FileFormatError(
                f"{path}: expected a folder holding one moectl trace (NAME.safetensors + NAME.json, as "
                f"RoutingTrace.save writes), found {len(found)}"
            )
        return found[0]
    file = path.with_suffix(".safetensors")
    if not (file.is_file() and file.with_suffix(".json").is_file()):
        raise MoectlFileError(
            f"{path}: no moectl trace there (NAME.safetensors + NAME.json) and not an .npy array"
        )
    return file


def read_trace(path: Path) -> tuple[np.ndarray, int]:
    """A moectl trace's routing [T, L, k] (rows in order, padding dropped) and its number of experts."""
    from moectl.routing.trace import RoutingTrace

    file = _trace_file(path)
    try:
        trace = RoutingTrace.load(file)
        chosen, valid = trace.chosen, trace.valid.bool()
        layers = sorted(chosen)
        num_experts = trace.num_experts
    except (KeyError, ValueError, OSError, StopIteration) as err:
        raise FileFormatError(f"{file}: not a readable moectl trace ({err})") from None
    if not layers or layers != list(range(len(layers))):
        raise FileFormatError(f"{file}: the trace has no complete routing record (layers {layers})")
    stacked = np.stack([chosen[layer][valid].numpy() for layer in layers], axis=1)  # [T, L, k]
    return stacked.astype(np.int64), num_experts


def read_accesses(paths: list[Path], num_experts: int | None = None, *, progress: bool = False) -> Accesses:
    """Every input concatenated along tokens; ``num_experts`` (required for .npy arrays) checked.
    ``progress``: a bar of the traces read, one step per trace (on an interactive terminal only)."""
    from moectl.progress import progress_bar

    if not paths:
        raise ConfigError("give at least one trace (a moectl trace or an .npy array)")
    parts: list[np.ndarray] = []
    found: int | None = None
    with progress_bar("reading traces", progress and len(paths) > 1) as bar:
        task = bar.add_task("read", total=len(paths))
        for path in paths:
            array, experts = _read_one(path)
            if experts is not None:
                if found is not None and experts != found:
                    raise ConfigError(f"{path}: {experts} experts per layer, the other traces {found}")
                found = experts
            if parts and array.shape[1:] != parts[0].shape[1:]:
                raise ConfigError(
                    f"{path}: [layers, top_k] = {list(array.shape[1:])}, the first trace "
                    f"{list(parts[0].shape[1:])}: traces of one model only"
                )
            parts.append(array)
            bar.advance(task)
    if num_experts is None:
        if found is None:
            raise ConfigError("--num-experts is required for an .npy array (it does not say how many experts)")
        num_experts = found
    elif found is not None and found != num_experts:
        raise ConfigError(f"--num-experts {num_experts}, but the trace's router has {found} experts")
    chosen = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if chosen.shape[0] == 0 or chosen.shape[1] == 0 or chosen.shape[2] == 0:
        raise FileFormatError(f"the trace is empty: [tokens, layers, top_k] = {list(chosen.shape)}")
    check_ids(chosen, num_experts)
    return Accesses(np.ascontiguousarray(chosen), num_experts, tuple(str(p) for p in paths))


def _read_one(path: Path) -> tuple[np.ndarray, int | None]:
    """One input's ``[tokens, layers, top_k]`` ids and its experts per layer (None for .npy)."""
    if path.suffix == ".npy":
        if not path.is_file():
            raise MoectlFileError(f"{path}: no such file")
        return read_array(path)
    return read_trace(path)


def check_ids(chosen: np.ndarray, num_experts: int) -> None:
    """Ids in [0, num_experts) and distinct within each token's layer (vectorised)."""
    low, high = int(chosen.min()), int(chosen.max())
    if low < 0 or high >= num_experts:
        bad = high if high >= num_experts else low
        t, layer, _ = (int(i) for i in np.argwhere(chosen == bad)[0])
        raise FileFormatError(
            f"expert id {bad} at token {t}, layer {layer} is outside 0..{num_experts - 1} "
            f"(--num-experts {num_experts})"
        )
    ordered = np.sort(chosen, axis=-1)
    dup = ordered[..., 1:] == ordered[..., :-1]
    if dup.any():
        t, layer, j = (int(i) for i in np.argwhere(dup)[0])
        raise FileFormatError(f"token {t}, layer {layer} lists expert {int(ordered[t, layer, j])} twice")
