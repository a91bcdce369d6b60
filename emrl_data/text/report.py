"""Report text in the E-MRL format (docs/contract.md#report-format): deterministic templates, the prompt and the verifier prompt.

    <findings>F</findings> || <impression>I</impression> || The key lesion is in image <key_slice>k</key_slice>, <bbox>[x1, y1, x2, y2]</bbox>

The third part appears only when a lesion is present. The wording follows RadGPT's structured reports
("A hypoattenuating lesion in hepatic segment 5/8 measures 3.1 x 2.2 cm (volume 5.4 cc).") so that
the parser (`emrl_data.text.parser`) reads our own templates and real AbdomenAtlas reports alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from emrl_data.organs import OrganTable, organ_spec
from emrl_data.types import Organ


PART_SEPARATOR = " || "

# The paper's verifier prompt, verbatim (docs/contract.md#report-format).
VERIFIER_PROMPT = (
    "Describe the abnormality in this image. Should a tumor be identified, please describe its size, "
    "location and enhancement pattern."
)

# Organ wording, looked up in the registry (`emrl_data.organs.OrganSpec`): organ -> text.
ORGAN_DISPLAY: OrganTable[str] = OrganTable(lambda spec: spec.display)
ORGAN_ADJECTIVE: OrganTable[str] = OrganTable(lambda spec: spec.adjective)
NEGATIVE_FINDINGS: OrganTable[str] = OrganTable(lambda spec: spec.negative_findings)
NEGATIVE_IMPRESSION: OrganTable[str] = OrganTable(lambda spec: spec.negative_impression)
ATTENUATION_WORD = {"hypo": "hypoattenuating", "iso": "isoattenuating", "hyper": "hyperattenuating"}


def format_location(organ: Organ, location: Sequence[str]) -> str:
    """Return the location phrase: "hepatic segment 5/8", "pancreas head/body", "left kidney".

    Args:
        organ: the organ of the row.
        location: sorted location names (liver "1".."8", pancreas "head"/"body"/"tail", kidney "left"/"right").

    An empty location (no sub-structure mask covers the lesion) renders as the organ: "the liver".
    """
    spec = organ_spec(organ)
    if not location:
        return spec.whole_organ_phrase
    return spec.location_phrase.format("/".join(location))


def format_cm(length_mm: float) -> str:
    """Return a length in cm with one decimal, as reported ("3.1")."""
    return f"{round(length_mm / 10.0, 1):.1f}"


def render_findings(
    organ: Organ,
    *,
    has_lesion: bool,
    lesion_count: int = 0,
    long_axis_mm: float | None = None,
    short_axis_mm: float | None = None,
    volume_mm3: float | None = None,
    location: Sequence[str] = (),
    attenuation: str | None = None,
) -> str:
    """Return the findings sentence(s) for one organ row (about its largest lesion)."""
    if not has_lesion:
        return NEGATIVE_FINDINGS[organ]
    if long_axis_mm is None or short_axis_mm is None or volume_mm3 is None or attenuation is None:
        raise ValueError(f"A positive {organ} row needs long/short axis, volume and attenuation.")
    lesion = f"{ATTENUATION_WORD[attenuation]} lesion in {format_location(organ, location)}"
    size = f"{format_cm(long_axis_mm)} x {format_cm(short_axis_mm)} cm (volume {volume_mm3 / 1000.0:.1f} cc)."
    if lesion_count <= 1:
        return f"A {lesion} measures {size}"
    return f"Multiple ({lesion_count}) {ORGAN_ADJECTIVE[organ]} lesions. The largest, a {lesion}, measures {size}"


def render_impression(
    organ: Organ,
    *,
    has_lesion: bool,
    lesion_count: int = 0,
    long_axis_mm: float | None = None,
    location: Sequence[str] = (),
    attenuation: str | None = None,
) -> str:
    """Return the impression sentence for one organ row."""
    if not has_lesion:
        return NEGATIVE_IMPRESSION[organ]
    if long_axis_mm is None or attenuation is None:
        raise ValueError(f"A positive {organ} row needs long axis and attenuation.")
    word = ATTENUATION_WORD[attenuation].capitalize()
    where = format_location(organ, location)
    size = format_cm(long_axis_mm)
    if lesion_count <= 1:
        return f"{word} {ORGAN_ADJECTIVE[organ]} mass in {where}, measuring {size} cm."
    return f"Multiple ({lesion_count}) {ORGAN_ADJECTIVE[organ]} masses; the largest is {word.lower()}, in {where}, measuring {size} cm."


def render_evidence(key_slice_frame: int, bbox_qwen: Sequence[int]) -> str:
    """Return the third part: the key frame (1-based) and the box on Qwen's 0-1000 grid."""
    x1, y1, x2, y2 = (int(v) for v in bbox_qwen)
    return (
        f"The key lesion is in image <key_slice>{key_slice_frame}</key_slice>, <bbox>[{x1}, {y1}, {x2}, {y2}]</bbox>"
    )


def render_report(findings: str, impression: str, evidence: str | None) -> str:
    """Join the parts in the E-MRL output format."""
    parts = [f"<findings>{findings}</findings>", f"<impression>{impression}</impression>"]
    if evidence is not None:
        parts.append(evidence)
    return PART_SEPARATOR.join(parts)


def render_prompt(organ: Organ, n_frames: int) -> str:
    """Return the user prompt of an organ row: frame count, numbering rule, organ, and what to write."""
    name = ORGAN_DISPLAY[organ]
    return (
        f"These are {n_frames} axial CT images of the {name}, numbered 1 to {n_frames} from inferior to superior "
        f"(image 1 is the lowest slice). Write a report on the {name} only. In the findings, state whether there "
        f"is a tumor and, if so, its size (long x short axis in cm), location and enhancement pattern; then give "
        f"an impression. If there is a tumor, name the image where it is largest and its bounding box on that "
        f"image as [x1, y1, x2, y2] on a 0-1000 grid. Answer exactly as: <findings>...</findings> || "
        f"<impression>...</impression> || The key lesion is in image <key_slice>k</key_slice>, "
        f"<bbox>[x1, y1, x2, y2]</bbox>. Leave out the last part when there is no tumor."
    )
