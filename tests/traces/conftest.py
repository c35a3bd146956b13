"""Make `platform/` (a source root, never a package) and the repo root importable."""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for _path in (_ROOT, _ROOT / "platform"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
