"""Call-and-return inference with persistent expert masks (TE-MoE §2.1, §4.1, Algorithm 2 lines 3–9).

:class:`ControllerPolicy` is a routing policy: at every MoE layer it keeps the active option ω
(k-hat experts) per sequence and restricts the router to it until the termination head fires.

Prefill does not loop over tokens through the network: within a layer the hidden states of
all positions of the call are known, so the (tiny) controller is scanned over positions — only
the termination MLP's option-dependent half runs per step, everything else for all positions
at once — and the experts then run for all tokens in one go under the per-token masks.
Decoding carries the controller state (ω per layer and row) from call to call; a call at KV
offset 0 starts new sequences. Batches with left padding are handled: a row's option starts at
its first real token (t = 0: router top-k-hat, no switch sampled).
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.errors import ConfigError, FileFormatError, MoectlFileError
from moectl.options.controller import OptionController
from moectl.options.plackett_luce import mask_of
from moectl.options.row_noise import OPTION, SWITCH, row_uniforms
from moectl.routing.gumbel import gumbel_noise
from moectl.routing.policy_config import PolicyConfig, register_policy, write_json_atomic
from moectl.routing.routing_state import RoutingState

_MODES = ("sample", "greedy")


@dataclass
class OptionRecord:
    """What one forward call decided at one MoE layer (for training and inspection)."""

    hidden: Tensor  # [B, T, d] h_t, float32
    prev: Tensor  # [B, T, N] bool ω_{t−1} (at a start position: the starting option)
    option: Tensor  # [B, T, N] bool ω_t
    order: Tensor  # [B, T, k̂] the ordered PL tuple sampled at t (the option where switch is set)
    switch: Tensor  # [B, T] bool d_t
    start: Tensor  # [B, T] bool the option started here (t = 0)
    beta: Tensor  # [B, T] β_t (0 at start and padding)


def cat_records(chunks: list[OptionRecord]) -> OptionRecord:
    """Join the records of successive calls (prefill, then decoding steps) along T."""
    return OptionRecord(
        *(torch.cat([getattr(c, f) for c in chunks], 1) for f in OptionRecord.__dataclass_fields__)
    )


@register_policy("controller")
class ControllerPolicy(PolicyConfig):
    """Route under a trained (or fresh) :class:`OptionController`.

    ``mode='sample'``: d_t ~ Bernoulli(β_t), new options by Plackett–Luce (as trained);
    ``'greedy'``: switch when β_t > 1/2, new option = top-k-hat of the selection logits.
    ``record=True`` keeps an :class:`OptionRecord` per call and layer in ``records``.

    As a config it names the controller's folder (weights are not JSON)::

        {"type": "controller", "format_version": 1, "path": "runs/ctrl", "mode": "sample", "seed": 0}

    ``from_dict`` (``moectl.load_policy("runs/ctrl", model)``) loads the folder — a run folder's
    ``final/`` if it has one — and merges its trained LoRA adapters and routers into ``model`` in
    place (once per model, as ``moectl options generate`` does). Loaded without a model, the merge
    waits for the first ``route()`` the policy enters (``attach``). ``save(FOLDER)`` writes the
    controller's weights and a ``policy.json``; ``save(FILE.json)`` only the reference.
    """

    def __init__(
        self,
        controller: OptionController,
        mode: str = "sample",
        seed: int = 0,
        record: bool = False,
        renorm: str = "pruned",
        path: str | os.PathLike | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ConfigError(f"mode must be one of {_MODES}, got {mode!r}")
        if renorm not in ("pruned", "stock"):
            raise ConfigError(f"renorm must be 'pruned' or 'stock', got {renorm!r}")
        self.controller = controller
        self.mode, self.record, self.renorm = mode, record, renorm
        self.path = None if path is None else Path(path)  # the folder it was loaded from / saved to
        self.options = dict(options or {})  # the training configuration (options.json)
        self.pending: Path | None = None  # a folder whose trained weights still go into the model
        self.seed = int(seed)
        self.generator: torch.Generator | None = None
        self.row_codes: Tensor | None = None  # draws keyed by row (training rollouts: row_noise.py)
        self._row_seen: Tensor | None = None
        self._row_call: tuple[object, Tensor] | None = None
        self.records: dict[int, list[OptionRecord]] = {}
        self._option: dict[int, Tensor] = {}
        self._started: dict[int, Tensor] = {}
        self._shared_switch: Tensor | None = None

    def __repr__(self) -> str:
        return f"ControllerPolicy(k_hat={self.controller.k_hat}, mode={self.mode!r}, seed={self.seed}, path={self.path})"

    # -- config -------------------------------------------------------------------------------
    def config_fields(self) -> dict[str, Any]:
        if self.path is None:
            raise ValueError(
                "this controller was never saved: policy.save(FOLDER) writes its weights and policy.json"
            )
        return {
            "path": str(self.path),
            "mode": self.mode,
            "seed": self.seed,
            "renorm": self.renorm,
            "k_hat": self.controller.k_hat,  # for readers; the folder's controller.json decides
        }

    def save(self, path: str | os.PathLike) -> Path:
        """``FILE.json``: the reference to the controller's folder (relative to FILE's folder);
        any other path: a folder with the controller's weights and a ``policy.json``."""
        path = Path(path)
        if path.suffix == ".json":
            fields = self.to_dict()
            fields["path"] = os.path.relpath(Path(fields["path"]).resolve(), path.parent.resolve())
            return write_json_atomic(path, fields)
        self.controller.save(path)
        self.path = path
        write_json_atomic(path / "policy.json", {**self.to_dict(), "path": "."})
        return path

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> ControllerPolicy:
        from moectl.options.option_state import controller_dir

        if not isinstance(data.get("path"), str):
            raise FileFormatError("a controller policy needs 'path', the folder `moectl options train` wrote")
        seed = data.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise FileFormatError(f"controller 'seed' must be an integer, got {seed!r}")
        folder = controller_dir(data["path"])
        if not (folder / "controller.json").exists():
            raise MoectlFileError(
                f"{data['path']}: not a controller folder (needs controller.json and controller.safetensors, "
                "as `moectl options train` writes)"
            )
        controller = _attach(folder, model) if model is not None else _alone(folder, info)
        options_file = folder / "options.json"
        try:
            options = json.loads(options_file.read_text()) if options_file.exists() else {}
        except ValueError as err:  # not JSON, or not UTF-8
            raise FileFormatError(f"{options_file}: not valid JSON ({type(err).__name__})") from None
        policy = cls(
            controller,
            mode=data.get("mode", "sample"),
            seed=seed,
            renorm=data.get("renorm", "pruned"),
            path=folder,
            options=options,
        )
        trained = any((folder / name).exists() for name in ("adapter.safetensors", "routers.safetensors"))
        policy.pending = folder if model is None and trained else None
        return policy

    def attach(self, model: nn.Module) -> None:
        """Merge the loaded folder's trained adapters and routers into ``model`` (once per model;
        ``route()`` calls this before binding). Nothing to do for a controller loaded with its model."""
        if self.pending is not None:
            self.controller = _attach(self.pending, model)

    def fork(self, seed: int) -> ControllerPolicy:
        """The same controller (shared weights) with no options yet, its draws seeded by ``seed``
        (``SequencePolicy``: the engine forks one per request). Trained adapters must be merged first."""
        if self.pending is not None:
            raise RuntimeError("attach the controller to its model before forking it (route() does)")
        return ControllerPolicy(
            self.controller, self.mode, seed, self.record, self.renorm, self.path, self.options
        )

    @property
    def current_option(self) -> Mapping[int, Tensor]:
        """The active option ω per MoE layer, ``{layer: [B, N] bool}`` for the batch being routed
        (a read-only view; a layer is absent before its first call of the sequence)."""
        return MappingProxyType(self._option)

    def draws(self) -> bool:
        """``'sample'`` draws d_t and new options from the seeded stream; ``'greedy'`` draws nothing
        (``SeededPolicy``)."""
        return self.mode == "sample"

    # -- Policy protocol ----------------------------------------------------------------------
    def bind(self, info: ModelInfo) -> None:
        self.controller.check(info)
        if info.top_k > self.controller.k_hat:
            raise ConfigError(f"k-hat = {self.controller.k_hat} is below the model's top-k = {info.top_k}")

    def reset(self, seed: int | None = None) -> None:
        """Forget the options (new sequences) and the records; reseed if ``seed`` is given."""
        self._option.clear()
        self._started.clear()
        self.records.clear()
        self._row_seen, self._row_call = None, None
        if seed is not None:
            self.seed = int(seed)
            self.generator = None

    def key_rows(self, codes: Tensor | None) -> None:
        """Draw d_t and the PL noise from a hash of (row code, layer, position) instead of the
        generator (:mod:`moectl.options.row_noise`; ``None``: the generator again)."""
        self.row_codes = codes
        self._row_seen, self._row_call = None, None

    def _row_positions(self, ctx, device: torch.device) -> Tensor:
        """[B, T] each token's position among its row's real tokens, carried across calls (once per call)."""
        if self._row_call is not None and self._row_call[0] is ctx:
            return self._row_call[1]
        valid = ctx.valid_mask(device).long()
        seen = self._row_seen
        if ctx.offset == 0 or seen is None or seen.shape[0] != valid.shape[0]:
            seen = torch.zeros(valid.shape[0], dtype=torch.long, device=device)
        pos = (seen.to(device)[:, None] + valid.cumsum(1) - 1).clamp(min=0)
        self._row_seen, self._row_call = seen.to(device) + valid.sum(1), (ctx, pos)
        return pos

    def _gen(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    @torch.no_grad()
    def apply(self, state: RoutingState) -> None:
        if state.hidden is None:
            raise RuntimeError(
                "the controller needs the router input (RoutingState.hidden), which was not captured"
            )
        layer, ctx = state.layer, state.ctx
        ctrl = self.controller.layers[layer]
        k_hat = self.controller.k_hat
        b, t_len, n = state.logits.shape
        param = next(ctrl.parameters())
        dev = param.device  # the controller's device; the layer may sit on another (device_map)
        if ctx.offset == 0 or layer not in self._option:
            if ctx.offset != 0:
                raise RuntimeError(
                    f"MoE layer {layer}: decoding at offset {ctx.offset} without a prefill under this policy"
                )
            self._option[layer] = torch.zeros(b, n, dtype=torch.bool, device=dev)
            self._started[layer] = torch.zeros(b, dtype=torch.bool, device=dev)
        option, started = self._option[layer], self._started[layer]
        if option.shape[0] != b:
            raise RuntimeError(
                f"batch size changed from {option.shape[0]} to {b} in the middle of a sequence"
            )

        h = state.hidden.to(device=dev, dtype=param.dtype)
        valid = ctx.valid_mask(dev)
        features = ctrl.expert_features()
        a, w_z, tail = ctrl.termination_parts(h)
        cand = ctrl.candidates(h)
        if self.mode == "greedy":
            order = cand.float().topk(k_hat, dim=-1).indices
            u = torch.full((b, t_len), 0.5, device=dev)
        elif self.row_codes is not None:  # keyed by (row, layer, position): the same on any process
            pos = self._row_positions(ctx, dev)
            codes = self.row_codes.to(dev)
            g = -torch.log(-torch.log(row_uniforms(codes, pos, OPTION, layer, n)))
            order = (cand.float() + g).topk(k_hat, dim=-1).indices
            u = row_uniforms(codes, pos, SWITCH, layer, 1)[..., 0]
        else:
            gen = self._gen(dev)
            order = (cand.float() + gumbel_noise(cand.shape, gen, dev)).topk(k_hat, dim=-1).indices
            u = torch.rand((b, t_len), generator=gen, device=gen.device).to(dev)
        start_order = state.logits.to(dev).topk(k_hat, dim=-1).indices  # ω_0 = TopK(g_0, k̂)
        shared = self._shared_switch if (self.controller.config.cross_layer and layer > 0) else None

        masks = torch.ones(b, t_len, n, dtype=torch.bool, device=dev)
        prev = torch.ones_like(masks)
        switch = torch.zeros(b, t_len, dtype=torch.bool, device=dev)
        starts = torch.zeros_like(switch)
        betas = torch.zeros(b, t_len, device=dev)
        z = ctrl.set_embedding(option, features)
        new_options, start_options = mask_of(order, n), mask_of(start_order, n)  # [B, T, N] each
        for t in range(t_len):
            v = valid[:, t]
            start = v & ~started
            cont = v & started
            prev[:, t] = torch.where(started[:, None], option, prev[:, t])
            beta = ctrl.beta_from_parts(a[:, t], w_z, tail, z)
            d = shared[:, t] & cont if shared is not None else (u[:, t] < beta) & cont
            betas[:, t] = torch.where(cont, beta, 0.0)
            # no host check for "did any row switch or start": z is recomputed either way (the
            # same value where nothing changed), so the scan never waits for the device
            option = torch.where(d[:, None], new_options[:, t], option)
            option = torch.where(start[:, None], start_options[:, t], option)
            z = ctrl.set_embedding(option, features)
            started = started | start
            prev[:, t] = torch.where(start[:, None], option, prev[:, t])
            masks[:, t] = torch.where(started[:, None], option, masks[:, t])
            switch[:, t], starts[:, t] = d, start
        self._option[layer], self._started[layer] = option, started
        if layer == 0:
            self._shared_switch = switch
        state.restrict(masks.to(state.logits.device), renorm=self.renorm)
        if self.record:
            rec = OptionRecord(h.float(), prev, masks, order, switch, starts, betas)
            self.records.setdefault(layer, []).append(rec)

    def layer_records(self) -> dict[int, OptionRecord]:
        """Every recorded call joined along T, per MoE layer."""
        return {layer: cat_records(chunks) for layer, chunks in self.records.items()}


# model -> the controller folder whose adapters and routers were merged into it (kept here, keyed
# weakly, not stamped on the user's model; the entry goes with the model)
_MERGED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def merged_controller(model: nn.Module) -> str | None:
    """The (resolved) folder of the controller whose trained weights were merged into ``model``, or None."""
    return _MERGED.get(model)


def _attach(folder: Path, model: nn.Module) -> OptionController:
    """The controller of ``folder``, its adapters and routers merged into ``model`` (once per model)."""
    from moectl.options.option_state import load_controlled

    key = str(folder.resolve())
    applied = merged_controller(model)
    if applied is None:
        merged, controller, _, _ = load_controlled(model, folder, merge=True)
        if merged is not model:
            raise RuntimeError(
                "merging the controller's adapters did not happen in place; use load_controlled"
            )
        model.eval()
        _MERGED[model] = key
        return controller
    if applied != key:
        raise ConfigError(
            f"the model already carries the adapters and routers of controller {applied}; load a fresh "
            f"model for {folder}"
        )
    controller = OptionController.load(folder, device=next(model.parameters()).device)
    controller.check(inspect(model))
    return controller


def _alone(folder: Path, info: ModelInfo | None) -> OptionController:
    """The controller of ``folder`` without its model (its trained weights merge in at ``attach``)."""
    device = info.layers[0].router.weight.device if info is not None else "cpu"
    controller = OptionController.load(folder, device=device)
    if info is not None:
        controller.check(info)
    return controller
