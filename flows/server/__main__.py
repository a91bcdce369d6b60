"""`python -m flows.server up|down|status` (`make serve`): the same as `emrl server ...`.

The entry point sits beside the package, not in it: `flows.server` stays a library the CLI imports (no import cycle).
"""

from __future__ import annotations

import sys

from flows.cli import main


if __name__ == "__main__":
    main(["server", *sys.argv[1:]])
