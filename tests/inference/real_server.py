"""A real OpenAI-compatible server for the tests: `transformers serve` (transformers 5.17) on loopback, serving a tiny
Qwen3-VL checkpoint as `train.tiny.model.save_tiny` writes it (standard form: `processor_class: Qwen3VLProcessor`).

`ServerProcess(model_dir, workdir)` starts it through `serve_launcher.py` (why a launcher: its docstring) on a free
127.0.0.1 port without waiting (a test can prepare its data meanwhile), `wait()` returns the base URL (…/v1) once
`/health` answers, `stop()` ends exactly that process by PID; `serve()` wraps the three for a `with` block. Nothing is downloaded: `HF_HUB_OFFLINE=1`, and the Hub cache is an empty folder of the test's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests import torchvision_side
from tests.loopback import free_port


LAUNCHER = Path(__file__).with_name("serve_launcher.py")
STARTUP_TIMEOUT_S = 180  # a hang guard for a loaded machine, not a timing assertion


class ServerProcess:
    """`transformers serve MODEL_DIR` on 127.0.0.1 (CPU), started by `__init__` without waiting for it.

    `wait()` returns the base URL (…/v1) once `/health` answers; `stop()` ends exactly this process (SIGTERM, then
    SIGKILL). The served model's name is `str(model_dir)` (the server refuses any other name).

    Raises:
        RuntimeError: when the torchvision side folder is missing; from `wait()`, when the server exits or does not
            answer in time (with the end of its log).
    """

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        if problem := torchvision_side.missing():
            raise RuntimeError(problem)
        (workdir / "hf-cache").mkdir(parents=True, exist_ok=True)
        self.log = workdir / "transformers-serve.log"  # a file, not a pipe: a full pipe would block the server
        self.port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(torchvision_side.DIR),
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": str(workdir / "hf-cache"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        cmd = [
            sys.executable,
            str(LAUNCHER),
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
        with self.log.open("wb") as err:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=err, stderr=subprocess.STDOUT)

    def wait(self) -> str:
        """Return the base URL (…/v1) once `/health` answers."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"transformers serve did not start: {self.log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return f"http://127.0.0.1:{self.port}/v1"
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server process (by its PID) and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)


@contextmanager
def serve(model_dir: Path, workdir: Path) -> Iterator[str]:
    """Run `transformers serve MODEL_DIR` (`ServerProcess`); yield its base URL (…/v1); stop it, even on failure."""
    server = ServerProcess(model_dir, workdir)
    try:
        yield server.wait()
    finally:
        server.stop()
