"""Quantization quality where weights have learned: moectl int8/int4 against llama.cpp's Q8_0 / Q4_K_M
of the same model, and the GGUF round trip (issue 40 item 4).

For each reference model (``--models``: moectl-small-standard and moectl-small-emo, both Qwen2-MoE,
a family llama.cpp and transformers' GGUF loader both take), on ``--docs`` held-out test documents
of ``--corpus`` (spread over its domains, each cut to ``--max-length`` tokens by the model's own
tokenizer), every variant below scores the SAME token ids, teacher forced, and is compared with
the bf16 model (transformers, as moectl loads it): KL(bf16 || variant) per token and the
perplexity ratio, each with a 95% bootstrap interval over documents, and how often the argmax
token agrees.

- ``moectl int8``, ``moectl int4 gG`` (G in ``--groups``): the checkpoint quantized at load
  (``moectl.load(..., quantize=, group_size=)``; experts and shared experts, the default scope);
  ``moectl int4 g32 all``: every Linear but the routers (``scope="all"``, as llama.cpp
  quantizes attention and the LM head too);
- ``llama.cpp BF16 / Q8_0 / Q4_K_M``: ``moectl export gguf`` (BF16), then llama.cpp's own quantizer
  (``gguf_quants.py``); logits from llama-cpp-python with ``logits_all=True``. The BF16 row is
  the floor: llama.cpp's arithmetic against transformers' on the same weights;
- ``GGUF X -> moectl ...``: the GGUF file loaded by ``moectl.load("x.gguf")`` (transformers' GGUF
  loader, dequantized to bf16, issue 40 item 3), as is or re-quantized to moectl's int8 / int4:
  what the round trip from a GGUF a user already has costs.

Tokenizers are checked too: the GGUF's tokenizer (transformers' and llama.cpp's) against the
checkpoint's, document by document. The machine's load is printed and saved.

    pip install 'moectl[llama]'
    python benchmarks/quant_quality_llama.py --corpus runs/corpus --threads 1 \\
        --json benchmarks/results/quant_quality_llama.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
from bench_args import fail, int_list
from gguf_quants import composition, write_all
from llama_bufts import no_extra_bufts
from moectl.extras import installed
from moectl.io.atomic import write_text_atomic
from moectl.options.prompt_data import texts_by_domain
from moectl.quant import GROUP_SIZES, model_bytes
from token_kl import DocSums, summary

MODELS = ["models/moectl-small-standard", "models/moectl-small-emo"]
Scorer = Callable[[list[int]], torch.Tensor]  # token ids -> [len, vocab] logits


def documents(corpus: str | None, docs: int) -> list[str]:
    """``docs`` test documents, taken in turn from each domain."""
    columns = list(texts_by_domain(corpus, "test").values())
    spread = [col[i] for i in range(max(len(c) for c in columns)) for col in columns if i < len(col)]
    return spread[:docs]


def torch_scorer(model) -> Scorer:
    @torch.no_grad()
    def score(ids: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids])).logits[0].float()

    return score


def llama_scorer(path: Path, n_ctx: int, threads: int):
    """(scorer, the Llama) for a GGUF in llama-cpp-python: every position's logits (``logits_all``)."""
    import llama_cpp

    with no_extra_bufts():
        llm = llama_cpp.Llama(
            str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
            n_threads_batch=threads, logits_all=True, verbose=False,
        )  # fmt: skip

    def score(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))

    return score, llm


def variants(model_dir: str, files: dict[str, Path], groups: list[int], n_ctx: int, threads: int) -> dict:
    """name -> (scorer, facts: bytes, GGUF composition, ...) of every variant."""
    out: dict[str, tuple[Scorer, dict]] = {}

    def add_moectl(name: str, spec: str, **quant) -> None:
        model, _, _ = moectl.load(spec, **quant)
        out[name] = (torch_scorer(model), {"model_bytes": model_bytes(model), "dtype": str(model.dtype)})

    add_moectl("moectl int8", model_dir, quantize="int8")
    for g in groups:
        add_moectl(f"moectl int4 g{g}", model_dir, quantize="int4", group_size=g)
    add_moectl("moectl int4 g32 all", model_dir, quantize="int4", group_size=32, scope="all")
    for name, path in files.items():
        score, _ = llama_scorer(path, n_ctx, threads)
        out[f"llama.cpp {name}"] = (score, {"gguf": composition(path)})
    add_moectl("GGUF BF16 -> moectl", str(files["BF16"]))
    add_moectl("GGUF Q8_0 -> moectl", str(files["Q8_0"]))
    add_moectl("GGUF Q8_0 -> moectl int8", str(files["Q8_0"]), quantize="int8")
    add_moectl("GGUF Q4_K_M -> moectl", str(files["Q4_K_M"]))
    for g in (32, 128):
        add_moectl(f"GGUF Q4_K_M -> moectl int4 g{g}", str(files["Q4_K_M"]), quantize="int4", group_size=g)
    return out


def tokenizer_agreement(model_dir: str, files: dict[str, Path], texts: list[str], max_length: int) -> dict:
    """Documents whose first ``max_length`` ids the GGUF's tokenizers give as the checkpoint's does."""
    import llama_cpp

    _, tok, _ = moectl.load(model_dir)
    _, gguf_tok, _ = moectl.load(str(files["BF16"]))
    llm = llama_cpp.Llama(str(files["BF16"]), vocab_only=True, verbose=False)
    same_hf = same_llama = 0
    for text in texts:
        want = tok(text)["input_ids"][:max_length]
        same_hf += gguf_tok(text)["input_ids"][:max_length] == want
        same_llama += llm.tokenize(text.encode(), add_bos=True, special=False)[:max_length] == want
    return {
        "documents": len(texts),
        "transformers_gguf_tokenizer": same_hf,
        "llama_cpp_tokenizer": same_llama,
    }


def run_model(model_dir: str, args, work: Path) -> dict:
    """Every variant of ``model_dir`` against its bf16 self on the held-out documents."""
    start = time.perf_counter()
    files = write_all(model_dir, work / Path(model_dir).name, args.threads)
    base, tok, _ = moectl.load(model_dir)
    texts = documents(args.corpus, args.docs)
    scorers = variants(model_dir, files, args.groups, args.max_length, args.threads)
    sums = {name: DocSums() for name in scorers}
    nll_ref, counts = [], []
    for text in texts:
        ids = tok(text, truncation=True, max_length=args.max_length)["input_ids"]
        if len(ids) < 2:
            continue
        targets = torch.tensor(ids[1:])
        ref = torch_scorer(base)(ids)[:-1].log_softmax(-1)
        nll_ref.append(float(F.nll_loss(ref, targets, reduction="sum")))
        counts.append(len(ids) - 1)
        for name, (score, _) in scorers.items():
            sums[name].add(ref, score(ids)[:-1].log_softmax(-1), targets)
    return {
        "model": model_dir,
        "docs": len(counts),
        "tokens": int(sum(counts)),
        "ppl_bf16": float(np.exp(sum(nll_ref) / sum(counts))),
        "bf16_model_bytes": model_bytes(base),
        "tokenizers": tokenizer_agreement(model_dir, files, texts, args.max_length),
        "variants": {
            name: {**summary(sums[name], nll_ref, counts), **facts} for name, (_, facts) in scorers.items()
        },
        "seconds": time.perf_counter() - start,
    }


def _size(row: dict) -> str:
    size = row["gguf"]["file_bytes"] if "gguf" in row else row["model_bytes"]
    return f"{size / 2**20:6.1f} MiB{' file' if 'gguf' in row else ''}"


def print_table(result: dict) -> None:
    s = result["setup"]
    print(f"load: {s['load_before']} before (1/5/15 min), {s['load_after']} after; {s['threads']} threads")
    for m in result["models"]:
        t = m["tokenizers"]
        print(f"\n{m['model']}: {m['docs']} test documents of {result['setup']['corpus']} ({m['tokens']} tokens), "
              f"bf16 perplexity {m['ppl_bf16']:.3f}, bf16 model {m['bf16_model_bytes'] / 2**20:.1f} MiB; "
              f"GGUF tokenizers agree on {t['transformers_gguf_tokenizer']}/{t['documents']} (transformers), "
              f"{t['llama_cpp_tokenizer']}/{t['documents']} (llama.cpp)")  # fmt: skip
        print(f"  {'variant':<32} {'KL/token [95%]':<30} {'ppl ratio [95%]':<28} argmax  size")
        for name, r in m["variants"].items():
            (lo, hi), (plo, phi) = r["kl_per_token_ci95"], r["ppl_ratio_ci95"]
            print(f"  {name:<32} {r['kl_per_token']:.5f} [{lo:.5f}, {hi:.5f}]   {r['ppl_ratio']:.4f} "
                  f"[{plo:.4f}, {phi:.4f}]   {r['argmax_agreement']:.3f}  {_size(r)}")  # fmt: skip


def llama_cpp_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument(
        "--corpus", default=None, help="corpus folder or JSONL (test split); default: the sample corpus"
    )
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--groups", default=",".join(map(str, GROUP_SIZES)), help="moectl int4 group sizes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--work", type=Path, default=None, help="folder for the GGUF files (default: a temporary one)"
    )
    ap.add_argument(
        "--json", dest="json_path", type=Path, default=Path("benchmarks/results/quant_quality_llama.json")
    )
    args = ap.parse_args()
    args.groups = int_list(args.groups, "--groups")
    if not set(args.groups) <= set(GROUP_SIZES):
        fail(f"--groups must be among {', '.join(map(str, GROUP_SIZES))}, got {args.groups}")
    if args.docs < 1 or args.max_length < 2 or args.threads < 1:
        fail("--docs and --threads must be at least 1, --max-length at least 2")
    if not installed("llama_cpp"):
        fail("this benchmark runs llama.cpp: pip install 'moectl[llama]'")
    torch.set_num_threads(args.threads)
    result: dict = {
        "setup": {
            "command": " ".join(sys.argv),
            "threads": args.threads,
            "cpus": os.cpu_count(),
            "corpus": args.corpus or "the shipped sample corpus",
            "max_length": args.max_length,
            "load_before": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__,
            "llama_cpp_python": llama_cpp_version(),
            "llama_cpp_use_extra_bufts": False,
        },
        "models": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for model_dir in args.models:
            result["models"].append(run_model(model_dir, args, work))
    result["setup"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print_table(result)
    write_text_atomic(args.json_path, json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
