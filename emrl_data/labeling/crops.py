"""The masks of one case as `label_organ` reads them: the mask source, a per-call mask cache, tight boxes and crops.

A mask is reduced to its tight box (`mask_box`, `any()` projections on any strides, no copy) and kept as the bool crop
inside it (`Boxed`); crops are copied into one shared memory layout (`copy_like`, `as_bool`) so `ravel('K')` gathers
of one by another line up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from emrl_data.types import Box3


class MaskSource(Protocol):
    """The CT and structure masks of one case, in canonical RAS voxel order `(x, y, z)` on the CT grid.

    The two attributes are declared as read-only properties so that plain attributes, frozen dataclasses and
    properties all satisfy the protocol.
    """

    @property
    def ct_hu(self) -> np.ndarray:
        """The CT in HU.

        Shape `(X, Y, Z)`, int16, canonical RAS (z grows inferior -> superior); may be a non-contiguous view
        (Fortran order, flipped axes).
        """
        ...

    @property
    def spacing_mm(self) -> tuple[float, float, float]:
        """Voxel size along `(x, y, z)` in mm."""
        ...

    def mask(self, structure: str) -> np.ndarray | None:
        """Return the mask of `structure`.

        Args:
            structure: file stem as released, e.g. `"liver"`, `"liver_lesion"`, `"liver_segment_5"`.

        Returns:
            Bool array of shape `(X, Y, Z)` on the CT grid (canonical RAS; may be a non-contiguous view), or None
            when the file is absent.
        """
        ...


class MaskGetter(Protocol):
    """Returns a full `(X, Y, Z)` mask by structure name, or None when the file is absent.

    With `keep=False` a mask not fetched before is not kept for later calls, so the caller can drop it.
    """

    def __call__(self, structure: str, *, keep: bool = True) -> np.ndarray | None: ...


class MaskCache:
    """A `MaskGetter` over a `MaskSource`: each file is read once per `label_organ` call, checked against the CT grid.

    A source may re-read its file on every `mask()`; part masks fetched with `keep=False` are not kept.
    """

    def __init__(self, source: MaskSource, ct_shape: tuple[int, ...]) -> None:
        self._source = source
        self._ct_shape = ct_shape
        self._cache: dict[str, np.ndarray | None] = {}

    def __call__(self, structure: str, *, keep: bool = True) -> np.ndarray | None:
        """Return the full mask of `structure` or None when absent; ValueError when it is not on the CT grid."""
        if structure in self._cache:
            return self._cache[structure]
        arr = self._source.mask(structure)
        if arr is not None and arr.shape != self._ct_shape:
            raise ValueError(f"mask {structure!r} is not on the CT grid: {arr.shape=} != ct.shape={self._ct_shape}.")
        if keep:
            self._cache[structure] = arr
        return arr


def mask_box(mask: np.ndarray) -> Box3 | None:
    """Return the tight half-open box of the nonzero voxels of a full volume, or None when it is empty.

    Works on any strides without copying: axes stored reversed (negative strides, e.g. a flipped nibabel view)
    are read forwards and the bounds mapped back, because reductions over negative strides are ~10x slower. One
    full pass projects along the axis that is slowest in memory; a second pass covers only the box found in the
    other two axes.

    Args:
        mask: shape `(X, Y, Z)`, bool (or integer, nonzero = inside), any memory layout.

    Returns:
        `(x, y, z)` slices in the volume frame, half-open, or None.
    """
    flipped = [axis for axis in range(3) if mask.strides[axis] < 0]
    view: np.ndarray = mask[tuple(slice(None, None, -1) if axis in flipped else slice(None) for axis in range(3))]
    outer = int(np.argmax(np.abs(view.strides)))
    inner = [axis for axis in range(3) if axis != outer]
    proj = np.logical_or.reduce(view, axis=outer)  # any() over the outer axis: (inner[0], inner[1])
    first = np.flatnonzero(proj.any(axis=1))
    if first.size == 0:
        return None
    second = np.flatnonzero(proj.any(axis=0))
    bounds: list[tuple[int, int]] = [(0, 0)] * 3
    bounds[inner[0]] = (int(first[0]), int(first[-1]) + 1)
    bounds[inner[1]] = (int(second[0]), int(second[-1]) + 1)
    sub = view[tuple(slice(*bounds[axis]) if axis != outer else slice(None) for axis in range(3))]
    along = np.flatnonzero(sub.any(axis=tuple(inner)))
    bounds[outer] = (int(along[0]), int(along[-1]) + 1)
    for axis in flipped:  # [a, b) on the reversed axis is [n - b, n - a) on the original one
        n, (a, b) = mask.shape[axis], bounds[axis]
        bounds[axis] = (n - b, n - a)
    return slice(*bounds[0]), slice(*bounds[1]), slice(*bounds[2])


def union_box(boxes: list[Box3 | None]) -> Box3 | None:
    """Return the smallest box holding every given box (None entries are empty), or None when all are empty."""
    present = [b for b in boxes if b is not None]
    if not present:
        return None
    return tuple(  # type: ignore[return-value]
        slice(min(b[i].start for b in present), max(b[i].stop for b in present)) for i in range(3)
    )


def box_xyzxyz(box: Box3) -> tuple[int, int, int, int, int, int]:
    """Return a box of slices as `(x0, y0, z0, x1, y1, z1)`, half-open."""
    return box[0].start, box[1].start, box[2].start, box[0].stop, box[1].stop, box[2].stop


def copy_like(view: np.ndarray, like: np.ndarray, dtype: type | None = None) -> np.ndarray:
    """Copy `view` into a new array whose axis order in memory follows `like` (positive strides).

    Two arrays made this way from the same `like` ravel in the same order with `ravel('K')`, which makes boolean
    gathers on them fast whatever the source layout (Fortran order, flipped views).

    Args:
        view: source, shape `(x, y, z)`.
        like: layout prototype of the same shape.
        dtype: dtype of the copy (default `like.dtype`).

    Returns:
        A writable copy of `view` with the memory layout of `like`.
    """
    out = np.empty_like(like, dtype=dtype)
    out[...] = view
    return out


def as_bool(view: np.ndarray, like: np.ndarray) -> NDArray[np.bool_]:
    """Copy a mask crop as bool (nonzero = inside) in the memory layout of `like`."""
    return copy_like(view if view.dtype == np.bool_ else view != 0, like, dtype=np.bool_)


@dataclass(frozen=True, slots=True)
class Boxed:
    """A mask kept as its tight box and the bool crop inside it: every voxel outside the box is 0 by definition.

    Attributes:
        box: the mask's tight half-open box in the volume frame, None when the mask is empty.
        crop: bool copy of the mask inside `box` (the source's memory order), None when empty.
    """

    box: Box3 | None
    crop: NDArray[np.bool_] | None

    @classmethod
    def of(cls, mask: np.ndarray, box: Box3 | None) -> Boxed:
        """Keep `mask` (a full volume) inside its tight `box` only."""
        if box is None:
            return cls(None, None)
        return cls(box, as_bool(mask[box], like=mask[box]))

    def window(self, box: tuple[slice, ...]) -> NDArray[np.bool_]:
        """Return the mask inside any `box` of the volume (zeros outside the mask's own box), bool."""
        shape = tuple(s.stop - s.start for s in box)
        fortran = self.crop is not None and self.crop.flags.f_contiguous and not self.crop.flags.c_contiguous
        out = np.zeros(shape, dtype=np.bool_, order="F" if fortran else "C")
        if self.box is None or self.crop is None:
            return out
        lo = [max(a.start, b.start) for a, b in zip(box, self.box, strict=True)]
        hi = [min(a.stop, b.stop) for a, b in zip(box, self.box, strict=True)]
        if any(low >= high for low, high in zip(lo, hi, strict=True)):
            return out
        dst = tuple(slice(low - a.start, high - a.start) for low, high, a in zip(lo, hi, box, strict=True))
        src = tuple(slice(low - b.start, high - b.start) for low, high, b in zip(lo, hi, self.box, strict=True))
        out[dst] = self.crop[src]
        return out


def box_finder(source: MaskSource) -> Callable[[str, np.ndarray], Box3 | None]:
    """Return `box(structure, mask)`: the box the source's reader found (`mask_box`, optional), else `mask_box`."""
    box_of = getattr(source, "mask_box", None)

    def box(structure: str, mask: np.ndarray) -> Box3 | None:
        known = box_of(structure) if box_of is not None else None
        return mask_box(mask) if known is None else known[0]

    return box


def crop_getter(source: MaskSource, get: MaskGetter) -> Callable[[str, Box3], np.ndarray | None]:
    """Return `crop(structure, box)`: the mask of `structure` inside `box`, or None when the file is absent.

    A source with `mask_crop(structure, box)` (optional; `CaseImages`) reads the file and checks its values only inside
    the box, where they are used; otherwise the full mask comes from `get` (not kept) and is cropped.
    """
    crop_of = getattr(source, "mask_crop", None)

    def crop(structure: str, box: Box3) -> np.ndarray | None:
        if crop_of is None:
            full = get(structure, keep=False)
            return None if full is None else full[box]
        out: np.ndarray | None = crop_of(structure, box)
        want = tuple(s.stop - s.start for s in box)
        if out is not None and out.shape != want:
            raise ValueError(f"mask {structure!r} crop is not the box: {out.shape=} != {want}.")
        return out

    return crop


def union_crop(masks: list[Boxed], box: Box3, like: np.ndarray) -> NDArray[np.bool_]:
    """Return the union of the masks inside `box` as bool, in the memory layout of `like` (shape of the box)."""
    out = copy_like(masks[0].window(box), like, dtype=np.bool_)
    for m in masks[1:]:
        out |= m.window(box)
    return out


def dilate_cube(mask: NDArray[np.bool_]) -> NDArray[np.bool_]:
    """Dilate by one voxel with the 3x3x3 cube (26-neighbourhood), as three separable 1-D passes.

    Args:
        mask: bool, shape `(x, y, z)`; voxels beyond the edges count as outside.

    Returns:
        The dilated mask, same shape.
    """
    out = mask.copy()
    for axis in range(3):
        src = out.copy()
        lo = [slice(None)] * 3
        hi = [slice(None)] * 3
        lo[axis], hi[axis] = slice(None, -1), slice(1, None)
        out[tuple(hi)] |= src[tuple(lo)]
        out[tuple(lo)] |= src[tuple(hi)]
    return out
