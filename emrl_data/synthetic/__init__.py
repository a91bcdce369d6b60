"""The embedded synthetic AbdomenAtlas: HU-realistic phantoms in the released on-disk layout, with their ground truth.

Who calls it: tests, benchmarks and demo flows that need an atlas without downloading one. Nothing in the
pipeline reads ground truth from here; the truth is a second, independent computation to check it against.

A case goes through the modules in this order (each module's docstring has the details):

* `specs`: what a case is (`CaseSpec`, `LesionSpec`), the real-data traps it can carry (`QUIRKS`) and the defects
  a reader must reject (`DEFECTS`).
* `geometry`: the canonical RAS grid in body units, boxed masks, and each organ's ellipsoids and sub-structures,
  drawn from its registry entry (`emrl_data.organs.OrganSpec.anatomy`): an organ is added in the registry only.
* `phantom`: body, organs and lesions painted in HU with seeded noise, and the masks with the lesions united in.
* `truth`: the ground truth, computed from the phantom's arrays independently of `emrl_data.labeling.labels`, and
  the truth records (`CaseTruth`, `AtlasTruth`, `synthetic_truth.json`).
* `nifti_writer`: deterministic `.nii.gz` bytes equal to nibabel's, and the canonical/stored affines.
* `atlas_writer`: the case files in the `split` or `combined` layout (quirks and defects applied), the metadata CSV,
  the IID split files and the truth file (`write_case`, `write_atlas`).
* `demo`: ready-made atlases (`demo_specs`, `bench_spec`).

The public names below are importable from `emrl_data.synthetic` itself.
"""

from emrl_data.organs import OrganAnatomy, PartRegion
from emrl_data.synthetic.atlas_writer import (
    metadata_columns,
    write_atlas,
    write_case,
)
from emrl_data.synthetic.demo import DEMO_SHAPE, bench_spec, demo_specs
from emrl_data.synthetic.specs import (
    ANISOTROPIC_SPACING_MM,
    DEFECTS,
    QUIRKS,
    CaseSpec,
    LesionSpec,
    Storage,
    header_spacing_mm,
)
from emrl_data.synthetic.truth import (
    TRUTH_FORMAT_VERSION,
    TRUTH_JSON_NAME,
    AtlasTruth,
    CaseTruth,
    ExpectedRejection,
)


__all__ = [
    "ANISOTROPIC_SPACING_MM",
    "DEFECTS",
    "DEMO_SHAPE",
    "QUIRKS",
    "TRUTH_FORMAT_VERSION",
    "TRUTH_JSON_NAME",
    "AtlasTruth",
    "CaseSpec",
    "CaseTruth",
    "ExpectedRejection",
    "LesionSpec",
    "OrganAnatomy",
    "PartRegion",
    "Storage",
    "bench_spec",
    "demo_specs",
    "header_spacing_mm",
    "metadata_columns",
    "write_atlas",
    "write_case",
]
