"""Shared fixtures for `train/` tests: the processor and a synthetic sft table (the tiny Qwen3-VL `tiny_dir`:
tests/conftest.py; nothing downloaded)."""

from pathlib import Path

import pytest

from train.tiny.model import build_processor
from train.tiny.synthetic import write_sft_table


@pytest.fixture(scope="session")
def processor():
    return build_processor()


@pytest.fixture(scope="session")
def sft_table(tmp_path_factory) -> Path:
    return write_sft_table(tmp_path_factory.mktemp("tables") / "sft", n_train=6, n_test=2, n_frames=8, size_px=64)
