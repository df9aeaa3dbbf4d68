"""The KV cache's name in transformers' forward calls and outputs, across transformers 5 releases.

transformers 5.24 renamed the forward keyword and output field ``past_key_values`` to ``cache``
(the old keyword still works, with a FutureWarning, until 5.40; the old output field is gone).
moectl reads the cache from a forward's keywords (to know a call's absolute offset) and from its
output (to continue decoding), and passes it back in; these helpers do each under either name, so
moectl runs on every transformers 5 release its ``pyproject.toml`` allows.
"""

from __future__ import annotations

from functools import cache
from typing import Any

OLD, NEW = "past_key_values", "cache"


@cache
def cache_keyword() -> str:
    """The keyword the installed transformers' models take the KV cache under."""
    from transformers import modeling_outputs

    fields = getattr(modeling_outputs.CausalLMOutputWithPast, "__dataclass_fields__", {})
    return NEW if NEW in fields else OLD


def cache_in(kwargs: dict[str, Any]) -> Any:
    """The KV cache passed to a forward (either name), or None."""
    found = kwargs.get(NEW)
    return kwargs.get(OLD) if found is None else found


def cache_out(output: Any) -> Any:
    """The KV cache a forward returned (a ``ModelOutput`` under either name), or None."""
    getter = getattr(output, "get", None)
    if getter is None:
        return None
    found = getter(NEW)
    return getter(OLD) if found is None else found


def with_cache(cache_value: Any) -> dict[str, Any]:
    """``{keyword: cache}`` to splat into a model call: ``model(ids, **with_cache(kv), use_cache=True)``."""
    return {cache_keyword(): cache_value}
