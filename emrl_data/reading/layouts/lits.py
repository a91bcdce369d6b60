"""LiTS as released: `volume-N.nii` and `segmentation-N.nii`, uncompressed, in the folder or its batch folders.

The folder given holds the files, or batch folders of them ("Training Batch 1", "Training Batch 2"). A case
is a `volume-N.nii` (`.nii.gz` too) with the `segmentation-N.nii` beside it; its id is `volume-N`. Label table: 1 liver,
2 tumour (`released_labels.json`). A volume without a segmentation (the test set) is rejected at discovery.
"""

from __future__ import annotations

import re
from pathlib import Path

from emrl_data.reading.atlas_cases import Discovery, nifti_path
from emrl_data.reading.label_maps import released_field, released_table
from emrl_data.reading.layouts import Layout, label_map_discovery, listdir


NAME = "lits"
_VOLUME = re.compile(r"volume-([0-9]+)\.nii(?:\.gz)?")


_BATCH = re.compile(r".*batch.*", re.IGNORECASE)


def _folders(root: Path) -> list[Path]:
    """`root` and its batch folders ("Training Batch 1") that hold a volume file (no other folder is listed)."""
    candidates = [root, *(root / n for n in listdir(root) if _BATCH.fullmatch(n) and (root / n).is_dir())]
    return [f for f in candidates if any(_VOLUME.fullmatch(n) for n in listdir(f))]


def _detect(root: Path) -> bool:
    return bool(_folders(root))


def _discover(root: Path) -> Discovery:
    root = Path(root).resolve()
    cases, warnings = [], []
    seen: dict[str, Path] = {}
    for folder in _folders(root):
        for name in listdir(folder):
            match = _VOLUME.fullmatch(name)
            if match is None or name.startswith("."):
                continue
            case_id = f"volume-{match.group(1)}"
            if case_id in seen:
                warnings.append(f"{folder.relative_to(root) / name}: {case_id} is also in {seen[case_id]}, ignored")
                continue
            seen[case_id] = folder.relative_to(root)
            cases.append((case_id, folder / name, nifti_path(folder / f"segmentation-{match.group(1)}")))
    return label_map_discovery(root, NAME, cases, released_table(NAME), warnings)


_TABLE = released_table(NAME)
LAYOUT = Layout(
    name=NAME,
    title=released_field(NAME, "title"),
    organs=tuple(str(o) for o in _TABLE.organs),
    labels=f"segmentation-N.nii: {_TABLE.describe()}",
    licence="LicenseRef-LiTS",
    terms="the LiTS challenge's terms of use (no SPDX licence: never published for commercial use)",
    citation="Bilic et al., The LiTS benchmark, Medical Image Analysis 84, 102680 (2023)",
    command=f"emrl build-sft-set {released_field(NAME, 'folder')} out/",
    detect=_detect,
    discover=_discover,
)
