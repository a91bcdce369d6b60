"""The Hub client libraries' log lines said once, in one line per retry, with no signed URL.

huggingface_hub puts a stream handler of its own on its `huggingface_hub` logger, and its records also propagate to
the root logger, where Prefect's console handler prints them again: every warning twice. It also names the URL a
request failed on, which after a redirect is a signed URL (a short-lived read credential), and says each retry in two
lines ("HTTP Error 429 thrown while requesting GET …", then "Rate limited. Waiting 2.0s before retry [Retry 1/5].").
`route_library_logs()` (called where a run first talks to the Hub; idempotent) removes the library's own handler, so
its records reach whatever handles the root logger (Prefect's inside a flow or the CLI, else Python's last resort),
and filters its records: the two lines of a retry become one ("HTTP 429 from 127.0.0.2: waiting 2 s, try 2 of 6"),
and every URL left in a line loses its query string.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import urlparse


LIBRARY_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.file_download", "huggingface_hub.utils._xet")
_URL_QUERY = re.compile(r"(https?://[^\s?#'\"<>]+)[?#][^\s'\"<>]*")
_FAILED = re.compile(
    r"^(?:HTTP Error (?P<status>\d+)|'(?P<error>.*)') thrown while requesting (?P<method>\S+) (?P<url>\S+)$"
)
_WAIT = re.compile(
    r"^(?:Rate limited\. Waiting|Retrying in) (?P<wait>[\d.]+)s(?: before retry)? \[Retry (?P<i>\d+)/(?P<n>\d+)\]\.?$"
)
_lock = threading.Lock()


def redact(text: str) -> str:
    """`text` with every URL cut before its query string or fragment (where signatures and expiry stamps are).

    >>> redact("GET https://cdn.example/x.tar.gz?X-Amz-Signature=abc&Expires=1 failed")
    'GET https://cdn.example/x.tar.gz failed'
    """
    return _URL_QUERY.sub(lambda m: m.group(1), text)


class OneLineRetries(logging.Filter):
    """Drops the library's "… thrown while requesting …" line, remembering its cause (per thread), and rewrites the
    "Waiting … [Retry i/n]" line that follows it into one line naming the cause, the host, the wait and the try;
    removes URL query strings from every other line."""

    def __init__(self) -> None:
        super().__init__()
        self._cause = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        failed = _FAILED.match(message)
        if failed is not None:
            cause = f"HTTP {failed['status']}" if failed["status"] else redact(failed["error"])[:120]
            self._cause.value = f"{cause} from {urlparse(failed['url']).netloc}"
            return False
        waiting = _WAIT.match(message)
        if waiting is not None:
            cause = getattr(self._cause, "value", "a failed request")
            tries = int(waiting["n"]) + 1
            record.msg, record.args = (
                f"{cause}: waiting {float(waiting['wait']):g} s, try {int(waiting['i']) + 1} of {tries}",
                None,
            )
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def route_library_logs() -> None:
    """Say the Hub libraries' warnings once, each retry in one line, without signed URLs (see the module)."""
    with _lock:
        library = logging.getLogger("huggingface_hub")
        for handler in list(library.handlers):
            if type(handler) is logging.StreamHandler:  # the library's own, added at its import
                library.removeHandler(handler)
        for name in LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, OneLineRetries) for f in logger.filters):
                logger.addFilter(OneLineRetries())
