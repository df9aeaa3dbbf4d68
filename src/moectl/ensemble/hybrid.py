"""Clean cache for hybrid models: recurrent (linear-attention / Mamba) layers in a K-sample step.

A clean-cache step feeds the K samples of the current token as K query tokens of one sequence
(``variant_clean.CleanCacheVariant``). Attention layers handle that with a mask; a recurrent
layer would instead run the K samples one after another through its state — sample k would see
samples 0 … k−1 as history. So around each recurrent mixer's forward this module:

1. reshapes its input [B, K, D] to [B·K, 1, D] (K independent one-token continuations);
2. hands it a ``_StateView`` instead of the cache: the clean conv and recurrent states repeated K
   times (their size is O(1) in the sequence length — a few KB to MB per row, not a KV cache);
3. reshapes the output back and, for a committing step, stores the clean sample's new states only.

Works for mixers that use transformers 5's linear-attention cache API (``get_conv_state``,
``get_recurrent_state``, ``update_conv_state``, ``update_recurrent_state``): Qwen3-Next's gated
DeltaNet and Jamba's Mamba. Anything else on a recurrent layer is refused with an error.
"""

from __future__ import annotations

import inspect as pyinspect
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from moectl.ensemble.clean_cache import new_clean_cache
from moectl.errors import NotSupportedError


class _StateView:
    """What a recurrent mixer sees as its cache during a K-sample step (one layer)."""

    def __init__(self, layer_idx: int, q: int, conv: Tensor | None, recurrent: Tensor | None) -> None:
        self.layer_idx, self.q = layer_idx, q
        self._conv_src, self._rec_src = conv, recurrent  # clean states [b, ...] before this step
        self.conv: Tensor | None = None
        self.recurrent: Tensor | None = None

    def _check(self, layer_idx: int, state_idx: int) -> None:
        if layer_idx != self.layer_idx or state_idx != 0:
            raise NotSupportedError(
                f"RoE clean cache: recurrent layer {self.layer_idx} asked for state {state_idx} of layer "
                f"{layer_idx}; only one conv + one recurrent state per layer is supported"
            )

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        self._check(layer_idx, state_idx)
        if self._conv_src is None:
            return None
        # a copy: decode kernels update the conv state in place
        self.conv = self._conv_src.repeat_interleave(self.q, dim=0)
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        self._check(layer_idx, state_idx)
        if self._rec_src is None:
            return None
        self.recurrent = self._rec_src.repeat_interleave(self.q, dim=0)
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._conv_src is not None

    def update_conv_state(
        self,
        conv_states: Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **_: Any,
    ) -> Tensor:
        """First token of a sequence (no state yet): left-pad with zeros, as a fresh cache layer does."""
        self._check(layer_idx, state_idx)
        kernel = conv_kernel_size or conv_states.shape[-1]
        full = conv_states
        if self.conv is not None:
            full = torch.cat([self.conv, conv_states], dim=-1)
        elif full.shape[-1] < kernel:
            full = F.pad(full, (kernel - full.shape[-1], 0))
        self.conv = full[..., -kernel:]
        return full

    def update_recurrent_state(
        self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0, **_: Any
    ) -> Tensor:
        self._check(layer_idx, state_idx)
        self.recurrent = recurrent_states
        return recurrent_states

    def clean(self) -> tuple[Tensor | None, Tensor | None]:
        """The clean sample's (query 0's) new states, [b, ...]."""
        pick = slice(None, None, self.q)
        return (
            None if self.conv is None else self.conv[pick],
            None if self.recurrent is None else self.recurrent[pick],
        )


_CACHE_ARGS = ("cache", "cache_params")  # the mixer's cache argument: transformers 5.24; earlier 5.x


def _cache_arg(module: nn.Module) -> str | None:
    """The name under which ``module.forward`` takes its cache, if it takes one."""
    parameters = pyinspect.signature(module.forward).parameters
    return next((name for name in _CACHE_ARGS if name in parameters), None)


def _store(layer: LinearAttentionCacheLayerMixin, conv: Tensor | None, recurrent: Tensor | None) -> None:
    """Write clean states into a cache layer, initialising it if this was the sequence's first token."""
    if conv is not None:
        if not layer.is_conv_states_initialized[0]:
            layer.lazy_initialization(conv_states=conv, conv_kernel_size=conv.shape[-1])
        layer.conv_states[0].copy_(conv)
    if recurrent is not None:
        if not layer.is_recurrent_states_initialized[0]:
            layer.lazy_initialization(recurrent_states=recurrent)
        layer.recurrent_states[0].copy_(recurrent)
    layer.has_previous_state[0] = True


def _states(layer: LinearAttentionCacheLayerMixin) -> tuple[Tensor | None, Tensor | None]:
    if not layer.has_previous_state[0]:
        return None, None
    conv = layer.conv_states[0] if layer.is_conv_states_initialized[0] else None
    rec = layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None
    return conv, rec


class RecurrentUnfold:
    """Hooks that run a hybrid model's recurrent mixers per sample during clean-cache steps."""

    def __init__(self, mixers: dict[int, nn.Module]) -> None:
        self.mixers = mixers
        self._cache_arg = {idx: _cache_arg(mixer) for idx, mixer in mixers.items()}
        self.keep_before = False  # adaptive K: remember pre-commit states for a second pass
        self._before: dict[int, tuple[Tensor | None, Tensor | None]] = {}

    @classmethod
    def for_model(cls, model: nn.Module, kinds) -> RecurrentUnfold:
        recurrent_types = {k.layer_type for k in kinds if k.kind == "recurrent"}
        if not recurrent_types:
            return cls({})
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layer_types = list(config.layer_types)
        # the layers whose state the clean cache keeps through the linear-attention cache API
        # (MiniMax's lightning attention keeps its own: none of its layers qualify)
        cache_layers = new_clean_cache(model).layers
        api = {i for i, layer in enumerate(cache_layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}
        mixers: dict[int, nn.Module] = {}
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            if idx is None or module is model or not 0 <= idx < len(layer_types):
                continue
            if layer_types[idx] in recurrent_types and idx in api and _cache_arg(module) is not None:
                mixers.setdefault(idx, module)
        missing = [i for i, t in enumerate(layer_types) if t in recurrent_types and i not in mixers]
        if missing:
            raise NotSupportedError(
                f"RoE clean cache: cannot find the recurrent mixer (a module with layer_idx and a "
                f"{' or '.join(f'`{a}`' for a in _CACHE_ARGS)} argument) of decoder layers {missing}; "
                "use cache='separate' or cache='none' for this model"
            )
        return cls(mixers)

    def __call__(
        self, cache, q: int, commit: bool = True, rows: Tensor | None = None, valid: Tensor | None = None
    ):
        """Install the hooks for one step of ``q`` samples per row. ``valid`` [b]: False where the
        current token is padding (its input is zeroed, as transformers masks padding states)."""
        if not self.mixers:
            return nullcontext()
        return self._installed(cache, q, commit, rows, valid)

    @contextmanager
    def _installed(
        self, cache, q: int, commit: bool, rows: Tensor | None, valid: Tensor | None
    ) -> Iterator[None]:
        views: dict[int, _StateView] = {}
        handles = []

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            idx = module.layer_idx
            layer = cache.layers[idx]
            if commit:
                conv, rec = _states(layer)
                if self.keep_before:
                    self._before[idx] = (
                        None if conv is None else conv.clone(),
                        None if rec is None else rec.clone(),
                    )
            else:
                conv, rec = self._before[idx]
            if rows is not None:
                conv = None if conv is None else conv[rows]
                rec = None if rec is None else rec[rows]
            view = views[idx] = _StateView(idx, q, conv, rec)
            if args:
                hidden, args = args[0], args[1:]
            else:
                hidden = kwargs.pop("hidden_states")
            b, t, d = hidden.shape
            if t != q:
                raise RuntimeError(f"recurrent layer {idx}: expected {q} samples per row, got {t} tokens")
            if valid is not None and not bool(valid.all()):
                hidden = hidden * valid.to(hidden.dtype)[:, None, None]
            kwargs = {**kwargs, "hidden_states": hidden.reshape(b * q, 1, d), self._cache_arg[idx]: view}
            kwargs["attention_mask"] = None
            return args, kwargs

        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            view = views[module.layer_idx]
            out = output[0] if isinstance(output, tuple) else output
            out = out.reshape(-1, q, out.shape[-1])
            if commit:
                _store(cache.layers[module.layer_idx], *view.clean())
            return (out, *output[1:]) if isinstance(output, tuple) else out

        try:
            for mixer in self.mixers.values():
                handles.append(mixer.register_forward_pre_hook(pre_hook, with_kwargs=True))
                handles.append(mixer.register_forward_hook(post_hook, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()
