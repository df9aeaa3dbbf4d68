"""Where a controller's options switch during generation, on the generated tokens themselves.

Positions come from the routing trace: generated token j (1-based) sits at trace position
``prompt_len - 1 + j``, so a switch recorded there is a switch at token j. The tokens are the ids
the model generated (never the decoded text encoded again: with a BPE tokenizer that can give
other tokens, and the markers would land on the wrong ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def omega_switches(allowed: Mapping[int, Tensor], valid: Tensor) -> dict[int, Tensor]:
    """``{moe_layer: [B, T] bool}``: where the recorded option ω changed from the position before
    (both positions real tokens), the switch record ``switch_events`` reads, from a trace."""
    step = valid[:, 1:] & valid[:, :-1]
    return {
        layer: torch.cat([torch.zeros_like(valid[:, :1]), (mask[:, 1:] != mask[:, :-1]).any(-1) & step], 1)
        for layer, mask in allowed.items()
    }


def switch_events(switch: Mapping[int, Tensor], prompt_len: Tensor, row: int) -> dict[int, list[int]]:
    """``{moe_layer: [generated position of each switch]}`` of one row; ``switch[layer]`` is the
    controller's ``[B, T]`` switch record, position 0 the last prompt token."""
    start = int(prompt_len[row]) - 1
    return {
        layer: [int(t) - start for t in record[row].nonzero().flatten().tolist() if t >= start]
        for layer, record in switch.items()
    }


def marked_text(tokenizer: Any, token_ids: Sequence[int], events: Mapping[int, list[int]]) -> str:
    """The generated text with ``│`` before every token where an option switched in any layer."""
    switched = {t for positions in events.values() for t in positions}
    return "".join(
        ("│" if j in switched else "") + tokenizer.decode([token], skip_special_tokens=True)
        for j, token in enumerate(token_ids, start=1)
    )
