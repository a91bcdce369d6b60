"""Deterministic `.nii.gz` bytes as the release writes them, and the affines of the canonical and stored grids.

`.nii.gz` NIfTI-1 files whose uncompressed bytes equal nibabel's `Nifti1Image.to_bytes()` (header from nibabel, voxels in
Fortran order; tested). The gzip stream is produced by ISA-L (level 1) with mtime 0 and no file name, so the same
array always gives the same bytes, and a 512 x 512 x 300 case is written in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import isal.igzip
import nibabel as nib
import numpy as np


_GZIP_LEVEL = 1  # ISA-L level 1: nibabel's default level is 1 too
LPS_FLIP = np.diag([-1.0, -1.0, 1.0, 1.0])
_VOX_OFFSET = 352  # NIfTI-1 single file: 348-byte header + 4-byte empty extension flag


def canonical_affine(shape: Sequence[int], spacing_mm: Sequence[float]) -> np.ndarray:
    """RAS affine of the canonical CT grid: diagonal spacing, x/y centred on 0, z ending at 0 (like a CT table)."""
    affine = np.diag([*map(float, spacing_mm), 1.0])
    affine[0, 3] = -(shape[0] - 1) / 2.0 * spacing_mm[0]
    affine[1, 3] = -(shape[1] - 1) / 2.0 * spacing_mm[1]
    affine[2, 3] = -(shape[2] - 1) * spacing_mm[2]
    return affine


def translate(affine: np.ndarray, start_vox: Sequence[int]) -> np.ndarray:
    """Affine of a sub-grid whose voxel 0 is voxel `start_vox` of `affine`'s grid."""
    shift = np.eye(4)
    shift[:3, 3] = np.asarray(start_vox, dtype=np.float64)
    return affine @ shift


def storage_affine(affine: np.ndarray, shape: Sequence[int], storage: str) -> np.ndarray:
    """Return the affine of a grid of `shape` stored in `storage` orientation, given its canonical RAS affine."""
    if storage == "RAS":
        return affine
    flip = np.array([[-1.0, 0, 0, shape[0] - 1], [0, -1.0, 0, shape[1] - 1], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    return affine @ flip


def to_storage(array: np.ndarray, affine: np.ndarray, storage: str) -> tuple[np.ndarray, np.ndarray]:
    """Return (stored array view, stored affine) for a canonical array and its RAS affine (LPS flips x and y)."""
    stored = array[::-1, ::-1] if storage == "LPS" else array
    return stored, storage_affine(affine, array.shape, storage)


def nifti_header_block(
    data: np.ndarray, affine: np.ndarray, *, code: int | None = None, claimed_shape: Sequence[int] | None = None
) -> bytes:
    """Return the 352 bytes nibabel's `Nifti1Image(data, affine).to_bytes()` puts before the voxels.

    Args:
        data: the array to be written (any dtype nibabel supports; 2-D to 4-D).
        affine: (4, 4) float voxel -> world (mm) of the stored array.
        code: when given, both q/sform codes (nibabel's default is sform 2, qform 0).
        claimed_shape: a shape to claim in the header instead of `data.shape` (the `absurd_header` defect).
    """
    image = nib.Nifti1Image(data, affine)
    if code is not None:
        image.set_qform(affine, code=code)
        image.set_sform(affine, code=code)
    header = image.header
    if claimed_shape is not None:
        header.set_data_shape(tuple(claimed_shape))
    header.set_data_offset(_VOX_OFFSET)
    header.set_slope_inter(1.0, 0.0)  # what nibabel writes for unscaled data
    block = header.binaryblock
    return block + b"\x00" * (_VOX_OFFSET - len(block))


def write_gzip(path: Path, chunks: Sequence[bytes | memoryview]) -> None:
    """Write `chunks` as one deterministic gzip stream (ISA-L, mtime 0, no file name in the header)."""
    with (
        path.open("wb") as raw,
        isal.igzip.IGzipFile(filename="", mode="wb", compresslevel=_GZIP_LEVEL, fileobj=raw, mtime=0) as stream,
    ):
        for chunk in chunks:
            stream.write(chunk)


def write_nifti_gz(
    path: Path,
    data: np.ndarray,
    affine: np.ndarray,
    *,
    code: int | None = None,
    claimed_shape: Sequence[int] | None = None,
) -> None:
    """Write `data` as `.nii.gz`; the uncompressed bytes equal nibabel's `to_bytes()` (tested).

    Args:
        path: the file to write.
        data: the stored array (any memory order; Fortran-ordered arrays are written without a copy).
        affine: (4, 4) float voxel -> world (mm) of the stored array.
        code: optional q/sform code for both forms.
        claimed_shape: optional shape to claim in the header instead of `data.shape`.
    """
    data = np.asfortranarray(data)  # a no-op for the Fortran-ordered arrays built here
    payload = data.T.data.cast("B")  # data.T is C-contiguous: its bytes are `data` in Fortran order
    write_gzip(path, [nifti_header_block(data, affine, code=code, claimed_shape=claimed_shape), payload])
