"""Load on ``moectl serve``: a bounded closed-loop generator on 127.0.0.1, optionally beside llama.cpp's
``llama-server`` on the same prompts.

At each concurrency level (``--concurrency 1,4,8``) that many clients each send streamed completion
requests back to back (the next as soon as the previous ends) until ``--requests`` have been answered.
Per level: p50 / p99 time to first token (request sent to the first chunk of a generated token), p50 /
p99 inter-token latency (between consecutive token chunks of one request), and aggregate tokens/s
(completion tokens of the level over its wall time). Every request asks for ``--max-tokens`` greedy
tokens with ``ignore_eos`` so the levels (and the two servers) decode the same amount.

``--rss-requests N`` then sends N more requests at the highest concurrency and reports the server's
resident memory (``/proc/PID/status`` VmRSS) after a warm-up and after the N, and the growth in
percent (the issue's bound: within 2% over 1,000 requests).

    python benchmarks/serve_load.py --model tiny:olmoe --json benchmarks/results/serve_load.json
    python benchmarks/serve_load.py --model runs/emo-small --llama-server ~/llama.cpp/build/bin/llama-server \
        --gguf runs/emo-small.gguf --json benchmarks/results/serve_load_llama.json

``--url`` measures a server that is already running instead of starting ``moectl serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import PROMPTS, fail
from moectl.io.atomic import write_text_atomic

STARTUP_S = 600.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, log: Path, timeout: float = STARTUP_S) -> None:
    """Poll ``base``/health until it answers 200; fail with the log if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(
                f"the server exited {proc.returncode} before answering: {log.read_text(errors='replace')[-2000:]}"
            )
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    fail(f"the server did not answer {base}/health in {timeout:.0f} s")


def start(command: list[str], port: int) -> tuple[subprocess.Popen, str, Path]:
    log = Path(tempfile.mkstemp(prefix="serve-load-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, log)
    return proc, base, log


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS for process {pid}")


SERIAL = itertools.count()  # request numbers of --unique-prompts, distinct over the whole run


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def carries_token(chunk: dict[str, Any]) -> bool:
    """Whether a streamed completion chunk brings a generated token: it has text, or it is a choice's
    chunk before the finish (``moectl serve`` sends one per token, its text "" while held back — an
    incomplete UTF-8 character, a possible stop string — as a random-weight model's tokens often are;
    llama-server's token chunks carry text). Not the finish chunk without text, nor the usage chunk."""
    choices = chunk.get("choices") or []
    return any(c.get("text") or ("text" in c and c.get("finish_reason") is None) for c in choices)


async def one_request(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """Send one streamed completion; its time to first token, inter-token gaps and token count."""
    sent = time.perf_counter()
    times: list[float] = []
    tokens = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if carries_token(chunk):
                times.append(time.perf_counter())
    if tokens is None and not times:
        raise RuntimeError("a stream carried neither tokens nor usage")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    ttft = times[0] - sent if times else None
    return {"ttft": ttft, "gaps": gaps, "tokens": tokens if tokens is not None else len(times)}


async def level(
    base: str,
    headers: dict,
    concurrency: int,
    requests: int,
    body: dict[str, Any],
    routings: list[str] | None = None,
    unique: bool = False,
    repeat: int = 1,
) -> dict[str, Any]:
    """``requests`` streamed completions from ``concurrency`` closed-loop clients (client i with
    routing ``routings[i % len(routings)]`` when given). ``unique``: every prompt starts with its
    request's number, so no server can reuse the cache of an earlier prompt (llama-server's
    ``cache_prompt`` reuses the longest common prefix by default). ``repeat``: each prompt is its
    text that many times over (longer prefills)."""
    results: list[dict[str, Any]] = []
    issued = 0
    # a new connection per request: llama-server closes kept-alive connections between streams
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600, limits=limits) as http:

        async def client(index: int) -> None:
            nonlocal issued
            mine = {**body, "routing": routings[index % len(routings)]} if routings else body
            while issued < requests:
                prompt = " ".join([PROMPTS[issued % len(PROMPTS)]] * repeat)
                if unique:
                    prompt = f"Request {next(SERIAL)}. {prompt}"
                issued += 1
                results.append(await one_request(http, {**mine, "prompt": prompt}))

        start_t = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.perf_counter() - start_t
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p99_s": percentile(gaps, 0.99),
    }


def measure(
    base: str,
    headers: dict,
    args: argparse.Namespace,
    model: str,
    extra: dict,
    routings: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Every concurrency level after a warm-up; ``routings``: one per client, round robin."""
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}  # fmt: skip
    unique, repeat = args.unique_prompts, args.prompt_repeat
    asyncio.run(level(base, headers, 1, min(2, args.requests), body, unique=unique, repeat=repeat))  # warm-up
    return [
        asyncio.run(level(base, headers, c, args.requests, body, routings, unique, repeat)) for c in args.concurrency
    ]


def rss_check(base: str, headers: dict, pid: int, args: argparse.Namespace, model: str, extra: dict) -> dict:
    body = {"model": model, "max_tokens": args.rss_max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}  # fmt: skip
    top = max(args.concurrency)
    asyncio.run(level(base, headers, top, max(50, top), body))  # warm-up: allocator pools settle
    before = rss_bytes(pid)
    run = asyncio.run(level(base, headers, top, args.rss_requests, body))
    after = rss_bytes(pid)
    return {
        "requests": run["requests"],
        "max_tokens": args.rss_max_tokens,
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "growth_percent": 100.0 * (after - before) / before,
    }


def show(name: str, rows: list[dict[str, Any]]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    print(f"\n{name}")
    print(
        f"{'clients':>7} {'requests':>8} {'tokens/s':>9} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}  (ms)"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>7} {r['requests']:>8} {r['tokens_per_s']:>9.1f} {ms(r['ttft_p50_s']):>9} "
            f"{ms(r['ttft_p99_s']):>7} {ms(r['itl_p50_s']):>8} {ms(r['itl_p99_s']):>7}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny:olmoe", help="what `moectl serve` serves")
    parser.add_argument("--url", default=None, help="measure this running server instead (http://HOST:PORT)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,4,8", help="comma list of closed-loop client counts")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--routing", default=None, help="a routing NAME the server registered (--serve-arg)")
    parser.add_argument(
        "--routings", default=None, help="comma list of registered NAMEs: client i uses the (i mod n)-th"
    )
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="extra `moectl serve` argument (repeatable)"
    )
    parser.add_argument(
        "--rss-requests", type=int, default=0, help="then N requests for the RSS check (0: none)"
    )
    parser.add_argument("--rss-max-tokens", type=int, default=8)
    parser.add_argument(
        "--unique-prompts",
        action="store_true",
        help="start every prompt with its request's number: no prompt-prefix cache can be reused",
    )
    parser.add_argument(
        "--prompt-repeat", type=int, default=1, help="each prompt is its text N times over (longer prefills)"
    )
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file llama-server serves")
    parser.add_argument("--threads", type=int, default=None, help="llama-server --threads (default: its own)")
    parser.add_argument(
        "--llama-arg", action="append", default=[],
        help="extra llama-server argument (repeatable), e.g. --llama-arg=--no-repack: a Q8_0 or Q4_K_M "
        "file dies of SIGSEGV/SIGILL on this CPU with llama.cpp's repacked AMX layouts",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.routings is not None:
        args.routings = [n for n in args.routings.split(",") if n]
        if not args.routings or args.routing:
            fail("--routings takes a comma list of routing names, and not together with --routing")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        fail(f"--concurrency must be a comma list of integers like 1,4,8, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        fail("--concurrency counts must be at least 1")
    if args.requests < 1 or args.max_tokens < 1 or args.rss_requests < 0 or args.rss_max_tokens < 1:
        fail("--requests, --max-tokens and --rss-max-tokens must be at least 1, --rss-requests at least 0")
    if args.prompt_repeat < 1:
        fail(f"--prompt-repeat must be at least 1, got {args.prompt_repeat}")
    if (args.llama_server is None) != (args.gguf is None):
        fail("--llama-server and --gguf go together: the binary and the GGUF file it serves")
    if args.llama_server is not None and not args.llama_server.is_file():
        fail(f"--llama-server {args.llama_server}: no such file")
    if args.gguf is not None and not args.gguf.is_file():
        fail(f"--gguf {args.gguf}: no such file")
    if args.json is not None and args.json.is_dir():
        fail(f"--json {args.json} is a folder: give a file path")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = {"routing": args.routing} if args.routing else {}
    result: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "requests_per_level": args.requests,
        "routing": args.routing,
        "routings_per_client": args.routings,
        "unique_prompts": args.unique_prompts,
        "prompt_repeat": args.prompt_repeat,
        "cpu_count": os.cpu_count(),
        "load_average_before": os.getloadavg()[0],  # a shared machine: other work skews every figure
    }
    proc = None
    try:
        if args.url:
            base, pid = args.url.rstrip("/"), None
        else:
            port = free_port()
            command = [sys.executable, "-m", "moectl.cli", "serve", args.model, "--port", str(port),
                       "--log-level", "warning", "--max-batch", str(max(args.concurrency)), *args.serve_arg]  # fmt: skip
            if args.api_key:
                command += ["--api-key", args.api_key]
            proc, base, _ = start(command, port)
            pid = proc.pid
        served = httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        if args.url:  # a server this script did not start: its model is what it says it serves
            result["model"], result["url"] = served, args.url
        result["moectl"] = measure(base, headers, args, served, extra, args.routings)
        show(
            f"server at {args.url} ({served})" if args.url else f"moectl serve {args.model}", result["moectl"]
        )
        if args.rss_requests and pid is not None:
            result["rss"] = rss_check(base, headers, pid, args, served, extra)
            r = result["rss"]
            print(
                f"\nRSS over {r['requests']} requests: {r['rss_before_bytes'] / 2**20:.1f} MiB -> "
                f"{r['rss_after_bytes'] / 2**20:.1f} MiB ({r['growth_percent']:+.2f}%)"
            )
    finally:
        if proc is not None:
            result["moectl_exit_status"] = stop(proc)
    if args.llama_server is not None:
        port = free_port()
        command = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
                   "-np", str(max(args.concurrency)), "-c", str(max(args.concurrency) * 2048)]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        command += args.llama_arg
        llama, base, _ = start(command, port)
        try:
            result["llama_server"] = measure(base, {}, args, args.model, {})
            show(f"llama-server {args.gguf.name}", result["llama_server"])
        finally:
            stop(llama)
    result["load_average_after"] = os.getloadavg()[0]
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
