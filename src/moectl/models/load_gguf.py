"""Load the GGUF a user already has (issue 40 item 3): ``moectl.load("x.gguf")``, ``moectl serve x.gguf``.

The file goes through transformers' GGUF loader (``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=name)``, the ``gguf`` package, a core dependency), which dequantizes every tensor at load:
the model is an ordinary transformers model in ``dtype``, and everything moectl does to a
checkpoint (routing, masks, traces, the engine) works on it. ``quantize=`` (``int8`` | ``int4``)
then re-quantizes its experts to moectl's formats, as for any checkpoint (``moectl.loaded``).

``dtype="auto"``: float32 when every matrix in the file is F32, else bfloat16 (a Q4_K / Q8_0 /
F16 / BF16 file; the rounding bfloat16 adds to a dequantized 4- or 8-bit weight is far below the
quantization's own). The loader holds the dequantized tensors and the model at once: about twice
the model's size in ``dtype`` at the peak. The tokenizer is the one in the file
(``AutoTokenizer.from_pretrained(folder, gguf_file=name)``), padding on the left.

What the round trip costs (``benchmarks/quant_quality_llama.py``, moectl-small-standard, 64 held-out
documents, KL per token to the bf16 checkpoint): a Q4_K_M file loaded here 0.0088 (llama.cpp running
the same file: 0.0096), re-quantized to moectl int4 0.0110 (group 32) / 0.0134 (group 128), where
moectl's int4 of the checkpoint itself is 0.0032 / 0.0051 (experts only); a Q8_0 file 0.00045, to
moectl int8 0.00048 (the checkpoint's int8: 0.00024). A BF16 file loads to the checkpoint's logits.

Supported families and the config transformers' mapping misses: ``moectl.models.gguf_config``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from moectl.errors import FileFormatError
from moectl.models.gguf_config import family_of, fix_config, matrix_types, read_header


def auto_dtype(reader: Any) -> torch.dtype:
    """float32 for a file whose matrices are all F32, else bfloat16."""
    return torch.float32 if matrix_types(reader) <= {"F32"} else torch.bfloat16


@contextmanager
def _no_dequantize_bar() -> Iterator[None]:
    """No "Converting and de-quantizing GGUF tensors" bar: transformers draws it with a plain tqdm
    that ``disable_progress_bar`` does not reach (moectl reports its own progress)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without the legacy loader: nothing to quiet
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar


def _dequantizing() -> dict[str, Any]:
    """``quantization_config=GgufConfig(dequantize=True)`` where transformers has it (5.24 does): every
    weight unpacked at load, said outright (else it warns that packed weights run fastest in
    float32, though the families here are always unpacked)."""
    import transformers

    config = getattr(transformers, "GgufConfig", None)
    return {} if config is None else {"quantization_config": config(dequantize=True)}


def _plain(model: Any) -> Any:
    """Forget the GGUF quantizer transformers attached: every weight is dense now, so the model
    saves, casts and quantizes (``moectl.quant``) as one loaded from safetensors."""
    model.hf_quantizer = None
    model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    return model


def _check_loaded(info: dict[str, Any], path: Path) -> None:
    """Refuse a file that left weights unset (transformers would start them random)."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or mismatched:
        names = missing or [str(m[0]) if isinstance(m, tuple) else str(m) for m in mismatched]
        what = "has no tensor for" if missing else "has the wrong shape for"
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise FileFormatError(f"{path.name} {what} {', '.join(names[:3])}{more}")


def load_gguf(
    spec: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    with_tokenizer: bool = True,
    device_map: str | None = None,
) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer padding on the left or None) from GGUF file ``spec``.

    One-line :class:`~moectl.errors.MoectlError` for a missing, foreign or damaged file and for a
    family moectl does not load from GGUF (naming the supported ones)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from moectl.kernels.cpu_linear import install as install_cpu_linear
    from moectl.models.grouped_experts import prefer_on_cpu
    from moectl.models.load import _quiet_transformers, padding_left

    path = Path(spec).expanduser().resolve()
    reader = read_header(path)
    arch, family = family_of(reader, path)
    torch_dtype = auto_dtype(reader) if dtype == "auto" else getattr(torch, dtype)
    folder, name = str(path.parent), path.name
    _quiet_transformers()
    placed = {"device_map": device_map} if device_map else {}
    try:
        config = fix_config(AutoConfig.from_pretrained(folder, gguf_file=name), reader, arch, family)
        with _no_dequantize_bar():
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, config=config, dtype=torch_dtype, output_loading_info=True,
                **_dequantizing(), **placed,
            )  # fmt: skip
        _check_loaded(info, path)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if with_tokenizer else None
    except FileFormatError:
        raise
    except (ValueError, RuntimeError, KeyError, OSError) as err:  # transformers refusing the file
        raise FileFormatError(f"could not load {path.name} ({family.model_type}): {err}") from err
    model = _plain(model if device_map else model.to(device))
    prefer_on_cpu(model)
    install_cpu_linear(model)
    return model.eval(), None if tokenizer is None else padding_left(tokenizer)
