"""Checkpoints moectl writes, loaded by the loaders users serve with: transformers 4.x, llama.cpp's converter.

Issue #43 item 6. For the reference model (default ``models/moectl-small-standard``, as shipped),
a subset of it that ``moectl.subsets.export_subset`` writes (``--keep`` experts per MoE layer,
evenly spaced: which ones does not matter here, the files do), and subsets of tiny random models of
``--families`` (OLMoE, Qwen3-MoE, Mixtral: the reference model is Qwen2-MoE) written with the
reference model's tokenizer, this script:

1. computes, with this environment's transformers 5, every prompt's token ids and its
   last-position logits in float32 (``AutoTokenizer`` + ``AutoModelForCausalLM``; and
   ``moectl.load`` for the same figures through moectl);
2. for each ``--transformers`` spec (default ``transformers<5``: the newest 4.x), makes a venv of its
   own (``python -m venv VENV && VENV/bin/pip install SPEC torch==THIS_TORCH safetensors
   tokenizers``; kept in ``--venv-root`` for the next run) and loads both folders there with
   ``AutoTokenizer`` + ``AutoModelForCausalLM``, recording the tokenizer class, the config's expert
   count and ``rope_theta``, the token ids and the logits; the same load of the files *as
   transformers 5 writes them* (without ``moectl.io.portable_config``) shows what it refused before;
3. runs llama.cpp's ``convert_hf_to_gguf.py`` (in a venv of the transformers it pins) on every
   folder when a llama.cpp source tree is found (``--llama-cpp DIR``, ``$LLAMA_CPP_DIR``, or
   ``--llama-cpp fetch``: the tree llama-cpp-python's source package vendors, by ``pip download``)
   and reads the GGUF's expert count and RoPE base back; without a tree that part is skipped,
   saying so. moectl's trained BPE tokenizer is not in the converter's table of pre-tokenizer
   hashes, which would stop it before the config is read: it is given the name moectl's own GGUF
   exporter picks, and the report says so (``pre_tokenizer_fallback``).

Pass: the same token ids, and logits within ``--atol`` of transformers 5's (same float32 weights,
same torch: the difference is summation order at most); a GGUF whose expert count and RoPE base
are the config's. The script exits 1 if a file moectl wrote fails (the files as transformers 5
writes them are expected to fail: they are what moectl wrote before).

    python benchmarks/export_loaders.py [--model models/moectl-small-standard] [--keep 8]
        [--transformers 'transformers<5' --transformers 'transformers==4.51.3'] [--venv-root /tmp]
        [--families olmoe,qwen3_moe,mixtral] [--llama-cpp DIR | --llama-cpp fetch] [--atol 1e-4]
        [--json benchmarks/results/export_loaders.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bench_args import PROMPTS, fail

# What runs inside the other venv: no moectl there, only the loader under test.
CHILD = r"""
import json, sys
import numpy as np, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
folder, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
report = {"transformers": transformers.__version__, "torch": torch.__version__, "errors": {}}
def short(err):
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
tok = model = None
try:
    config = AutoConfig.from_pretrained(folder)
    report["num_experts"] = getattr(config, "num_experts", None)
    report["num_local_experts"] = getattr(config, "num_local_experts", None)
    report["rope_theta"] = getattr(config, "rope_theta", None)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
except Exception as err:
    report["errors"]["model"] = short(err)
try:
    tok = AutoTokenizer.from_pretrained(folder)
    report["tokenizer_class"] = type(tok).__name__
except Exception as err:
    report["errors"]["tokenizer"] = short(err)
report["loaded"] = model is not None and tok is not None
if report["loaded"]:
    ids = [p if isinstance(p, list) else tok(p)["input_ids"] for p in prompts]
    with torch.no_grad():
        logits = [model(torch.tensor([row])).logits[0, -1].float().numpy() for row in ids]
    report["ids"] = ids
    np.save(out, np.stack(logits))
print(json.dumps(report))
"""

CONVERTER_TRANSFORMERS = "transformers==4.57.6"  # what llama.cpp's requirements-convert_legacy_llama.txt pins
CONVERTER_EXTRAS = ("numpy", "sentencepiece", "protobuf<5")


def venv_for(spec: str, root: Path, extras: tuple[str, ...] = ()) -> Path:
    """A venv holding ``spec``, this process's torch and ``extras`` (made once, then reused): its python."""
    name = "moectl-" + re.sub(r"[^A-Za-z0-9.]+", "_", "-".join((spec, *extras))).strip("_")
    venv = root / name
    python = venv / "bin" / "python"
    if not python.exists():
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        print(f"making {venv}: pip install '{spec}' {torch_pin} safetensors tokenizers", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", spec, torch_pin, "safetensors", "tokenizers", *extras]
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            fail(f"pip could not install {spec!r} with {torch_pin}: {done.stderr.strip().splitlines()[-1:]}")
    return python


@torch.no_grad()
def reference(folder: Path, prompts: list) -> dict:
    """This environment's figures: transformers 5 and moectl on ``folder``; a prompt is text, or
    token ids (a tiny model, whose vocabulary is smaller than the tokenizer's)."""
    import moectl

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, _, _ = moectl.load(str(folder), dtype="float32")
    ids = [p if isinstance(p, list) else tok(p)["input_ids"] for p in prompts]
    logits = np.stack([model(torch.tensor([row])).logits[0, -1].numpy() for row in ids])
    mine = np.stack([ours(torch.tensor([row])).logits[0, -1].numpy() for row in ids])
    return {"ids": ids, "logits": logits, "moectl_vs_transformers5": float(np.abs(mine - logits).max())}


def as_transformers_5_writes(folder: Path, out: Path) -> Path:
    """``folder`` with its config and tokenizer files re-saved by transformers 5 alone (no
    ``portable_config``): what moectl wrote before #43."""
    shutil.copytree(folder, out)
    AutoConfig.from_pretrained(folder).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


def load_in(python: Path, folder: Path, scratch: Path, prompts: list) -> tuple[dict, np.ndarray | None]:
    """The child's report on ``folder`` and its logits (None when it could not load)."""
    out = scratch / f"logits-{time.monotonic_ns()}.npy"
    done = subprocess.run(
        [str(python), "-c", CHILD, str(folder), json.dumps(prompts), str(out)],
        capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip():
        return {"loaded": False, "errors": {"process": done.stderr.strip()[-400:]}}, None
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report, (np.load(out) if report.get("loaded") else None)


def compare(ref: dict, report: dict, logits: np.ndarray | None, atol: float) -> dict:
    """Same ids? Logits within ``atol`` of transformers 5's?"""
    ids = report.pop("ids", None)
    row = {**report, "same_ids": ids == ref["ids"] if ids is not None else None}
    if logits is not None:
        diff = float(np.abs(logits - ref["logits"]).max())
        row.update(max_abs_logit_diff=diff, logit_scale=float(np.abs(ref["logits"]).max()))
        row["pass"] = bool(row["same_ids"] and diff <= atol)
    else:
        row["pass"] = False
    return row


def evenly(info, keep: int) -> dict[int, list[int]]:
    """``keep`` evenly spaced experts of every MoE layer (which ones does not matter here)."""
    step = info.num_experts // keep
    return {layer.index: list(range(0, step * keep, step)) for layer in info.layers}


def find_llama_cpp(given: str | None, root: Path) -> Path | None:
    """A llama.cpp source tree holding ``convert_hf_to_gguf.py``: ``--llama-cpp DIR``,
    ``$LLAMA_CPP_DIR``, or with ``--llama-cpp fetch`` the one vendored in llama-cpp-python's source
    package (``pip download llama-cpp-python --no-deps --no-binary :all:``, unpacked under ``root``)."""
    if given == "fetch":
        return fetch_llama_cpp(root)
    for candidate in (given, os.environ.get("LLAMA_CPP_DIR")):
        if candidate and (Path(candidate) / "convert_hf_to_gguf.py").is_file():
            return Path(candidate)
    return None


def fetch_llama_cpp(root: Path) -> Path:
    """llama.cpp's converter as llama-cpp-python's sdist vendors it (downloaded once)."""
    import tarfile

    found = sorted(root.glob("moectl-llama-cpp/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if found:
        return found[-1].parent
    where = root / "moectl-llama-cpp"
    where.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "llama-cpp-python", "--no-deps", "--no-binary", ":all:", "-d", str(where)]
    done = subprocess.run(pip, capture_output=True, text=True)
    sdists = sorted(where.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not sdists:
        fail(f"pip could not download llama-cpp-python's source: {done.stderr.strip().splitlines()[-1:]}")
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "requirements/")
    with tarfile.open(sdists[-1]) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(wanted)]  # fmt: skip
        tar.extractall(where, members=members, filter="data")
    return sorted(where.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))[-1].parent


# llama.cpp's converter, run in the transformers 4.x venv it pins, on one folder. A BPE tokenizer whose
# pre-tokenizer it does not know by hash (moectl's own trained one) would stop it before anything else
# is read: then it is given the name moectl's own GGUF exporter picks (export/gguf_vocab.py), so the
# config's keys and the tensors are what is tested, and the report says it was needed.
CONVERT = r"""
import runpy, sys
llama, folder, out, fallback = sys.argv[1:5]
sys.path[:0] = [llama, llama + "/gguf-py"]
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        print(f"moectl: pre-tokenizer not known to llama.cpp by hash; using {fallback!r}", file=sys.stderr)
        return fallback
base.TextModel.get_vocab_base_pre = pre
sys.argv = [llama + "/convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32"]
runpy.run_path(llama + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(python: Path, llama_cpp: Path, folder: Path, scratch: Path) -> dict:
    """``convert_hf_to_gguf.py FOLDER`` to an f32 GGUF: did it write one, and do its expert count and
    RoPE base equal the config's (read back with llama.cpp's gguf-py)."""
    from moectl.export.gguf_vocab import pre_tokenizer

    out = scratch / f"{folder.name}-{time.monotonic_ns()}.gguf"
    fallback = pre_tokenizer(json.loads((folder / "tokenizer.json").read_text()))
    command = [str(python), "-c", CONVERT, str(llama_cpp), str(folder), str(out), fallback]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in (done.stdout + done.stderr).strip().splitlines() if line.strip()]
    row = {"returncode": done.returncode, "written": out.is_file(), "last_line": lines[-1][-300:] if lines else "",
           "pre_tokenizer_fallback": any(line.startswith("moectl: pre-tokenizer") for line in lines)}  # fmt: skip
    if out.is_file():
        sys.path.insert(0, str(llama_cpp / "gguf-py"))
        from gguf import GGUFReader

        fields = GGUFReader(out).fields
        arch = bytes(fields["general.architecture"].parts[-1]).decode()

        def value(key: str) -> float | None:
            field = fields.get(f"{arch}.{key}")
            return None if field is None else float(field.parts[-1][0])

        config = json.loads((folder / "config.json").read_text())
        theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
        row.update(arch=arch, expert_count=value("expert_count"), rope_freq_base=value("rope.freq_base"))
        count = config.get("num_experts") or config.get("num_local_experts")
        row["pass"] = row["expert_count"] == count and row["rope_freq_base"] == theta
        out.unlink()
    else:
        row["pass"] = False
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/moectl-small-standard"))
    parser.add_argument("--keep", type=int, default=8, help="experts per MoE layer in the subset")
    parser.add_argument(
        "--families", default="olmoe,qwen3_moe,mixtral",
        help="tiny models of these families too, exported (4 of 8 experts) with the model's tokenizer",
    )  # fmt: skip
    parser.add_argument("--transformers", action="append", help="pip spec of a transformers to load with")
    parser.add_argument("--venv-root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument(
        "--llama-cpp", help="a llama.cpp source tree (convert_hf_to_gguf.py), or 'fetch': llama-cpp-python's vendored one"
    )
    parser.add_argument("--atol", type=float, default=1e-4, help="max |logit difference| allowed")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/export_loaders.json"))
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        fail(f"--model {args.model}: no config.json there (give a checkpoint folder)")
    specs = args.transformers or ["transformers<5"]

    import moectl
    from moectl.subsets import export_subset

    model, tok, info = moectl.load(str(args.model), dtype="float32")
    if not 1 <= args.keep < info.num_experts:
        fail(f"--keep must be from 1 to {info.num_experts - 1} (the model has {info.num_experts} experts), got {args.keep}")
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(moectl.FAMILIES))
    if unknown:
        fail(f"--families: {', '.join(unknown)} not among moectl's tiny families ({', '.join(moectl.FAMILIES)})")
    results, conversions = [], []
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        folders = {"reference": (args.model, PROMPTS)}
        subset = scratch / f"subset-{args.keep}"
        export_subset(model, evenly(info, args.keep), subset, tokenizer=tok, metadata={"method": "evenly spaced"})
        folders[f"subset {args.keep}"] = (subset, PROMPTS)
        ids = [[3 + (7 * i + 13 * j) % 250 for j in range(12)] for i in range(4)]  # within a tiny vocabulary
        for family in families:
            tiny = moectl.tiny(family, vocab_size=len(tok))  # the tokenizer's vocabulary: the converter checks it
            export_subset(tiny, evenly(moectl.inspect(tiny), 4), scratch / f"tiny-{family}", tokenizer=tok)
            folders[f"tiny {family}"] = (scratch / f"tiny-{family}", ids)
        before = {name: as_transformers_5_writes(path, scratch / f"t5-{i}") for i, (name, (path, _)) in enumerate(folders.items())}
        refs = {name: reference(path, prompts) for name, (path, prompts) in folders.items()}
        for spec in specs:
            python = venv_for(spec, args.venv_root)
            for name, (path, prompts) in folders.items():
                for files, where in (("moectl's", path), ("transformers 5's own", before[name])):
                    report, logits = load_in(python, where, scratch, prompts)
                    row = {"spec": spec, "model": name, "files": files, **compare(refs[name], report, logits, args.atol)}
                    row["moectl_vs_transformers5"] = refs[name]["moectl_vs_transformers5"]
                    results.append(row)
                    status = "PASS" if row["pass"] else "FAIL"
                    errors = "; ".join(f"{k}: {v}" for k, v in row.get("errors", {}).items())
                    detail = errors or f"max |dlogit| {row['max_abs_logit_diff']:.2e}, same ids {row['same_ids']}"
                    print(f"{status}  {row.get('transformers', spec):>8}  {name:<15} {files:<21} {detail}", flush=True)
        llama_cpp = find_llama_cpp(args.llama_cpp, args.venv_root)
        if llama_cpp is None:
            skipped = (
                "no llama.cpp source tree (give --llama-cpp DIR, $LLAMA_CPP_DIR, or --llama-cpp fetch): "
                "convert_hf_to_gguf.py not run"
            )
            print(f"skipped: {skipped}")
        else:
            skipped = None
            python = venv_for(CONVERTER_TRANSFORMERS, args.venv_root, CONVERTER_EXTRAS)
            for name, (path, _) in folders.items():
                for files, where in (("moectl's", path), ("transformers 5's own", before[name])):
                    row = {"model": name, "files": files, **convert(python, llama_cpp, where, scratch)}
                    conversions.append(row)
                    status = "PASS" if row["pass"] else "FAIL"
                    print(f"{status}  convert_hf_to_gguf.py  {name:<15} {files:<21} {row.get('expert_count')} experts, "
                          f"rope {row.get('rope_freq_base')}; {row['last_line'][:120]}", flush=True)  # fmt: skip
    meta = {
        "model": str(args.model),
        "keep": args.keep,
        "families": families,
        "prompts": len(PROMPTS),
        "atol": args.atol,
        "transformers_here": __import__("transformers").__version__,
        "torch": torch.__version__,
        "llama_cpp_convert": conversions or {"skipped": skipped},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.json}")
    ours = [r for r in [*results, *conversions] if r["files"] == "moectl's"]
    if not all(r["pass"] for r in ours):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
