"""PEFT's ``get_peft_model`` without transformers' deprecation noise.

PEFT 0.21 calls ``model.is_gradient_checkpointing``, which transformers 5 marks deprecated: every
options and subset verb printed a ``FutureWarning`` about code that is not moectl's. This wrapper
silences exactly that warning around the call and nothing else.
"""

from __future__ import annotations

import warnings
from typing import Any


def get_peft_model(model: Any, config: Any) -> Any:
    """``peft.get_peft_model(model, config)`` with transformers' ``is_gradient_checkpointing``
    deprecation warning suppressed."""
    from peft import get_peft_model as _get

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return _get(model, config)
