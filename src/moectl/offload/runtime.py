"""Swap each MoE layer's experts module for one that keeps only a budget of experts resident.

The original experts module stays the compute module: its 3-D expert parameters are removed
(moved to the store, so the memory is really freed) and replaced by views that map a global
expert id to its resident slot, loading misses on access. The module's own forward then runs
unchanged, so offloaded outputs are exactly the original's for the same routing (same kernels,
same experts visited in the same order). ``with offload(model, ...) as rt:`` restores the
original parameters (reloaded from the store) on exit.

``async_loads`` (default: on with CUDA, off without) lets loads overlap compute (``expert_loader.py``):
a policy's loads start before the experts forward and each expert's load is waited on only when
the forward first indexes it. ``prefetch`` (default: as ``async_loads``) asks the policy, at each
decoding step, for the experts of a predicted switch and starts loading them (``prefetch.py``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor, nn

from moectl.adapters import inspect
from moectl.errors import MoectlError
from moectl.offload.delta_store import DeltaStore, pending_delta
from moectl.offload.expert_loader import Loader, make_loader
from moectl.offload.expert_store import DiskStore, HostStore
from moectl.offload.expert_tensors import meta_of, per_expert, present, put_back, take
from moectl.offload.int8 import SCALE, QuantizingStore, dequantize_rows, slot_templates
from moectl.offload.offload_config import OffloadConfig
from moectl.offload.prefetch import PrefetchConfig
from moectl.offload.residency import LRUPolicy, parse_policy
from moectl.offload.resident import ResidentSet
from moectl.offload.signals import ExitOnSignal
from moectl.offload.slot_forward import slot_experts_forward
from moectl.offload.slot_forward import supports as supports_slots


class BudgetError(MoectlError, ValueError):
    """The resident budget cannot hold what a step needs."""


class _ExpertView:
    """Stands in for a [E, ...] expert parameter: ``view[e]`` is expert e's resident slot (int8 slots:
    dequantised to the parameter's dtype, for forwards that index experts themselves)."""

    def __init__(self, res: ResidentSet, name: str, num_experts: int, dtype: torch.dtype) -> None:
        self.res, self.name, self.num_experts = res, name, num_experts
        slot = res.slots[name]
        self.shape = torch.Size((num_experts, *slot.shape[1:]))
        self.dtype, self.device = dtype, slot.device
        self.scale = res.slots.get(name + SCALE)

    def __getitem__(self, idx) -> Tensor:
        if isinstance(idx, Tensor) and idx.numel() != 1:
            raise BudgetError(
                "the experts forward indexed several experts at once; only the 'eager' experts "
                "implementation is supported (model.set_experts_implementation('eager'))"
            )
        slot = self.res.access(int(idx))
        weight = self.res.slots[self.name][slot]
        return weight if self.scale is None else dequantize_rows(weight, self.scale[slot], self.dtype)


class OffloadedExperts(nn.Module):
    """Runs the original experts forward with the policy deciding residency around it."""

    def __init__(
        self,
        inner: nn.Module,
        res: ResidentSet,
        policy,
        layer: int,
        runtime,
        *,
        num_experts: int,
        grouped: bool = False,
    ) -> None:
        """``grouped``: run the experts as one grouped GEMM per projection over the resident slots
        (offload/slot_forward.py; only where the experts' layout allows it), else their own forward."""
        super().__init__()
        self.inner, self.layer, self.policy = inner, layer, policy
        self.res = res
        self._runtime = [runtime]  # a list: not registered as a submodule
        self.last_probs: Tensor | None = None
        self.grouped = grouped
        self.num_experts = num_experts
        self.switches = 0  # decoding steps at which the policy's pinned option changed (TE-MoE §2.2)
        self.union = 0  # distinct experts the latest forward needed (a batch: the union of its rows')
        self.union_total = self.union_forwards = 0
        self._forward_s = 0.0
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA forwards not yet read

    @property
    def forward_s(self) -> float:
        """Seconds in the experts forward: host wall time on CPU; on CUDA the compute stream's time
        between events around it, counted once those events have completed (never waits)."""
        pending = []
        for start, end in self._timed:
            if end.query():
                self._forward_s += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end))
        self._timed = pending
        return self._forward_s

    @property
    def compute_s(self) -> float:
        """Seconds in the experts forward not spent waiting for loads (settled loads only)."""
        return self.forward_s - self.res.timing.forward_wait_s

    def keep_tokens(self, index: Tensor) -> None:
        """This layer's next call brings only the tokens ``index`` of its router's call (the engine
        drops a batched prefill's padding): the router probabilities kept for the policy are cut to them."""
        if self.last_probs is not None:
            self.last_probs = self.last_probs.reshape(-1, self.last_probs.shape[-1]).index_select(0, index)

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        idx = args[0] if args else kwargs.get("top_k_index", kwargs.get("router_indices"))
        if idx is None:
            raise TypeError("offloaded experts: cannot find the selected expert indices in the call")
        chosen = idx.reshape(-1, idx.shape[-1])
        probs = None if self.last_probs is None else self.last_probs.reshape(chosen.shape[0], -1)
        runtime = self._runtime[0]
        self.res.begin_step(runtime.step)
        flat = chosen.reshape(-1).tolist()  # the one host sync of the forward's expert ids
        uses = Counter(flat)
        needed = sorted(uses)
        self.res.expect(needed, [uses[e] for e in needed])
        self.union = len(needed)
        self.union_total += self.union
        self.union_forwards += 1
        option = frozenset(self.res.pinned)
        self.policy.before(self.layer, self.res, chosen, probs)
        if chosen.shape[0] == 1 and option and self.res.pinned != option:  # a decoding step changed ω
            self.switches += 1
        if runtime.prefetch and chosen.shape[0] == 1:  # a decoding step: start the predicted switch's loads
            predicted = self.policy.predict(self.layer, self.res, chosen, probs, runtime.prefetch_config)
            if predicted:
                self.res.prefetch(predicted, protect=set(chosen[0].tolist()))
        self.res.in_forward = True
        cuda = hidden_states.device.type == "cuda"
        if cuda:  # timed by events on the compute stream: the host never waits for the experts
            stream = torch.cuda.current_stream(hidden_states.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        t0 = time.perf_counter()
        try:
            out = self._grouped(hidden_states, idx, flat, needed, args, kwargs) if self.grouped else None
            if out is None:
                out = self.inner(hidden_states, *args, **kwargs)
        finally:
            self.res.in_forward = False
        if cuda:
            end.record(stream)
            self._timed.append((start, end))
        else:
            self._forward_s += time.perf_counter() - t0
        self.policy.after(self.layer, self.res, chosen, probs)
        return out

    def _grouped(
        self,
        hidden_states: Tensor,
        idx: Tensor,
        flat: list[int],
        experts: list[int],
        args: tuple,
        kwargs: dict,
    ) -> Tensor | None:
        """The slot-grouped forward (``offload/slot_forward.py``), or None where the eager loop must run:
        more distinct experts chosen than the budget holds, or weights not found in the call.
        ``flat``: the chosen ids on the host; ``experts``: their distinct values, ascending (the order
        the eager loop visits experts in)."""
        weights = args[1] if len(args) > 1 else kwargs.get("top_k_weights")
        if weights is None:
            return None
        if len(experts) > self.res.budget:
            return None
        slots = [self.res.access(e) for e in experts]
        if idx.numel() == idx.shape[-1]:  # one token (a decoding step): map its k ids on the host
            slot = dict(zip(experts, slots, strict=True))
            slot_index = torch.tensor([slot[e] for e in flat], dtype=torch.long).view(idx.shape)
            slot_index = slot_index.to(idx.device, non_blocking=True)
        else:
            slot_of = torch.zeros(self.num_experts, dtype=torch.long)
            slot_of[experts] = torch.tensor(slots, dtype=torch.long)
            slot_index = slot_of.to(idx.device, non_blocking=True)[idx]
        return slot_experts_forward(self.inner, self.res.slots, hidden_states, slot_index, weights)


def resolve_budget(budget: float | int, num_experts: int) -> int:
    """A float is a fraction in (0, 1] of the experts per layer (rounded down); an int a count."""
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise BudgetError(f"a fractional budget must be in (0, 1], got {budget}")
        return int(budget * num_experts + 1e-9)
    if int(budget) < 1:
        raise BudgetError(
            f"the budget must be a count of at least top-k experts per layer (or a fraction in (0, 1]), got {budget}"
        )
    return min(int(budget), num_experts)


class OffloadRuntime:
    """Installed by ``offload``; holds the store, the resident sets and the counters.

    ``reader``: the ``ShardReader`` of the checkpoint the model was loaded from (``moectl.offload.
    lazy.load_lazy`` returns one). With it, or with ``store="checkpoint"``, non-resident experts
    are read from the checkpoint's own shards, straight into the resident slots. A model whose
    experts were never loaded (left on the meta device) needs it: such a model is served without
    the experts ever being in memory, and leaving the block puts them back on meta.
    """

    def __init__(self, model: nn.Module, config: OffloadConfig, reader=None) -> None:
        self.model, self.config, self.reader = model, config, reader
        self.async_spec, self.prefetch_spec = config.async_loads, config.prefetch
        self.prefetch_config = config.prefetch_config
        self.experts_forward = config.experts_forward
        self.async_loads = self.prefetch = False
        self.loaders: dict[torch.device, Loader] = {}
        policy = config.policy
        self.policy = LRUPolicy() if policy is None else parse_policy(policy, model)  # any policy spec
        self.budget_spec, self.verify = config.budget, config.verify
        self.store_dir = config.store_dir
        self.store_kind = config.store
        self.step = 0
        self.step_tokens: list[int] = []
        self.step_times: list[float] = []  # perf_counter at the start of each forward
        self.modules: list[OffloadedExperts] = []
        self.stored_expert_bytes: list[int] = []  # one expert per MoE layer, as the store holds it
        self._hooks: list = []
        self._restore: list = []
        self._tmp: str | None = None
        self._own_reader = False
        self.store = None
        self.lazy = False
        self._signals = ExitOnSignal()  # SIGTERM / SIGHUP unwind while a temporary store exists

    # -- install / restore ---------------------------------------------------------------------
    def _experts_params(self, info) -> tuple[list[dict[str, Tensor]], list[nn.Module]]:
        layers, experts_modules = [], []
        for layer in info.layers:
            experts = layer.block.experts
            if isinstance(experts, OffloadedExperts):
                raise BudgetError(f"MoE layer {layer.index} is already offloaded (nested offload() blocks)")
            impl = getattr(getattr(experts, "config", None), "_experts_implementation", "eager")
            if impl not in (None, "eager"):
                raise BudgetError(
                    f"MoE layer {layer.index} uses the {impl!r} experts implementation; offloading needs "
                    "'eager' (model.set_experts_implementation('eager'))"
                )
            params = {n: t.data for n, t in per_expert(experts, layer.num_experts).items()}
            if not params:
                raise BudgetError(f"MoE layer {layer.index}: the experts module holds no [E, ...] parameters")
            if self.config.slot_dtype != "same" and callable(getattr(experts, "expert_tensors", None)):
                raise BudgetError(
                    f"MoE layer {layer.index}: the experts are quantized already ({type(experts).__name__}); slot dtype "
                    f"{self.config.slot_dtype!r} applies to experts in the model's dtype: use 'same'"
                )
            layers.append(params)
            experts_modules.append(experts)
        return layers, experts_modules

    def _checkpoint_reader(self, experts_modules: list[nn.Module]):
        """The checkpoint's shard reader, its MoE layers checked against the model's."""
        from moectl.io.shards import ShardReader

        reader = self.reader
        if reader is None:
            folder = Path(str(getattr(getattr(self.model, "config", None), "name_or_path", "") or ""))
            if not (folder.is_dir() and any(folder.glob("*.safetensors"))):
                raise BudgetError(
                    "store 'checkpoint' needs the model's checkpoint folder (safetensors shards); this model "
                    "was not loaded from one: use store 'disk' or 'host'"
                )
            reader = ShardReader(folder, self.model, method=self.config.read_method)
            self.reader, self._own_reader = reader, True
        names = {id(m): n for n, m in self.model.named_modules()}
        if len(reader.layers) != len(experts_modules):
            raise BudgetError(
                f"the checkpoint has {len(reader.layers)} MoE layers of experts, the model {len(experts_modules)}"
            )
        for layer, module in zip(reader.layers, experts_modules, strict=True):
            if not names.get(id(module), "").endswith(layer.module.removeprefix("model.")):
                raise BudgetError(
                    f"MoE layer {layer.index}: the checkpoint's experts are {layer.module}, the model's "
                    f"{names.get(id(module))}: the reader was made for another model"
                )
        return reader

    def __enter__(self) -> OffloadRuntime:
        """Install; an error part way (a slot allocation, a store write) undoes what was done:
        the layers already wrapped get their experts back and the temporary store is removed."""
        try:
            return self._install()
        except BaseException:
            with contextlib.suppress(Exception):  # the install's error is the one to report
                self.close()
            raise

    def _install(self) -> OffloadRuntime:
        info = inspect(self.model)
        self.info = info
        layers, experts_modules = self._experts_params(info)
        self.lazy = any(t.is_meta for params in layers for t in params.values())
        self.budget = [resolve_budget(self.budget_spec, layer.num_experts) for layer in info.layers]
        for layer, b in zip(info.layers, self.budget, strict=True):
            need = self.policy.min_budget(layer.index, layer.top_k)
            if b < need:
                raise BudgetError(
                    f"MoE layer {layer.index}: a budget of {b} resident experts is too small: the policy "
                    f"{self.policy.name} needs at least {need} (top-k = {layer.top_k}, {layer.num_experts} experts)"
                )
        kind = self.store_kind
        if kind == "disk" and (self.reader is not None or self.lazy):
            kind = "checkpoint"  # loaded from a checkpoint folder: its own shards are the disk store
        if self.lazy and kind != "checkpoint":
            raise BudgetError(
                f"the model's experts were never loaded (meta device): they can only be read from its "
                f"checkpoint, not a {kind!r} store"
            )
        self.store_kind = kind
        if kind == "checkpoint":
            self.store = self._checkpoint_reader(experts_modules)
        elif kind == "host":
            self.store = HostStore(layers)
        else:
            if self.store_dir is None:
                self._signals.install()  # before the copy exists: a signal now unwinds and removes it
                self._tmp = tempfile.mkdtemp(prefix="moectl-experts-")
            self.store = DiskStore.write(self.store_dir or self._tmp, layers, verify=self.verify)
        deltas = {
            layer.index: pending_delta(experts)
            for layer, experts in zip(info.layers, experts_modules, strict=True)
            if pending_delta(experts) is not None
        }
        self.slot_store = DeltaStore(self.store, deltas) if deltas else self.store  # adapters of lazy experts
        if self.config.slot_dtype == "int8":
            self.slot_store = QuantizingStore(self.slot_store)
        devices = [
            self._device_of(experts, params) for experts, params in zip(experts_modules, layers, strict=True)
        ]
        cuda = any(d.type == "cuda" for d in devices)
        self.async_loads = cuda if self.async_spec is None else bool(self.async_spec)
        self.prefetch = self.async_loads if self.prefetch_spec is None else bool(self.prefetch_spec)
        for d in devices:
            if d not in self.loaders:
                self.loaders[d] = make_loader(d, self.async_loads, self.config.load_timeout_s)
        for layer, experts, params, b, device in zip(
            info.layers, experts_modules, layers, self.budget, devices, strict=True
        ):
            self.stored_expert_bytes.append(sum(p[0].numel() * p.element_size() for p in params.values()))
            templates = slot_templates(params, self.config.slot_dtype)
            store = self.slot_store
            res = ResidentSet(layer.index, store, b, templates, device, self.loaders[device])
            meta = {n: meta_of(experts, n) for n in params}
            self._restore.append((layer, experts, meta, device, res))  # before anything is removed
            for name in params:
                take(experts, name, _ExpertView(res, name, layer.num_experts, params[name].dtype))
            wrapper = OffloadedExperts(
                experts,
                res,
                self.policy,
                layer.index,
                self,
                num_experts=layer.num_experts,
                grouped=self.experts_forward == "grouped" and supports_slots(experts, set(params)),
            )
            layer.block.experts = wrapper
            self.modules.append(wrapper)
            if self.policy.needs_probs:
                self._hooks.append(layer.router.register_forward_hook(self._probs_hook(layer, wrapper)))
        del layers, params
        base = getattr(self.model, "base_model", self.model)
        self._hooks.append(base.register_forward_pre_hook(self._count_step, with_kwargs=True))
        return self

    def _device_of(self, experts: nn.Module, params: dict[str, Tensor]) -> torch.device:
        """Where the slots go: the experts' device, or for experts on meta the device of the
        layer's other weights (the router's, the attention's)."""
        device = next(iter(params.values())).device
        if device.type != "meta":
            return device
        for module in (experts, self.model):
            for t in module.parameters():
                if not t.is_meta:
                    return t.device
        return torch.device("cpu")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._signals.hold = True  # a SIGTERM / SIGHUP now exits once the store is removed
        try:
            self._close()
        finally:
            self._signals.restore()

    def _close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        error: BaseException | None = None
        for loader in self.loaders.values():  # no copy may still write into a slot about to be freed
            try:
                loader.drain()
            except BaseException as err:
                error = error or err
            finally:
                loader.close()
        self.loaders.clear()
        for layer, experts, meta, device, res in self._restore:
            try:
                for name, m in meta.items():
                    if present(experts, name):  # never removed (an install that failed part way)
                        continue
                    if self.lazy:  # never loaded: back on meta, as the model came
                        full = torch.empty(m.shape, dtype=m.dtype, device="meta")
                    else:
                        full = torch.stack(
                            [self.store.load(layer.index, e)[name] for e in range(layer.num_experts)]
                        )
                        full = full.to(device=device, dtype=m.dtype)
                    put_back(experts, name, m, full)
                layer.block.experts = experts
                res.slots.clear()
            except BaseException as err:  # restore the other layers, then report it
                error = error or err
        self._restore.clear()
        if hasattr(self.store, "close") and (self.store is not self.reader or self._own_reader):
            self.store.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if error is not None:
            raise error

    def _probs_hook(self, layer, wrapper: OffloadedExperts):
        def hook(module: nn.Module, args: tuple, output) -> None:
            wrapper.last_probs = layer.rule.probs(layer.adapter.logits_of(output))

        return hook

    def _count_step(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        self.step += 1
        self.step_times.append(time.perf_counter())
        self.step_tokens.append(int(x.shape[0] * x.shape[1]) if x is not None else 0)

    # -- counters ------------------------------------------------------------------------------
    @property
    def resident_sets(self) -> list[ResidentSet]:
        return [m.res for m in self.modules]

    @property
    def loader_name(self) -> str:
        return "+".join(sorted({loader.name for loader in self.loaders.values()})) or "none"

    def totals(self) -> dict:
        """Counters summed over the MoE layers (completes the loads in flight first)."""
        sets = self.resident_sets
        for r in sets:
            r.drain()
        return {
            "loads": sum(r.loads for r in sets),
            "bytes_moved": sum(r.bytes_moved for r in sets),
            "hits": sum(r.hits for r in sets),
            "misses": sum(r.misses for r in sets),
            "load_s": sum(r.timing.load_s for r in sets),
            "stall_s": sum(r.timing.stall_s for r in sets),
            "wait_s": sum(r.timing.wait_s for r in sets),
            "prefetch_loads": sum(r.prefetch_loads for r in sets),
            "prefetch_hits": sum(r.prefetch_hits for r in sets),
            "prefetch_wasted": sum(r.prefetch_wasted for r in sets),
            "prefetch_unused": sum(len(r.prefetched) for r in sets),
            "compute_s": sum(m.compute_s for m in self.modules),
            "switches": sum(m.switches for m in self.modules),
            "resident_expert_bytes": sum(r.slot_bytes for r in sets),
            "expert_bytes": [
                r.expert_bytes for r in sets
            ],  # one expert in its slot (int8 slots: int8 + scales)
            "stored_expert_bytes": list(self.stored_expert_bytes),
        }

    def events(self) -> list[tuple[int, int, int]]:
        """(step, MoE layer, expert) of every load, in order."""
        return sorted((s, r.layer, e) for r in self.resident_sets for s, e in r.events)


def offload(
    model: nn.Module,
    budget: float | int | OffloadConfig = 0.25,
    policy="lru",
    store: str = "disk",
    store_dir: str | Path | None = None,
    verify: bool = True,
    async_loads: bool | None = None,
    prefetch: bool | None = None,
    prefetch_config: PrefetchConfig | None = None,
    reader=None,
    slot_dtype: str = "same",
) -> OffloadRuntime:
    """``with offload(model, OffloadConfig(0.25, "option:4")) as rt:`` — generate, read ``rt.totals()``.

    The settings may also be given one by one (``offload(model, 0.25, "option:4", store="host")``).
    ``reader``: the checkpoint's ``ShardReader`` (see ``OffloadRuntime``).
    """
    if isinstance(budget, OffloadConfig):
        config = budget
    else:
        config = OffloadConfig(
            budget=budget,
            policy=policy,
            store=store,
            store_dir=None if store_dir is None else Path(store_dir),
            verify=verify,
            async_loads=async_loads,
            prefetch=prefetch,
            prefetch_config=prefetch_config or PrefetchConfig(),
            slot_dtype=slot_dtype,
        )
    return OffloadRuntime(model, config, reader=reader)
