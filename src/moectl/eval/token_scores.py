"""Log-probability and greedy flag of each scored token under a routing plan, without [B, T, V].

Scoring a token needs two numbers of its next-token distribution: log p(x) = logit_x − log Σ_v
exp(logit_v), and whether x is the argmax (lm-eval's ``is_greedy``). So the routed model runs once
to its final hidden states (after the final norm; the LM head sees one position,
``logits_to_keep=1``), and the LM head then runs on a few positions at a time — only those that
predict a scored token — keeping per position the target's log-probability and argmax check. The
extra memory of a scoring pass is one chunk's logits (``head_bytes``), whatever T and V are.

``repeats = K`` routed copies per request: the copies' distributions are averaged in probability
space per chunk (log mean_k p_k), so the greedy check is on the mixture. Under RoE the clean-cache
span path of ``moectl.roe.parallel`` does the same for the K routing samples. A request whose
policies draw from a stream (``request_noise.needs_isolation``) runs alone, reseeded from its key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.eval.forward import BatchRouting, RequestBatch, RoutingPlan, SwitchStats, to_left_padding
from moectl.eval.request_noise import needs_isolation, reseed, set_request_codes
from moectl.lm.final_hidden import decoder_of, final_hidden
from moectl.lm.lm_head import HEAD_BYTES, Head, compute_dtype, head_chunks, head_rows, output_head, vocab_size
from moectl.lm.scored_tokens import TokenScores
from moectl.roe.parallel import RoEScoringInputs, ensemble_token_scores
from moectl.routing.session import route


def head_scores(head: Head, hidden: Tensor, targets: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(log-probability [N], is-argmax [N]) of ``targets`` [N] from final hidden states [N, K, H].

    The K copies' distributions are averaged in probability space. The head runs on ``rows``
    hidden states at a time; nothing of size V outlives a chunk.
    """
    n, k = hidden.shape[0], hidden.shape[1]
    logprob = torch.empty(n, dtype=compute_dtype(hidden.dtype), device=hidden.device)
    greedy = torch.empty(n, dtype=torch.bool, device=hidden.device)
    for span, logits in head_chunks(head, hidden, max(1, rows // k)):  # logits [n, K, V]
        if k == 1:
            logits = logits[:, 0]
            logprob[span] = logits.gather(-1, targets[span, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        else:
            logits = torch.logsumexp(torch.log_softmax(logits, -1), dim=1) - math.log(k)
            logprob[span] = logits.gather(-1, targets[span, None]).squeeze(-1)
        greedy[span] = logits.argmax(-1) == targets[span]
        del logits
    return logprob, greedy


def _final_hidden(model: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """The decoder's last hidden state [B, T, H] (final norm applied), the LM head run on one position."""
    position = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return final_hidden(model, decoder_of(model), input_ids=ids, attention_mask=mask, position_ids=position)


def _routed_scores(
    model: nn.Module,
    batch: RequestBatch,
    routing: BatchRouting,
    info: ModelInfo,
    scored: Tensor,
    stats: SwitchStats | None,
    region: str,
    head_bytes: int,
) -> TokenScores:
    """One routed forward of the batch (K copies per row), then the chunked head on the scored positions."""
    k = int(routing.repeats)
    ids, mask = batch.input_ids, batch.attention_mask
    if k > 1:
        ids, mask = ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)
    set_request_codes(routing.policies, batch.keys, k)
    with (
        torch.no_grad(),
        route(model, list(routing.policies), record=stats is not None, info=info) as session,
    ):
        hidden = _final_hidden(model, ids, mask)
    if stats is not None:
        stats.add(session.trace, region)
    b, t = batch.input_ids.shape
    hidden = hidden.view(b, k, t, -1)
    row, col = scored[:, 1:].nonzero(as_tuple=True)  # position col predicts token col + 1
    targets = batch.input_ids[row, col + 1]
    head = output_head(model)
    lp, greedy = head_scores(head, hidden[row, :, col], targets, head_rows(vocab_size(model), head_bytes))
    out = TokenScores(
        torch.zeros(b, t, dtype=lp.dtype, device=lp.device),
        torch.ones(b, t, dtype=torch.bool, device=lp.device),
    )
    out.logprob[row, col + 1] = lp
    out.greedy[row, col + 1] = greedy
    return out


def _roe_scores(
    model: nn.Module, batch: RequestBatch, routing: BatchRouting, info: ModelInfo, scored: Tensor
) -> TokenScores:
    """RoE scores (RoE §2.3, clean cache) of a batch padded on either side, via a left-padded copy."""
    assert routing.roe is not None
    set_request_codes(routing.policies, batch.keys)  # a keyed policy composed with RoE
    there, back = to_left_padding(batch.attention_mask)
    ids, mask = batch.input_ids.gather(1, there), batch.attention_mask.gather(1, there)
    inputs = RoEScoringInputs(model, ids, mask, routing.roe, info, routing.policies)
    result = ensemble_token_scores(inputs, greedy=True)
    assert result.greedy is not None
    logprob, greedy = result.logprob.gather(1, back), result.greedy.gather(1, back)
    return TokenScores(logprob * scored, greedy | ~scored)


def _one_by_one(
    model: nn.Module,
    batch: RequestBatch,
    routing: BatchRouting,
    info: ModelInfo,
    scored: Tensor,
    stats: SwitchStats | None,
    region: str,
    head_bytes: int,
) -> TokenScores:
    """Each request alone (its real tokens only), its stream-drawing policies reseeded from its key."""
    b, t = batch.input_ids.shape
    out: TokenScores | None = None
    real = batch.attention_mask.bool()
    for r in range(b):  # one forward per request: policies whose draws cannot be keyed
        keep = real[r].nonzero().flatten()
        one = RequestBatch(
            batch.input_ids[r : r + 1, keep],
            batch.attention_mask[r : r + 1, keep],
            [batch.keys[r]],
            batch.kind,
        )
        reseed(routing.policies, batch.keys[r])
        part = _routed_scores(model, one, routing, info, scored[r : r + 1, keep], stats, region, head_bytes)
        if out is None:
            out = TokenScores(
                torch.zeros(b, t, dtype=part.logprob.dtype, device=part.logprob.device),
                torch.ones(b, t, dtype=torch.bool, device=part.logprob.device),
            )
        out.logprob[r, keep] = part.logprob[0]
        out.greedy[r, keep] = part.greedy[0]
    assert out is not None
    return out


@torch.no_grad()
def routed_token_scores(
    model: nn.Module,
    batch: RequestBatch,
    plan: RoutingPlan,
    info: ModelInfo,
    scored: Tensor,
    stats: SwitchStats | None = None,
    region: str = "all",
    head_bytes: int = HEAD_BYTES,
) -> TokenScores:
    """:class:`TokenScores` of the ``scored`` [B, T] tokens of ``batch`` under the plan's routing.

    ``scored`` marks real tokens after the first of their row. ``head_bytes`` bounds the float
    buffers of one LM-head call (``moectl.lm.lm_head.head_rows``).
    """
    scored = scored.bool() & batch.attention_mask.bool()
    scored[:, 0] = False
    routing = plan(batch)
    if routing.roe is not None:
        return _roe_scores(model, batch, routing, info, scored)
    if any(needs_isolation(p) for p in routing.policies):
        return _one_by_one(model, batch, routing, info, scored, stats, region, head_bytes)
    return _routed_scores(model, batch, routing, info, scored, stats, region, head_bytes)


def sum_scores(scores: TokenScores, scored: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: summed log-probability of the scored tokens (float64) and whether all are greedy."""
    mask = scored.bool()
    total = (scores.logprob.double() * mask).sum(-1)
    return total, (scores.greedy | ~mask).all(-1)


__all__: Sequence[str] = ["TokenScores", "head_scores", "routed_token_scores", "sum_scores"]
