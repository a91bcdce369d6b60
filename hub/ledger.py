"""The part ledger: which case-store entries each curated part pair produced, so a rerun skips every part it has."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from emrl_data.atomic_write import write_json_atomic


logger = logging.getLogger(__name__)


class PartLedger:
    """Which case-store entries each curated part pair produced, keyed by everything the cases depend on.

    One JSON file per key under `root`: written only once every case of the pair is in the case store, so a rerun
    whose key is here (same part checksums, config, splits and metadata) reads no byte of the part.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry of `key`, or None (also for an entry that cannot be read: the part is then read again)."""
        path = self.root / f"{key}.json"
        try:
            entry: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            if path.exists():
                logger.warning("part ledger entry %s is unusable (%s): the part is read again", path.name, err)
            return None
        return entry

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Record an entry (atomically)."""
        write_json_atomic(entry, self.root / f"{key}.json")
