"""AbdomenAtlas 3.0: one mask file per structure, in the released split layout or RadGPT's combined one.

Discovery is `emrl_data.reading.atlas_cases.discover_cases` (the rules: docs/contract.md#input); this layout is the
one a folder falls back to when no other layout recognises it, so its messages are the ones a wrong folder gets.
"""

from __future__ import annotations

from pathlib import Path

from emrl_data.organs import Organ
from emrl_data.reading.atlas_cases import discover_cases
from emrl_data.reading.layouts import Layout


def _detect(root: Path) -> bool:
    return True  # the fallback: anything no other layout claims is read (and refused) as AbdomenAtlas


LAYOUT = Layout(
    name="abdomenatlas",
    title="AbdomenAtlas 3.0 (image_only/ + mask_only/, or BDMAP_* folders)",
    organs=tuple(str(o) for o in Organ),
    labels="one 0/1 mask file per structure (segmentations/<structure>.nii.gz), the 3.0 class map",
    licence="CC-BY-NC-SA-4.0",
    terms="the AbdomenAtlas 3.0 Mini Hub cards",
    citation="Bassi et al., RadGPT: constructing 3D image-text tumor datasets, arXiv 2501.04678",
    command="emrl build-sft-set AbdomenAtlas3.0Mini/ out/",
    detect=_detect,
    discover=discover_cases,
)
