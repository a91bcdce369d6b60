"""The architecture holds: import contracts and committed schemas."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from emrl_data.tables.records import SCHEMAS, schema_to_json


ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_committed_schemas_are_up_to_date() -> None:
    for name in SCHEMAS:
        committed = json.loads((ROOT / "schemas" / f"{name}.schema.json").read_text())
        assert committed == schema_to_json(name), (
            f"schemas/{name}.schema.json is stale: run `python -m emrl_data.tables.records --write-schemas schemas/`"
        )
