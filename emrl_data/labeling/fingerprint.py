"""A fingerprint of a CT's voxels that finds the same scan in two datasets (docs/data.md#the-same-ct-in-two-datasets).

One 64-bit hash per axial slice of the canonical RAS volume, for the `HASHED_SLICES` middle slices of the scan, each
over a window that the slice's own content fixes:

1. HU are clipped to +-1000 (AbdomenAtlas stores them clipped, MSD, KiTS and LiTS do not);
2. the slice's body is its largest 8-connected region of -100 < HU < 100 (the band AbdomenAtlas Mini's body crop
   uses); the window is that region's in-plane box, and the hash is BLAKE2b (8 bytes) of the window's shape and its
   clipped int16 HU. A slice whose window holds fewer than `MIN_WINDOW_VOXELS` has no hash (`NO_HASH`): a corner of
   the body matches too easily.

A crop to the body's box (Mini's) keeps each slice's body region whole and removes only voxels outside it, so the
window and its hash are unchanged; the HU are those `read_nifti` gives whatever the stored dtype (int16, float32,
uint16 with slope and intercept), and the array is the canonical one whatever the stored orientation. Two copies of a
scan share their hashes, at one offset, over the middle slices both hold. Only the middle slices are hashed: the
region pass over all 300 slices of a 512 x 512 x 300 CT costs about as much as curating it, over 32 slices 0.16x
(bench/fingerprint.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import cc3d
import numpy as np


FINGERPRINT_VERSION = 1  # raised whenever a hash of the same voxels can change
HASHED_SLICES = 32  # the middle slices of the scan that get a hash
MIN_WINDOW_VOXELS = 256  # a slice's window smaller than this (16 x 16) gets no hash
CLIP_HU = 1000
BODY_BAND_HU = (-100, 100)  # exclusive bounds, as AbdomenAtlas Mini's body crop
NO_HASH = 0


@dataclass(frozen=True, slots=True)
class CtFingerprint:
    """The slice hashes of one CT.

    Attributes:
        slice_hashes: one unsigned 64-bit hash per canonical axial slice z (index = `z_vox`), `NO_HASH` where the
            slice is not hashed or has too little body.
        version: `FINGERPRINT_VERSION` of the code that computed it (hashes of two versions never match).
    """

    slice_hashes: tuple[int, ...]
    version: int = FINGERPRINT_VERSION

    def to_dict(self) -> dict[str, object]:
        """The JSON form kept in the case store."""
        return {"version": self.version, "slice_hashes": list(self.slice_hashes)}

    @classmethod
    def from_dict(cls, value: dict[str, object]) -> CtFingerprint:
        """The fingerprint of `to_dict`'s form."""
        hashes = value["slice_hashes"]
        assert isinstance(hashes, list)
        return cls(tuple(int(h) for h in hashes), int(value["version"]))  # type: ignore[call-overload]


def hashed_slices(depth: int) -> range:
    """The slices `ct_fingerprint` hashes in a scan of `depth` slices: the middle `HASHED_SLICES` (all when fewer)."""
    first = max(0, (depth - HASHED_SLICES) // 2)
    return range(first, min(depth, first + HASHED_SLICES))


def ct_fingerprint(ct_hu: np.ndarray) -> CtFingerprint:
    """The fingerprint of a CT given as canonical RAS `(X, Y, Z)` HU (any integer dtype; `CaseImages.ct_hu`)."""
    hashes = [NO_HASH] * ct_hu.shape[2]
    for z in hashed_slices(ct_hu.shape[2]):
        window = body_window(ct_hu[:, :, z])
        if window is not None:
            hashes[z] = slice_hash(np.clip(ct_hu[window[0], window[1], z], -CLIP_HU, CLIP_HU).astype(np.int16))
    return CtFingerprint(tuple(hashes))


def body_window(slice_hu: np.ndarray) -> tuple[slice, slice] | None:
    """The in-plane box of a slice's largest 8-connected region of `BODY_BAND_HU`, or None when it is too small."""
    band = (slice_hu > BODY_BAND_HU[0]) & (slice_hu < BODY_BAND_HU[1])
    if not band.any():
        return None
    labels = cc3d.connected_components(band, connectivity=8)
    counts = np.bincount(labels.ravel())
    counts[0] = 0  # the background
    body = labels == int(np.argmax(counts))  # ties: the lowest label
    xs, ys = np.flatnonzero(np.any(body, axis=1)), np.flatnonzero(np.any(body, axis=0))
    if (xs[-1] - xs[0] + 1) * (ys[-1] - ys[0] + 1) < MIN_WINDOW_VOXELS:
        return None
    return slice(int(xs[0]), int(xs[-1]) + 1), slice(int(ys[0]), int(ys[-1]) + 1)


def slice_hash(window_hu: np.ndarray) -> int:
    """BLAKE2b-64 of a 2-D int16 window's shape and values (C order, little endian); never `NO_HASH`."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.asarray(window_hu.shape, dtype="<u4").tobytes())
    digest.update(np.ascontiguousarray(window_hu, dtype="<i2").tobytes())
    return int.from_bytes(digest.digest(), "little") or 1
