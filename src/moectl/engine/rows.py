"""Routing per row: one policy installed on the model that hands each row to its own request's policies.

``RowRouter`` is a routing policy (``moectl.routing.routing_state.Policy``). Before each forward the engine
says which rows belong to which routing (``set_groups``); at every MoE layer the router applies each
group's policies to a ``RoutingState`` cut to that group's rows, with a context as the request alone
would have it (its own offset: the real tokens it has seen), and writes their ``allowed`` / ``noise``
back into the batch's state. In a prefill of several requests the rows are left-padded to the
longest prompt; a group's ``pad`` columns are cut off before its policies see the rows, so a policy
sees exactly the [1, n, E] call of its request alone (absolute positions 0..n−1, the same draws
from a generator) and padding stays unrestricted. A row with no routing is left as the model routes it. Stateless
routings (an expert mask) share one group for all their rows; a policy with sequence state (a
controller, a document pool, Gumbel noise) is forked per request, so its state never mixes rows.
Draws keyed by request (evaluation's keyed noise) are stateless too: their requests share a group
whose context carries each row's own offset and request code (``RouteContext.offsets``/``row_codes``).

``SwitchMeter`` records, per row, its routing into the request's own ``RoutingTrace`` when the engine
records (``EngineConfig.record``), and counts, per row, how often each layer's expert set ω changes from one generated
token to the next (TE-MoE §2.2): ω is the row's allowed mask where its routing restricts the layer,
else the experts the router chose (the router as an option with k-hat = top-k). The prefill's last
token starts the count ("from the last prompt token on"); only decoding steps are counted. Each
router's hook only keeps its call's last-token choice; ``SwitchMeter.end`` updates ω and the counts
of every layer at once after the forward (a few tensor operations per step, not per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.engine.row_constants import ConstantRows, row_effects
from moectl.metrics.switch_rate import option_step
from moectl.routing.option_lens import OptionLens
from moectl.routing.pool import DocumentPool
from moectl.routing.protocols import SeededPolicy
from moectl.routing.routing_state import Policy, RouteContext, RoutingState


@dataclass
class Group:
    """Rows [n] of the batch that share one list of policies, their offset (tokens seen) and how many
    leading columns of this call are padding in each of them (a batched prefill's left padding)."""

    rows: Tensor
    policies: list[Policy]
    offset: int
    pad: int = 0
    offsets: Tensor | None = None  # [n] each row's own tokens seen, where its rows are several requests
    codes: Tensor | None = None  # [n] each row's request code, for policies keyed by request


def splittable(policies: list[Policy]) -> bool:
    """Whether a prompt routed by ``policies`` may be fed in several calls (chunked prefill) and be
    routed exactly as in one: each call's group has the offset of the tokens before it, and
    sequence state (a controller's options, a causal pool's sums, a positional mask) carries across
    calls. Not so for a policy drawing from a seeded stream in call order (Gumbel noise, a sampling
    controller: the draws would come in another order, layer by layer per chunk) nor for a pool over
    the whole document (``DocumentPool`` mode 'full': a chunk's tokens would not see later ones)."""
    for policy in policies:
        if isinstance(policy, SeededPolicy) and policy.draws():
            return False
        if isinstance(policy, DocumentPool) and policy.mode == "full":
            return False
    return True


class RowRouter:
    """The one policy the engine installs: each group's policies on its rows (see the module doc)."""

    def __init__(self) -> None:
        self.groups: list[Group] = []
        self.allowed: dict[int, Tensor] = {}  # per MoE layer: [B, T, E] of the latest call, where restricted
        self.restricted_rows: Tensor | None = None  # [B] bool: rows whose routing restricted ``allowed``
        self.lens: dict[int, Tensor] = {}  # k-hat -> rows [n] counted with the router-as-option lens
        self.row_top_k: dict[int, Tensor] | None = None  # topk:N -> its rows, in the current forward
        self._call: RouteContext | None = None  # the forward call the group contexts below belong to
        self._contexts: list[RouteContext] = []  # per dynamic group: its context, one object for every layer
        self.dynamic: list[Group] = []  # groups whose policies run per layer (not row-constant)
        self.constants: ConstantRows | None = None  # the row-constant groups, prepared (row_constants.py)
        self._constants_key: tuple | None = None
        self._constants_held: list = []  # their policy lists, kept alive while the key names their ids
        self._prepared: ConstantRows | None = None  # the latest prepared tensors, reused while the key holds
        self._effects: dict[int, tuple[list, list | None]] = {}  # id(policies) -> (policies, row effects)
        self._experts: list[int] = []  # experts per MoE layer

    def bind(self, info: ModelInfo) -> None:
        self.allowed = {}
        self._experts = [layer.num_experts for layer in info.layers]
        self._effects, self._constants_key, self.constants, self._prepared = {}, None, None, None

    def set_groups(self, groups: list[Group], batch: int, device: torch.device) -> None:
        """The rows of the next forward by routing (empty: route every row as the model does)."""
        self.groups = groups
        self.allowed = {}
        self._call, self._contexts = None, []
        self.restricted_rows = torch.zeros(batch, dtype=torch.bool, device=device) if groups else None
        lens: dict[int, list[Tensor]] = {}  # k-hat -> rows whose routing is ``option:K`` (option_lens)
        for group in groups:
            for policy in group.policies:
                if isinstance(policy, OptionLens):
                    lens.setdefault(policy.k_hat, []).append(group.rows)
        self.lens = {k: torch.cat(rows).to(device) for k, rows in lens.items()}
        self.row_top_k = None  # {N: rows} of the latest layer where rows choose their own number of experts
        self._split(groups, batch, device)

    def _split(self, groups: list[Group], batch: int, device: torch.device) -> None:
        """Row-constant groups (unpadded, every policy a ``RowConstantPolicy``) into ``constants``,
        prepared again only when their rows or routings change; the rest into ``dynamic``."""
        effects: dict[int, tuple[list, list | None]] = {}
        constant: list[tuple[Group, list]] = []
        self.dynamic = []
        for group in groups:
            key = id(group.policies)
            found = effects.get(key) or self._effects.get(key)
            if found is None or found[0] is not group.policies:
                found = (group.policies, row_effects(group.policies, len(self._experts)))
            effects[key] = found
            if found[1] is not None and group.pad == 0 and self._experts:
                constant.append((group, found[1]))
            else:
                self.dynamic.append(group)
        if not groups:  # between forwards: the prepared tensors stay for the next step's groups
            self.constants = None
            return
        self._effects = effects  # only the routings of this forward's groups
        if not constant:
            self.constants = None
            return
        key = (batch, str(device), tuple((tuple(g.rows.tolist()), id(g.policies)) for g, _ in constant))
        if key != self._constants_key:
            self._prepared = ConstantRows([(g.rows, e) for g, e in constant], batch, self._experts, device)
            self._constants_key, self._constants_held = key, [g.policies for g, _ in constant]
        self.constants = self._prepared

    def apply(self, state: RoutingState) -> None:
        if not self.groups:
            return
        ctx = state.ctx
        if ctx is not self._call:  # a group's context is one object across the call's layers, as a
            self._call = ctx  # request alone sees it (policies keep per-call work keyed by it)
            self._contexts = [self._context(ctx, group, state.logits.device) for group in self.dynamic]
        allowed: Tensor | None = None
        noise: Tensor | None = None
        forced: Tensor | None = None
        top_k: dict[int, list[Tensor]] = {}  # N -> rows whose routing chooses N experts (topk:N)
        replays: list[tuple[Tensor, slice, Tensor]] = []  # (rows, columns, [n, t, k']) replayed experts
        renorm = None
        shared = False  # ``allowed`` / ``forced`` are the prepared tensors' views: copied before writing
        if self.constants is not None:  # the row-constant groups: this layer's prepared tensors
            layer = self.constants.layers[state.layer]
            if layer.allowed is not None:
                allowed, renorm, shared = layer.allowed.expand(state.logits.shape), self.constants.renorm, True
                if self.restricted_rows is not None and layer.restricting is not None:
                    self.restricted_rows |= layer.restricting
            if layer.forced is not None:
                forced, shared = layer.forced.expand(state.logits.shape), True
            for k, rows in self.constants.top_k.items():
                top_k[k] = [rows]
        for group, sub_ctx in zip(self.dynamic, self._contexts, strict=True):
            if shared:
                allowed = None if allowed is None else allowed.clone()
                forced = None if forced is None else forced.clone()
                shared = False
            rows = group.rows.to(state.logits.device)
            cols = slice(group.pad, None)  # the group's real columns (all, but in a batched prefill)
            sub = RoutingState(state.layer, state.logits[rows, cols], state.rule, sub_ctx)
            if state.hidden is not None:
                sub.hidden = state.hidden[rows, cols]
            for policy in group.policies:
                policy.apply(sub)
            if sub.allowed is not None:
                if allowed is None:
                    allowed = torch.ones_like(state.logits, dtype=torch.bool)
                allowed[rows, cols] = sub.allowed
                renorm = sub.renorm  # one mode across registered routings (engine.routings checks)
                if self.restricted_rows is not None:
                    self.restricted_rows[rows] = True
            if sub.noise is not None:
                if noise is None:
                    noise = torch.zeros_like(state.logits)
                noise[rows, cols] = sub.noise
            if sub.forced is not None:
                if forced is None:
                    forced = torch.zeros_like(state.logits, dtype=torch.bool)
                forced[rows, cols] = sub.forced
            if sub.top_k is not None:
                top_k.setdefault(sub.top_k, []).append(rows)
            if sub.replayed is not None:
                replays.append((rows, cols, sub.replayed))
        if allowed is not None:
            state.restrict(allowed, renorm=renorm)
            self.allowed[state.layer] = allowed
        if noise is not None:
            state.add_noise(noise)
        if forced is not None:
            state.force(forced)
        if replays:
            width = max(given.shape[-1] for _, _, given in replays)
            replayed = torch.full((*state.logits.shape[:2], width), -1, dtype=torch.long, device=state.logits.device)
            for rows, cols, given in replays:
                replayed[rows, cols, : given.shape[-1]] = given
            state.replay(replayed)
        if top_k:
            state.row_top_k = {k: rows[0] if len(rows) == 1 else torch.cat(rows) for k, rows in top_k.items()}
            self.row_top_k = state.row_top_k

    def mask_rows(self) -> tuple[str | None, list[Tensor | None] | None, str]:
        """For a forward that runs no router hooks (the compiled decoding step): where every group's
        routing is an expert mask (row-constant, no forced experts, no ``topk:N``, no ``option:K``
        lens), None, each MoE layer's allowed experts [B, E] (None where no row is restricted) and
        the renormalisation; and, as ``apply`` would, ``allowed`` and ``restricted_rows`` set for
        the switch counts. Else the reason it cannot, and nothing set."""
        constants = self.constants
        if self.dynamic or constants is None:
            return "a request's routing policy (noise, pool, controller, replay)", None, "pruned"
        if constants.top_k:
            return "topk:N routing", None, "pruned"
        if self.lens:
            return "option:K routing (its lens reads the router's distribution)", None, "pruned"
        if any(layer.forced is not None for layer in constants.layers):
            return "forced experts", None, "pruned"
        masks: list[Tensor | None] = []
        for index, layer in enumerate(constants.layers):
            if layer.allowed is None:
                masks.append(None)
                continue
            masks.append(layer.allowed[:, 0])
            self.allowed[index] = layer.allowed
            if self.restricted_rows is not None and layer.restricting is not None:
                self.restricted_rows |= layer.restricting
        return None, masks, constants.renorm

    @staticmethod
    def _context(ctx: RouteContext, group: Group, device: torch.device) -> RouteContext:
        """The call as the group's requests alone would make it: its rows, its real columns, its offset."""
        rows = group.rows.to(device)
        return RouteContext(
            batch=int(rows.numel()),
            length=ctx.length - group.pad,
            offset=group.offset,
            valid=None if ctx.valid is None else ctx.valid[rows.to(ctx.valid.device), group.pad :],
            calls=ctx.calls,
            offsets=None if group.offsets is None else group.offsets.to(device),
            row_codes=None if group.codes is None else group.codes.to(device),
        )


class SwitchMeter:
    """Per-row switch counts of the running batch (see the module doc); rows follow the batch."""

    def __init__(self, info: ModelInfo, router: RowRouter) -> None:
        self.info, self.router = info, router
        self.num_experts = max(layer.num_experts for layer in info.layers)
        self.prev: Tensor | None = None  # [B, L, E] bool: ω at each row's latest token
        self.switches: Tensor | None = None  # [B, L] switches counted per row and layer
        self.counting = False
        self.traces: list | None = None  # per row: its request's RoutingTrace (recording), or None
        self.pads: list[int] | None = None  # per row: leading padding columns of this call (None: none)
        self._last: dict[int, Tensor] = {}  # per MoE layer: [B, k] experts chosen at each row's last token
        self._last_probs: dict[int, Tensor] = {}  # per MoE layer: [B, E] p at the last token (option:K rows)
        self._chosen: Tensor | None = None  # [L, B, k] the compiled step's choices (``chose``)
        self._omega: Tensor | None = None  # ω [B, L, E] as the compiled step built it (``chose``)
        self._handles: list = []
        self._default_k = 0  # experts per token of rows without a topk:N of their own, this call

    def install(self, model: nn.Module) -> None:
        """Hook every router after moectl's routing hook (registered later, so it sees the final choice)."""
        for layer in self.info.layers:
            self._handles.append(layer.router.register_forward_hook(self._hook(layer)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer):
        def hook(module: nn.Module, args: tuple, output) -> None:
            if self.prev is None or self.switches is None:
                return
            chosen = layer.adapter.indices_of(output, layer.top_k)
            b = self.prev.shape[0]
            chosen = chosen.reshape(b, -1, chosen.shape[-1])
            self._default_k = chosen.shape[-1] if not self.router.row_top_k else layer.top_k
            if self.traces is not None:
                self._record(layer, output, chosen)
            self._last[layer.index] = chosen[:, -1]  # [B, k] the call's last token per row
            if self.router.lens:  # the router's distribution at each row's last token, for option:K rows
                logits = layer.adapter.logits_of(output).reshape(b, chosen.shape[1], -1)[:, -1]
                self._last_probs[layer.index] = layer.rule.probs(logits.float())

        return hook

    def chose(self, chosen: Tensor, omega: Tensor | None = None) -> None:
        """The experts [L, B, k] a forward that ran no router hooks chose at each row's token (the
        compiled decoding step, ``moectl.lm.compiled_decode``), for ``end`` to count; ``omega``: the
        same as ω [B, L, E] bool where the step built it (``end`` then takes it whole where no row is
        restricted and no row is ``option:K``: 76 -> 37 us a step, reference model, one row)."""
        self._chosen, self._omega = chosen, omega

    def end(self) -> None:
        """After a forward: ω of every layer that ran at each row's last token, switches counted
        where ω changed (a decoding step), ω kept for the next call."""
        last, self._last = self._last, {}
        built, self._omega = self._omega, None
        compiled, self._chosen = self._chosen, None
        if self.prev is None or self.switches is None or (not last and compiled is None):
            return
        if (
            built is not None
            and built.shape == self.prev.shape
            and self.router.restricted_rows is None
            and not self.router.lens
        ):  # every MoE layer, as chosen: whole-tensor updates
            if self.counting:
                self.switches += (built.to(self.prev.device) != self.prev).any(-1).to(self.switches.device)
            self.prev.copy_(built)
            return
        if compiled is not None:  # the compiled step's choices, per MoE layer as the hooks keep them
            last = {i: compiled[i] for i in range(compiled.shape[0])}
        layers = sorted(last)
        device = self.prev.device
        chosen = torch.stack([last[i].to(device).long() for i in layers], 1)  # [B, L', k]
        omega = torch.zeros(*chosen.shape[:2], self.prev.shape[-1], dtype=torch.bool, device=device)
        omega.scatter_(2, chosen, True)
        rows = self.router.restricted_rows
        if rows is not None:
            restricted = rows.to(device)[:, None]
            for j, layer in enumerate(layers):
                allowed = self.router.allowed.get(layer)
                if allowed is not None:
                    omega[:, j] = torch.where(restricted, allowed[:, -1].to(device), omega[:, j])
        probs, self._last_probs = self._last_probs, {}
        if self.router.lens and probs:
            omega = self._options(omega, layers, probs)
        if len(layers) == self.prev.shape[1]:  # every MoE layer ran: whole-tensor updates
            if self.counting:
                self.switches += (omega != self.prev).any(-1).to(self.switches.device)
            self.prev.copy_(omega)
            return
        index = torch.tensor(layers, device=device)
        if self.counting:
            changed = (omega != self.prev[:, index]).any(-1).to(self.switches.device)
            self.switches[:, index.to(self.switches.device)] += changed
        self.prev[:, index] = omega

    def _options(self, chosen: Tensor, layers: list[int], probs: dict[int, Tensor]) -> Tensor:
        """ω of the ``option:K`` rows by TE-MoE §2.2's lens (``routing/option_lens``): the option is
        kept while the activated experts stay inside it, else renewed (``option_of``); at a prefill's
        last token (not counting) it starts afresh. ``chosen`` [B, L', E]: the activated experts."""
        omega = chosen.clone()
        p = torch.stack([probs[i].to(chosen.device) for i in layers], 1)  # [B, L', E]
        index = torch.tensor(layers, device=chosen.device)
        prev = self.prev[:, index].to(chosen.device)
        for k_hat, rows in self.router.lens.items():
            rows = rows.to(chosen.device)
            omega[rows] = option_step(prev[rows] if self.counting else None, p[rows], chosen[rows], k_hat)
        return omega

    def _record(self, layer, output, chosen: Tensor) -> None:
        """Each row's probs, chosen experts and (where its routing restricts) allowed set."""
        assert self.traces is not None
        b, t = chosen.shape[:2]
        probs = layer.rule.probs(layer.adapter.logits_of(output).reshape(b, t, -1).float())
        allowed = self.router.allowed.get(layer.index)
        rows = self.router.restricted_rows
        restricted = rows.tolist() if allowed is not None and rows is not None else [False] * b
        pads = self.pads or [0] * b
        own = self._own_top_k(b)
        for r, trace in enumerate(self.traces):
            if trace is not None:
                p = pads[r]  # the row's own tokens only, as its request alone records them
                keep = allowed[r : r + 1, p:] if restricted[r] else None
                trace.record(layer.index, probs[r : r + 1, p:], chosen[r : r + 1, p:, : own[r]], keep)

    def _own_top_k(self, rows: int) -> list[int]:
        """Each row's own number of experts (its topk:N, else the call's): a wider row's padding cut."""
        width = [None] * rows
        for k, idx in (self.router.row_top_k or {}).items():
            for r in idx.tolist():
                width[r] = k
        return [w if w is not None else self._default_k for w in width]

    def new_rows(self, rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """ω [rows, L, E] (no expert yet) and switch counts [rows, L] (zero) for rows about to be
        prefilled, to ``start`` their forward with and join the batch's."""
        layers = self.info.num_moe_layers
        prev = torch.zeros(rows, layers, self.num_experts, dtype=torch.bool, device=device)
        return prev, torch.zeros(rows, layers, dtype=torch.long, device=device)

    def start(self, prev: Tensor | None, switches: Tensor | None, counting: bool) -> None:
        """Before a forward: ω at each row's latest token [B, L, E], the rows' switch counts [B, L]
        (updated in place by ``end``), and whether this call is a decoding step (switches count)."""
        self.prev, self.switches, self.counting = prev, switches, counting
        self._last, self._last_probs, self._chosen, self._omega = {}, {}, None, None
