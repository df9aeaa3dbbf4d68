"""A controller folder for a large checkpoint without loading its experts: TE-MoE's speed check stand-in.

Issue 44 item 3 asks for the decode speed of the best controller under the 45% cap of the
OLMoE-1B-7B-dims checkpoint (random weights, where quality means nothing). No controller is trained
at that size on this machine; this writes one as ``moectl.options.build_controller`` makes it
before training — selection heads from the checkpoint's routers, termination heads' output bias
-3, so β = σ(-3) ≈ 4.7% per token and layer: it switches at about the rate the trained reference
controllers reach (k̂ = 8, η = 0.64: 7.3%), which is what the residency runtime's speed depends on.
The model is built on the ``meta`` device and only the routers' tensors are read from the shards,
so a 13.8 GB checkpoint needs a few MB of memory.

    python benchmarks/fresh_controller.py --checkpoint /work/ckpt/olmoe-1b-7b --k-hat 8 \\
        --out /work/ckpt/olmoe-1b-7b-controller-k8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import fail
from moectl.adapters.inspect import inspect
from moectl.options.controller import build_controller


def router_tensors(checkpoint: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` from a (sharded) safetensors checkpoint."""
    index = checkpoint / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.exists() else dict.fromkeys(names, "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in files:
            fail(f"{checkpoint}: no tensor {name} (a checkpoint of another layout?)")
        with safe_open(str(checkpoint / files[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--k-hat", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").is_file():
        fail(f"--checkpoint {args.checkpoint}: not a checkpoint folder (no config.json)")
    config = AutoConfig.from_pretrained(args.checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    info = inspect(model)
    names = {id(m): n for n, m in model.named_modules()}
    wanted = [f"{names[id(layer.router)]}.weight" for layer in info.layers]
    tensors = router_tensors(args.checkpoint, wanted)
    for layer, name in zip(info.layers, wanted, strict=True):
        layer.router.weight = nn.Parameter(tensors[name].float(), requires_grad=False)
        if getattr(layer.router, "bias", None) is not None:
            layer.router.bias = None  # (OLMoE, Qwen-MoE, Mixtral routers have none)
    controller = build_controller(info, args.k_hat, seed=args.seed)
    controller.save(args.out)
    print(f"wrote {args.out}: a fresh k-hat={args.k_hat} controller for {args.checkpoint} "
          f"({len(info.layers)} MoE layers, {sum(p.numel() for p in controller.parameters()) / 1e6:.1f} M parameters)")  # fmt: skip


if __name__ == "__main__":
    main()
