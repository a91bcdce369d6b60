"""Rewrite a checkpoint saved with the custom `CTQwen3VLProcessor` class to the standard Qwen3-VL form, in place.

    python -m train.tools.upgrade_checkpoint DIR [DIR ...]      # or: emrl upgrade-checkpoint DIR

Older checkpoints declare `processor_class: CTQwen3VLProcessor` and have no video processor config,
so `AutoProcessor` returns a bare tokenizer and servers see a text-only model. This sets `Qwen3VLProcessor`, writes
the image and video processor configs (`model_io.checkpoint`) and keeps the weights and the tokenizer untouched.
Idempotent. Exit status: 0 done (or already standard), 2 when a DIR is not a Qwen3-VL checkpoint (one-line error).
"""

from __future__ import annotations

import argparse
import sys

from model_io.checkpoint import NotACheckpointError, upgrade_checkpoint


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit status (0, or 2 on a directory that is not a checkpoint)."""
    parser = argparse.ArgumentParser(
        prog="python -m train.tools.upgrade_checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="checkpoint directory (rewritten in place)")
    args = parser.parse_args(argv)
    for d in args.dirs:
        try:
            changed = upgrade_checkpoint(d)
        except NotACheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{d}: " + (f"rewrote {', '.join(changed)}" if changed else "already standard"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
