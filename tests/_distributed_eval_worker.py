"""Run under ``accelerate launch``: the evaluations of test_distributed_eval.py, one launch for all.

``python tests/_distributed_eval_worker.py ROOT``: ROOT holds ``evals/`` (the cache), ``corpus.jsonl``,
``subset.json`` and ``ctrl/``; rank 0 writes ``ROOT/NAME.dp.json`` per run of :data:`RUNS`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = {  # name → EvalConfig keywords beyond the model, the cache and the seed
    "subset": {"tasks": ["arc_easy"], "limit": 7, "perplexity": "corpus.jsonl", "policy": "subset.json"},
    "roe": {"tasks": ["arc_easy"], "limit": 7, "roe": "K=2,tau=0.5"},
    "controller": {"tasks": ["arc_easy"], "limit": 5, "perplexity": "corpus.jsonl", "controller": "ctrl"},
}


def run(root: Path, name: str) -> dict | None:
    from moectl.eval.eval_run import EvalConfig, evaluate

    kwargs = dict(RUNS[name])
    for key in ("perplexity", "policy", "controller"):
        if key in kwargs:
            kwargs[key] = str(root / kwargs[key])
    return evaluate(EvalConfig("tiny:olmoe", cache=str(root / "evals"), batch_size=3, **kwargs), progress=False)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    for name in RUNS:
        doc = run(root, name)
        if doc is not None:  # rank 0
            (root / f"{name}.dp.json").write_text(json.dumps(doc, default=str))
    from moectl.cli import leave_process_group

    leave_process_group(finished=True)  # as `moectl` does under accelerate launch
