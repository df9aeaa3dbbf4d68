"""A learned policy in the server (issue #44 item 4): a trained TE-MoE controller served by ``moectl serve``
with offloaded experts, beside the model as trained, ``reroute:TOL`` and an expert subset.

Each configuration is its own ``moectl serve MODEL --budget B`` (a subprocess on a free loopback port,
``--threads`` and ``OMP_NUM_THREADS`` set, ``--no-compile``: an offloading engine never decodes through the
compiled step, ``--prefix-cache 0``, ``--store host``), all at the same budget of resident experts per
MoE layer. One server per configuration, because two of them cannot share one:

- ``controller``: ``--routing controller=controller:DIR``. A trained controller carries LoRA adapters
  and routers that merge into the model; ``moectl serve`` registers such a routing only alone.
- ``reroute:TOL``: ``--residency reroute:TOL``. Rerouting is a server-wide residency policy: it reads
  the offload runtime's resident sets, which only the runtime's own residency policy is handed.
  ``--routing`` does not take ``reroute:TOL``, and an inline ``{"type": "reroute", ...}`` routing is
  refused (it used to load and change nothing: no resident set reaches it). It reroutes every row
  of a decoding step against the resident set they share (``offload/reroute.py``: ``reroute_rows``;
  before 2026-11-29 it acted only at steps of one row, so concurrent requests got its S3-FIFO base).
- ``model`` (as trained) and ``subset``: ``--residency R`` (default ``s3fifo``, reroute's base).

Requests name a routing so that every switch rate is counted alike: ``model`` and ``reroute`` requests
use ``option:K`` (the model's own routing; ``switch_rate`` counted with options of K experts, K the
controller's k-hat: TE-MoE's switch rate of a plain router), ``controller`` its controller (its current
option), ``subset`` the subset (its allowed experts: 0 by construction). The subset is selected with
``moectl subset select --method router`` from the bundled sample's train split (round-robin over its
domains; ``--subset-keep``, default the budget, so it fits in the resident slots), unless ``--subset``
gives one.

Per configuration: ``--clients`` threads (plain HTTP through urllib) first send one warm-up request each
(not counted: the resident set's cold fill), then each sends ``--prompts`` completions back to back:
held-out prompts (the first ``--chars`` characters of the bundled sample's test documents, round-robin
over its domains, the same prompts and per-request seeds in every configuration), ``--max-tokens``
tokens at ``--temperature`` (TE-MoE's protocol for the switch rate: 0.5) with ``ignore_eos``. Reported:
each request's ``switch_rate`` (mean and normal 95% interval over requests), the server's expert bytes
read per generated token (``/metrics`` ``moectl_expert_bytes_read`` before and after the measured
requests: the server counts bytes for all its routings together, so each configuration is measured
alone), expert loads per token, aggregate tokens/s (completion tokens over the wall time of the measured
requests, prefill included), and the load average before and after.

    OMP_NUM_THREADS=1 python benchmarks/serve_learned_policy.py --clients 8 --prompts 2 --max-tokens 64 \\
        --json benchmarks/results/serve_learned_policy.json

``--quick``: one prompt of 8 tokens per client, a smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import fail
from moectl.io.atomic import write_text_atomic
from moectl.options.evaluate import ci95

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "src" / "moectl" / "data" / "sample"
MODEL = "models/moectl-small-standard"
CONTROLLER = "models/moectl-small-standard-controller-k8-eta0.32"
STARTUP_S = 600.0
REQUEST_S = 1800.0
MIB = 2**20
METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


@dataclass
class Configuration:
    """One server: its name in the results, its ``moectl serve`` flags, the routing its requests name."""

    name: str
    flags: list[str]
    routing: str | None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- prompts and the subset ---------------------------------------------------------------------------
def round_robin(split: str, n: int, chars: int, skip: int = 0) -> list[dict[str, str]]:
    """``n`` documents of the sample's ``split``, round-robin over its domains (sorted; in file order
    within one), each cut to its first ``chars`` characters (at a space where one is near); the first
    ``skip`` of that order passed over. Documents under 20 characters are passed over too."""
    by_domain: dict[str, list[str]] = {}
    with gzip.open(SAMPLE / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            text = " ".join(str(row["text"]).split())
            if len(text) >= 20:
                by_domain.setdefault(row.get("domain", "all"), []).append(text)
    queues = {d: iter(texts) for d, texts in sorted(by_domain.items())}
    out: list[dict[str, str]] = []
    while len(out) < n + skip and queues:
        for domain in list(queues):
            text = next(queues[domain], None)
            if text is None:
                del queues[domain]
            elif len(out) < n + skip:
                cut = text[:chars]
                if len(text) > chars and " " in cut[chars // 2 :]:
                    cut = cut[: cut.rindex(" ")]
                out.append({"domain": domain, "text": cut})
    if len(out) < n + skip:
        fail(f"the sample's {split} split has {len(out)} usable documents, asked for {n + skip}")
    return out[skip:]


def make_subset(model: str, keep: int, out: Path, docs: int, threads: int, seed: int) -> dict[str, Any]:
    """``moectl subset select MODEL --keep KEEP`` on ``docs`` train documents (round-robin over domains);
    the subset file's contents."""
    calibration = out.with_suffix(".calibration.jsonl")
    rows = round_robin("train", docs, 2000)
    calibration.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows), encoding="utf-8")
    command = [sys.executable, "-m", "moectl.cli", "subset", "select", model, "--data", str(calibration),
               "--keep", str(keep), "--out", str(out), "--method", "router", "--seed", str(seed)]  # fmt: skip
    done = subprocess.run(command, env=_env(threads), capture_output=True, text=True, timeout=STARTUP_S)
    if done.returncode != 0:
        fail(f"moectl subset select exited {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")
    return json.loads(out.read_text(encoding="utf-8"))


def controller_k_hat(folder: str) -> int:
    """The controller's k-hat (its controller.json, in the folder or its final/)."""
    for sub in ("", "final"):
        path = Path(folder) / sub / "controller.json"
        if path.exists():
            return int(json.loads(path.read_text(encoding="utf-8"))["k_hat"])
    fail(f"--controller: {folder} holds no controller.json (a `moectl options train` folder)")


# -- the server -----------------------------------------------------------------------------------------
def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """``moectl serve MODEL --port P FLAGS`` until :meth:`stop`, its output in a log file."""

    def __init__(self, model: str, flags: list[str], threads: int, startup_s: float = STARTUP_S) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="serve-learned-policy-", suffix=".log")[1])
        self.command = [sys.executable, "-m", "moectl.cli", "serve", model, "--port", str(self.port),
                        "--log-level", "warning", "--threads", str(threads), *flags]  # fmt: skip
        started = time.perf_counter()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=_env(threads)
            )
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                text = self.output()
                self.log.unlink(missing_ok=True)
                fail(f"moectl serve exited {self.proc.returncode} before answering: {text[-2000:]}")
            try:
                if get(f"{self.base}/health", timeout=2.0)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                fail(f"moectl serve did not answer /health in {startup_s:.0f} s")
            time.sleep(0.2)
        self.startup_s = time.perf_counter() - started

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM (drains), then the exit status (killed after 60 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)
        return self.proc.returncode


def get(url: str, timeout: float = 30.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read()


def post(url: str, body: dict[str, Any], timeout: float = REQUEST_S) -> dict[str, Any]:
    """POST ``body`` as JSON; the JSON answer (RuntimeError with the server's message on an HTTP error)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"HTTP {err.code}: {err.read()[:500]!r}") from None


def metrics(base: str) -> dict[str, float]:
    """``/metrics`` as {name or name{labels}: value}."""
    out: dict[str, float] = {}
    for line in get(f"{base}/metrics")[1].decode().splitlines():
        match = METRIC.match(line.strip())
        if match and not line.startswith("#"):
            with contextlib.suppress(ValueError):  # a value Prometheus writes that is not a float
                out[match.group(1)] = float(match.group(2))
    return out


# -- clients ------------------------------------------------------------------------------------------
def clients_run(
    base: str, model: str, routing: str | None, prompts: list[list[dict]], max_tokens: int, temperature: float
) -> tuple[list[dict[str, Any]], float]:
    """One thread per client, each sending its prompts back to back (all released together); every
    request's result and the wall time from the release to the last answer."""
    barrier = threading.Barrier(len(prompts) + 1)
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(index: int, mine: list[dict]) -> None:
        barrier.wait()
        for prompt in mine:
            body = {"model": model, "prompt": prompt["text"], "max_tokens": max_tokens, "temperature": temperature,
                    "seed": prompt["seed"], "ignore_eos": True}  # fmt: skip
            if routing is not None:
                body["routing"] = routing
            sent = time.perf_counter()
            try:
                answer = post(f"{base}/v1/completions", body)
            except Exception as err:  # reported by the caller, with the others' results
                with lock:
                    errors.append(err)
                return
            row = {
                "client": index,
                "seed": prompt["seed"],
                "domain": prompt["domain"],
                "routing": answer.get("routing"),
                "switch_rate": answer.get("switch_rate"),
                "completion_tokens": answer["usage"]["completion_tokens"],
                "prompt_tokens": answer["usage"]["prompt_tokens"],
                "finish_reason": answer["choices"][0]["finish_reason"],
                "latency_s": time.perf_counter() - sent,
            }
            with lock:
                results.append(row)

    threads = [threading.Thread(target=client, args=(i, mine), daemon=True) for i, mine in enumerate(prompts)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; the first: {errors[0]}")
    return sorted(results, key=lambda r: r["seed"]), wall


def measure(
    config: Configuration, args: argparse.Namespace, warmup: list[list[dict]], prompts: list[list[dict]]
) -> dict:
    """One configuration on its own server: warm-up, then the measured requests between two /metrics."""
    load_before = os.getloadavg()
    server = Server(args.model, config.flags, args.threads)
    try:
        served = json.loads(get(f"{server.base}/v1/models")[1])["data"][0]["id"]
        clients_run(server.base, served, config.routing, warmup, args.warmup_tokens, args.temperature)
        before = metrics(server.base)
        rows, wall = clients_run(
            server.base, served, config.routing, prompts, args.max_tokens, args.temperature
        )
        after = metrics(server.base)
    finally:
        code = server.stop()
    load_after = os.getloadavg()
    rates = [r["switch_rate"] for r in rows if r["switch_rate"] is not None]
    tokens = sum(r["completion_tokens"] for r in rows)

    def delta(name: str) -> float | None:
        return after[name] - before.get(name, 0.0) if name in after else None

    moved, loads = delta("moectl_expert_bytes_read"), delta("moectl_expert_loads")
    mean, half = ci95(rates)
    return {
        "name": config.name,
        "routing": config.routing,
        "serve_flags": config.flags,
        "note": config.note,
        **config.extra,
        "requests": len(rows),
        "switch_rate_reported": len(rates),
        "switch_rate_mean": mean if rates else None,
        "switch_rate_ci95": [mean - half, mean + half] if rates else None,
        "switch_rate_min": min(rates) if rates else None,
        "switch_rate_max": max(rates) if rates else None,
        "completion_tokens": tokens,
        "bytes_read": moved,
        "bytes_per_token": moved / tokens if moved is not None and tokens else None,
        "mib_per_token": moved / tokens / MIB if moved is not None and tokens else None,
        "loads_per_token": loads / tokens if loads is not None and tokens else None,
        "hit_rate_server": after.get("moectl_expert_hit_rate"),  # over the server's life, warm-up included
        "union_mean_server": after.get("moectl_expert_union_mean"),
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "latency_mean_s": sum(r["latency_s"] for r in rows) / len(rows) if rows else None,
        "startup_s": server.startup_s,
        "server_exit": code,
        "loadavg_before": list(load_before),
        "loadavg_after": list(load_after),
        "per_request": rows,
    }


# -- the run --------------------------------------------------------------------------------------------
def configurations(args: argparse.Namespace, k_hat: int, subset_path: Path) -> list[Configuration]:
    base = ["--budget", str(args.budget), "--store", args.store, "--max-batch", str(args.clients),
            "--no-compile", "--prefix-cache", "0", "--seed", str(args.seed)]  # fmt: skip
    lens = f"option:{k_hat}"
    out = [
        Configuration("model", [*base, "--residency", args.residency, "--routing", f"model={lens}"], "model",
                      f"the model as trained; switch rate counted at k-hat {k_hat} ({lens})"),
        Configuration("controller", [*base, "--residency", args.residency, "--routing",
                      f"controller=controller:{args.controller}"], "controller",
                      "the trained controller as a routing (registered alone: its adapters merge into the model)"),
        Configuration(f"reroute:{args.tol:g}", [*base, "--residency", f"reroute:{args.tol:g}", "--routing",
                      f"model={lens}"], "model",
                      f"reroute:{args.tol:g} as the server's residency (S3-FIFO + rerouting); the model's routing "
                      f"otherwise, switch rate at k-hat {k_hat}"),
        Configuration("subset", [*base, "--residency", args.residency, "--routing", f"subset={subset_path}"],
                      "subset", "the expert subset as a routing"),
    ]  # fmt: skip
    wanted = [n.strip() for n in args.only.split(",")] if args.only else None
    if wanted:
        names = {c.name.split(":")[0] for c in out}
        unknown = [n for n in wanted if n not in names]
        if unknown:
            fail(f"--only: unknown configuration(s) {unknown}; choose from {sorted(names)}")
        out = [c for c in out if c.name.split(":")[0] in wanted]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration; the results document."""
    k_hat = controller_k_hat(args.controller)
    n = args.clients * args.prompts
    held_out = round_robin("test", n + args.clients, args.chars)
    warm, measured = held_out[n:], held_out[:n]
    for i, prompt in enumerate(measured):
        prompt["seed"] = args.seed + i
    for i, prompt in enumerate(warm):
        prompt["seed"] = args.seed + n + i
    # client c sends prompts c, c + clients, ...: every client's requests mix domains
    prompts = [measured[c :: args.clients] for c in range(args.clients)]
    warmup = [[p] for p in warm]
    with tempfile.TemporaryDirectory(prefix="serve-learned-policy-") as tmp:
        if args.subset is not None:
            subset_path = Path(args.subset)
            subset = json.loads(subset_path.read_text(encoding="utf-8"))
            subset_made = None
        else:
            keep = args.subset_keep or args.budget
            subset_path = Path(tmp) / f"subset{keep}.json"
            subset = make_subset(args.model, keep, subset_path, args.subset_docs, args.threads, args.seed)
            subset_made = {"method": "router", "keep": keep, "calibration_docs": args.subset_docs,
                           "calibration": "the bundled sample's train split, round-robin over domains"}  # fmt: skip
        rows = []
        for config in configurations(args, k_hat, subset_path):
            print(f"[{config.name}] serving ...", file=sys.stderr, flush=True)
            rows.append(measure(config, args, warmup, prompts))
            row = rows[-1]
            print(f"[{config.name}] switch {_fmt(row['switch_rate_mean'])}  MiB/token {_fmt(row['mib_per_token'])}  "
                  f"tok/s {_fmt(row['tokens_per_s'], 1)}  load {row['loadavg_after'][0]:.2f}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return {
        "benchmark": "serve_learned_policy",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": args.model,
        "controller": args.controller,
        "k_hat": k_hat,
        "budget": args.budget,
        "residency": args.residency,
        "store": args.store,
        "clients": args.clients,
        "prompts_per_client": args.prompts,
        "max_tokens": args.max_tokens,
        "warmup_tokens": args.warmup_tokens,
        "temperature": args.temperature,
        "chars": args.chars,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "seed": args.seed,
        "subset": {"path": str(args.subset) if args.subset else None, "made": subset_made, "file": subset},
        "one_server_per_configuration": (
            "the controller carries adapters that merge into the model (moectl serve registers it alone), "
            "and reroute:TOL is a server-wide --residency, not a per-request routing; bytes are counted by "
            "the server for all routings together, so each configuration runs on its own server, one after "
            "another, same model and budget"
        ),
        "reroute_batched": "offload/reroute.py reroutes every row of a decoding step (reroute_rows)",
        "rows": rows,
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table(doc: dict[str, Any]):
    from rich.table import Table

    t = Table(
        title=f"{doc['model']} served, budget {doc['budget']} experts/layer, {doc['clients']} clients × "
        f"{doc['prompts_per_client']} prompts × {doc['max_tokens']} tokens, T={doc['temperature']:g}, "
        f"{doc['threads']} thread(s)"
    )
    for col in (
        "configuration",
        "switch rate (95% CI)",
        "MiB/token",
        "loads/token",
        "tok/s",
        "load before→after",
    ):
        t.add_column(col, justify="left" if col == "configuration" else "right")
    for r in doc["rows"]:
        ci = r["switch_rate_ci95"]
        rate = "—" if ci is None else f"{r['switch_rate_mean']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        t.add_row(r["name"], rate, _fmt(r["mib_per_token"]), _fmt(r["loads_per_token"], 2),
                  _fmt(r["tokens_per_s"], 1), f"{r['loadavg_before'][0]:.2f}→{r['loadavg_after'][0]:.2f}")  # fmt: skip
    return t


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=MODEL, help="the served model (its own tokenizer)")
    parser.add_argument("--controller", default=CONTROLLER, help="a `moectl options train` folder")
    parser.add_argument(
        "--subset", default=None, help="a subset file; default: one selected with --subset-keep"
    )
    parser.add_argument(
        "--subset-keep", type=int, default=None, help="experts the made subset keeps (default: --budget)"
    )
    parser.add_argument(
        "--subset-docs", type=int, default=64, help="train documents the subset is selected on"
    )
    parser.add_argument("--budget", type=int, default=8, help="resident experts per MoE layer")
    parser.add_argument("--residency", default="s3fifo", help="residency of the non-reroute servers")
    parser.add_argument("--tol", type=float, default=0.1, help="reroute:TOL's tolerance")
    parser.add_argument(
        "--store", default="host", help="where non-resident experts live (disk | checkpoint | host)"
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per client and configuration")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--warmup-tokens", type=int, default=16, help="max_tokens of each client's warm-up request"
    )
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--chars", type=int, default=200, help="characters of each held-out document sent")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads and OMP_NUM_THREADS of the server"
    )
    parser.add_argument("--seed", type=int, default=0, help="first request seed; a tiny model's weights")
    parser.add_argument("--only", default=None, help="comma list of model, controller, reroute, subset")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 prompt of 8 tokens per client")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.warmup_tokens, args.chars = 1, 8, 4, 80
    for flag in ("clients", "prompts", "max_tokens", "warmup_tokens", "budget", "threads", "chars"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not 0 <= args.tol <= 1:
        fail(f"--tol must be in [0, 1], got {args.tol}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    doc = run(args)
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table(doc))
    console.print(f"load average (1 min) before/after each configuration on {doc['cpus']} CPUs; "
                  f"{doc['one_server_per_configuration']}.", soft_wrap=False)  # fmt: skip
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
