"""``moectl serve`` does not wait forever on anyone: clients that send nothing are disconnected
(--read-timeout), and SIGTERM ends the process within --shutdown-timeout, the requests still
running finished with ``finish_reason: "abort"`` (one request with a 5,000,000-character stop
string once froze a server that SIGTERM could not stop)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from _server_helpers import Server


@pytest.fixture(scope="module")
def server():
    running = Server("--read-timeout", "1", "--timeout-keep-alive", "1", "--max-batch", "4")
    yield running
    running.stop()


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (EOF or reset)."""
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_connections_that_send_part_of_a_request_are_closed(server):
    socks = []
    for i in range(40):
        sock = socket.create_connection(("127.0.0.1", server.port))
        partial = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b""  # half a header, or nothing
        sock.sendall(partial)
        socks.append(sock)
    t0 = time.monotonic()
    assert all(closed_by_server(sock, 10.0) for sock in socks)
    assert time.monotonic() - t0 < 10.0
    for sock in socks:
        sock.close()
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200


def test_a_body_that_never_arrives_is_closed(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\":")  # fmt: skip
    assert closed_by_server(sock, 10.0)
    sock.close()


def test_a_request_answered_longer_than_the_read_timeout_is_not_cut(server):
    t0 = time.monotonic()
    body = {"model": "tiny:olmoe", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=120) as got:
        assert got.status_code == 200
        lines = got.iter_lines()
        events.append(next(lines))
        time.sleep(1.5)  # the client reads slowly: the answer outlasts the 1 s read timeout whatever the speed
        events += list(lines)
    assert time.monotonic() - t0 > 1.0
    chunks = [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "length"  # all 400 tokens
    assert "data: [DONE]" in events


def test_sigterm_aborts_what_still_runs_after_the_shutdown_timeout():
    running = Server("--shutdown-timeout", "1")
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": "tiny:olmoe", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{running.base}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    client = threading.Thread(target=stream)
    client.start()
    assert first.wait(60)
    t0 = time.monotonic()
    running.proc.send_signal(signal.SIGTERM)
    try:
        code = running.proc.wait(30)
    except subprocess.TimeoutExpired:
        running.proc.kill()
        raise
    took = time.monotonic() - t0
    client.join(30)
    running.log.unlink(missing_ok=True)
    assert code == 0
    assert took < 1.0 + 10.0, took  # the deadline, one step, the process's own exit
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    tokens = sum(1 for line in lines[:-1] if json.loads(line.removeprefix("data: "))["choices"][0]["text"])
    assert tokens < 1000
