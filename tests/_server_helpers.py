"""Shared by the server tests: ``moectl serve`` in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

STARTUP_S = 90.0  # a loaded 2-core CI machine; a start normally takes 3-10 s


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """``moectl serve tiny:olmoe --port P ARGS`` until :meth:`stop`; its output in a log file."""

    def __init__(self, *args: str, model: str = "tiny:olmoe", startup_s: float = STARTUP_S) -> None:
        self.startup_s = startup_s
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="moectl-serve-", suffix=".log")[1])
        command = [sys.executable, "-m", "moectl.cli", "serve", model, "--port", str(self.port)]
        command += ["--log-level", "warning", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moectl serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moectl serve did not answer /health in {self.startup_s:.0f} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, api_key: str = "none", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=api_key, max_retries=0, timeout=60.0, **kwargs)

    def stop(self) -> int:
        """SIGTERM, then the exit status (killed after 30 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)
        return self.proc.returncode
