"""Write a checkpoint folder (optionally cut to an expert subset) as one GGUF file llama.cpp loads.

Everything that can be refused is checked first (architecture and config, tokenizer, tensor
names, subset, output path); only then is the file written, to a temporary file beside ``out``
renamed into place on success, so a failure leaves nothing half-written. The tensors stream
through ``gguf.GGUFWriter``'s header / key-values / tensor-info / data stages one at a time:
memory holds one source tensor (one MoE layer's fused experts at most), never the model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gguf

from moectl.errors import FileFormatError, OutputExistsError, OutputIsFolderError
from moectl.export.gguf_arch import spec_for, write_hparams
from moectl.export.gguf_tensors import FILE_TYPES, arrays, plan, resolve_outtype
from moectl.export.gguf_vocab import read_vocab
from moectl.io.atomic import atomic_path
from moectl.io.shards import ShardReader
from moectl.models.meta_model import build_meta, load_config


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse a folder, or an existing file unless ``overwrite``."""
    if out.is_dir():
        raise OutputIsFolderError(f"--out {out} is a folder: give a file path, e.g. {out / 'model.gguf'}")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"--out {out} already exists; pass --overwrite to replace it")


def _subset_keep(model: Any, subset: str | Path) -> dict[int, list[int]]:
    """Decoder layer -> kept expert ids, from a subset file validated against the model."""
    from moectl.adapters import inspect
    from moectl.adapters.slicing import check_keep
    from moectl.subsets.files import load_subset

    info = inspect(model)
    keep = check_keep(info, load_subset(subset, info).keep)
    return {info.layer(i).layer_idx: ids for i, ids in keep.items()}


def write_gguf(
    model_dir: str | Path,
    out: str | Path,
    subset: str | Path | None = None,
    outtype: str = "auto",
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write checkpoint folder ``model_dir`` (``keep`` only the experts of ``subset`` when given) as
    GGUF file ``out``; returns a report. ``ValueError``/``OSError`` name what was refused.

    ``outtype``: ``auto`` (the checkpoint's dtype), ``f32``, ``f16`` or ``bf16``; ``tokenizer``: a
    folder with the ``tokenizer.json`` to write (default: ``model_dir``'s own).
    """
    start = time.perf_counter()
    model_dir, out = Path(model_dir).expanduser(), Path(out).expanduser()
    check_out(out, overwrite)
    if not model_dir.is_dir():
        raise FileFormatError(f"{model_dir} is not a checkpoint folder (config.json + *.safetensors)")
    config = load_config(model_dir)
    spec = spec_for(config)
    model = build_meta(config, None)
    reader = ShardReader(model_dir, model)
    try:
        keep = _subset_keep(model, subset) if subset is not None else None
        num_experts = len(next(iter(keep.values()))) if keep else int(config.num_experts)
        outtype = resolve_outtype(outtype, reader)
        planned = plan(reader, spec, int(config.num_hidden_layers), outtype, keep)
        vocab = read_vocab(Path(tokenizer).expanduser() if tokenizer else model_dir, int(config.vocab_size))
        with atomic_path(out) as tmp:
            writer = gguf.GGUFWriter(tmp, spec.name)
            writer.add_type(gguf.GGUFType.MODEL)
            writer.add_name(model_dir.name)
            writer.add_description(
                f"exported by moectl from {model_dir.name}"
                + (f", experts kept by {Path(subset).name}" if subset is not None else "")
            )
            hparams = write_hparams(writer, config, spec, num_experts)
            vocab.add_to(writer)
            writer.add_file_type(FILE_TYPES[outtype])
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for p in planned:
                writer.add_tensor_info(p.name, p.shape, p.qtype_numpy, p.nbytes, raw_dtype=p.qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for _, array in arrays(reader, planned):
                writer.write_tensor_data(array)
            writer.close()
    finally:
        reader.close()
    return {
        "model": str(model_dir),
        "out": str(out),
        "arch": spec.name,
        "outtype": outtype,
        "subset": str(subset) if subset is not None else None,
        "experts": num_experts,
        "experts_source": int(config.num_experts),
        "untied_output": bool(spec.needs_output and "lm_head.weight" in reader.map.tied),
        "tensors": len(planned),
        "tensor_bytes": sum(p.nbytes for p in planned),
        "file_bytes": out.stat().st_size,
        "hparams": hparams,
        "tokenizer": vocab.summary(),
        "seconds": round(time.perf_counter() - start, 3),
    }
