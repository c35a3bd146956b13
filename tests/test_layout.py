"""The source root must never become a package: platform/__init__.py would shadow the stdlib `platform`."""
import importlib
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mode_independent  # no database, no broker: CI runs it once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


def test_platform_is_a_source_root_not_a_package():
    assert (ROOT / "platform").is_dir()
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_stdlib_platform_module_is_not_shadowed():
    module = importlib.import_module("platform")
    assert hasattr(module, "python_version"), module
    assert "site-packages" not in (module.__file__ or "") and str(ROOT) not in (module.__file__ or "")


def test_no_top_level_module_named_after_the_stdlib():
    names = {p.stem for p in ROOT.iterdir() if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    for source_root in (ROOT / "platform",):
        names |= {p.name for p in source_root.iterdir() if (p / "__init__.py").exists()}
    clashes = names & set(sys.stdlib_module_names)
    assert not clashes, f"these names shadow standard-library modules: {sorted(clashes)}"


def test_every_package_of_the_source_root_is_installed():
    """pyproject's package list names every package under platform/ (a missing one installs without it)."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    patterns = {pattern.rstrip("*") for pattern in include}
    packages = {p.name for p in (ROOT / "platform").iterdir() if (p / "__init__.py").exists()}
    assert packages <= patterns, f"not installed: {sorted(packages - patterns)}"
