"""Real MoE models' shapes with random weights: presets, models, checkpoints (the public API).

Presets (``known_shapes()``; values and sources in ``shape_presets``): ``olmoe-1b-7b``,
``qwen3-30b-a3b``, ``gpt-oss-20b`` (bf16, dequantised), ``deepseek-v2-lite``, ``mixtral-8x7b``,
``phi-3.5-moe``, ``deepseek-v3`` and ``emo-1b-14b`` (as Qwen2-MoE: see its preset).

Spec strings, accepted wherever a MODEL is (``moectl.models.load.load_model``)::

    shape:olmoe-1b-7b          all 16 layers, full width
    shape:olmoe-1b-7b@2        2 decoder layers
    shape:olmoe-1b-7b@2~w64    2 layers at hidden size 64, every other width scaled alike (tests)

Python::

    from moectl.models.shapes import build_shape, parameter_counts, write_shape_checkpoint
    meta = build_shape("deepseek-v3")                    # meta device: shapes and counts, no memory
    parameter_counts(meta)["total"]                      # 671,026,...
    model = build_shape("qwen3-30b-a3b", num_layers=1, device="cpu")   # bf16, seeded N(0, 0.02)
    small = build_shape("shape:mixtral-8x7b@2~w64", device="cpu")      # or width=64
    write_shape_checkpoint("shape:olmoe-1b-7b@2", "/tmp/olmoe2")        # streamed, sharded, atomic
    check_checkpoint("/tmp/olmoe2")                       # every shard present and whole

The weights depend only on (seed, tensor name, shape, dtype): the checkpoint written with a seed
holds exactly the weights ``build_shape(..., device="cpu", seed=seed)`` does.
"""

from __future__ import annotations

from moectl.models.shape_build import (
    SPEC_PREFIX,
    ShapeSpec,
    build_from_config,
    build_shape,
    fill_model,
    known_shapes,
    parameter_counts,
    parse_shape_spec,
    shape_config,
)
from moectl.models.shape_checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    MARKER,
    check_checkpoint,
    make_checkpoint,
    write_shape_checkpoint,
)
from moectl.models.shape_presets import PRESETS, PUBLISHED, Published

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "MARKER",
    "PRESETS",
    "PUBLISHED",
    "SPEC_PREFIX",
    "Published",
    "ShapeSpec",
    "build_from_config",
    "build_shape",
    "check_checkpoint",
    "fill_model",
    "known_shapes",
    "make_checkpoint",
    "parameter_counts",
    "parse_shape_spec",
    "shape_config",
    "write_shape_checkpoint",
]
