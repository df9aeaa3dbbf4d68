"""Expert LoRA for TE-MoE controller training: PEFT's materialised delta vs the selected experts only.

One options-training step, as the trainer runs it, on the same model with the same adapters
(r = α = 16 on attention and on the experts, TE-MoE §5), timed in one process for three modes
that take turns step by step (so a varying machine load hits all of them alike):

- ``peft``: PEFT's ``target_parameters`` on the fused expert weights (folds W + s·B·A for all
  experts into the weight on every forward — every decoding step of the rollout included);
- ``cheap``: ``moectl.options.expert_lora`` (x·Aᵀ·Bᵀ·s on each selected expert's rows);
- ``none``: LoRA on attention only (the floor: what expert LoRA adds is cheap − none).

A step = the teacher-mixed rollout under a controller (``options.rollout.rollout``: ``--prompts``
prompts × ``--new-tokens`` sampled tokens, student and teacher forwards per token) + the
intra-option policy's update (``options.option_losses.student_log_probs`` forward, backward, AdamW step).
``peft`` and ``cheap`` start from the same A and B (PEFT's initialisation, B drawn with std
``--b-init`` instead of 0 so that the adapters act, copied into the cheap modules), so their
first (untimed) steps sample the same tokens: the script prints the largest difference of that
step's student log-probabilities, the check that both compute the same thing.

    python benchmarks/expert_lora.py --model models/moectl-small-standard --steps 3 \
        --json benchmarks/results/expert_lora.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moectl.adapters import inspect
from moectl.models.load import load_model
from moectl.options.controller import build_controller
from moectl.options.expert_lora import expert_lora_modules, load_expert_lora_state_dict
from moectl.options.option_losses import student_log_probs
from moectl.options.policy import ControllerPolicy
from moectl.options.rollout import rollout
from moectl.options.teacher import add_lora


def _setup(spec: str, mode: str, args, peft_state: dict | None):
    """Model, tokenizer, info and router snapshot with the adapters of ``mode``."""
    model, tokenizer = load_model(spec, dtype="float32")
    info = inspect(model)
    cheap, experts = mode == "cheap", mode != "none"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model, snapshot = add_lora(model, info, args.r, args.r, experts=experts, cheap_experts=cheap)
        if mode == "peft":  # B != 0, so that the first step's check compares adapted models
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, args.b_init)
    if peft_state is not None:  # the same A and B as the PEFT model
        from peft import set_peft_model_state_dict

        used = load_expert_lora_state_dict(model, peft_state)
        rest = {k: v for k, v in peft_state.items() if k not in used and (experts or "experts" not in k)}
        set_peft_model_state_dict(model, rest)
    if (mode == "cheap") != bool(expert_lora_modules(model)):
        raise SystemExit(f"{mode}: add_lora did not build the expert adapters this mode needs")
    return model, tokenizer, inspect(model), snapshot


class Run:
    """One mode's model, controller and optimiser; ``step()`` runs and times one options step."""

    def __init__(self, spec: str, mode: str, args, peft_state: dict | None) -> None:
        self.mode, self.args = mode, args
        self.model, tokenizer, self.info, self.snapshot = _setup(spec, mode, args, peft_state)
        self.pad_id = tokenizer.pad_token_id or 0
        self.policy = ControllerPolicy(build_controller(self.info, args.k_hat, seed=args.seed), mode="sample",
                                       seed=args.seed + 1)  # fmt: skip
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=2e-4)
        self.times: list[tuple[float, float]] = []
        self.first_logp: torch.Tensor | None = None

    def peft_state(self) -> dict:
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def step(self, prompts: torch.Tensor, step: int) -> None:
        t0 = time.perf_counter()
        self.model.eval()
        roll = rollout(
            self.model, self.info, self.policy, prompts, torch.ones_like(prompts), self.args.new_tokens,
            tau=0.2, top_p=0.95, pad_id=self.pad_id, generator=torch.Generator().manual_seed(self.args.seed + step),
            router_snapshot=self.snapshot,
        )  # fmt: skip
        t1 = time.perf_counter()
        self.model.train()
        logp = student_log_probs(self.model, self.info, roll)
        valid = roll.valid.float()
        loss = -(logp * valid).sum() / valid.sum().clamp(min=1)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        t2 = time.perf_counter()
        if step == 0:  # warm-up, not timed; its log-probs check that the modes compute the same
            self.first_logp = logp.detach()
        else:
            self.times.append((t1 - t0, t2 - t1))

    def summary(self) -> dict:
        roll, update = zip(*self.times, strict=True)
        steps = [a + b for a, b in self.times]
        return {
            "mode": self.mode,
            "step_s": statistics.median(steps),
            "rollout_s": statistics.median(roll),
            "update_s": statistics.median(update),
            "steps_s": steps,
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (TE-MoE §5: 16)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32, help="sampled tokens per prompt (§5: 256)")
    parser.add_argument("--k-hat", type=int, default=8)
    parser.add_argument("--r", type=int, default=16, help="LoRA rank = alpha (§5: 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--b-init", type=float, default=0.01, help="std of the LoRA B start values (both modes)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    _, tokenizer = load_model(args.model, with_tokenizer=True)
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else 256
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, vocab, (args.prompts, args.prompt_tokens), generator=g)
    peft = Run(args.model, "peft", args, None)
    state = peft.peft_state()
    runs = [peft, Run(args.model, "cheap", args, state), Run(args.model, "none", args, state)]
    for step in range(args.steps + 1):  # the modes take turns, so a varying machine load hits all alike
        for run in runs:
            run.step(prompts, step)
    rows = [run.summary() for run in runs]
    by = {row["mode"]: row for row in rows}
    diff = float((runs[0].first_logp - runs[1].first_logp).abs().max())
    ratio = by["peft"]["step_s"] / by["cheap"]["step_s"]
    print(
        f"{args.model}: {args.prompts} prompts x {args.new_tokens} new tokens, r = alpha = {args.r}, "
        f"k-hat {args.k_hat}, {torch.get_num_threads()} threads, median of {args.steps} steps per mode"
    )
    print(f"{'mode':6s} {'step s':>8s} {'rollout s':>10s} {'update s':>9s}   expert LoRA")
    notes = {"peft": "PEFT target_parameters (materialised)", "cheap": "moectl expert_lora (selected experts)",
             "none": "none (attention LoRA only)"}  # fmt: skip
    for row in rows:
        print(
            f"{row['mode']:6s} {row['step_s']:8.2f} {row['rollout_s']:10.2f} {row['update_s']:9.2f}   {notes[row['mode']]}"
        )
    print(
        f"step time ratio peft / cheap: {ratio:.2f}x; cheap / none: {by['cheap']['step_s'] / by['none']['step_s']:.2f}x"
        f"   (first-step student log-prob max |peft - cheap| {diff:.2e})"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "threads": torch.get_num_threads(),
            "results": rows,
            "ratio_peft_over_cheap": ratio,
            "ratio_cheap_over_none": by["cheap"]["step_s"] / by["none"]["step_s"],
            "first_step_logp_max_abs_diff": diff,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
