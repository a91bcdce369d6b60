"""Helpers of the flow tests: reading back the tables a run wrote."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq


def rejection_rows(out: Path, *columns: str) -> list[tuple]:
    """The `columns` of every row of the `rejections` table under `out`, in table order."""
    rows = pq.read_table(next((out / "rejections/data").glob("*.parquet"))).to_pylist()
    return [tuple(r[c] for c in columns) for r in rows]
