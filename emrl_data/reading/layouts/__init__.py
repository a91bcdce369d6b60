"""One module per dataset layout; this package holds what each declares (`Layout`) and the discovery that every
label-map layout shares.

A layout module (one per dataset, in this package) builds one `Layout`: its name, how to detect it from a folder, how
to find its cases (a `Discovery` of `CaseRef`s: the CT and the mask folder or label map of each), what it annotates
(its organs and its label table in words), its licence (an SPDX id) and citation, and a one-line command. `emrl_data.reading.layout`
holds the list of layouts and dispatches between them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas_cases import CaseRef, Discovery, NoCasesError, printable
from emrl_data.reading.label_maps import LabelMap, LabelTable
from emrl_data.sources import Source


# A case id outside AbdomenAtlas is the dataset's own case name: letters, digits, `_`, `-` (also a path component).
CASE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


@dataclass(frozen=True, slots=True)
class Layout:
    """One dataset layout as released.

    Attributes:
        name: what `--layout` and `emrl layouts` call it ("kits23").
        title: the dataset ("KiTS23 (kidney tumours)").
        organs: the registered organs it annotates; every other organ is unknown for its cases (no row).
        labels: its label table in words ("1 kidney, 2 tumor, 3 cyst"), or how its masks are stored.
        licence: the SPDX id of the data's licence as its own release states it (`LicenseRef-...` for a challenge's
            own terms; `emrl_data.sources`).
        terms: where the licence is stated, and what else it covers, in words.
        citation: what to cite.
        command: one line that builds the SFT set from it.
        detect: whether a folder holds this layout (cheap: names and small files only).
        discover: the cases of a folder of this layout, in case-id order.
        discover_labels: for a dataset whose labels are released apart from its images (PANORAMA): the cases of an
            image folder with the labels of another folder (`--labels DIR`); None where labels sit in the folder.
    """

    name: str
    title: str
    organs: tuple[str, ...]
    labels: str
    licence: str
    terms: str
    citation: str
    command: str
    detect: Callable[[Path], bool]
    discover: Callable[[Path], Discovery]
    discover_labels: Callable[[Path, Path], Discovery] | None = None

    @property
    def source(self) -> Source:
        """What the rows of this layout's cases name as their source."""
        return Source(self.name, self.licence, self.citation)


def hidden_warning(prefix: str, hidden: Sequence[str]) -> list[str]:
    """One warning for hidden entries (`._liver_0.nii.gz` AppleDouble files, `.DS_Store`), or none."""
    if not hidden:
        return []
    return [f"{prefix}: {len(hidden)} hidden entr{'y' if len(hidden) == 1 else 'ies'} ignored ({hidden[0]}, ...)"]


def listdir(folder: Path) -> list[str]:
    """The sorted entries of `folder`; [] when it does not exist."""
    try:
        return sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


def label_map_discovery(
    root: Path,
    layout: str,
    cases: Sequence[tuple[str, Path, Path]],
    table: LabelTable,
    warnings: list[str],
) -> Discovery:
    """Refs of label-map cases `(case id, CT, label map)`; a case whose label map is absent is rejected.

    Raises:
        NoCasesError: no case has both files' places (the message names the layout and what was expected).
    """
    refs, rejections = [], []
    organs = tuple(str(o) for o in table.organs)
    for case_id, ct_path, label_path in sorted(cases):
        ref = CaseRef(case_id, root, ct_path, label_path.parent, LabelMap(label_path, table), organs)
        if not os.path.lexists(label_path):
            rel = printable(ref.relative(label_path))
            detail = f"{rel}: no label map for the CT {printable(ref.relative(ct_path))}: the case is not used"
            rejections.append(Rejection(case_id, None, "discover", RejectReason.MISSING_ORGAN_MASK, detail, rel))
            continue
        refs.append(ref)
    if not refs:
        raise NoCasesError(f"no {layout} case under {root}" + (f" ({rejections[0].detail})" if rejections else ""))
    return Discovery(layout, tuple(refs), tuple(rejections), tuple(printable(w) for w in warnings))
