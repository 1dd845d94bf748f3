"""The `draftsmith` console script and `python -m draftsmith.cli`; the commands live in `draftsmith.app.cli`."""

from __future__ import annotations

import sys

from draftsmith.app.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
