"""Make `platform/` (a source root, never a package) and the repo root importable."""
import re
import sys
import uuid
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
for _path in (_ROOT, _ROOT / "platform"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


@pytest.fixture(scope="session")
def chdb_session_path(tmp_path_factory) -> str:
    """The one chdb data directory of this pytest process.

    chdb runs ONE embedded server per process, on one data directory: a second path
    opened in the same process fails. Every in-process store test uses this path and
    keeps apart from the others with its own database name (see `make_store`).
    """
    return str(tmp_path_factory.mktemp("chdb-session") / "chdb")


@pytest.fixture
def make_store(chdb_session_path, request):
    """make_store(suffix='') -> a ClickHouseStore on the session chdb path with a database of its own."""
    from traces.store import ClickHouseStore  # after the sys.path set-up above

    stores = []

    def factory(suffix: str = ""):
        base = re.sub(r"[^A-Za-z0-9_]", "_", request.node.name)[:40]
        database = f"t_{base}_{suffix}_{uuid.uuid4().hex[:8]}"
        store = ClickHouseStore(url=None, chdb_path=chdb_session_path, database=database)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        try:
            store.command(f"DROP DATABASE IF EXISTS `{store.database}` SYNC")
        except Exception:  # best effort: the data directory is temporary anyway
            pass
        store.close()
