"""Fixtures shared by the alerts tests."""
import pytest
from alerts_support import installed_store


@pytest.fixture(scope="module")
def store():
    """A scratch ClickHouse store that traces.store.get_store() hands out for the module's tests."""
    with installed_store() as scratch:
        yield scratch
