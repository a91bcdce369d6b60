"""The reader seam: every dataset layout the pipeline reads, detected from a folder or named, and its cases.

Each layout is one module of `emrl_data/reading/layouts/` declaring a `Layout` (detection, case discovery, label table,
what it annotates, licence, citation). `discover` finds the layout of a folder (the first in `LAYOUTS` whose `detect`
says yes; AbdomenAtlas last, as the fallback) or takes the one named, and returns its cases as `CaseRef`s: the rest
of the pipeline sees cases in one shape, whatever the dataset (docs/contract.md#adding-a-dataset-layout).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from emrl_data.reading.atlas_cases import Discovery
from emrl_data.reading.layouts import Layout, abdomenatlas, kits23, lits, msd, panorama


LAYOUTS: tuple[Layout, ...] = (
    msd.TASK03,
    msd.TASK07,
    kits23.LAYOUT,
    lits.LAYOUT,
    panorama.LAYOUT,
    abdomenatlas.LAYOUT,
)


def layout_named(name: str) -> Layout:
    """The layout called `name`.

    Raises:
        ValueError: no layout has that name (the message lists them).
    """
    for layout in LAYOUTS:
        if layout.name == name:
            return layout
    raise ValueError(f"no layout {name!r}; the layouts are {', '.join(x.name for x in LAYOUTS)} (`emrl layouts`)")


def detect_layout(root: Path) -> Layout:
    """The first layout of `LAYOUTS` that recognises `root` (AbdomenAtlas when none does)."""
    root = Path(root)
    return next(layout for layout in LAYOUTS if layout.detect(root))


def discover(root: Path, layout: str | None = None, labels: Path | None = None) -> Discovery:
    """The cases under `root`, in case-id order, read by the layout named (`layout`) or detected; `labels`: the
    folder of the label maps, for a layout whose labels are released apart (`Layout.discover_labels`).

    The discovery names the layout's `Source` (its dataset, licence and citation): every row of its cases carries it.

    Raises:
        FileNotFoundError: `root` or `labels` is not a folder.
        ValueError: `layout` names no layout, or `labels` is given for a layout that reads its labels in place.
        AtlasError: a layout folder or file cannot be read; NoCasesError: no case.
    """
    root = Path(root).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"Atlas root {root} is not a folder.")
    chosen = layout_named(layout) if layout is not None else detect_layout(root)
    if labels is None:
        return replace(chosen.discover(root), source=chosen.source)
    if chosen.discover_labels is None:
        apart = ", ".join(x.name for x in LAYOUTS if x.discover_labels is not None)
        raise ValueError(
            f"--labels {labels}: the {chosen.name} layout reads its labels in place (only {apart} takes a folder)"
        )
    if not Path(labels).is_dir():
        raise FileNotFoundError(f"--labels {labels} is not a folder.")
    return replace(chosen.discover_labels(root, Path(labels)), source=chosen.source)
