"""A bounded retry around whole Hub calls, with the waits huggingface_hub 1.33 itself uses.

The library retries single requests (`http_backoff`: 408/429/5xx and dropped connections, honouring the `RateLimit`
header on a 429 and `Retry-After` in seconds) but not a whole library call: `dataset_info`, the first page of
`list_repo_tree`, a file GET answered 5xx or reset mid-body (`http_get` retries only 408/429), a Xet transfer
(hf_xet retries each request, then raises). `call_with_retry` is that outer loop. Each retry resumes where the
download stopped (`hub.download`), so retrying a whole call costs at most one range twice. The statuses are the
library's (`RETRY_STATUSES` is its default list, checked by a test), the rate-limit wait is read with its
`parse_ratelimit_headers`; docs/decisions.md#hub-downloads-the-librarys-parts-our-resume says what stays ours.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

import httpx
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import parse_ratelimit_headers


RETRY_STATUSES = (408, 429, 500, 502, 503, 504)  # huggingface_hub's `_DEFAULT_RETRY_ON_STATUS_CODES`
ATTEMPTS = 6  # tries in all, about 1 + 2 + 4 + 8 + 16 s of waiting when the answer names no wait
MAX_WAIT_S = 300.0  # a longer rate-limit reset or Retry-After is cut to this (the Hub's window is 5 minutes)
logger = logging.getLogger(__name__)
T = TypeVar("T")


def _status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    return response.status_code if isinstance(response, httpx.Response) else None


def retry_after_s(err: BaseException) -> float | None:
    """The wait an HTTP error's answer asks for: the `RateLimit` reset of a 429 with no requests left (the Hub's
    form), else `Retry-After` in seconds; None when it names none (or gives an HTTP date)."""
    response = getattr(err, "response", None)
    if not isinstance(response, httpx.Response):
        return None
    limit = parse_ratelimit_headers(response.headers)
    if response.status_code == 429 and limit is not None and limit.remaining == 0:
        return float(limit.reset_in_seconds) + 1.0  # as the library waits: the reset, plus a second for rounding
    value = response.headers.get("retry-after", "").strip()
    return float(value) if value.isdigit() else None


def is_busy(err: BaseException) -> bool:
    """A rate limit or a server error (408, 429, 5xx): worth trying again."""
    return isinstance(err, HfHubHTTPError) and _status(err) in RETRY_STATUSES


def is_transient(err: BaseException) -> bool:
    """A rate limit, a server error or a dropped or reset connection (hf_xet raises `ConnectionError` once its own
    retries are spent): worth trying again."""
    return is_busy(err) or isinstance(err, (httpx.TransportError, ConnectionError, TimeoutError))


def is_refused_by_storage(err: BaseException, hub_endpoint: str) -> bool:
    """A 401/403 from a host other than the Hub: an expired signed URL, cured by resolving the file again."""
    response = getattr(err, "response", None)
    if _status(err) not in (401, 403) or not isinstance(response, httpx.Response):
        return False
    return response.request.url.netloc.decode() != urlparse(hub_endpoint).netloc


def call_with_retry(
    fn: Callable[[], T],
    what: str,
    *,
    attempts: int = ATTEMPTS,
    retry_on: Callable[[BaseException], bool] = is_transient,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()`, tried again after a failure `retry_on` accepts (default `is_transient`): waits what the answer asks
    (`retry_after_s`), else 1, 2, 4, ... s; at most `attempts` tries, then the last error is raised. Other errors are
    raised at once. Each retry is logged once, in one line with no URL (a signed URL is a credential)."""
    delay = 1.0
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:
            if not retry_on(err) or attempt == attempts:
                raise
            wait = min(retry_after_s(err) or delay, MAX_WAIT_S)
            logger.warning("%s: %s; waiting %.0f s, try %d of %d", what, describe(err), wait, attempt + 1, attempts)
            sleep(wait)
            delay = min(2 * delay, MAX_WAIT_S)
    raise AssertionError("unreachable")


_QUERY = re.compile(r"(https?://[^\s?#]+)[?#][^\s]*")


def one_line(err: BaseException) -> str:
    """An error's first line, every URL in it cut before its query string (a signed URL is a credential)."""
    text = str(err).splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {_QUERY.sub(_before_query, text)}" if text else type(err).__name__


def _before_query(match: re.Match[str]) -> str:
    return match.group(1)


def describe(err: BaseException) -> str:
    """An error in a few words, without its URL: `HTTP 503`, `ReadError`, `ConnectionError`."""
    status = _status(err)
    return f"HTTP {status}" if status is not None else type(err).__name__
