"""Routing randomness that belongs to a request, so a score does not depend on batching or order.

``GumbelTopK`` and ``RandomOptions`` draw from one generator stream in call order: the noise a
request gets would depend on which requests share its batch and where it sits. Evaluation needs
each request to be routed the same wherever the harness puts it. Two mechanisms:

- **keyed noise** (batched): :class:`KeyedGumbel` and :class:`KeyedRandomOptions` replace the
  stream by a counter-based hash of (policy seed, request code, MoE layer, position in the
  request, expert). The request code comes from the request's key (a hash of its real tokens,
  :func:`moectl.eval.forward.request_keys`); the position counts the request's real tokens, carried
  across decoding steps, so padding on either side and a KV cache change nothing.
  :func:`keyed_policies` swaps them in (``static_plan`` does); the forward sets the codes of each
  batch with :func:`set_request_codes`.
- **one request per forward** (any other seeded policy, e.g. a sampling ``ControllerPolicy``,
  whose draws cannot be keyed from outside): :func:`needs_isolation` says so and the evaluator
  runs each request alone after :func:`reseed` gives the policy a seed derived from the request's
  key and the policy's own seed.

Generation runs on the engine, each request with policies of its own: :func:`request_policies`
gives a request its keyed copies (its codes set), forks of stream-drawing policies seeded as
:func:`reseed` would seed them, and forks of other per-sequence policies.

The hash and its uniforms (24 bits: u = (h + 0.5) / 2**24, strictly inside (0, 1)) are
``moectl.routing.keyed_hash``'s, shared with RoE's per-layer noise.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
from torch import Tensor

from moectl.routing.gumbel import GumbelTopK
from moectl.routing.keyed_hash import M32, layer_word, mix, mix_int, seed_key, uniforms
from moectl.routing.protocols import ResettablePolicy, SeededPolicy, SequencePolicy
from moectl.routing.routing_state import RouteContext, RoutingState


def request_codes(keys: Sequence[str], salt: int = 0) -> Tensor:
    """[B] int64: a 32-bit code per request key (hex digest), mixed with ``salt``."""
    folded = [(int(k, 16) ^ (int(k, 16) >> 32)) & M32 for k in keys]
    return mix(torch.tensor(folded, dtype=torch.int64) ^ mix_int(salt))


def hashed_uniform(code: Tensor, position: Tensor, salt: int, n: int) -> Tensor:
    """[B, T, n] float32 uniforms in (0, 1) from the hash of (salt, code [B], position [B, T], index)."""
    base = mix(code.long() ^ mix_int(salt))  # [B]
    return uniforms(mix(base[:, None] ^ (position.long() & M32)), n)  # per token [B, T], then index


def layer_salt(seed: int, layer: int) -> int:
    """One 32-bit salt per (policy seed, MoE layer)."""
    return mix_int(seed_key(seed) ^ layer_word(layer))


class RequestRows:
    """The request code of each row of the current forward calls, and each token's position in its request.

    Positions count the row's real tokens (``RouteContext.valid``), from 0 at a call with KV-cache
    offset 0, carried over later calls (decoding steps) of the same rows.
    """

    def __init__(self) -> None:
        self.codes: Tensor | None = None
        self._ctx: RouteContext | None = None
        self._positions: Tensor | None = None
        self._seen: Tensor | None = None

    def set(self, codes: Tensor) -> None:
        self.codes, self._ctx, self._positions, self._seen = codes, None, None, None

    def positions(self, ctx: RouteContext, device: torch.device) -> Tensor:
        """[B, T] position of each token of the call ``ctx`` within its request (once per call); from
        each row's own offset where the call gives them (``ctx.offsets``: the engine's rows)."""
        if ctx is self._ctx and self._positions is not None:
            return self._positions
        valid = ctx.valid_mask(device).long()
        if ctx.offsets is not None:
            self._positions = (ctx.offsets.to(device)[:, None] + valid.cumsum(1) - 1).clamp(min=0)
            self._seen, self._ctx = None, ctx
            return self._positions
        if ctx.offset == 0 or self._seen is None or self._seen.shape[0] != valid.shape[0]:
            seen = torch.zeros(valid.shape[0], dtype=torch.long, device=device)
        else:
            seen = self._seen.to(device)
        self._positions = (seen[:, None] + valid.cumsum(1) - 1).clamp(min=0)
        self._seen = seen + valid.sum(1)
        self._ctx = ctx
        return self._positions

    def uniforms(self, state: RoutingState, seed: int) -> Tensor:
        """[B, T, E] uniforms for ``state``'s layer, keyed by (seed, layer, request, position, expert)."""
        codes = state.ctx.row_codes if state.ctx.row_codes is not None else self.codes
        if codes is None:
            raise RuntimeError("request-keyed routing used without request codes (set_request_codes)")
        b, _, e = state.logits.shape
        codes = codes.to(state.logits.device)
        if codes.shape[0] != b:
            raise RuntimeError(f"{codes.shape[0]} request codes for a batch of {b} rows")
        positions = self.positions(state.ctx, state.logits.device)
        return hashed_uniform(codes, positions, layer_salt(seed, state.layer), e)


class RequestKeyed:
    """A policy whose draws are keyed by request (``request_rows``), not drawn from a stream."""

    request_rows: RequestRows


class KeyedGumbel(RequestKeyed, GumbelTopK):
    """``GumbelTopK`` whose noise is keyed by request and position instead of drawn from a stream."""

    def __init__(self, source: GumbelTopK) -> None:
        super().__init__(source.tau_spec, seed=source.seed, row_scale=source.row_scale)
        self.request_rows = RequestRows()

    def apply(self, state: RoutingState) -> None:
        tau = self.tau.get(state.layer, 0.0)
        if tau == 0.0:
            return
        u = self.request_rows.uniforms(state, self.seed)
        noise = (-torch.log(-torch.log(u))).to(state.logits.dtype) * tau
        if self.row_scale is not None:
            noise = noise * self.row_scale.to(noise)[:, None, None]
        state.add_noise(noise)


@cache
def _keyed_random_options() -> type | None:
    """``KeyedRandomOptions``, defined on first use (``moectl.options`` loads only when needed)."""
    try:
        from moectl.options.random_options import RandomOptions
    except ImportError:  # pragma: no cover - moectl.options ships with moectl
        return None

    class KeyedRandomOptions(RequestKeyed, RandomOptions):
        """``RandomOptions`` whose random k-hat sets are keyed by request and position."""

        def __init__(self, source: RandomOptions) -> None:
            super().__init__(source.k_hat, seed=source.seed, renorm=source.renorm)
            self.request_rows = RequestRows()

        def apply(self, state: RoutingState) -> None:
            groups = self.groups(state.layer)
            b, t, e = state.logits.shape
            u = self.request_rows.uniforms(state, self.seed).view(b, t, groups, e // groups)
            idx = u.topk(self.k_hat // groups, dim=-1).indices
            allowed = torch.zeros_like(u, dtype=torch.bool).scatter_(-1, idx, True).view(b, t, e)
            state.restrict(allowed, self.renorm)

    return KeyedRandomOptions


def keyed_policies(policies: Sequence[Any]) -> list[Any]:
    """``policies`` with ``GumbelTopK`` and ``RandomOptions`` (exactly those classes) keyed by request."""
    out: list[Any] = []
    for policy in policies:
        name = type(policy).__name__
        if type(policy) is GumbelTopK:
            out.append(KeyedGumbel(policy))
        elif name == "RandomOptions" and type(policy).__module__ == "moectl.options.random_options":
            keyed = _keyed_random_options()
            out.append(policy if keyed is None else keyed(policy))
        else:
            out.append(policy)
    return out


def row_codes(keys: Sequence[str], copies: int = 1) -> Tensor:
    """[len(keys) * copies] int64: the code of each row of requests ``keys`` (``copies`` routed
    copies per request, request-major; copy c draws its own)."""
    codes = request_codes(keys)
    if copies > 1:
        copy = torch.arange(copies, dtype=torch.int64).repeat(len(keys)) * 0x2545F491 & M32
        codes = mix(codes.repeat_interleave(copies) ^ copy)
    return codes


def set_request_codes(policies: Sequence[Any], keys: Sequence[str], copies: int = 1) -> None:
    """Give the keyed policies the codes of a batch's rows (``copies`` routed copies per request, request-major)."""
    keyed = [p.request_rows for p in policies if isinstance(p, RequestKeyed)]
    if not keyed:
        return
    codes = row_codes(keys, copies)
    for rows in keyed:
        rows.set(codes)


def keyed_alone(policies: Sequence[Any]) -> bool:
    """Whether every policy of ``policies`` that needs something per request is keyed by request
    (and the rest are shared as they are): then requests can share one instance of each, every row
    drawing with its own code and position (``RouteContext.row_codes``/``offsets``) — one call per
    layer for a batch of requests instead of one per request."""
    own = [p for p in policies if per_request(p)]
    return bool(own) and all(
        isinstance(p, RequestKeyed) and getattr(p, "row_scale", None) is None for p in own
    )


def needs_isolation(policy: Any) -> bool:
    """True for a seeded policy whose draws are a stream (not keyed): run one request per forward."""
    if isinstance(policy, RequestKeyed) or not isinstance(policy, SeededPolicy):
        return False
    return isinstance(policy.seed, int) and policy.draws()  # a greedy controller draws nothing


_BASE_SEEDS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def isolated_seed(policy: Any, key: str) -> int:
    """The seed an isolated policy draws with for the request ``key``: from (its own seed, the key);
    its own is the seed it had when first asked (``reseed`` may change ``policy.seed`` later)."""
    base = _BASE_SEEDS.setdefault(policy, int(policy.seed))
    return (mix_int(base) << 31 ^ int(key, 16)) & ((1 << 63) - 1)


def per_request(policy: Any) -> bool:
    """Whether ``policy`` needs an instance of its own per request (keyed draws, a stream of draws,
    or per-sequence state) rather than being shared by every request."""
    return isinstance(policy, (RequestKeyed, SequencePolicy)) or needs_isolation(policy)


def request_policies(policies: Sequence[Any], key: str, copies: int = 1) -> list[Any]:
    """``policies`` as one request (``key``; ``copies`` routed copies) routes with on its own rows:
    keyed policies copied with the request's codes (copy c its own, as ``set_request_codes``), a
    policy drawing from a stream forked with ``isolated_seed`` (the seed ``reseed`` gives it when
    the request runs alone), other per-sequence policies forked; the rest shared. Unbound."""
    out: list[Any] = []
    for policy in policies:
        if isinstance(policy, RequestKeyed):
            own = copy.copy(policy)
            own.request_rows = RequestRows()
            set_request_codes([own], [key], copies)
        elif needs_isolation(policy):
            seed = isolated_seed(policy, key)
            if isinstance(policy, SequencePolicy):
                own = policy.fork(seed)
            else:  # not forkable: a deep copy, so its sequence state is its own
                own = copy.deepcopy(policy)
                own.seed = seed
                if isinstance(own, ResettablePolicy):
                    own.reset(seed=seed)
        elif isinstance(policy, SequencePolicy):
            own = policy.fork(0)  # per-sequence state, no draws of its own to seed
        else:
            own = policy
        out.append(own)
    return out


def reseed(policies: Sequence[Any], key: str) -> None:
    """Seed each isolated policy from (its own seed, the request ``key``) before the request runs.

    The policy's seed when first reseeded is remembered as its own; ``reset(seed=)`` is used where
    the policy has one (controllers: it also forgets the options), else ``seed`` is set and
    ``route()``'s ``bind`` reseeds.
    """
    for policy in policies:
        if not needs_isolation(policy):
            continue
        seed = isolated_seed(policy, key)
        if isinstance(policy, ResettablePolicy):
            policy.reset(seed=seed)
        else:
            policy.seed = seed
