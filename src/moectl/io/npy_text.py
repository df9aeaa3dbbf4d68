"""Integer arrays as text: a ``.npy`` file in base64, the form vLLM's server sends routed experts in.

``np.load(io.BytesIO(base64.b64decode(text)))`` reads it back on a client without moectl.
"""

from __future__ import annotations

import base64
import binascii
import io

import torch
from torch import Tensor

from moectl.errors import ConfigError


def encode(array: Tensor) -> str:
    """``array`` (integers) as base64 of a ``.npy`` file of int32."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array.cpu().numpy().astype(np.int32), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode(text: str, what: str = "array") -> Tensor:
    """The integer array :func:`encode` wrote; ``ConfigError`` naming ``what`` for anything else."""
    import numpy as np

    try:
        array = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as err:
        raise ConfigError(f"{what}: not a base64 .npy array ({err})") from None
    if array.dtype.kind not in "iu":
        raise ConfigError(f"{what}: the array holds {array.dtype}, not integers")
    return torch.from_numpy(array.astype(np.int32) if array.dtype.kind == "u" else array)
