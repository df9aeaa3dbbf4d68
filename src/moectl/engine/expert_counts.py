"""Expert use per routing: tokens routed to each expert of each MoE layer, over a recorded window.

SGLang's expert distribution record, per routing: ``start()`` opens a window, ``stop()`` closes it,
``dump()`` returns the counts (``moectl serve``'s ``/start_expert_distribution_record``,
``/stop_expert_distribution_record``, ``/dump_expert_distribution_record``; ``/metrics`` exports
them as ``moectl_expert_tokens{routing, layer, expert}``, a label set bounded by the registered
routings × MoE layers × experts). A token counts once per MoE layer for each of its top-k experts
(the experts its router chose under its routing); padding columns of a batched prefill do not
count. Counting is one ``bincount`` per MoE layer per forward over all rows (each row's routing
as an index), with no host sync inside the forward; the per-routing sums are moved into the
window after it. Outside a window the router hooks return at once.

Deviation: the K samples of a RoE request (its ensemble's forwards) are not counted — one token
is routed K ways there, and none of them alone is "the" routing of the token.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo

DEFAULT = "default"  # the name of requests that name no routing (the model as trained)


class ExpertCounts:
    """Per-routing expert counts of the engine's forwards (see the module doc)."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.num_experts = max(layer.num_experts for layer in info.layers)
        self._lock = threading.Lock()
        self._active = False
        self._started: float | None = None
        self._stopped: float | None = None
        self._counts: dict[str, Tensor] = {}  # routing -> [MoE layers, E] int64 (host)
        self._token_totals: dict[str, int] = {}  # routing -> tokens counted
        self._tokens = torch.zeros(0)  # [R] this forward's tokens per routing
        self._forwards = 0
        self._names: list[str] = []  # this forward's routings; rows index them
        self._rows: Tensor | None = None  # [B] each row's routing index (None: this forward is not counted)
        self._step: Tensor | None = None  # [R, MoE layers, E] this forward's counts
        self._valid: Any = None  # () -> [B, T] bool of the current call, or None: every column counts
        self._handles: list = []

    # -- control (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        """Open a new window (the previous counts are dropped)."""
        with self._lock:
            self._counts, self._token_totals, self._forwards = {}, {}, 0
            self._started, self._stopped = time.time(), None
            self._active = True

    def stop(self) -> None:
        with self._lock:
            if self._active:
                self._active, self._stopped = False, time.time()

    @property
    def recording(self) -> bool:
        return self._active

    def dump(self) -> dict[str, Any]:
        """The window's counts: per routing, ``counts[layer][expert]`` tokens, and its token total."""
        with self._lock:
            counts = {name: c.clone() for name, c in self._counts.items()}
            totals = dict(self._token_totals)
            started, stopped, forwards = self._started, self._stopped, self._forwards
        return {
            "recording": self._active,
            "started": started,
            "stopped": stopped,
            "forwards": forwards,
            "moe_layers": [layer.layer_idx for layer in self.info.layers],
            "num_experts": self.num_experts,
            "top_k": self.info.top_k,
            "routings": {
                name: {"tokens": totals.get(name, 0), "counts": c.tolist()}
                for name, c in sorted(counts.items())
            },
        }

    # -- the engine's side (its thread) -----------------------------------------------------
    def install(self, valid) -> None:
        """Hook every router (after the routing hooks: the final choice). ``valid()`` gives the
        current call's [B, T] valid columns (the routing session's), or None."""
        self._valid = valid
        for layer in self.info.layers:
            self._handles.append(layer.router.register_forward_hook(self._hook(layer)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def begin(self, names: list[str], device: torch.device) -> None:
        """Before a forward: each row's routing name (None: this forward is not counted)."""
        if not self._active:
            self._rows = None
            return
        self._names = sorted(set(names))
        index = {name: i for i, name in enumerate(self._names)}
        self._rows = torch.tensor([index[n] for n in names], dtype=torch.long, device=device)
        shape = (len(self._names), self.info.num_moe_layers, self.num_experts)
        self._step = torch.zeros(shape, dtype=torch.float32, device=device)
        self._tokens = torch.zeros(len(self._names), dtype=torch.float32, device=device)

    def end(self) -> None:
        """After a forward: its counts into the window."""
        rows, step, self._rows, self._step = self._rows, self._step, None, None
        if rows is None or step is None:
            return
        step = step.round().long().cpu()
        tokens = self._tokens.round().long().tolist()
        with self._lock:
            if not self._active:
                return
            self._forwards += 1
            for i, name in enumerate(self._names):
                self._token_totals[name] = self._token_totals.get(name, 0) + tokens[i]
                if name in self._counts:
                    self._counts[name] += step[i]
                else:
                    self._counts[name] = step[i].clone()

    def _hook(self, layer):
        e, j = self.num_experts, layer.index

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            rows, step = self._rows, self._step
            if rows is None or step is None:
                return
            chosen = layer.adapter.indices_of(output, layer.top_k)
            b = rows.shape[0]
            if chosen.numel() % b:
                return  # not this forward's rows (another caller's forward of the model)
            chosen = chosen.reshape(b, -1, chosen.shape[-1]).long()
            valid = self._valid() if self._valid is not None else None
            weight = torch.ones(chosen.shape[:2], device=chosen.device)
            if valid is not None and tuple(valid.shape) == tuple(chosen.shape[:2]):
                weight = valid.to(chosen.device).float()
            rows = rows.to(chosen.device)
            flat = (rows[:, None, None] * e + chosen).reshape(-1)
            # a slot repeating an earlier one is a narrower row's padding (topk:N rows beside wider ones)
            k = chosen.shape[-1]
            earlier = torch.ones(k, k, dtype=torch.bool, device=chosen.device).tril(-1)
            repeat = ((chosen[..., :, None] == chosen[..., None, :]) & earlier).any(-1)
            weights = (weight[..., None] * (~repeat).float()).reshape(-1)
            step[:, j] += torch.bincount(flat, weights, minlength=step.shape[0] * e).view(-1, e).to(step.device)
            if j == 0:  # tokens per routing, once per forward
                self._tokens += torch.bincount(rows, weight.sum(1), minlength=step.shape[0]).to(step.device)

        return hook
