"""Launch a peer script under torchrun (2 processes, this machine) and read its JSON line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, *args: str, attempts: int = 3) -> dict:
    """The last line the script's rank 0 printed, parsed as JSON. A port taken between choosing
    and binding it (seen once in ~20 runs) fails the launch, so a failed launch is retried on a
    fresh port, and its output shown."""
    for attempt in range(1, attempts + 1):
        try:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    "2",
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(free_port()),
                    str(script),
                    *args,
                ],  # fmt: skip
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
            return json.loads(out.stdout.strip().splitlines()[-1])
        except subprocess.CalledProcessError as exc:
            print(f"torchrun failed (attempt {attempt} of {attempts}):\n{exc.stderr[-2000:]}")
    raise RuntimeError(f"torchrun failed {attempts} times; its output is above")
