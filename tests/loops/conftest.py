"""The loops tests import the alerts tests' receiver (tests/alerts/alerts_support.py)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "alerts"))
