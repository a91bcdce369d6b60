"""Synthetic datasets in the label-map layouts (MSD Task03/Task07, KiTS23, LiTS, PANORAMA), written as each is
released, with their ground truth.

The phantom of a `CaseSpec` (`phantom`: every registered organ drawn, lesions included) becomes one CT and one label
map with the dataset's real label values (`emrl_data.reading.label_maps.released_table`): the organ label over the
organ minus its lesions, each lesion at its role's label (KiTS: a lesion listed in `KitCase.cysts` at the cyst label,
the others at the tumour label). Organs the dataset does not annotate stay in the CT, unlabelled (their lesions too).

Real quirks: MSD's AppleDouble `._<name>.nii.gz` files beside images and labels, its `dataset.json` and unlabelled
`imagesTs/`; KiTS's `dataset/case_XXXXX/` folders, `kits23.json` and arrays stored slice axis first (`z_first`);
LiTS's uncompressed `.nii` files in a "Training Batch 1" folder; PANORAMA's images in Zenodo batch folders
(`batch_1/<id>_0000.nii.gz`, two cases a batch) with the label maps in `panorama_labels/manual_labels/` (and an
`automatic_labels/` copy the reader must not use), each ignored label (veins, ducts) drawn as a 2-voxel cube in the
air at the volume's corner. Storage orientations: "RAS", "LPS", "oblique" (the
affine rotated 10 degrees about the patient's long axis over the canonical voxels) and "z_first".

The truth of each annotated organ is `truth.organ_truth` on the phantom; its location is () where the dataset has no
sub-structure files (a liver's segments), and the kidney's side where its two mask files are cut from one label.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from emrl_data.labeling.labels import OrganLabels
from emrl_data.organs import organ_spec
from emrl_data.reading.label_maps import IGNORED, LabelTable, lesion_structure, released_table
from emrl_data.synthetic.nifti_writer import canonical_affine, nifti_header_block, write_nifti_gz
from emrl_data.synthetic.phantom import Phantom, build_phantom
from emrl_data.synthetic.specs import CaseSpec, header_spacing_mm
from emrl_data.synthetic.truth import organ_truth
from emrl_data.types import Organ


KIT_LAYOUTS = ("msd-task03", "msd-task07", "kits23", "lits", "panorama")
KIT_STORAGES = ("RAS", "LPS", "oblique", "z_first")
OBLIQUE_DEGREES = 10.0
# The first bytes of an AppleDouble file (magic 0x00051607, version 2): what macOS's tar leaves beside each file.
APPLEDOUBLE = bytes.fromhex("0005160700020000") + b"Mac OS X        " + b"\x00" * 58


@dataclass(frozen=True, slots=True)
class KitCase:
    """One case of a kit: the phantom to draw, how its files are stored, and which lesions are cysts (KiTS).

    Attributes:
        spec: the phantom (its BDMAP id is not written: the layout names the case). Its `storage` is ignored.
        storage: one of `KIT_STORAGES`.
        cysts: indices into `spec.lesions` labelled as cysts (a layout with a cyst label); the others are tumours.
    """

    spec: CaseSpec
    storage: str = "RAS"
    cysts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.storage not in KIT_STORAGES:
            raise ValueError(f"storage={self.storage!r} must be one of {KIT_STORAGES}.")


@dataclass(frozen=True, slots=True)
class KitTruth:
    """What was written for one case and what a correct pipeline must find (one row per annotated organ).

    Attributes:
        case_id: the id the layout gives the case (`liver_0`, `case_00000`, `volume-0`).
        ct_path: the CT, relative to the kit's root (posix).
        label_path: the label map, relative to the kit's root.
        organs: organ -> its truth, for the organs the layout annotates only.
        masks: structure -> canonical bool mask on the CT grid, for every structure the layout provides.
    """

    case_id: str
    ct_path: str
    label_path: str
    organs: dict[Organ, OrganLabels]
    masks: dict[str, np.ndarray]


def stored(array: np.ndarray, affine: np.ndarray, storage: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored array, its affine) of a canonical RAS array and affine in a kit storage (`KIT_STORAGES`)."""
    if storage == "RAS":
        return array, affine
    if storage == "LPS":
        flip = np.array(
            [[-1.0, 0, 0, array.shape[0] - 1], [0, -1.0, 0, array.shape[1] - 1], [0, 0, 1, 0], [0, 0, 0, 1]]
        )
        return array[::-1, ::-1], affine @ flip
    if storage == "oblique":
        t = math.radians(OBLIQUE_DEGREES)
        rotation = np.array(
            [[math.cos(t), -math.sin(t), 0, 0], [math.sin(t), math.cos(t), 0, 0], [0, 0, 1, 0], [0] * 3 + [1]]
        )
        return array, rotation @ affine
    if storage == "z_first":
        return array.transpose(2, 1, 0), affine[:, [2, 1, 0, 3]]
    raise ValueError(f"storage={storage!r} must be one of {KIT_STORAGES}.")


def label_volume(
    phantom: Phantom, table: LabelTable, cysts: Sequence[int] = ()
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(uint8 canonical label map, structure -> canonical mask the layout provides) of a phantom under `table`."""
    labels = np.zeros(phantom.ct.shape, dtype=np.uint8, order="F")
    by_role = {role: value for value, _, role in table.labels}
    masks: dict[str, np.ndarray] = {}
    for organ in table.organs:
        spec = organ_spec(organ)
        organ_mask = np.zeros(labels.shape, dtype=bool, order="F")
        for stem in spec.organ_masks:
            m = phantom.masks[stem]
            organ_mask[m.slices()] |= m.data
            masks[stem] = np.zeros(labels.shape, dtype=bool, order="F")
            masks[stem][m.slices()] = m.data
        labels[organ_mask] = by_role["organ"]
        for index, lesion in enumerate(phantom.lesions):
            if lesion.organ is not organ:
                continue
            role = "cyst" if index in cysts else next(r for r in ("tumor", "lesion") if r in by_role)
            labels[lesion.mask.slices()][lesion.mask.data] = by_role[role]
            name = lesion_structure(organ, role)
            masks.setdefault(name, np.zeros(labels.shape, dtype=bool, order="F"))
            masks[name][lesion.mask.slices()] |= lesion.mask.data
    ignored = [value for value, _, role in table.labels if role == IGNORED]
    for i, value in enumerate(ignored):  # in the air at the corner: no structure may read them
        labels[2 * i : 2 * i + 2, :2, :2] = value
    return labels, masks


def _write_nii(path: Path, data: np.ndarray, affine: np.ndarray) -> None:
    """An uncompressed `.nii` (LiTS): nibabel's header, then the voxels in Fortran order."""
    data = np.asfortranarray(data)
    path.write_bytes(nifti_header_block(data, affine) + data.T.tobytes())


def _paths(root: Path, layout: str, organ: Organ, n: int) -> tuple[str, str, str]:
    """(case id, CT path, label path) of case `n` in `layout`, relative to the root."""
    if layout.startswith("msd-"):
        case_id = f"{organ}_{n:03d}" if layout == "msd-task07" else f"{organ}_{n}"
        return case_id, f"imagesTr/{case_id}.nii.gz", f"labelsTr/{case_id}.nii.gz"
    if layout == "kits23":
        case_id = f"case_{n:05d}"
        return case_id, f"dataset/{case_id}/imaging.nii.gz", f"dataset/{case_id}/segmentation.nii.gz"
    if layout == "lits":
        return f"volume-{n}", f"Training Batch 1/volume-{n}.nii", f"Training Batch 1/segmentation-{n}.nii"
    if layout == "panorama":
        case_id = f"{100000 + n}_{n + 1:05d}"
        return case_id, f"batch_{n // 2 + 1}/{case_id}_0000.nii.gz", f"panorama_labels/manual_labels/{case_id}.nii.gz"
    raise ValueError(f"layout={layout!r} must be one of {KIT_LAYOUTS}.")


def write_kit(root: Path, layout: str, cases: Sequence[KitCase]) -> list[KitTruth]:
    """Write `cases` under `root` in `layout` (one of `KIT_LAYOUTS`), as the dataset is released; return their truth."""
    root = Path(root)
    table = released_table(layout)
    truths = []
    for n, case in enumerate(cases):
        spec = replace(case.spec, storage="RAS", quirks=case.spec.quirks - {"lps_storage"})
        phantom = build_phantom(spec)
        labels, masks = label_volume(phantom, table, case.cysts)
        case_id, ct_rel, label_rel = _paths(root, layout, table.organs[0], n)
        affine = canonical_affine(spec.shape, spec.spacing_mm)
        for rel, array in ((ct_rel, phantom.ct), (label_rel, labels)):
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            data, data_affine = stored(array, affine, case.storage)
            (_write_nii if layout == "lits" else write_nifti_gz)(path, data, data_affine)
            if layout.startswith("msd-"):
                (path.parent / f"._{path.name}").write_bytes(APPLEDOUBLE)
        truths.append(KitTruth(case_id, ct_rel, label_rel, _organ_truths(phantom, spec, table), masks))
    _write_extras(root, layout, table, truths)
    return truths


def _organ_truths(phantom: Phantom, spec: CaseSpec, table: LabelTable) -> dict[Organ, OrganLabels]:
    """The truth of each annotated organ; no location where the layout has none of the organ's part files."""
    provided = {stem for stem in (s for o in table.organs for s in organ_spec(o).organ_masks)}
    out = {}
    for organ in table.organs:
        truth = organ_truth(organ, phantom, header_spacing_mm(spec))
        if not {stem for stem, _ in organ_spec(organ).parts} <= provided:
            truth = replace(truth, location=())
        out[organ] = truth
    return out


def _write_extras(root: Path, layout: str, table: LabelTable, truths: Sequence[KitTruth]) -> None:
    """The files beside the cases: MSD's dataset.json and an unlabelled test CT, KiTS's kits23.json."""
    if layout.startswith("msd-"):
        dataset = {
            "name": str(table.organs[0]).capitalize(),
            "licence": "CC-BY-SA 4.0",
            "tensorImageSize": "3D",
            "modality": {"0": "CT"},
            "labels": {str(value): name for value, name, _ in table.labels},
            "numTraining": len(truths),
            "numTest": 1,
            "training": [{"image": f"./{t.ct_path}", "label": f"./{t.label_path}"} for t in truths],
            "test": [f"./imagesTs/{Path(truths[0].ct_path).name}"],
        }
        (root / "dataset.json").write_text(json.dumps(dataset, indent=4))
        (root / "imagesTs").mkdir(exist_ok=True)
        (root / "imagesTs" / Path(truths[0].ct_path).name).write_bytes((root / truths[0].ct_path).read_bytes())
    elif layout == "kits23":
        clinical = [{"case_id": t.case_id} for t in truths]
        (root / "dataset" / "kits23.json").write_text(json.dumps(clinical, indent=2))
    elif layout == "panorama":
        automatic = root / "panorama_labels" / "automatic_labels"
        automatic.mkdir(parents=True, exist_ok=True)
        (automatic / Path(truths[0].label_path).name).write_bytes(b"not a label map: the reader must not open it")
        (root / "panorama_labels" / "README.md").write_text("# panorama_labels\n")
