"""Per-layer option controllers (TE-MoE §4.2 and appendix A2).

One :class:`LayerController` per MoE layer, separate parameters:

- expert-set encoder (DeepSets, eq. 2): z(ω) = (1/k̂) Σ_{i∈ω} φ(e_i), learned e_i ∈ R^{d_e},
  φ a two-layer GELU MLP;
- termination head (eq. 3): β = σ(MLP_β(concat(RMSNorm(h), RMSNorm(z)))), ReLU MLP, output bias
  initialised to −3 (σ(−3) ≈ 0.05);
- option-value head Q_Ω(h, ω) (eq. 4): ReLU MLP on the same concat;
- state-value head V_Ω(h) (A2: linear on h; moectl's default an MLP, see :meth:`LayerController.v`);
- selection head c = f_sel(h): linear, initialised from the router weights, sampled by
  Plackett–Luce (``plackett_luce.py``).

Hidden sizes scale with the model: the paper uses d_e = 128 and 1024 hidden units for a
2880-wide model (gpt-oss-20b); :func:`controller_sizes` keeps that ratio, within [32, 1024].

Deviation (one line): a linear V_Ω has one output, so "initialised from the router weights" is
read as w_V = the mean router row (b_V = 0); the selection head copies the router exactly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError, FileFormatError, MoectlFileError, UnsupportedModelError
from moectl.io.atomic import default_mode


@dataclass
class ControllerConfig:
    """Shapes and the option budget of a controller; saved next to its weights."""

    k_hat: int
    hidden_size: int  # d, the model's hidden size
    num_experts: list[int]  # N per MoE layer
    top_k: int
    d_e: int = 128
    d_h: int = 1024
    cross_layer: bool = False  # one switch decision (MoE layer 0's head) for every layer (§A4)
    value_head: str = "mlp"  # "linear" is A2's V (see LayerController.v)
    family: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        bad = [n for n in ("k_hat", "hidden_size", "top_k", "d_e", "d_h") if not count(getattr(self, n))]
        if not isinstance(self.num_experts, list) or not self.num_experts or not all(map(count, self.num_experts)):
            bad.append("num_experts")
        if bad:
            raise FileFormatError(
                f"controller config: {', '.join(bad)} must be integers >= 1 (num_experts: one per MoE layer)"
            )
        if not isinstance(self.cross_layer, bool) or self.value_head not in ("mlp", "linear"):
            raise FileFormatError("controller config: cross_layer must be true/false and value_head 'mlp' or 'linear'")
        if not isinstance(self.family, str) or not isinstance(self.meta, dict):
            raise FileFormatError("controller config: family must be a string and meta an object")

    def to_dict(self) -> dict:
        return asdict(self)


def controller_sizes(hidden_size: int) -> tuple[int, int]:
    """(d_e, d_h) scaled from the paper's (128, 1024) at d = 2880, rounded to 8, within [32, 1024]."""
    d_h = int(min(1024, max(32, round(1024 * hidden_size / 2880 / 8) * 8)))
    d_e = int(min(128, max(16, d_h // 8)))
    return d_e, d_h


def _mlp(d_in: int, d_h: int, d_out: int, act: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, d_h), act, nn.Linear(d_h, d_out))


class LayerController(nn.Module):
    """The controller of one MoE layer (TE-MoE Fig. 4)."""

    def __init__(
        self, hidden_size: int, num_experts: int, k_hat: int, d_e: int, d_h: int, value_head: str = "mlp"
    ) -> None:
        super().__init__()
        self.k_hat, self.num_experts, self.hidden_size = k_hat, num_experts, hidden_size
        self.expert_embedding = nn.Parameter(torch.randn(num_experts, d_e))
        self.phi = _mlp(d_e, d_h, d_h, nn.GELU())
        self.norm_h = nn.RMSNorm(hidden_size)
        self.norm_z = nn.RMSNorm(d_h)
        self.termination = _mlp(hidden_size + d_h, d_h, 1, nn.ReLU())
        self.option_value = _mlp(hidden_size + d_h, d_h, 1, nn.ReLU())
        if value_head not in ("mlp", "linear"):
            raise ConfigError(f"value_head must be 'mlp' or 'linear', got {value_head!r}")
        self.state_value = (
            nn.Linear(hidden_size, 1) if value_head == "linear" else _mlp(hidden_size, d_h, 1, nn.ReLU())
        )
        self.selection = nn.Linear(hidden_size, num_experts)
        with torch.no_grad():
            self.termination[-1].bias.fill_(-3.0)

    def init_from_router(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Selection head := router (A2). A linear V_Ω gets the mean router row (its one output can take
        only one direction); an MLP V_Ω keeps the default init, like Q_Ω."""
        with torch.no_grad():
            w = weight.detach().float().reshape(self.num_experts, self.hidden_size)
            self.selection.weight.copy_(w)
            self.selection.bias.copy_(
                bias.detach().float() if bias is not None else torch.zeros(self.num_experts)
            )
            if isinstance(self.state_value, nn.Linear):
                self.state_value.weight.copy_(w.mean(0, keepdim=True))
                self.state_value.bias.zero_()

    # -- pieces -----------------------------------------------------------------------------
    def expert_features(self) -> Tensor:
        """φ(e_i) for every expert, [N, d_h]."""
        return self.phi(self.expert_embedding)

    def set_embedding(self, option: Tensor, features: Tensor | None = None) -> Tensor:
        """RMSNorm(z(ω)) for options ω (bool [..., N] with k-hat set), [..., d_h]."""
        features = self.expert_features() if features is None else features
        z = option.to(features.dtype) @ features / self.k_hat
        return self.norm_z(z)

    def _head(self, head: nn.Sequential, h: Tensor, z: Tensor) -> Tensor:
        return head(torch.cat([self.norm_h(h), z], dim=-1)).squeeze(-1)

    def beta(self, h: Tensor, z: Tensor) -> Tensor:
        """Termination probability β(h, ω) for hidden [..., d] and set embedding z [..., d_h]."""
        return torch.sigmoid(self._head(self.termination, h, z))

    def q(self, h: Tensor, z: Tensor) -> Tensor:
        """Option value Q_Ω(h, ω)."""
        return self._head(self.option_value, h, z)

    def v(self, h: Tensor) -> Tensor:
        """State value V_Ω(h): linear on h (A2, ``value_head='linear'``) or a ReLU MLP on RMSNorm(h).

        Deviation (the MLP, moectl's default): with the paper's linear V the critic Q, an MLP, moves
        several times faster, and Q − V then carries Q's head start as a systematic bias larger than
        η that drives β up (measured on moectl-small: switch rate 5% → 50% in 20 steps). Matching
        V's architecture to Q's removes that bias.
        """
        if isinstance(self.state_value, nn.Linear):
            return self.state_value(h).squeeze(-1)
        return self.state_value(self.norm_h(h)).squeeze(-1)

    def candidates(self, h: Tensor) -> Tensor:
        """Selection logits c = f_sel(h), [..., N]."""
        return self.selection(h)

    # -- the scan's split first layer ------------------------------------------------------
    def termination_parts(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Split MLP_β's first layer: (W_h·RMSNorm(h) + b [..., d_h], W_z [d_h, d_h], head tail).

        During the scan only the z part changes with the option, so the h part is computed for all
        positions at once.
        """
        first = self.termination[0]
        d = self.hidden_size
        a = self.norm_h(h) @ first.weight[:, :d].T + first.bias
        return a, first.weight[:, d:], self.termination[-1]

    def beta_from_parts(self, a: Tensor, w_z: Tensor, tail: nn.Linear, z: Tensor) -> Tensor:
        return torch.sigmoid(tail(torch.relu(a + z @ w_z.T)).squeeze(-1))


class OptionController(nn.Module):
    """Per-layer controllers for a whole model (``layers[i]`` for MoE layer i)."""

    def __init__(self, config: ControllerConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            LayerController(config.hidden_size, n, config.k_hat, config.d_e, config.d_h, config.value_head)
            for n in config.num_experts
        )

    @property
    def k_hat(self) -> int:
        return self.config.k_hat

    def save(self, path: str | Path) -> None:
        """Write ``controller.json`` and ``controller.safetensors`` into folder ``path``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "controller.safetensors"))
        (path / "controller.safetensors").chmod(default_mode())  # safetensors writes 0600
        (path / "controller.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> OptionController:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "controller.json").exists():
            raise MoectlFileError(
                f"{path}: not a controller folder (needs controller.json and controller.safetensors, "
                "as `moectl options train` writes)"
            )
        file = path / "controller.json"
        try:
            data = json.loads(file.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise FileFormatError(f"{file}: not valid JSON ({type(err).__name__})") from None
        if not isinstance(data, dict):
            raise FileFormatError(f"{file}: a controller config is a JSON object, got {type(data).__name__}")
        try:
            config = ControllerConfig(**data)
        except TypeError as err:  # a missing or unknown field
            raise FileFormatError(f"{file}: {' '.join(str(err).split()).removeprefix('ControllerConfig.')}") from None
        except ValueError as err:
            raise FileFormatError(f"{file}: {err}") from None
        controller = cls(config)
        weights = path / "controller.safetensors"
        try:
            controller.load_state_dict(load_file(str(weights)))
        except FileNotFoundError:
            raise MoectlFileError(f"{weights}: missing (a controller folder holds controller.json and it)") from None
        except Exception as err:  # safetensors' own errors, or tensors of other shapes than the config's
            raise FileFormatError(f"{weights}: does not hold this controller ({' '.join(str(err).split())[:200]})") from None
        return controller.to(device)

    def check(self, info: ModelInfo) -> None:
        """Raise ``ValueError`` if this controller does not fit the model."""
        got = [layer.num_experts for layer in info.layers]
        if got != list(self.config.num_experts) or hidden_size_of(info) != self.config.hidden_size:
            raise ConfigError(
                f"controller was built for hidden size {self.config.hidden_size} and experts per MoE layer "
                f"{self.config.num_experts}; the model has {hidden_size_of(info)} and {got}"
            )


def hidden_size_of(info: ModelInfo) -> int:
    """d: the width of the routers' input."""
    return int(info.layers[0].router.weight.shape[-1])


def build_controller(
    info: ModelInfo,
    k_hat: int,
    d_e: int | None = None,
    d_h: int | None = None,
    cross_layer: bool = False,
    seed: int = 0,
    value_head: str = "mlp",
) -> OptionController:
    """A fresh controller for ``info``'s model; selection and value heads initialised from the routers."""
    sizes = [layer.num_experts for layer in info.layers]
    if not sizes:
        raise UnsupportedModelError("the model has no MoE layers")
    if value_head not in ("mlp", "linear"):
        raise ConfigError(f"value_head must be 'mlp' or 'linear', got {value_head!r}")
    if not info.top_k <= k_hat <= min(sizes):
        raise ConfigError(
            f"k-hat must be between top-k ({info.top_k}) and the experts per layer ({min(sizes)}), got {k_hat}"
        )
    auto_e, auto_h = controller_sizes(hidden_size_of(info))
    config = ControllerConfig(
        k_hat=int(k_hat),
        hidden_size=hidden_size_of(info),
        num_experts=sizes,
        top_k=info.top_k,
        d_e=d_e or auto_e,
        d_h=d_h or auto_h,
        cross_layer=cross_layer,
        value_head=value_head,
        family=info.family,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        controller = OptionController(config)
    for layer, ctrl in zip(info.layers, controller.layers, strict=False):
        ctrl.init_from_router(layer.router.weight, getattr(layer.router, "bias", None))
    device = info.layers[0].router.weight.device
    return controller.to(device)
