"""The supported vLLM range and its one version parser, as the launcher, the endpoint probe and the GRPO rollout
engine all read a version (`model_io.vllm_support`)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from inference.probe import EndpointProbeError, _check_vllm_version
from model_io.vllm_support import VLLMServeError, check_version, is_supported_vllm, served_template, vllm_release


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.32.0", (0, 32)),
        ("0.32", (0, 32)),
        ("0.32rc1", (0, 32)),
        ("0.32.0rc1", (0, 32)),
        ("0.32.0.dev3+cpu", (0, 32)),
        ("0.32.1+cpu", (0, 32)),
        ("0.32.0.post1", (0, 32)),
        ("0.32.0+g1a2b3c.d20261206", (0, 32)),
        ("0.11.1rc2.dev161+g8e0fb2a.cpu", (0, 11)),
        (" 0.33.0\n", (0, 33)),
        ("v0.32.0", (0, 32)),
        ("1.0.0", (1, 0)),
        ("0.31.2", (0, 31)),
        ("transformers 5.17.0", None),
        ("dev", None),
        ("", None),
        ("0", None),
        ("0.x", None),
        ("0.32.0 (cpu)", None),
        ("0.32.0cpu", None),
    ],
)
def test_vllm_release_reads_the_release_series(version: str, release: tuple[int, int] | None) -> None:
    assert vllm_release(version) == release


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.32rc1", True),
        ("0.32.0.dev3+cpu", True),
        ("0.32.1+cpu", True),
        ("0.31.2", False),
        ("0.33.0", False),
        ("0.33rc1", False),
        ("1.0.0", False),
        ("not vLLM", False),
    ],
)
def test_the_supported_range_is_the_0_32_series(version: str, supported: bool) -> None:
    assert is_supported_vllm(version) is supported


def test_check_version_refuses_versions_outside_the_range_and_strings_that_are_no_version() -> None:
    check_version("0.32.0")
    check_version("0.32.1+cpu")
    check_version("0.32rc1")
    for version in ("0.31.2", "0.33.0", "1.0.0", "dev", "0.32.0 (cpu)"):
        with pytest.raises(VLLMServeError, match=re.escape(f"vLLM {version} is outside the supported range")):
            check_version(version)


class _VersionEndpoint:
    """What `inference.probe._check_vllm_version` reads of a backend: `GET /version` and its JSON."""

    url, model, dialect = "http://127.0.0.1:1/v1/chat/completions", "m", "vllm"

    def __init__(self, version: object) -> None:
        self.version = version

    def get(self, path: str) -> SimpleNamespace:
        assert path == "/version"
        return SimpleNamespace(status=200)

    def answer_json(self, answer: object) -> tuple[dict, None]:
        return {"version": self.version}, None

    def safe_text(self, text: str) -> str:
        return text


@pytest.mark.parametrize(
    ("version", "is_vllm"),
    [("0.32.0", True), ("0.32rc1", True), ("0.32.0.dev3+cpu", True), ("transformers 5.17.0", False), (7, False)],
)
def test_the_probe_reads_a_server_version_with_the_same_parser(version: object, is_vllm: bool) -> None:
    assert _check_vllm_version(_VersionEndpoint(version)) is is_vllm


def test_the_probe_refuses_a_vllm_outside_the_range() -> None:
    with pytest.raises(
        EndpointProbeError, match=re.escape("the server runs vLLM 0.33rc1, outside the supported range")
    ):
        _check_vllm_version(_VersionEndpoint("0.33rc1"))


def test_the_served_template_renders_a_video_as_the_video_token_alone() -> None:
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe.<|im_end|>"
    assert served_template(text) == "<|im_start|>user\n<|video_pad|>Describe.<|im_end|>"
