"""The decoder's final hidden states (after the final norm), the LM head left to the caller.

Scoring many positions runs the model to its final hidden states and the LM head on a few of them
at a time (``lm_head.head_chunks``): :func:`decoder_of` finds the decoder under the head,
:func:`keeping_final_hidden` keeps its output while open, :func:`final_hidden` runs the whole
model once (every routing hook fires) with the head on one position.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from moectl.errors import UnsupportedModelError


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder under the LM head: the module whose output is the final-normed hidden state."""
    for candidate in (getattr(model, "model", None), getattr(model, "get_decoder", lambda: None)()):
        if isinstance(candidate, nn.Module) and candidate is not model:
            return candidate
    raise UnsupportedModelError(f"{type(model).__name__}: cannot find the decoder under the LM head")


@contextmanager
def keeping_final_hidden(decoder: nn.Module) -> Iterator[list[Tensor]]:
    """While open, each forward of ``decoder`` appends its last hidden state [B, T, H] (after the
    final norm) to the yielded list."""
    box: list[Tensor] = []

    def keep(module: nn.Module, args: tuple, output) -> None:
        box.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder.register_forward_hook(keep)
    try:
        yield box
    finally:
        handle.remove()


def final_hidden(model: nn.Module, decoder: nn.Module, **inputs) -> Tensor:
    """The decoder's last hidden state [B, T, H] for ``inputs``, from a forward of the whole model.

    The whole model runs (so every hook a routing session put on it fires as usual) with
    ``logits_to_keep=1``: the LM head sees one position; the caller runs it on the rest in chunks.
    """
    with keeping_final_hidden(decoder) as box:
        model(**inputs, logits_to_keep=1)
    return box[-1]
