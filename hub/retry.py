"""A bounded retry of our own around the Hub calls huggingface_hub 1.33 does not retry.

The library retries 408/429/5xx with backoff (honouring `Retry-After` in seconds) on its metadata HEAD
(`get_hf_file_metadata(retry_on_errors=True)`) and on later listing pages, and 408/429 on a file GET (`http_get`).
It does not retry `dataset_info`, the first page of `list_repo_tree`, or a 5xx answering a file GET: those go
through `call_with_retry`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import httpx
from huggingface_hub.errors import HfHubHTTPError


RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
ATTEMPTS = 6  # tries in all, about 1 + 2 + 4 + 8 + 16 s of waiting when no Retry-After is given
MAX_WAIT_S = 60.0  # a longer Retry-After is cut to this
logger = logging.getLogger(__name__)
T = TypeVar("T")


def retry_after_s(err: BaseException) -> float | None:
    """The `Retry-After` seconds of an HTTP error's answer, None when it gives none (or an HTTP date)."""
    response = getattr(err, "response", None)
    value = response.headers.get("retry-after", "").strip() if response is not None else ""
    return float(value) if value.isdigit() else None


def is_busy(err: BaseException) -> bool:
    """A rate limit or a server error (408, 429, 5xx): worth trying again."""
    if isinstance(err, HfHubHTTPError):
        response = err.response
        return response is not None and response.status_code in RETRY_STATUSES
    return False


def is_transient(err: BaseException) -> bool:
    """A rate limit, a server error or a dropped connection: worth trying again."""
    return is_busy(err) or isinstance(err, (httpx.TransportError, ConnectionError))


def call_with_retry(
    fn: Callable[[], T],
    what: str,
    *,
    attempts: int = ATTEMPTS,
    retry_on: Callable[[BaseException], bool] = is_transient,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()`, tried again after a failure `retry_on` accepts (default `is_transient`): waits `Retry-After` when the
    answer gives one, else 1, 2, 4, ... s; at most `attempts` tries, then the last error is raised. Other errors are
    raised at once."""
    delay = 1.0
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:
            if not retry_on(err) or attempt == attempts:
                raise
            wait = min(retry_after_s(err) or delay, MAX_WAIT_S)
            logger.warning("%s: %s; try %d of %d in %.0f s", what, _short(err), attempt + 1, attempts, wait)
            sleep(wait)
            delay = min(2 * delay, MAX_WAIT_S)
    raise AssertionError("unreachable")


def _short(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__
