"""Mining and evaluation against a server nobody here wrote: `transformers serve` on loopback with a tiny Qwen3-VL.

The real `OpenAIBackend` in the "openai" dialect, its probe, and the real `emrl build-rl-hardset --dialect openai` then
`emrl eval` on the predictions, against transformers' own OpenAI-compatible server (`real_server.py`). The images
reach the model: the prompt grows by exactly the tokens of the added frames. The vLLM dialect is refused by this
server, and the probe says so in one line, as it does for a wrong model name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cli.main import main
from inference.openai_client import OpenAIBackend
from inference.probe import EndpointProbeError
from inference.requests import request_from_row
from tests.inference.helpers import first_train_row, serve_beside_sft_set
from tests.inference.real_server import ServerProcess
from train.tiny.model import save_tiny


pytestmark = pytest.mark.side_env  # transformers serve needs torchvision (.cache/torchvision)


FRAME_PX = 64
# A 64² frame is 4x4 patches of 16 px, merged 2x2: 4 image tokens, plus <|vision_start|> and <|vision_end|>.
TOKENS_PER_FRAME = (FRAME_PX // 16) ** 2 // 4 + 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-VL as train/ saves every checkpoint: the standard form a server loads without our code."""
    return save_tiny(tmp_path_factory.mktemp("standard") / "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def served(prefect_harness, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """(base URL, OUT with an sft set): the SFT set is built while the server starts; the server is stopped by PID."""
    yield from serve_beside_sft_set(
        ServerProcess(checkpoint, tmp_path_factory.mktemp("transformers-serve")), tmp_path_factory, FRAME_PX
    )


def test_the_images_reach_the_model(endpoint: str, checkpoint: Path, sft_out: Path) -> None:
    request = request_from_row(first_train_row(sft_out))
    with OpenAIBackend(endpoint, str(checkpoint), dialect="openai", max_tokens=8, retries=0) as backend:
        report = backend.probe(request)
        results = backend.generate([request])
    low, high = report.prompt_tokens
    assert report.frame_counts == (2, 4) and report.usage_reported
    assert high - low == 2 * TOKENS_PER_FRAME  # two more 64² frames: exactly their image tokens
    assert results[0].ok and isinstance(results[0].text, str), results


def test_the_vllm_dialect_is_refused_in_one_line(endpoint: str, checkpoint: Path, sft_out: Path) -> None:
    request = request_from_row(first_train_row(sft_out))
    with OpenAIBackend(endpoint, str(checkpoint), retries=0) as backend, pytest.raises(EndpointProbeError) as caught:
        backend.probe(request)
    # transformers serve decodes a video_url as a video file and fails (HTTP 500); the fix never says "--dialect openai"
    assert str(caught.value) == (
        f"probe of {endpoint}/chat/completions (model '{checkpoint}', dialect vllm) failed: HTTP 500: "
        "Internal Server Error"
    )
    assert caught.value.fix == (
        "this server does not take the frames as one video (its log says why), the input our checkpoints were "
        "trained on: serve the checkpoint with vLLM, make vllm-serve CKPT=DIR (python -m inference.vllm_server DIR; "
        "docs/serving.md) (--dialect openai would send N images, a different input)"
    )


def _mine(sft_out: Path, out: Path, endpoint: str, model: str) -> list[str]:
    return [
        "build-rl-hardset",
        str(sft_out / "sft"),
        str(out),
        "--endpoint",
        endpoint,
        "--endpoint-model",
        model,
        "--dialect",
        "openai",
        "--limit",
        "2",
        "--max-new-tokens",
        "12",
        "--bootstrap",
        "10",
    ]


@pytest.fixture(scope="module")
def mined(endpoint: str, checkpoint: Path, sft_out: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT of `emrl build-rl-hardset --dialect openai` against the server (two rows of each split)."""
    out = tmp_path_factory.mktemp("served")
    main(_mine(sft_out, out, endpoint, str(checkpoint)))
    return out


def test_emrl_mining_against_transformers_serve(mined: Path, endpoint: str, checkpoint: Path, sft_out: Path) -> None:
    rows = pq.read_table(mined / "predictions" / "data").to_pylist()
    sft_rows = pq.read_table(sft_out / "sft" / "data", columns=["split"]).to_pylist()
    expected = sum(min(2, sum(r["split"] == split for r in sft_rows)) for split in ("train", "test"))
    assert len(rows) == expected >= 3  # --limit 2: at most two rows of each split
    for row in rows:  # every row has a prediction: parsed, or a recorded parse failure; no inference error
        assert row["inference_error"] is None and isinstance(row["prediction"], str), row
        assert row["score_existence"] in (0.0, 1.0) and row["model"] == f"{endpoint}#{checkpoint}"
    summary = json.loads((mined / "rl_hardset" / "summary.json").read_text())
    assert summary["predictions"] == expected and summary["failed_predictions"] == 0


def test_emrl_eval_puts_the_served_model_beside_ours(
    mined: Path, endpoint: str, sft_out: Path, tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "Our model": the same tiny weights (seed 0), run locally on the test split (frames as one video).
    ours = tmp_path / "ours"
    main(
        [
            "build-rl-hardset",
            str(sft_out / "sft"),
            str(ours),
            "--model",
            str(tiny_dir),
            "--device",
            "cpu",
            "--split",
            "test",
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--bootstrap",
            "10",
        ]
    )
    assert {r["split"] for r in pq.read_table(ours / "predictions" / "data").to_pylist()} == {"test"}
    capsys.readouterr()

    eval_dir = tmp_path / "eval"
    main(
        [
            "eval",
            str(ours / "predictions"),
            str(mined / "predictions"),
            "--split",
            "test",
            "--out",
            str(eval_dir),
            "--bootstrap",
            "10",
        ]
    )
    printed = capsys.readouterr().out
    served_name = pq.read_table(mined / "predictions" / "data", columns=["model"]).to_pylist()[0]["model"]
    for index, name in enumerate((str(tiny_dir), served_name), start=1):
        assert f"# Model: {name}" in printed
        assert (eval_dir / f"model-{index}" / "metrics.md").read_text().startswith(f"# Model: {name}\n\n### Table 1")
        assert json.loads((eval_dir / f"model-{index}" / "metrics.json").read_text())["model"] == name
    side_by_side = printed[printed.index("## Models side by side") :].splitlines()
    assert side_by_side[2] == "| model | folder | rows | average B-Acc | Table 2 overall |"
    assert [line.split(" | ")[:2] for line in side_by_side[4:6]] == [
        [f"| {tiny_dir}", "model-1"],
        [f"| {served_name}", "model-2"],
    ]


def test_emrl_mining_with_a_wrong_model_name_stops_in_one_line(
    endpoint: str, checkpoint: Path, sft_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(_mine(sft_out, tmp_path, endpoint, "tiny"))
    out, err = capsys.readouterr()
    assert exited.value.code == 1 and "Traceback" not in out + err
    assert err.splitlines()[-2:] == [
        f"emrl build-rl-hardset: failed: probe of {endpoint}/chat/completions (model 'tiny', dialect openai) failed: "
        f"HTTP 400: Server is pinned to '{checkpoint}'; requested 'tiny'.",
        "  fix: pass the name the server serves as --endpoint-model (transformers serve: the path it was given)",
    ]
    assert not list((tmp_path / ".work").glob("predictions-*.jsonl")) or all(
        p.read_text() == "" for p in (tmp_path / ".work").glob("predictions-*.jsonl")
    )  # no row was sent
