"""The LM head on a few final hidden states at a time, reduced as the logits come (docs/architecture.md:
"Memory by design").

Scoring a token needs log p(x) = logit_x − log Σ_v exp(logit_v): one number per token, not the
[tokens, V] logits. :func:`head_chunks` is the one loop that runs the head on ``rows`` positions at
a time; each caller reduces a chunk's logits as they come. :func:`target_logprobs` keeps only the
target's log-probability; :func:`add_log_probs` folds one sample's next-token distributions into a
running [B, P, V] accumulator (probability or log-probability sums over the K samples of RoE, §3.1)
for the callers that need a whole distribution (greedy checks, an evaluation harness);
``eval.token_scores.head_scores`` and ``engine.logprobs.prompt_logprobs`` are the others. The
vocabulary-wide float buffers of one call are at most ``rows`` · V.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from moectl.errors import UnsupportedModelError

HEAD_BYTES = 1 << 27  # float32 logits (and their temporaries) of one head call

Head = Callable[[Tensor], Tensor]


def output_head(model: nn.Module) -> Head:
    """hidden [..., H] (after the final norm) → logits [..., V], as the model's own forward computes them.

    The output embedding, then what some families apply after it: Granite-MoE divides by
    ``logits_scaling``, soft-capping models cap with tanh (``final_logit_softcapping``).
    """
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no output embedding (LM head) to score with")
    scaling = getattr(model.config, "logits_scaling", None)
    softcap = getattr(model.config, "final_logit_softcapping", None)

    def head(hidden: Tensor) -> Tensor:
        logits = lm_head(hidden)
        if scaling is not None and scaling != 1:
            logits = logits / scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return head


def vocab_size(model: nn.Module) -> int:
    """Rows of the model's output embedding: the V of its logits (``out_features``, which a quantized
    head keeps without a ``weight``: ``moectl.quant``)."""
    head = model.get_output_embeddings()
    out_features = getattr(head, "out_features", None)
    return int(out_features) if out_features is not None else int(head.weight.shape[0])


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for a float64 model (the reduction never loses the model's precision)."""
    return torch.promote_types(dtype, torch.float32)


def head_rows(vocab: int, budget: int = HEAD_BYTES) -> int:
    """Tokens per head call so that its float buffers (logits, a copy, a temporary) fit ``budget``."""
    return max(1, budget // max(1, 3 * 4 * vocab))


def head_chunks(head: Head, hidden: Tensor, rows: int, dim: int = 0) -> Iterator[tuple[slice, Tensor]]:
    """(positions, logits) for ``rows`` positions of ``hidden`` at a time along ``dim`` (hidden
    [..., H] → logits [..., V] in the compute dtype). A chunk's logits are the caller's to reduce
    and drop (``del``) before asking for the next, so that one chunk's buffers are alive at a time."""
    dtype = compute_dtype(hidden.dtype)
    for first in range(0, hidden.shape[dim], rows):
        span = slice(first, first + rows)
        logits = head(hidden.narrow(dim, first, min(rows, hidden.shape[dim] - first))).to(dtype)
        yield span, logits
        del logits


def target_logprobs(head: Head, hidden: Tensor, targets: Tensor, rows: int) -> Tensor:
    """log softmax(head(hidden))[target] for hidden [N, H], targets [N]: [N] in the compute dtype."""
    out = torch.empty(hidden.shape[0], dtype=compute_dtype(hidden.dtype), device=hidden.device)
    for span, logits in head_chunks(head, hidden, rows):  # chunks of tokens, a few per sequence
        out[span] = logits.gather(-1, targets[span, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        del logits  # before the next chunk's logits exist
    return out


def add_log_probs(head: Head, hidden: Tensor, acc: Tensor | None, how: str, rows: int) -> Tensor:
    """Fold one sample's next-token log-probabilities at hidden [B, P, H] into ``acc`` [B, P, V].

    ``how="prob_mean"``: acc = log Σ_k p_k (log-add-exp); ``"logprob_mean"``: acc = Σ_k log p_k.
    ``acc`` None starts the sums. Positions go through the head ``rows`` tokens at a time.
    """
    b, p = hidden.shape[:2]
    step = max(1, rows // max(1, b))
    fresh = acc is None
    for span, logits in head_chunks(head, hidden, step, dim=1):  # chunks of positions, a few per sequence
        logp = torch.log_softmax(logits, dim=-1)
        if acc is None:
            acc = torch.empty((b, p, logp.shape[-1]), dtype=logp.dtype, device=hidden.device)
        part = acc[:, span]
        if fresh:
            part.copy_(logp)
        elif how == "prob_mean":
            torch.logaddexp(part, logp, out=part)
        else:
            part += logp
        del logits, logp
    assert acc is not None
    return acc
