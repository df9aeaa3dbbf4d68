"""Load a model and tokenizer from ``tiny:FAMILY``, ``shape:NAME[@LAYERS][~wWIDTH]``, a local
checkpoint directory, a hub id or a GGUF file."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from moectl.errors import ConfigError, FileFormatError, MoectlFileError
from moectl.kernels.cpu_linear import install as install_cpu_linear
from moectl.models.folder_loaders import loader_for
from moectl.models.gguf_config import is_gguf
from moectl.models.grouped_experts import prefer_on_cpu
from moectl.models.shapes import MARKER, SPEC_PREFIX, build_shape, check_checkpoint, known_shapes
from moectl.models.tiny import FAMILIES, tiny


class ByteTokenizer:
    """UTF-8 bytes as token ids 3..258, with pad=0, bos=1, eos=2: the tiny models' tokenizer."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259
    padding_side = "left"

    def encode(self, text: str, **_: object) -> list[int]:
        """Byte ids; transformers' keywords (``add_special_tokens``, ``verbose``) change nothing here."""
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259)
        return data.decode("utf-8", errors="replace")

    def __call__(
        self, texts: list[str] | str, return_tensors: str = "pt", padding: bool = True, **_: object
    ) -> dict[str, torch.Tensor]:
        if isinstance(texts, str):  # one text: a batch of one, as a Hugging Face tokenizer gives it
            texts = [texts]
        encoded = [self.encode(t) or [self.bos_token_id] for t in texts]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, e in enumerate(encoded):  # tokenisation, not a tensor hot path
            ids[row, width - len(e) :] = torch.tensor(e)
            mask[row, width - len(e) :] = 1
        return {"input_ids": ids, "attention_mask": mask}


def byte_tokenizer(vocab_size: int = ByteTokenizer.vocab_size) -> ByteTokenizer:
    """The byte tokenizer for a model of ``vocab_size`` ids (ids past 258 decode to nothing)."""
    tokenizer = ByteTokenizer()
    tokenizer.vocab_size = max(int(vocab_size), ByteTokenizer.vocab_size)
    return tokenizer


def _quiet_transformers() -> None:
    """No "Loading weights" bar on every command: moectl reports its own progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def check_model_folder(folder: Path) -> None:
    """A local model folder holds a config.json and complete weight files: refuse anything else
    before transformers reads it, naming the file (a truncated shard otherwise surfaces as a long
    traceback from deep inside the loader)."""
    if not folder.is_dir():
        raise MoectlFileError(f"{folder} is a file, not a model folder (a folder with config.json)")
    if not (folder / "config.json").is_file():
        raise MoectlFileError(
            f"{folder} is not a model folder: it has no config.json (expected what "
            "save_pretrained writes: config.json and *.safetensors)"
        )
    if any(folder.glob("*.safetensors")):
        check_checkpoint(folder)  # ValueError naming a missing or truncated file


DEVICE_MAPS = ("auto", "balanced")


def check_device_map(device_map: str | None) -> None:
    """``ValueError`` naming the allowed values for anything but None, auto or balanced."""
    if device_map is not None and device_map not in DEVICE_MAPS:
        raise ConfigError(
            f"--device-map {device_map!r} is not known: give auto (fill the devices in order) or "
            "balanced (the same share on each), or leave it out for --device"
        )


def check_dtype_device(dtype: str, device: str) -> None:
    """``ConfigError`` naming the allowed values for a dtype torch does not know (``auto`` or a
    torch dtype name) or a device string torch cannot parse, before any model is built."""
    if dtype != "auto" and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise ConfigError(f"--dtype {dtype!r} is not known: give auto, float32, bfloat16 or float16")
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"--device {device!r} is not a device: give cpu, cuda, cuda:1, ... (or auto / balanced)"
        ) from None


def place(model: PreTrainedModel, device: str, device_map: str | None) -> PreTrainedModel:
    """``model`` on ``device``, or with ``device_map`` spread over every visible device by
    accelerate (``infer_auto_device_map`` + ``dispatch_model``; decoder layers are never split).

    The layers then sit on different devices; accelerate's hooks move activations between them,
    and moectl's routing moves each policy's masks to its router's device."""
    if device_map is None:
        return model.to(device)
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    memory = (
        get_balanced_memory(model, no_split_module_classes=no_split) if device_map == "balanced" else None
    )
    placement = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    return dispatch_model(model, placement)


def load_model(
    spec: str,
    dtype: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    with_tokenizer: bool = True,
    device_map: str | None = None,
) -> tuple[PreTrainedModel, object]:
    """``spec`` is ``tiny:FAMILY`` (offline random model), ``shape:NAME[@LAYERS][~wWIDTH]`` (a real
    model's shape with random bf16 weights, see ``moectl.models.shapes``), a checkpoint directory,
    a hub id or a GGUF file (``moectl.models.load_gguf``, issue 40 item 3).

    Returns (model in eval mode, tokenizer padding on the left); the tokenizer is None when
    ``with_tokenizer`` is False. Shapes and checkpoints written from them have no tokenizer of
    their own: they come with the byte tokenizer over the model's vocabulary. ``device_map``
    (``auto`` | ``balanced``) spreads the model over every visible device instead of ``device``
    (a checkpoint: transformers' ``from_pretrained(device_map=...)``, loaded straight there);
    ``device`` auto or balanced means the same (the CLI's ``--device-map``).
    """
    if device in DEVICE_MAPS:
        device_map, device = device, "cpu"
    check_device_map(device_map)
    check_dtype_device(dtype, device)
    if spec.startswith("tiny:"):
        family = spec.split(":", 1)[1]
        model = tiny(family, seed=seed, vocab_size=ByteTokenizer.vocab_size)
        if dtype != "auto":
            model = model.to(getattr(torch, dtype))
        install_cpu_linear(model)
        return place(model, device, device_map), ByteTokenizer()
    if spec.startswith(SPEC_PREFIX):
        shape_dtype = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype)
        model = build_shape(
            spec, dtype=shape_dtype, device=device if device_map is None else "cpu", seed=seed
        )
        model = place(model, device, device_map) if device_map else model
        prefer_on_cpu(model)
        install_cpu_linear(model)
        return model, byte_tokenizer(model.config.vocab_size) if with_tokenizer else None
    if is_gguf(spec):  # a GGUF file (issue 40 item 3): transformers' GGUF loader, dequantized
        from moectl.models.load_gguf import load_gguf

        return load_gguf(spec, dtype, device, with_tokenizer=with_tokenizer, device_map=device_map)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(spec).expanduser()
    if not local.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") != 1):
        raise MoectlFileError(
            f"{spec!r} is neither a checkpoint directory nor a hub id (owner/name); for an offline "
            f"model use tiny:FAMILY with FAMILY one of {', '.join(FAMILIES)}, or shape:NAME with NAME "
            f"one of {', '.join(known_shapes())}"
        )
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    _quiet_transformers()
    if local.exists():
        check_model_folder(local)
        folder_loader = loader_for(local)  # e.g. moectl.quant's quantized checkpoints (issue 40 item 2)
        if folder_loader is not None:
            return folder_loader(local, dtype, device, device_map, with_tokenizer)
    placed = {"device_map": device_map} if device_map else {}
    if (local / MARKER).is_file():  # written by moectl.models.shapes: check shards, no tokenizer
        check_checkpoint(local)
        model = AutoModelForCausalLM.from_pretrained(str(local), dtype=torch_dtype, **placed)
        tokenizer = byte_tokenizer(model.config.vocab_size) if with_tokenizer else None
        model = model if device_map else model.to(device)
        prefer_on_cpu(model)
        install_cpu_linear(model)
        return model.eval(), tokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(local) if local.exists() else spec, dtype=torch_dtype, **placed
        )
        model = model if device_map else model.to(device)
        prefer_on_cpu(model)  # padded groups: oneDNN compiles a bf16 kernel per new group size
        install_cpu_linear(model)  # bf16 products on the CPU at the memory's speed (moectl.kernels)
        if not with_tokenizer:
            return model.eval(), None
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else spec)
    except OSError as err:
        raise MoectlFileError(
            f"could not load {spec!r}: {err}. Without network, pass a local checkpoint directory."
        ) from err
    except ValueError as err:  # transformers refusing the folder's config (an unknown model_type, ...)
        raise FileFormatError(f"could not load {spec!r}: {err}") from err
    return model.eval(), padding_left(tokenizer)


def padding_left(tokenizer):
    """``tokenizer`` padding on the left, with the EOS token as pad where it has none (what generation
    of a batch wants); returned for chaining."""
    if getattr(tokenizer, "pad_token_id", None) is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def tokenizer_for(path: str, vocab_size: int):
    """The tokenizer in folder ``path`` (or a hub id) for a model of ``vocab_size`` ids, padding on
    the left: a checkpoint without one of its own (moectl's shape checkpoints) served with the
    tokenizer its GGUF export carries. ``ConfigError`` when it does not load or has ids past the
    model's vocabulary."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--tokenizer {path!r}: no tokenizer loads from it ({err})") from None
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            f"--tokenizer {path!r} has {len(tokenizer)} tokens, more than the model's vocabulary of "
            f"{vocab_size}: give the tokenizer the model was trained (or exported) with"
        )
    return padding_left(tokenizer)
