"""The Medical Segmentation Decathlon as released: `TaskNN_Name/{dataset.json, imagesTr/, labelsTr/, imagesTs/}`.

A case is an image of `imagesTr/` (`<name>_<n>.nii.gz`) with the label map of the same name in `labelsTr/`; its id is
that name (`liver_0`). The label table is the one `dataset.json` states ("labels"), and it must be the task's as
released (`released_labels.json`): a task whose table differs is another task, not read as this one. The tar holds
macOS AppleDouble files (`._liver_0.nii.gz`) beside the images: hidden entries, ignored and counted in one warning.
`imagesTs/` holds unlabelled CTs and is not read. Task03 (CC BY-SA 4.0) and Task07 are read by this module.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

from emrl_data.reading.atlas_cases import AtlasError, Discovery, nifti_path
from emrl_data.reading.label_maps import LabelTable, released_field, released_table
from emrl_data.reading.layouts import Layout, hidden_warning, label_map_discovery, listdir


_IMAGE = re.compile(r"([A-Za-z]+_[0-9]+)\.nii(?:\.gz)?")
_LICENCE = "CC-BY-SA-4.0"
_CITATION = "Antonelli et al., The Medical Segmentation Decathlon, Nature Communications 13, 4128 (2022)"


def _dataset_labels(root: Path) -> list[tuple[int, str]] | None:
    """The labels `dataset.json` states, `(value, name)` by value, or None when there are none or it is unreadable."""
    try:
        labels = json.loads((root / "dataset.json").read_text(encoding="utf-8"))["labels"]
        return sorted((int(k), str(v)) for k, v in labels.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _same_labels(found: list[tuple[int, str]] | None, released: LabelTable) -> bool:
    """Same values and names (the roles are ours, not `dataset.json`'s)."""
    return found == [(value, name) for value, name, _ in released.labels]


def _detect(name: str, root: Path) -> bool:
    return (root / "imagesTr").is_dir() and _same_labels(_dataset_labels(root), released_table(name))


def _discover(name: str, root: Path) -> Discovery:
    root = Path(root).resolve()
    table = released_table(name)
    if not _same_labels(_dataset_labels(root), table):
        title = released_field(name, "title")
        raise AtlasError(f"{root}/dataset.json does not state the labels of {title}: {table.describe()}")
    names = listdir(root / "imagesTr")
    hidden = [n for n in names if n.startswith(".")]
    cases, warnings = [], hidden_warning("imagesTr/", hidden)
    for entry in names:
        match = _IMAGE.fullmatch(entry)
        if entry in hidden:
            continue
        if match is None:
            warnings.append(f"imagesTr/{entry}: not a <name>_<n>.nii.gz image, ignored")
            continue
        case_id = match.group(1)
        cases.append((case_id, root / "imagesTr" / entry, nifti_path(root / "labelsTr" / case_id)))
    unlabelled = [n for n in listdir(root / "imagesTs") if not n.startswith(".")]
    if unlabelled:
        warnings.append(f"imagesTs/: {len(unlabelled)} unlabelled test CTs, not read")
    return label_map_discovery(root, name, cases, table, warnings)


def msd_layout(name: str) -> Layout:
    """The layout of one MSD task (`name`: its key in `released_labels.json`)."""
    table = released_table(name)
    return Layout(
        name=name,
        title=released_field(name, "title"),
        organs=tuple(str(o) for o in table.organs),
        labels=f"dataset.json: {table.describe()}; imagesTr/<name>_<n>.nii.gz + labelsTr/ (same name)",
        licence=_LICENCE,
        terms='dataset.json "licence" of each task (the Decathlon\'s terms)',
        citation=_CITATION,
        command=f"emrl build-sft-set {released_field(name, 'folder')} out/",
        detect=partial(_detect, name),
        discover=partial(_discover, name),
    )


TASK03 = msd_layout("msd-task03")
TASK07 = msd_layout("msd-task07")
