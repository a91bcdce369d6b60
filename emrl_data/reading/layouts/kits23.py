"""KiTS23 as its download script leaves it: `dataset/case_XXXXX/{imaging.nii.gz, segmentation.nii.gz}`.

The folder given is `dataset/` or the repository root above it. A case is a `case_` + 5 digits folder; its id is that
name. One label-map file per case with one label for both kidneys (1), tumour (2) and cyst (3) (`released_labels.json`):
the two kidney mask files are cut from label 1 (with its tumours and cysts) by patient-frame position
(`emrl_data.reading.label_maps`), the tumour and the cyst are separate files whose union is the row's lesion, so a
cyst is never called a tumour. `kits23.json` (clinical data) is not read.
"""

from __future__ import annotations

import re
from pathlib import Path

from emrl_data.reading.atlas_cases import Discovery, nifti_path
from emrl_data.reading.label_maps import released_field, released_table
from emrl_data.reading.layouts import Layout, hidden_warning, label_map_discovery, listdir


NAME = "kits23"
_CASE = re.compile(r"case_[0-9]{5}")
_KNOWN = {"kits23.json"}


def _cases_dir(root: Path) -> Path | None:
    """`root` or its `dataset/` when it holds a case folder, else None."""
    for folder in (root, root / "dataset"):
        if any(_CASE.fullmatch(n) and (folder / n).is_dir() for n in listdir(folder)):
            return folder
    return None


def _detect(root: Path) -> bool:
    return _cases_dir(root) is not None


def _discover(root: Path) -> Discovery:
    root = Path(root).resolve()
    folder = _cases_dir(root) or root
    names = listdir(folder)
    hidden = [n for n in names if n.startswith(".")]
    prefix = f"{folder.relative_to(root)}/" if folder != root else ""
    warnings = hidden_warning(prefix or "./", hidden)
    cases = []
    for name in names:
        if name in hidden or name in _KNOWN:
            continue
        if not (_CASE.fullmatch(name) and (folder / name).is_dir()):
            warnings.append(f"{prefix}{name}: not a case_XXXXX folder, ignored")
            continue
        case = folder / name
        cases.append((name, nifti_path(case / "imaging"), nifti_path(case / "segmentation")))
    return label_map_discovery(root, NAME, cases, released_table(NAME), warnings)


_TABLE = released_table(NAME)
LAYOUT = Layout(
    name=NAME,
    title=released_field(NAME, "title"),
    organs=tuple(str(o) for o in _TABLE.organs),
    labels=f"case_XXXXX/segmentation.nii.gz: {_TABLE.describe()}; sides cut by patient-frame position",
    licence="CC-BY-NC-SA-4.0",
    terms="the data (neheller/kits23 README); its code is MIT",
    citation="Heller et al., The KiTS21/KiTS23 challenge, arXiv 2307.01984 (2023)",
    command=f"emrl build-sft-set {released_field(NAME, 'folder')} out/",
    detect=_detect,
    discover=_discover,
)
