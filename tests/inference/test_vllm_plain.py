"""vLLM started without the project's flags (as from vLLM's own docs): the default dialect stops before any row.

A separate module from `test_vllm_server.py` so that its server runs alone: module fixtures end with their module, and
two vLLM servers at once would not fit a loaded 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from inference.vllm_server import VLLMServer
from tests.inference.helpers import build_small_sft_set
from train.tiny.model import save_tiny


FRAME_PX = 64
NAME = "tiny"


@pytest.fixture(scope="module")
def plain_vllm(prefect_harness, tmp_path_factory: pytest.TempPathFactory):
    """(base URL, OUT with an sft set) of vLLM started as a user might from vLLM's own docs: no project chat template,
    no server-side processor settings. The SFT set is built while it starts."""
    checkpoint = save_tiny(tmp_path_factory.mktemp("vllm-plain-ckpt") / "tiny-qwen3-vl")
    server = VLLMServer(
        checkpoint,
        tmp_path_factory.mktemp("vllm-plain"),
        name=NAME,
        drop_flags=("--chat-template", "--mm-processor-kwargs"),
    )
    try:
        sft_out = build_small_sft_set(tmp_path_factory, FRAME_PX)
        yield server.wait(), sft_out
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.side_env
def test_mining_against_a_vllm_without_the_project_flags_stops_in_one_line(
    plain_vllm, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint, sft_out = plain_vllm
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "build-rl-hardset",
                str(sft_out / "sft"),
                str(tmp_path),
                "--endpoint",
                endpoint,
                "--endpoint-model",
                NAME,
                "--dialect",
                "vllm",
                "--max-new-tokens",
                "12",
            ]
        )
    out, err = capsys.readouterr()
    assert exited.value.code == 1 and "Traceback" not in out + err
    problem, fix = err.splitlines()[-2:]
    assert problem.startswith(f"emrl build-rl-hardset: failed: probe of {endpoint}/chat/completions (model 'tiny', ")
    assert problem.endswith(
        "dialect vllm): the server wraps the video in an extra <|vision_start|>…<|vision_end|> pair (2 vision starts "
        "for 1 frame pair(s)), so the model does not see the training layout"
    )
    assert fix == (
        "  fix: start vLLM with the chat template inference.vllm_server writes (--chat-template): make vllm-serve "
        "CKPT=DIR (python -m inference.vllm_server DIR; docs/serving.md)"
    )
    assert not list((tmp_path / ".work").glob("predictions-*.jsonl")) or all(
        p.read_text() == "" for p in (tmp_path / ".work").glob("predictions-*.jsonl")
    )  # no row was sent
