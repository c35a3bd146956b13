"""``python -m engine``: the managed engine's command line (up, status, down, render); see ``engine.launcher.cli``."""
from __future__ import annotations

import sys

from engine.launcher.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
