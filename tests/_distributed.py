"""Launch a moectl verb on two CPU processes the way a user does on GPUs: ``accelerate launch``.

``accelerate launch --cpu`` starts a single process (it expects mpirun for several), so the tests
use ``--multi_gpu`` with no GPU visible: accelerate's torch-elastic launcher starts the processes
and ``moectl.distributed.ranks`` joins them over gloo. One thread each, as on the CI's 2 cores.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], cwd: Path, processes: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu --num_processes N -m moectl ARGS`` on CPU; the finished process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), "-m", "moectl", *args,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def check(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
