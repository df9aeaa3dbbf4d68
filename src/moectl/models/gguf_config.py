"""What a GGUF file holds, read before any weight (issue 40 item 3): its family, and the config
transformers' GGUF loader would get wrong.

transformers 5 loads GGUF files of two MoE families moectl routes: llama.cpp's ``qwen2moe``
(Qwen1.5/2-MoE, moectl's reference models) and ``qwen3moe`` (Qwen3-MoE). Its config mapping
(``transformers.integrations.ggml``) reads neither the routed experts' width
(``{arch}.expert_feed_forward_length``) nor Qwen2-MoE's shared expert's
(``expert_shared_feed_forward_length``): it keeps Qwen's defaults (1408, 5632) and the load then
fails on every expert tensor's shape. :func:`gguf_config` takes transformers' config and sets
those from the file, with the settings llama.cpp's graphs fix in C++ (``moectl.export.gguf_arch``):
top-k renormalisation off for ``qwen2moe``, on for ``qwen3moe``; every layer MoE; no sliding window.

Other families are refused in one line naming the supported ones: Mixtral's GGUF is llama.cpp's
``llama`` with experts, which transformers reads as a dense Llama (its experts dropped); OLMoE,
DeepSeek and the rest have no GGUF loader in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moectl.errors import FileFormatError, MoectlFileError, UnsupportedModelError

MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFFamily:
    """One llama.cpp architecture transformers' GGUF loader turns into a moectl MoE family."""

    model_type: str  # transformers' model_type
    norm_topk_prob: bool  # what llama.cpp's graph does (fixed in C++)
    shared_expert: bool  # Qwen2-MoE's shared expert (its own width key)


FAMILIES: dict[str, GGUFFamily] = {
    "qwen2moe": GGUFFamily("qwen2_moe", norm_topk_prob=False, shared_expert=True),
    "qwen3moe": GGUFFamily("qwen3_moe", norm_topk_prob=True, shared_expert=False),
}


def supported() -> str:
    """The supported families, as an error message names them."""
    return ", ".join(f"{arch} ({fam.model_type})" for arch, fam in FAMILIES.items())


def is_gguf(spec: str) -> bool:
    """Whether model spec ``spec`` names a GGUF file: a name ending ``.gguf``, or an existing file
    that starts with the GGUF magic."""
    if str(spec).lower().endswith(".gguf"):
        return True
    path = Path(spec).expanduser()
    if not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def read_header(path: Path) -> Any:
    """``gguf.GGUFReader`` over ``path`` (memory-mapped: no weight is read); a missing, foreign or
    damaged file as a one-line :class:`~moectl.errors.MoectlError`."""
    import gguf

    if not path.exists():
        raise MoectlFileError(f"{path}: no such GGUF file")
    if not path.is_file():
        raise FileFormatError(f"{path} is a folder, not a GGUF file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise FileFormatError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as err:
        raise FileFormatError(f"{path} is not a readable GGUF file (truncated or damaged?): {err}") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (a number, a string or a list), or ``default``."""
    item = reader.fields.get(key)
    return default if item is None else item.contents()


def family_of(reader: Any, path: Path) -> tuple[str, GGUFFamily]:
    """(llama.cpp architecture, its family); :class:`UnsupportedModelError` naming the supported
    ones for any other."""
    arch = field(reader, "general.architecture")
    if arch in FAMILIES:
        return arch, FAMILIES[arch]
    experts = field(reader, f"{arch}.expert_count", 0) if arch else 0
    if arch is None:
        why = "has no general.architecture"
    elif arch == "llama" and experts:
        why = "is llama.cpp's llama with experts (Mixtral), which transformers' GGUF loader reads as a dense Llama"
    elif not experts:
        why = f"is {arch!r}, not a Mixture-of-Experts model"
    else:
        why = f"is {arch!r}, a family transformers 5 has no GGUF loader for"
    raise UnsupportedModelError(f"{path.name} {why}; moectl loads GGUF files of {supported()}")


def _round_float32(value: float) -> float:
    """A float32 field as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(f"{float(value):.7g}")


def fix_config(config: Any, reader: Any, arch: str, family: GGUFFamily) -> Any:
    """``config`` (transformers' reading of the file) with what its GGUF mapping misses set from the
    file's metadata and llama.cpp's fixed choices; returned for chaining."""
    width = field(reader, f"{arch}.expert_feed_forward_length")
    if width is None:
        raise FileFormatError(f"{arch}.expert_feed_forward_length is missing: the routed experts' width")
    config.moe_intermediate_size = int(width)
    if family.shared_expert:
        shared = field(reader, f"{arch}.expert_shared_feed_forward_length")
        if shared is None:
            raise FileFormatError(
                f"{arch}.expert_shared_feed_forward_length is missing: the shared expert's width"
            )
        config.shared_expert_intermediate_size = int(shared)
    key_length = field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    config.norm_topk_prob = family.norm_topk_prob
    config.mlp_only_layers, config.decoder_sparse_step = [], 1
    config.use_sliding_window = False
    config.rms_norm_eps = _round_float32(config.rms_norm_eps)
    return config


def matrix_types(reader: Any) -> set[str]:
    """The GGUF types of the file's matrices (``{"Q4_K", "Q6_K", "F32"}``): what dtype ``auto`` reads."""
    return {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
