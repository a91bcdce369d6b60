"""The QA report of a curation run: where a user of 9,262 cases must look (counts, CSV agreement, worst rows).

Pure computation over the organ rows (light rows: no frames needed) and the rejections; flows write the markdown
beside their summary and publish it as an artifact.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from emrl_data.outcome import Rejection
from emrl_data.types import Organ, row_id


# Organ volume agreement with the CSV: RadGPT resamples to 1 mm before counting voxels, so a few % differ.
VOLUME_REL_TOLERANCE = 0.10
# Long axis agreement (the size rule of docs/contract.md#scoring): within max(0.5 cm, 20 %).
LONG_AXIS_ABS_CM, LONG_AXIS_REL = 0.5, 0.20
ATTRIBUTES = ("lesion_count", "long_axis", "location", "attenuation", "organ_volume")


@dataclass(frozen=True, slots=True)
class Agreement:
    """How often our value of one attribute agrees with the atlas CSV's, over the rows where both exist."""

    attribute: str
    compared: int
    agreed: int
    disagreeing: tuple[str, ...]  # "<case_id>/<organ>", in row order

    @property
    def rate(self) -> float | None:
        """agreed / compared, None when nothing was compared."""
        return self.agreed / self.compared if self.compared else None


@dataclass(frozen=True, slots=True)
class QaReport:
    """Counts of every flag and rejection reason, CSV agreement per attribute, and the most implausible rows."""

    n_rows: int
    n_cases: int
    flag_counts: dict[str, int]
    rejection_counts: dict[str, int]
    agreements: tuple[Agreement, ...]
    implausible: tuple[tuple[str, float, str], ...]  # (case_id/organ, score, why), worst first
    warnings: tuple[str, ...] = field(default=())
    duplicate_cts: tuple[tuple[str, ...], ...] = ()  # case ids sharing byte-identical CT files (a leak risk)


def _compare(row: Mapping[str, Any], attribute: str) -> bool | None:
    """True/False when our value and the CSV's can be compared for `attribute`, None when they cannot."""
    if attribute == "lesion_count":
        atlas = row.get("atlas_lesion_count")
        return None if atlas is None else atlas == row["lesion_count"]
    if attribute == "organ_volume":
        atlas = row.get("atlas_organ_volume_cm3")
        if atlas is None:
            return None
        ours = row["organ_volume_mm3"] / 1000.0
        return abs(ours - atlas) <= VOLUME_REL_TOLERANCE * max(atlas, ours)
    if not row["has_lesion"]:
        return None
    if attribute == "long_axis":
        atlas, ours = row.get("atlas_long_axis_cm"), row.get("long_axis_mm")
        if not atlas or ours is None:  # the CSV fills "no lesion" with 0
            return None
        return abs(ours / 10.0 - atlas) <= max(LONG_AXIS_ABS_CM, LONG_AXIS_REL * atlas)
    if attribute == "location":
        atlas = row.get("atlas_location")
        return None if not atlas else list(atlas) == list(row["location"])
    if attribute == "attenuation":
        atlas = row.get("atlas_attenuation")
        return None if atlas is None else atlas == row["attenuation"]
    raise ValueError(f"unknown attribute {attribute!r}; valid: {ATTRIBUTES}")


def _implausibility(row: Mapping[str, Any], plausible: Mapping[Organ, tuple[float, float]]) -> tuple[float, str]:
    """(score, why) of one row: log2 distance of the organ volume outside its plausible range (x2), +1 per
    attribute disagreeing with the CSV, +1 per other QA flag, +0.5 when the row carries warnings."""
    score, why = 0.0, []
    low, high = plausible[Organ(row["organ"])]
    volume_cm3 = row["organ_volume_mm3"] / 1000.0
    if volume_cm3 < low or volume_cm3 > high:
        score += 2.0 * abs(math.log2(max(volume_cm3, 1e-3) / (low if volume_cm3 < low else high)))
        why.append(f"organ volume {volume_cm3:.1f} cm^3 outside [{low:.0f}, {high:.0f}]")
    disagree = [a for a in ATTRIBUTES if _compare(row, a) is False]
    if disagree:
        score += len(disagree)
        why.append("disagrees with the CSV on " + ", ".join(disagree))
    others = [f for f in row.get("qa_flags") or () if not f.startswith("organ_volume")]
    if others:
        score += len(others)
        why.append(", ".join(others))
    if row.get("warnings"):
        score += 0.5
        why.append(f"{len(row['warnings'])} warning(s)")
    return score, "; ".join(why)


def build_qa_report(
    rows: Sequence[Mapping[str, Any]],
    rejections: Sequence[Rejection],
    *,
    plausible_volume_cm3: Mapping[Organ, tuple[float, float]],
    warnings: Sequence[str] = (),
    file_digests: Mapping[str, str] | None = None,
    top_n: int = 20,
) -> QaReport:
    """Compute the QA report of a run.

    Args:
        rows: every organ row (frames not needed).
        rejections: every rejection of the run.
        plausible_volume_cm3: organ -> (low, high) plausible volume (`emrl_data.organs.PLAUSIBLE_ORGAN_VOLUME_CM3`).
        warnings: run-level warnings (discovery, CSV decoding).
        file_digests: "<case_id>/<path relative to the atlas root>" -> sha256 of the file, for the files read; CT
            files (named `ct.nii*`) shared by several case ids are listed as duplicates.
        top_n: how many of the most implausible rows to list.

    Returns:
        The report; rows with a score of 0 are never listed as implausible.
    """
    flags = Counter(f for row in rows for f in row.get("qa_flags") or ())
    flags.update({"rows_with_warnings": sum(1 for row in rows if row.get("warnings"))})
    agreements = []
    for attribute in ATTRIBUTES:
        results = [(row, _compare(row, attribute)) for row in rows]
        compared = [(row, ok) for row, ok in results if ok is not None]
        agreements.append(
            Agreement(
                attribute,
                len(compared),
                sum(1 for _, ok in compared if ok),
                tuple(row_id(row["case_id"], row["organ"]) for row, ok in compared if not ok),
            )
        )
    scored = [(row_id(row["case_id"], row["organ"]), *_implausibility(row, plausible_volume_cm3)) for row in rows]
    worst = sorted((s for s in scored if s[1] > 0), key=lambda s: (-s[1], s[0]))[:top_n]
    return QaReport(
        n_rows=len(rows),
        n_cases=len({row["case_id"] for row in rows} | {r.case_id for r in rejections}),
        flag_counts=dict(sorted(flags.items())),
        rejection_counts=dict(sorted(Counter(str(r.reason) for r in rejections).items())),
        agreements=tuple(agreements),
        implausible=tuple((key, round(score, 2), why) for key, score, why in worst),
        warnings=tuple(warnings),
        duplicate_cts=_duplicate_cts(file_digests or {}),
    )


def _duplicate_cts(file_digests: Mapping[str, str]) -> tuple[tuple[str, ...], ...]:
    """Groups of case ids whose CT files are byte-identical (one source's case re-released under another id)."""
    cases_of: dict[str, set[str]] = {}
    for key, digest in file_digests.items():
        case_id, _, rel = key.partition("/")
        if rel.rsplit("/", 1)[-1].startswith("ct.nii"):
            cases_of.setdefault(digest, set()).add(case_id)
    return tuple(sorted(tuple(sorted(ids)) for ids in cases_of.values() if len(ids) > 1))


def qa_markdown(report: QaReport, *, max_ids: int = 20) -> str:
    """Render the report as markdown (`qa.md` and the Prefect artifact)."""

    def cell(ids: Sequence[str]) -> str:
        more = f" ... and {len(ids) - max_ids} more" if len(ids) > max_ids else ""
        return ", ".join(ids[:max_ids]) + more

    lines = [
        "# QA report",
        "",
        f"{report.n_rows} organ rows from {report.n_cases} cases.",
        "",
        "## Flags and rejections",
        "",
        "| kind | code | count |",
        "|---|---|---|",
    ]
    lines += [f"| flag | {k} | {v} |" for k, v in report.flag_counts.items()]
    lines += [f"| rejection | {k} | {v} |" for k, v in report.rejection_counts.items()]
    lines += ["", "## Agreement with the atlas CSV", "", "| attribute | compared | agreement | disagreeing rows |"]
    lines += ["|---|---|---|---|"]
    for a in report.agreements:
        rate = "n/a" if a.rate is None else f"{100 * a.rate:.1f} %"
        lines.append(f"| {a.attribute} | {a.compared} | {rate} | {cell(a.disagreeing) or '-'} |")
    lines += [
        "",
        f"## The {len(report.implausible)} most implausible rows",
        "",
        "| row | score | why |",
        "|---|---|---|",
    ]
    lines += [f"| {key} | {score} | {why} |" for key, score, why in report.implausible] or ["| none | 0 | |"]
    if report.duplicate_cts:
        lines += ["", "## Byte-identical CT files under different case ids", ""]
        lines += [f"- {', '.join(ids)}" for ids in report.duplicate_cts]
    if report.warnings:
        lines += ["", "## Run warnings", ""] + [f"- {w}" for w in report.warnings]
    return "\n".join(lines) + "\n"
