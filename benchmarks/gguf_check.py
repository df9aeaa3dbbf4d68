"""Exported GGUF files in llama.cpp against transformers: tokens, last-position logits, greedy text.

Issue 15.4. For a moectl checkpoint (default: ``models/moectl-small-standard``) and an expert
subset of it (``--keep`` of its experts per layer, chosen by the router method on the sample
corpus's math validation documents), ``moectl.export.write_gguf`` writes one GGUF file per
``--outtype``; llama-cpp-python loads each and, on every prompt (moectl's default prompts and
the start of one validation document per domain), is compared with transformers running the
same weights in float32 (the subset: the folder ``moectl subset export`` writes):

- tokens: llama.cpp's tokenizer (``tokenizer.ggml.pre`` chosen by moectl) gives the same ids;
- logits at the last prompt position: max |llama.cpp - transformers|, and the scale (max |logit|);
- greedy continuations of ``--new-tokens`` tokens (EOS suppressed on both sides): identical?
  If not, where they first differ and how close transformers' own choice was there (its top-1
  minus top-2 logit: a near tie flips under any rounding).

For scale, the same figures for transformers in bfloat16 against float32 are printed: the
rounding a bf16 GGUF (whose matrices ggml multiplies with bf16 activations) must be judged by.

    pip install 'moectl[llama]'    # builds llama.cpp from source: ~15-30 min on 2 cores
    python benchmarks/gguf_check.py [--model models/moectl-small-standard] [--keep 8]
        [--outtype auto --outtype f32] [--new-tokens 32] [--threads 2] [--json out/gguf_check.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llama_peer import greedy, open_llama
from moectl.data.sample import load_sample_corpus
from moectl.export import write_gguf
from moectl.generate import DEFAULT_PROMPTS
from moectl.subsets import export_subset
from moectl.subsets.calibrate import tokenize
from moectl.subsets.files import save_subset
from moectl.subsets.select import select_subset


def prompts() -> list[str]:
    """moectl's default prompts and the first 300 characters of one validation document per domain."""
    texts = [p["prompt"] for p in DEFAULT_PROMPTS]
    seen: set[str] = set()
    for doc in load_sample_corpus("validation")["validation"]:
        if doc["domain"] not in seen:
            seen.add(doc["domain"])
            texts.append(doc["text"][:300])
    return texts


def choose_subset(model, tok, keep: int, out: Path) -> dict[int, list[int]]:
    """``keep`` experts per MoE layer by the router method on the math validation documents."""
    docs = [d["text"] for d in load_sample_corpus("validation")["validation"] if d["domain"] == "math"]
    batch = tokenize(tok, docs, 256)
    kept = select_subset(model, batch["input_ids"], keep, "router", batch["attention_mask"])
    save_subset(out, kept, method="router", calibration={"data": "sample corpus, math validation"})
    return kept


@torch.no_grad()
def hf_reference(model, tok, texts: list[str], new_tokens: int) -> list[dict]:
    out = []
    for text in texts:
        ids = tok(text)["input_ids"]
        x = torch.tensor([ids])
        logits = model(x).logits[0, -1].float().numpy()
        gen = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        top2 = torch.stack(gen.scores)[:, 0].float().topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()  # how close each greedy choice was to a tie
        out.append(
            {
                "ids": ids,
                "logits": logits,
                "greedy": gen.sequences[0, len(ids) :].tolist(),
                "margins": margins,
            }
        )
    return out


def llama_run(llm, tok, texts: list[str], new_tokens: int) -> list[dict]:
    """Tokens, last-position logits and a greedy continuation (EOS masked, as min_new_tokens does)."""
    out = []
    for text in texts:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)  # BOS iff the GGUF says so
        logits, tokens = greedy(llm, ids, new_tokens, tok.eos_token_id)
        out.append({"ids": ids, "logits": logits, "greedy": tokens})
    return out


def compare(got: list[dict], ref: list[dict]) -> dict:
    rows = []
    for g, r in zip(got, ref, strict=True):
        diff = float(np.abs(g["logits"] - r["logits"]).max())
        first = next(
            (i for i, (a, b) in enumerate(zip(g["greedy"], r["greedy"], strict=True)) if a != b), None
        )
        rows.append(
            {
                "same_tokens": g["ids"] == r["ids"],
                "max_abs_logit_diff": diff,
                "logit_scale": float(np.abs(r["logits"]).max()),
                "same_argmax": int(g["logits"].argmax()) == int(r["logits"].argmax()),
                "same_greedy": first is None,
                "first_greedy_difference": first,
                # the reference's top-1 minus top-2 logit where the tokens first differ: a near tie?
                "reference_margin_there": None if first is None else r["margins"][first],
            }
        )
    return {
        "prompts": len(rows),
        "same_tokens": all(r["same_tokens"] for r in rows),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        "logit_scale": max(r["logit_scale"] for r in rows),
        "same_argmax": sum(r["same_argmax"] for r in rows),
        "same_greedy": sum(r["same_greedy"] for r in rows),
        "rows": rows,
    }


def _differences(result: dict) -> str:
    return " ".join(
        f"({r['first_greedy_difference']}, {r['reference_margin_there']:.3f})"
        for r in result["rows"]
        if r["first_greedy_difference"] is not None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--keep", type=int, default=8, help="experts per layer in the subset")
    parser.add_argument("--outtype", action="append", help="GGUF matrix dtype(s): auto, f32, f16, bf16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import llama_cpp

    torch.set_num_threads(args.threads)
    outtypes = args.outtype or ["auto", "f32"]
    texts = prompts()
    tok = AutoTokenizer.from_pretrained(args.model)
    results = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        full = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        kept = choose_subset(full, tok, args.keep, tmp / "subset.json")
        export_subset(full, kept, tmp / "subset", tok)
        variants = {"full": (full, None), f"subset {args.keep}": (None, tmp / "subset.json")}
        for name, (model, subset) in variants.items():
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(tmp / "subset", dtype=torch.float32).eval()
            ref = hf_reference(model, tok, texts, args.new_tokens)
            bf16 = compare(hf_reference(model.to(torch.bfloat16), tok, texts, args.new_tokens), ref)
            results.append({"model": name, "engine": "transformers bf16", **bf16})
            for outtype in outtypes:
                path = tmp / f"{name.replace(' ', '-')}-{outtype}.gguf"
                t0 = time.perf_counter()
                report = write_gguf(args.model, path, subset=subset, outtype=outtype)
                export_s = time.perf_counter() - t0
                llm = open_llama(path, args.threads)
                got = compare(llama_run(llm, tok, texts, args.new_tokens), ref)
                llm.close()
                engine = f"llama.cpp {report['outtype']}"
                results.append({"model": name, "engine": engine, "export_s": export_s,
                                "file_bytes": report["file_bytes"], **got})  # fmt: skip
    print(f"{args.model}: {len(texts)} prompts, {args.new_tokens} greedy tokens, vs transformers float32")
    print(
        f"{'model':>10} {'engine':>18} {'tokens':>6} {'max|dlogit|':>11} {'scale':>6} {'argmax':>6} {'greedy':>6}"
    )
    for r in results:
        print(
            f"{r['model']:>10} {r['engine']:>18} {'same' if r['same_tokens'] else 'DIFF':>6} "
            f"{r['max_abs_logit_diff']:>11.2e} {r['logit_scale']:>6.1f} "
            f"{r['same_argmax']:>3}/{r['prompts']:<2} {r['same_greedy']:>3}/{r['prompts']:<2}  {_differences(r)}"
        )
    meta = {"model": args.model, "keep": args.keep, "new_tokens": args.new_tokens, "threads": args.threads,
            "llama_cpp_python": llama_cpp.__version__}  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
