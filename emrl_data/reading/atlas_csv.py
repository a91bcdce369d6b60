"""Robust reading of the atlas' run-level CSV files (metadata and split files assembled from many sources)."""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from emrl_data.outcome import CaseDataError
from emrl_data.reading.atlas_cases import AtlasError, probe_file
from emrl_data.reading.fileio import read_regular_bytes
from emrl_data.types import is_valid_case_id


_FIELD_LIMIT = min(sys.maxsize, 2**31 - 1)
_DELIMITERS = (",", ";", "\t")


@dataclass(frozen=True, slots=True)
class CsvTable:
    """A CSV file read robustly: its header, its records with their line numbers, and the lines it could not use.

    Attributes:
        header: the first record (stripped cells).
        records: (first physical line number, cells) per data record; blank records are left out.
        bad_lines: (line number, problem, cells) for records that could not be decoded (neither UTF-8 nor cp1252);
            the cells hold U+FFFD where the bytes were.
        encoding_note: None for clean UTF-8, else a note naming the lines decoded as cp1252.
        delimiter: the delimiter used.
    """

    header: tuple[str, ...]
    records: tuple[tuple[int, tuple[str, ...]], ...]
    bad_lines: tuple[tuple[int, str, tuple[str, ...]], ...]
    encoding_note: str | None
    delimiter: str


def read_csv_table(path: Path, *, key_column: str = "BDMAP ID") -> CsvTable:
    """Read a CSV from any of the atlas' sources: UTF-8 (BOM or not), else cp1252 per line; `,` `;` or tab.

    Each physical line is decoded as UTF-8, else as cp1252 (noted); a line neither can decode makes its record a
    `bad_lines` entry instead of a record. The delimiter is the one that splits the header into a cell equal to
    `key_column` (the most cells wins), else `,`. The csv field size limit is raised (report cells are long).

    Raises:
        OSError: the file cannot be read.
    """
    raw = read_regular_bytes(path)
    text_lines, undecodable, cp1252 = _decode_lines(raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw)
    delimiter = _sniff_delimiter(text_lines[0] if text_lines else "", key_column)
    # Process-wide and only ever raised (threads may read CSVs at once; restoring it would race).
    csv.field_size_limit(max(csv.field_size_limit(), _FIELD_LIMIT))
    reader = csv.reader(text_lines, delimiter=delimiter)
    parsed: list[tuple[int, int, tuple[str, ...]]] = []
    first = 1
    try:
        for row in reader:
            parsed.append((first, reader.line_num, tuple(c.strip() for c in row)))
            first = reader.line_num + 1
    except csv.Error as err:
        raise ValueError(f"{path.name} line {reader.line_num}: not CSV ({err})") from None
    header = parsed[0][2] if parsed else ()
    records: list[tuple[int, tuple[str, ...]]] = []
    bad: list[tuple[int, str, tuple[str, ...]]] = []
    for first, last, cells in parsed[1:]:
        lines = [n for n in range(first, last + 1) if n in undecodable]
        swallowed = _swallowed_rows(text_lines[first:last], first + 1, header, delimiter, key_column)
        if lines:
            bad.append((first, f"line {lines[0]} holds bytes that are neither UTF-8 nor cp1252 (or NUL)", cells))
        elif swallowed:
            problem = f"a quote opened on line {first} is not closed before line {swallowed[0][0]}"
            bad += [(first, problem, cells)] + [
                (n, f"{problem}: swallowed into line {first}", c) for n, c in swallowed
            ]
        elif any(cells):
            records.append((first, cells))
    note = None
    if cp1252:
        note = f"{path.name}: {len(cp1252)} line(s) not UTF-8, decoded as cp1252 (first: line {cp1252[0]})"
    return CsvTable(header, tuple(records), tuple(bad), note, delimiter)


def _decode_lines(raw: bytes) -> tuple[list[str], set[int], list[int]]:
    """Physical lines decoded as UTF-8, else cp1252: (lines, numbers of undecodable or NUL lines, cp1252 lines)."""
    text_lines: list[str] = []
    undecodable: set[int] = set()
    cp1252: list[int] = []
    for number, line in enumerate(raw.splitlines(keepends=True), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            try:
                text = line.decode("cp1252")
                cp1252.append(number)
            except UnicodeDecodeError:
                text = line.decode("utf-8", errors="replace")
                undecodable.add(number)
        if "\x00" in text:  # the csv module refuses NUL; a NUL line is garbage for us too
            text = text.replace("\x00", "\ufffd")
            undecodable.add(number)
        text_lines.append(text)
    return text_lines, undecodable, cp1252


def _swallowed_rows(
    lines: Sequence[str], first_number: int, header: Sequence[str], delimiter: str, key_column: str
) -> list[tuple[int, tuple[str, ...]]]:
    """The continuation lines of a multi-line record that parse alone as a full row with a case id: rows an
    unterminated quote swallowed (a multi-line report cell never looks like that)."""
    if key_column not in header:
        return []
    col = list(header).index(key_column)
    found = []
    for number, line in enumerate(lines, start=first_number):
        cells = tuple(c.strip() for c in next(csv.reader([line], delimiter=delimiter), []))
        if len(cells) == len(header) and is_valid_case_id(cells[col]):
            found.append((number, cells))
    return found


def _sniff_delimiter(header_line: str, key_column: str) -> str:
    best, best_cells = ",", 0
    for delimiter in _DELIMITERS:
        cells = [c.strip() for c in next(csv.reader([header_line], delimiter=delimiter), [])]
        if key_column in cells and len(cells) > best_cells:
            best, best_cells = delimiter, len(cells)
    return best


def plan_file(path: Path) -> bool:
    """True when a run-level file (metadata CSV, split file) exists; AtlasError when it exists but cannot be used."""
    try:
        return probe_file(path, path.name, "a CSV file")
    except CaseDataError as err:
        raise AtlasError(f"cannot use {err.detail} (fix or remove it: it decides splits or weak labels)") from None
