"""The AbdomenAtlas 3.0 layout on disk: the only module that knows file names and folder layouts (docs/contract.md#input).

Two layouts are supported:

* split (as released): `image_only/<id>/ct.nii.gz` + `mask_only/<id>/segmentations/<structure>.nii.gz`
* combined (RadGPT's): `<id>/ct.nii.gz` + `<id>/segmentations/<structure>.nii.gz`

Files may also be uncompressed `.nii`. Structure names are spelled as released (docs/contract.md#input).

Every entry that looks like a case ends as a `CaseRef` or a `Rejection`; every other entry inside a layout folder is
named in a discovery warning (docs/decisions.md#reading-the-atlas).

This module holds the plan of a run (`plan_atlas`) and re-exports the parts it is made of, one module each:
discovery of cases (`atlas_cases`), the CSV reader (`atlas_csv`), the split files (`atlas_splits`) and the metadata
CSV (`atlas_metadata`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from emrl_data.organs import LOCATION_NAMES, METADATA_COLUMNS, ORGAN_STRUCTURES, OrganSpec  # noqa: F401 - re-exported
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas_cases import (  # noqa: F401 - re-exported: the atlas' entry points import from here
    CT_FILE_STEM,
    NIFTI_SUFFIXES,
    SPLIT_LAYOUT_DIRS,
    USED_STRUCTURES,
    AtlasError,
    CaseRef,
    Discovery,
    NoCasesError,
    lesion_files,
    nifti_path,
    printable,
    probe_file,
    special_entries,
    structure_of,
    unrecognised_lesion_files,
)
from emrl_data.reading.atlas_csv import CsvTable, read_csv_table  # noqa: F401 - re-exported
from emrl_data.reading.atlas_metadata import (  # noqa: F401 - re-exported
    METADATA_FILE,
    AtlasOrganMeta,
    plan_metadata,
    read_metadata,
    sort_locations,
)
from emrl_data.reading.atlas_splits import (  # noqa: F401 - re-exported
    SPLIT_DIR,
    SPLIT_FILES,
    SplitListing,
    hash_split,
    read_split_files,
)
from emrl_data.reading.layout import discover
from emrl_data.reading.layouts import abdomenatlas
from emrl_data.sources import Source
from emrl_data.types import Organ


def discover_cases(root: Path, *, layout: str | None = None, labels: Path | None = None) -> Discovery:
    """The cases under a dataset root, by its detected layout or the one named (`emrl_data.reading.layout.discover`);
    `labels`: the label maps' folder of a layout whose labels are released apart (PANORAMA).

    An AbdomenAtlas folder (and any folder no other layout recognises) is read by
    `emrl_data.reading.atlas_cases.discover_cases`, whose rules and messages are unchanged.
    """
    return discover(root, layout, labels)


# Organ knowledge lives in the registry; these names stay as lookups into it (organ -> structures / location names /
# metadata-CSV columns).
OrganStructures = OrganSpec


@dataclass(frozen=True, slots=True)
class AtlasPlan:
    """Everything known about an atlas before its images are read."""

    layout: str
    refs: tuple[CaseRef, ...]
    splits: dict[str, str]
    split_source: str  # "IID split files" or "case-id hash"
    metadata: dict[str, dict[Organ, AtlasOrganMeta]]
    rejections: tuple[Rejection, ...]  # invalid case ids, entries that are not cases, split conflicts, metadata rows
    warnings: tuple[str, ...] = ()  # discovery and CSV notes for the run summary
    source: Source = abdomenatlas.LAYOUT.source  # the dataset, licence and citation every row names


def plan_atlas(
    root: Path,
    *,
    limit: int | None = None,
    test_fraction: float = 0.10,
    layout: str | None = None,
    labels: Path | None = None,
) -> AtlasPlan:
    """Discover the cases, assign splits (IID files, else the hash split) and read the metadata CSV if present.

    The layout is detected (`emrl_data.reading.layout`) unless `layout` names one (`labels`: the label maps' folder of
    a layout that takes one); `AtlasPlan.layout` is the layout
    found: "split" or "combined" for AbdomenAtlas, else the layout's name ("kits23"). A case missing from existing
    split files gets the hash split; a case listed in more than one split file is
    rejected (`split_conflict`, step "discover") and not curated. A metadata row that cannot be parsed becomes a
    `bad_metadata_row` rejection (step "metadata"); the case itself still runs, without `atlas_*` values.

    Raises:
        FileNotFoundError: `root` is not a folder.
        AtlasError: a layout folder, the metadata CSV or a split file cannot be read; NoCasesError: no case.
    """
    root = Path(root).resolve()
    discovery = discover_cases(root, layout=layout, labels=labels)
    refs = list(discovery.refs[:limit] if limit is not None else discovery.refs)
    listing = read_split_files(root)
    rejections = list(discovery.rejections)
    warnings = list(discovery.warnings)
    if listing is not None:
        warnings += list(listing.warnings) + [problem for _, problem in listing.problems]
        for ref in [r for r in refs if r.case_id in listing.conflicts]:
            files = listing.conflicts[ref.case_id]
            detail = f"{ref.case_id} is listed in {' and '.join(files)}: a train/test leak; the case is not used"
            rejections.append(Rejection(ref.case_id, None, "discover", RejectReason.SPLIT_CONFLICT, detail, files[0]))
        refs = [r for r in refs if r.case_id not in listing.conflicts]
    splits = {
        r.case_id: str(
            listing.splits[r.case_id]
            if listing and r.case_id in listing.splits
            else hash_split(r.case_id, test_fraction=test_fraction)
        )
        for r in refs
    }
    metadata, meta_rejections = plan_metadata(root, {r.case_id for r in refs}, warnings)
    return AtlasPlan(
        discovery.layout,
        tuple(refs),
        splits,
        "IID split files" if listing else "case-id hash",
        metadata,
        tuple(rejections + meta_rejections),
        tuple(warnings),
        discovery.source or abdomenatlas.LAYOUT.source,
    )
