"""The atlas' metadata CSV: weak labels kept beside ours as `atlas_*` columns, read by column name."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from emrl_data.organs import LOCATION_NAMES, METADATA_COLUMNS
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas_cases import AtlasError, os_reason
from emrl_data.reading.atlas_csv import plan_file, read_csv_table
from emrl_data.types import Organ, is_valid_case_id


logger = logging.getLogger(__name__)


METADATA_FILE = "AbdomenAtlas3.0MiniWithMeta.csv"


@dataclass(frozen=True, slots=True)
class AtlasOrganMeta:
    """The metadata CSV's weak labels for one organ of one case (None = column absent or empty)."""

    lesion_count: int | None
    long_axis_cm: float | None
    location: tuple[str, ...] | None
    attenuation: str | None
    organ_volume_cm3: float | None


def read_metadata(path: Path) -> tuple[dict[str, dict[Organ, AtlasOrganMeta]], dict[str, str]]:
    """Parse the metadata CSV by column NAME (never by position); tolerate missing columns (see `read_csv_table`).

    A row is a problem (and left out) when it cannot be decoded, has another number of cells than the header,
    holds a value that is not a finite number where one is expected (`inf`, `abc`; an empty cell or `nan` is
    "absent", as pandas writes it), or when its id has another row with different values (never "last wins";
    identical duplicates are one row).

    Returns:
        (metadata per case id, problems per case id): the problem names the file, the line, the column and the value.

    Raises:
        ValueError: the file has no `BDMAP ID` column.
        OSError: the file cannot be read.
    """
    table = read_csv_table(path)
    if "BDMAP ID" not in table.header:
        raise ValueError(
            f"{path.name}: no 'BDMAP ID' column (delimiter tried: , ; tab); found {list(table.header)[:8]}."
        )
    if table.encoding_note:
        logger.warning("%s", table.encoding_note)
    col = table.header.index("BDMAP ID")
    rows: dict[str, dict[Organ, AtlasOrganMeta]] = {}
    first_line: dict[str, int] = {}
    problems: dict[str, str] = {}
    for line_no, problem, cells in table.bad_lines:
        key = cells[col] if len(cells) > col and is_valid_case_id(cells[col]) else f"line {line_no}"
        problems[key] = f"{path.name} line {line_no}: {problem}"
    for line_no, cells in table.records:
        case_id = cells[col] if len(cells) > col else ""
        key = case_id or f"line {line_no}"
        if key in problems:
            continue
        try:
            if len(cells) != len(table.header):
                raise ValueError(f"{len(cells)} cells where the header has {len(table.header)}")
            record = dict(zip(table.header, cells, strict=True))
            meta = {organ: _organ_meta(organ, record) for organ in Organ}
        except ValueError as err:
            problems[key] = f"{path.name} line {line_no}: {err}"
            rows.pop(key, None)
            continue
        if key in rows and rows[key] != meta:
            problems[key] = (
                f"{path.name} lines {first_line[key]} and {line_no}: two rows for {case_id} with different values "
                "(neither is used)"
            )
            del rows[key]
            continue
        rows[key] = meta
        first_line.setdefault(key, line_no)
    return rows, problems


def _organ_meta(organ: Organ, record: dict[str, str]) -> AtlasOrganMeta:
    cols = METADATA_COLUMNS[organ]

    def cell(key: str) -> str | None:
        value = record.get(cols[key])
        value = value.strip() if isinstance(value, str) else None
        return value if value and value.lower() != "nan" else None

    def number(key: str) -> float | None:
        value = cell(key)
        if value is None:
            return None
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"column {cols[key]!r} holds {value!r}, not a number") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"column {cols[key]!r} holds {value!r}, not a finite non-negative number")
        return number

    count = number("count")
    if count is not None and (count < 0 or count != int(count)):
        raise ValueError(f"column {cols['count']!r} holds {count!r}, not a lesion count")
    location = cell("location")
    attenuation = cell("attenuation")
    attenuation_code = None
    if attenuation is not None:
        attenuation_code = {"hypoattenuating": "hypo", "isoattenuating": "iso", "hyperattenuating": "hyper"}.get(
            attenuation.lower()
        )
        if attenuation_code is None:
            raise ValueError(f"column {cols['attenuation']!r} holds {attenuation!r}")
    return AtlasOrganMeta(
        lesion_count=None if count is None else int(count),
        long_axis_cm=number("diameter_cm"),
        location=None if location is None else sort_locations(organ, (p.strip() for p in location.split(","))),
        attenuation=attenuation_code,
        organ_volume_cm3=number("organ_volume_cm3"),
    )


def sort_locations(organ: Organ, names: Iterable[str]) -> tuple[str, ...]:
    """Return location names de-duplicated and in vocabulary order (`LOCATION_NAMES`); unknown names raise."""
    vocab = LOCATION_NAMES[organ]
    chosen = {n for n in names if n}
    unknown = chosen - set(vocab)
    if unknown:
        raise ValueError(f"unknown {organ} location(s) {sorted(unknown)}; valid: {list(vocab)}")
    return tuple(n for n in vocab if n in chosen)


def plan_metadata(
    root: Path, wanted: set[str], warnings: list[str]
) -> tuple[dict[str, dict[Organ, AtlasOrganMeta]], list[Rejection]]:
    """Read the metadata CSV when present: (rows of the wanted cases, bad_metadata_row rejections).

    A CSV that cannot be used at all (unreadable, no `BDMAP ID` column) is a run warning, not a failure: it holds
    weak labels only, so the run goes on without `atlas_*` values and says so in the summary and `qa.md`.
    """
    path = root / METADATA_FILE
    try:
        if not plan_file(path):
            return {}, []
        metadata, problems = read_metadata(path)
    except (AtlasError, ValueError, OSError) as err:
        reason = os_reason(err) if isinstance(err, OSError) else str(err).rstrip(".")
        warnings.append(f"{METADATA_FILE} not used: {reason}; no atlas_* values in this run")
        logger.warning("%s", warnings[-1])
        return {}, []
    rejections = [
        Rejection(case_id, None, "metadata", RejectReason.BAD_METADATA_ROW, problem, METADATA_FILE)
        for case_id, problem in sorted(problems.items())
        if case_id in wanted or not is_valid_case_id(case_id)  # a row of another case is not this run's business
    ]
    return {k: v for k, v in metadata.items() if k in wanted}, rejections
