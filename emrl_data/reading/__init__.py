"""Reading the atlas: layout on disk, safe file opening, NIfTI decoding and mask placement."""
