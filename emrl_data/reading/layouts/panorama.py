"""PANORAMA as released: CT images in Zenodo batches, labels in the `panorama_labels` repository.

The folder given holds the images (`<patient>_<study>_0000.nii.gz`, nnU-Net names) or its batch folders of them, as
the Zenodo batches unpack (one level: `batch_1/`, ...). A case's id is `<patient>_<study>`; its label map is
`manual_labels/<patient>_<study>.nii.gz` of the DIAGNijmegen/panorama_labels repository: beside the images
(`panorama_labels/manual_labels/` or `manual_labels/` in the folder given) or in the folder `--labels DIR` names.
`automatic_labels/` (model outputs) is not read. The labels repository changes over time: the case key hashes each
label map's content, so a new label revision is curated again.

Label table (`released_labels.json`): 1 PDAC (the tumour), 4 pancreas parenchyma (the organ); 2 veins, 3 arteries,
5 pancreatic duct and 6 common bile duct are ignored (no structure reads them). Pancreas only: no other organ's row.
An image without a label map is rejected at discovery (`missing_organ_mask`).
"""

from __future__ import annotations

import re
from pathlib import Path

from emrl_data.reading.atlas_cases import Discovery, nifti_path
from emrl_data.reading.label_maps import BACKGROUND, IGNORED, released_field, released_table
from emrl_data.reading.layouts import Layout, label_map_discovery, listdir


NAME = "panorama"
_IMAGE = re.compile(r"([0-9]+_[0-9]+)_0000\.nii(?:\.gz)?")
LABEL_FOLDERS = ("panorama_labels/manual_labels", "manual_labels")


def _image_folders(root: Path) -> list[Path]:
    """`root` and its sub-folders (the unpacked batches) that hold a `<id>_0000.nii.gz` image."""
    candidates = [root, *(root / n for n in listdir(root) if not n.startswith(".") and (root / n).is_dir())]
    return [f for f in candidates if any(_IMAGE.fullmatch(n) for n in listdir(f))]


def _detect(root: Path) -> bool:
    return bool(_image_folders(root))


def _labels_beside(root: Path) -> Path:
    """The first of `LABEL_FOLDERS` under `root` that exists (the first when none does: its rejections name it)."""
    return next((root / f for f in LABEL_FOLDERS if (root / f).is_dir()), root / LABEL_FOLDERS[0])


def _discover(root: Path, labels: Path | None = None) -> Discovery:
    root = Path(root).resolve()
    labels = _labels_beside(root) if labels is None else Path(labels).resolve()
    cases, warnings = [], []
    seen: dict[str, Path] = {}
    for folder in _image_folders(root):
        for name in listdir(folder):
            match = _IMAGE.fullmatch(name)
            if match is None or name.startswith("."):
                continue
            case_id = match.group(1)
            if case_id in seen:
                warnings.append(f"{folder.relative_to(root) / name}: {case_id} is also in {seen[case_id]}, ignored")
                continue
            seen[case_id] = folder.relative_to(root)
            cases.append((case_id, folder / name, nifti_path(labels / case_id)))
    table = released_table(NAME)
    read = ", ".join(f"{value} {name}" for value, name, role in table.labels if role not in (IGNORED, BACKGROUND))
    warnings.append(f"labels {', '.join(table.ignored)}: not read (only {read})")
    return label_map_discovery(root, NAME, cases, table, warnings)


_TABLE = released_table(NAME)
LAYOUT = Layout(
    name=NAME,
    title=released_field(NAME, "title"),
    organs=tuple(str(o) for o in _TABLE.organs),
    labels=f"manual_labels/<id>.nii.gz (panorama_labels, or --labels DIR): {_TABLE.describe()}",
    licence="CC-BY-NC-4.0",
    terms="the PANORAMA Zenodo batches and the panorama_labels repository",
    citation=released_field(NAME, "citation"),
    command=f"emrl build-sft-set {released_field(NAME, 'folder')} out/ --labels panorama_labels/manual_labels",
    detect=_detect,
    discover=_discover,
    discover_labels=_discover,
)
