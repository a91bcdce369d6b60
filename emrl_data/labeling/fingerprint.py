"""A fingerprint of a CT's voxels that finds the same scan in two datasets (docs/data.md#the-same-ct-in-two-datasets).

One 64-bit hash per axial slice of the canonical RAS volume, over a window the slice's own content fixes:

1. HU are clipped to +-1000 (AbdomenAtlas stores them clipped, MSD, KiTS and LiTS do not);
2. the body is the largest 26-connected component of -100 < HU < 100 (`mini_body_box`'s band: what AbdomenAtlas
   Mini crops to); a crop to the body's box keeps that component whole, so it is the same component in both copies;
3. on each axial slice the window is the in-plane box of the body's voxels on that slice; the hash is BLAKE2b (8
   bytes) of the window's shape and its clipped int16 HU. A slice whose window holds fewer than
   `MIN_WINDOW_VOXELS` has no hash (0): a corner of the body matches too easily.

The window lies inside the body's box, so a crop to that box (or any larger box) leaves every hash as it was; the HU
are those `read_nifti` gives whatever the stored dtype (int16, float32, uint16 with slope and intercept), and the
array is the canonical one whatever the stored orientation. Two copies of a scan share their slice hashes, at the
same offset, over every slice both hold.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import cc3d
import numpy as np


FINGERPRINT_VERSION = 1  # raised whenever a hash of the same voxels can change
MIN_WINDOW_VOXELS = 256  # a slice's window smaller than this (16 x 16) gets no hash
CLIP_HU = 1000
BODY_BAND_HU = (-100, 100)  # exclusive bounds, as AbdomenAtlas Mini's body crop
NO_HASH = 0


@dataclass(frozen=True, slots=True)
class CtFingerprint:
    """The slice hashes of one CT.

    Attributes:
        slice_hashes: one unsigned 64-bit hash per canonical axial slice z (index = `z_vox`), `NO_HASH` where the
            slice has too little body.
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


def ct_fingerprint(ct_hu: np.ndarray) -> CtFingerprint:
    """The fingerprint of a CT given as canonical RAS `(X, Y, Z)` HU (any integer dtype; `CaseImages.ct_hu`)."""
    depth = ct_hu.shape[2]
    band = (ct_hu > BODY_BAND_HU[0]) & (ct_hu < BODY_BAND_HU[1])
    if not band.any():
        return CtFingerprint((NO_HASH,) * depth)
    body = cc3d.largest_k(np.asfortranarray(band), k=1, connectivity=26).astype(bool, copy=False)
    del band
    on_x = np.any(body, axis=1)  # (X, Z): the body's x extent per slice
    on_y = np.any(body, axis=0)  # (Y, Z)
    del body
    hashes = []
    for z in range(depth):
        xs, ys = np.flatnonzero(on_x[:, z]), np.flatnonzero(on_y[:, z])
        if xs.size == 0 or ys.size == 0 or (xs[-1] - xs[0] + 1) * (ys[-1] - ys[0] + 1) < MIN_WINDOW_VOXELS:
            hashes.append(NO_HASH)
            continue
        window = ct_hu[xs[0] : xs[-1] + 1, ys[0] : ys[-1] + 1, z]
        hashes.append(slice_hash(np.clip(window, -CLIP_HU, CLIP_HU).astype(np.int16)))
    return CtFingerprint(tuple(hashes))


def slice_hash(window_hu: np.ndarray) -> int:
    """BLAKE2b-64 of a 2-D int16 window's shape and values (C order, little endian); never `NO_HASH`."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.asarray(window_hu.shape, dtype="<u4").tobytes())
    digest.update(np.ascontiguousarray(window_hu, dtype="<i2").tobytes())
    return int.from_bytes(digest.digest(), "little") or 1
