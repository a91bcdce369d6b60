"""Fixtures for `inference` tests: requests and a served endpoint (the tiny checkpoint `tiny_dir`: tests/conftest.py)."""

from pathlib import Path

import pytest

from inference.requests import InferenceRequest
from tests.inference.helpers import make_requests


@pytest.fixture(scope="session")
def requests3() -> list[InferenceRequest]:
    # different frame counts (8, 5 odd, 6) and prompt lengths, so a batch needs left padding
    return make_requests([8, 5, 6])


# A module that defines `served` (a real server beside a small sft set: `helpers.serve_beside_sft_set`) gets these.
@pytest.fixture(scope="module")
def endpoint(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def sft_out(served) -> Path:
    return served[1]
