"""``route()``: install routing policies and a recorder on a model, and remove them again.

In transformers 5 a router returns ``(logits, weights, indices)`` from one forward, so editing
the logits is too late: moectl registers a forward hook on each router module that recomputes
weights and indices from the raw logits with the family's rule (``adapters/rules.py``) under the
policies' constraints. A pre-hook on the base model records the call's batch shape, KV-cache
offset and padding. Leaving the context removes every hook: the model is exactly as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, MoELayer, UnsupportedModelError, inspect
from moectl.errors import ConfigError
from moectl.routing.kv_cache import cache_in
from moectl.routing.policy_files import routing_policies
from moectl.routing.replay import overlay as replay_overlay
from moectl.routing.routing_state import Policy, RouteContext, RoutingState
from moectl.routing.top_k import select as select_top_k
from moectl.routing.trace import RoutingTrace

_ACTIVE: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def sessions_on(model: nn.Module) -> int:
    """How many routing sessions are open on ``model`` now (a registry keyed by the model, nothing
    stamped on it): the engine decodes one prompt at a time inside a caller's session."""
    return _ACTIVE.get(model, 0)


class RoutingSession:
    """An active routing configuration; use through ``with moectl.route(...) as session``."""

    def __init__(
        self,
        model: nn.Module,
        policies: Sequence[Policy] = (),
        record: bool = False,
        info: ModelInfo | None = None,
        probs_dtype: torch.dtype = torch.float32,
        collect: bool = False,
    ) -> None:
        self.model = model
        # files, dicts and strings are loaded first (a controller folder merges its adapters into the model)
        self.policies = routing_policies(list(policies), model, info)
        self.info = info or inspect(model)
        for policy in self.policies:
            if not isinstance(policy, Policy):
                raise TypeError(f"{type(policy).__name__} is not a routing policy (needs bind() and apply())")
        self.record = record
        self.collect = collect
        # with collect=True: {moe_layer: (logits [B, T, E] float32 keeping the graph, chosen [B, T, k])}
        # of the latest forward, for training losses (load balancing, z-loss)
        self.collected: dict[int, tuple[Tensor, Tensor]] = {}
        self.probs_dtype = probs_dtype
        self.trace: RoutingTrace | None = None
        self.ctx = RouteContext()
        self._handles: list[Any] = []
        self._counted = False  # counted in the registry of open sessions
        self._fired: list[int] = []

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> RoutingSession:
        for policy in self.policies:
            policy.bind(self.info)
        meta = {"family": self.info.family, "moe_layers": [layer.layer_idx for layer in self.info.layers]}
        self.trace = RoutingTrace(self.info.num_moe_layers, meta, self.probs_dtype) if self.record else None
        self.ctx = RouteContext()
        self._fired = [0] * self.info.num_moe_layers
        root = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT
        base = getattr(root, "base_model", root)
        try:
            self._handles.append(base.register_forward_pre_hook(self._begin, with_kwargs=True))
            self._handles.append(base.register_forward_hook(self._end))
            if self._active:
                for layer in self.info.layers:
                    self._handles.append(layer.router.register_forward_hook(self._router_hook(layer)))
        except Exception:
            self.close()
            raise
        _ACTIVE[self.model] = _ACTIVE.get(self.model, 0) + 1
        self._counted = True
        return self

    @property
    def _active(self) -> bool:
        return bool(self.policies or self.record or self.collect)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._counted:
            self._counted = False
            left = _ACTIVE.get(self.model, 1) - 1
            if left > 0:
                _ACTIVE[self.model] = left
            else:
                _ACTIVE.pop(self.model, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- hooks -----------------------------------------------------------------------------
    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("input_ids")
        if x is None and args:
            x = args[0]
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None:
            raise ValueError("routing needs input_ids or inputs_embeds to know the batch shape")
        b, t = int(x.shape[0]), int(x.shape[1])
        cache = cache_in(kwargs)
        offset = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
        mask = kwargs.get("attention_mask")
        valid = mask[:, -t:].bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None
        self.ctx = RouteContext(batch=b, length=t, offset=offset, valid=valid, calls=self.ctx.calls + 1)
        self._fired = [0] * self.info.num_moe_layers
        self.collected = {}
        if self.trace is not None:
            self.trace.begin_call(offset, self.ctx.valid_mask(x.device))

    def _end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._active:
            return
        missed = [i for i, n in enumerate(self._fired) if n == 0]
        if missed:
            raise UnsupportedModelError(
                f"the routers of MoE layers {missed} were not called during the forward pass: something "
                "(a hub kernel, a fused or quantised MoE forward, a serving engine) bypasses the router "
                "module, so routing policies cannot act on it"
            )

    def _router_hook(self, layer: MoELayer):
        adapter, rule = layer.adapter, layer.rule
        bias_of = adapter.bias

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            self._fired[layer.index] += 1
            ctx = self.ctx
            logits = adapter.logits_of(output)
            e = logits.shape[-1]
            if logits.numel() != ctx.batch * ctx.length * e:
                raise RuntimeError(
                    f"MoE layer {layer.index}: router saw {logits.numel() // e} tokens, expected "
                    f"{ctx.batch}x{ctx.length}; was the model called through its base model?"
                )
            state = RoutingState(layer.index, logits.reshape(ctx.batch, ctx.length, e).float(), rule, ctx)
            if args and isinstance(args[0], Tensor) and args[0].numel() % (ctx.batch * ctx.length) == 0:
                state.hidden = args[0].reshape(ctx.batch, ctx.length, -1)
            for policy in self.policies:
                policy.apply(state)
            new = None
            changed = state.top_k is not None or state.row_top_k is not None  # topk:N (routing/top_k.py)
            replayed = state.replayed  # routing/replay.py: tokens whose experts are given
            if changed or state.allowed is not None or state.noise is not None or state.forced is not None or replayed is not None:
                n = ctx.batch * ctx.length
                allowed = None if state.allowed is None else state.allowed.reshape(n, e)
                if allowed is not None and not changed and (state.restrictions > 1 or rule.grouped):
                    # an intersection of policies (or a grouped router) may leave too few experts
                    rule.check_allowed(allowed, where=f"combined policies, MoE layer {layer.index}")
                noise = None if state.noise is None else state.noise.reshape(n, e)
                forced = None if state.forced is None else state.forced.reshape(n, e)
                if forced is not None and allowed is not None and bool((forced & ~allowed).any()):
                    raise ConfigError(f"MoE layer {layer.index}: a forced expert is not allowed by another policy")
                if changed:
                    weights, idx = select_top_k(rule, state, bias_of(module), allowed, noise, forced)
                else:
                    weights, idx = rule.select(
                        state.logits.reshape(n, e), bias_of(module), allowed, noise, state.renorm, forced
                    )
                if replayed is not None:
                    weights, idx = replay_overlay(rule, state.logits.reshape(n, e), weights, idx, replayed.reshape(n, -1))
                new = adapter.repack(output, weights, idx)
                chosen = idx
            else:
                chosen = adapter.indices_of(output, rule.top_k)
            shape = (ctx.batch, ctx.length, -1)
            if self.collect:
                self.collected[layer.index] = (state.logits, chosen.reshape(shape))
            if self.trace is not None:
                self.trace.record(layer.index, state.probs, chosen.reshape(shape), state.allowed)
            return new

        return hook


def route(
    model: nn.Module,
    policies: Any = None,
    record: bool = False,
    info: ModelInfo | None = None,
    probs_dtype: torch.dtype = torch.float32,
    collect: bool = False,
) -> RoutingSession:
    """Route ``model`` under ``policies`` (applied in order) inside a ``with`` block.

    ``policies`` is a policy, a list of them, or anything ``moectl.load_policy`` reads — a policy
    file or folder, a dict, ``option:8`` — loaded for ``model``. Residency policies
    (``serve-offload``'s lru / option / static / controller) install the routing they need; a RoE
    config is refused (it is K routings: use ``moectl.roe``).

    >>> with route(model, [ExpertMask.from_lists(info, {0: [0, 1]}), GumbelTopK(0.3)], record=True) as s:
    ...     model(input_ids)
    >>> s.trace.chosen[0]  # [B, T, k]
    """
    if policies is None:
        policies = []
    elif not isinstance(policies, (list, tuple)):
        policies = [policies]
    return RoutingSession(model, policies, record=record, info=info, probs_dtype=probs_dtype, collect=collect)
