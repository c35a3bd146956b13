"""Shared fixtures: a real platform process (`manage.py runplatform`) with its own data directory.

In server mode (DATABASE_URL=postgresql://…) every platform gets a fresh PostgreSQL
database, created here and dropped afterwards; CELERY_BROKER_URL is passed through.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
import uuid
from pathlib import Path

import pytest
from benchkit.harness import PlatformProcess
from fleet_support import close_finished_worlds
from otlp_live_helpers import _drop_database, _server_mode_database
from quiet_support import running_test

TESTS = Path(__file__).resolve().parent
# The periodic calibration of engine models (tuning.calibrate_groups) would fit every group with an hour's traffic
# in the background of unrelated live tests (tens of CPU seconds each): off in every platform the tests start,
# unless a test turns it on. Its tests call it directly.
os.environ.setdefault("TUNING_CALIBRATION_INTERVAL_SECONDS", "0")
# Each platform's metadata database starts as a copy of one migrated once (benchkit.harness.copy_migrated_database):
# ~3.5 s of CPU less per platform, of which the suites start about a hundred.
os.environ.setdefault("OBSERVATORY_MIGRATED_TEMPLATES", "1")
# Tests that touch neither the metadata database nor the broker run the same in both modes: the engine (its
# simulator, gateway, launcher, real vLLM; no Django), the collectors, and modules marked mode_independent (pure
# statistics, plans, searches in the simulator, the OTLP pipeline's spool and ClickHouse, where the database only
# looks the key up). CI runs each of them once, in the suite its marker names (`mode_independent(suite=...)`;
# default embedded; tests/engine and tests/collectors: server), to balance the two suites that run side by side:
# OBSERVATORY_SUITE=embedded|server deselects the others' share. Unset (make test), everything runs.
# tests/engine's one test of the platform (runplatform --with-engine) is marked mode_dependent: both suites.
# Tests marked one_suite(suite=...) do use the platform, but what they test is not the mode's: the pages in a real
# browser (templates, scripts, forms; the data under them is the same API's, tested in both modes by the live
# API tests), the API document walked by the fuzzer, and the long end-to-end scenarios (rollouts, runs, studies,
# an alert, `make up`) whose mode-specific part (leases, two workers and a doubled beat on PostgreSQL and Redis) has
# tests of its own in both modes. They too run once, in the suite named.
SUITE_OF_DIRECTORY = {"engine": "server", "collectors": "server"}


def assigned_suite(item) -> str | None:
    """The one suite a mode-independent test runs in; None for a test that runs in both."""
    if item.get_closest_marker("mode_dependent"):
        return None
    marker = item.get_closest_marker("mode_independent") or item.get_closest_marker("one_suite")
    if marker is not None:
        return marker.kwargs.get("suite", "embedded")
    parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
    return SUITE_OF_DIRECTORY.get(parts[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Each test, from its setup (its module's fixtures included) to its teardown, holds the share of the lock that a
    # quiet stretch of the other suite's (tests/quiet_support.py) waits for.
    with running_test():
        yield


@pytest.hookimpl(trylast=True)  # after the test's own and its module's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    close_finished_worlds(item, nextitem)


def pytest_collection_modifyitems(config, items):
    suite = os.environ.get("OBSERVATORY_SUITE", "")
    if suite not in ("embedded", "server"):
        return
    keep, dropped = [], []
    for item in items:
        owner = assigned_suite(item)
        (keep if owner in (None, suite) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@dataclasses.dataclass
class LivePlatform:
    process: PlatformProcess
    keys: dict[str, str]  # project name -> ingest key
    tokens: dict[str, str]  # user name -> API token

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.process.grpc_port}"


def start_platform(extra_env: dict | None = None, grpc: bool = True, data_dir: str | None = None):
    """Start a platform with projects alpha and beta; alice reads alpha, bob reads beta. Returns (platform, cleanup)."""
    env = dict(extra_env or {})
    database = _server_mode_database()
    if database:
        env["DATABASE_URL"] = database[1]
    process = PlatformProcess(data_dir=data_dir, extra_env=env, grpc=grpc)

    def cleanup():
        process.stop()
        if database:
            _drop_database(database[0], database[1])

    try:
        # One manage.py process for the set-up (five would cost ~15 s more per platform on a loaded 2-core host).
        _, alpha, beta, alice, bob = process.manage_many(
            ("migrate", "-v0"), ("create_ingest_key", "--project", "alpha"), ("create_ingest_key", "--project", "beta"),
            ("create_api_token", "--user", "alice", "--role", "viewer", "--project", "alpha"),
            ("create_api_token", "--user", "bob", "--role", "viewer", "--project", "beta"))
        keys = {"alpha": alpha, "beta": beta}
        tokens = {"alice": alice, "bob": bob}
        process.start()
    except BaseException:
        cleanup()
        raise
    return LivePlatform(process, keys, tokens), cleanup


@pytest.fixture(scope="module")
def live_platform():
    """One platform shared by the tests of a module (OTLP/HTTP on its web port, OTLP/gRPC enabled)."""
    platform, cleanup = start_platform()
    try:
        yield platform
    finally:
        cleanup()


def _platform_factory():
    cleanups = []

    def factory(**kwargs):
        platform, cleanup = start_platform(**kwargs)
        cleanups.append(cleanup)
        return platform

    yield factory
    for cleanup in reversed(cleanups):
        cleanup()


@pytest.fixture
def fresh_platform_factory():
    """Start platforms owned by one test (for kill -9, outages, small limits); all stopped afterwards."""
    yield from _platform_factory()


@pytest.fixture(scope="module")
def module_platform_factory():
    """Start platforms shared by the tests of a module, with settings of its own; stopped after the module."""
    yield from _platform_factory()


@pytest.fixture
def platform_process():
    """platform_process(**PlatformProcess kwargs) → a PlatformProcess of the test's own, with a fresh PostgreSQL
    database in server mode (a bare PlatformProcess would share DATABASE_URL's database with every other);
    all stopped, and their databases dropped, afterwards."""
    made = []

    def factory(**kwargs):
        env = dict(kwargs.pop("extra_env", None) or {})
        database = _server_mode_database()
        if database:
            env["DATABASE_URL"] = database[1]
        process = PlatformProcess(extra_env=env, **kwargs)
        made.append((process, database))
        return process

    yield factory
    for process, database in reversed(made):
        process.stop()
        if database:
            _drop_database(database[0], database[1])


# ---------------------------------------------------------------------------------------------- installs
def wait_for_install(variable: str, target: str, timeout: float = 1800) -> None:
    """.ci/run starts the suites while `make vllm` and `make stack` still run (the suites' first minutes need
    neither), naming in ``variable`` the file each install writes its exit status to when it ends: wait for it,
    and fail at once, pointing at the log, if the install failed. Without the variable (make test), return."""
    path = os.environ.get(variable)
    if not path:
        return
    status = Path(path)
    deadline = time.monotonic() + timeout
    while not status.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"`make {target}` was still running after {timeout:.0f} s ({variable}={path})")
        time.sleep(1)
    code = status.read_text().strip()
    if code != "0":
        pytest.fail(f"`make {target}` failed (exit status {code}); its log is {status.with_suffix('.log')}")


# ---------------------------------------------------------------------------------------------- real vLLM
# The tests that run real vLLM (its CPU build, `make vllm`) skip where it is not installed, saying so, unless
# OBSERVATORY_REQUIRE_VLLM=1 (set by .ci/run, which installs it): then its absence fails them. .ci/run runs them
# in the embedded-mode suite only (OBSERVATORY_REAL_VLLM=0 in server mode): the two suites run side by side on
# two cores, and two sets of vLLM processes would slow both; the vLLM path does not touch PostgreSQL or Redis.
@pytest.fixture(scope="session")
def real_vllm_executable() -> str:
    from pathlib import Path

    from engine.launcher.vllm_command import find_vllm_executable

    if os.environ.get("OBSERVATORY_REAL_VLLM") == "0":
        pytest.skip("real vLLM runs in the embedded-mode suite (OBSERVATORY_REAL_VLLM=0 here)")
    wait_for_install("OBSERVATORY_VLLM_INSTALL_STATUS", "vllm")
    executable = find_vllm_executable()
    if executable is None or not Path(executable).exists():
        message = "vLLM's CPU build is not installed: run `make vllm` (CI installs it)"
        if os.environ.get("OBSERVATORY_REQUIRE_VLLM") == "1":
            pytest.fail(message + "; OBSERVATORY_REQUIRE_VLLM=1 says it must be here")
        pytest.skip(message)
    return executable


@pytest.fixture(scope="session")
def real_vllm_python(real_vllm_executable) -> str:
    """The Python of vLLM's virtualenv (for vLLM's own argument parser)."""
    from pathlib import Path

    return str(Path(real_vllm_executable).parent / "python")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The test-size tiny Llama model (python -m engine tiny-model), built once per session."""
    from engine import tiny_model

    return str(tiny_model.build(tmp_path_factory.mktemp("tiny-model"), "test"))


# ---------------------------------------------------------------------------------------------- real stack
# LiteLLM, the openai client and its instrumentations from PyPI (`make stack`: .venv-stack). Like real vLLM:
# skipped without it, unless OBSERVATORY_REQUIRE_STACK=1 (CI), which makes its absence a failure.
@pytest.fixture(scope="session")
def stack_python() -> str:
    from pathlib import Path

    if os.environ.get("OBSERVATORY_REAL_STACK") == "0":
        pytest.skip("the real serving-stack tests run in the embedded-mode suite (OBSERVATORY_REAL_STACK=0 here)")
    wait_for_install("OBSERVATORY_STACK_INSTALL_STATUS", "stack")
    python = Path(__file__).resolve().parents[1] / ".venv-stack" / "bin" / "python"
    if not python.exists():
        message = "the serving-stack packages are not installed: run `make stack` (CI installs them)"
        if os.environ.get("OBSERVATORY_REQUIRE_STACK") == "1":
            pytest.fail(message + "; OBSERVATORY_REQUIRE_STACK=1 says they must be here")
        pytest.skip(message)
    return str(python)


# The dashboard's browser tests drive Debian's Chromium (`apt-get install chromium`; .ci/run installs it) through
# Playwright (a dependency of the project) with the system executable (Playwright's own browser download cannot work
# here). Skipped without either, unless OBSERVATORY_REQUIRE_BROWSER=1 (CI), which makes its absence a failure.
def browser_missing(message: str) -> None:
    """Fail (OBSERVATORY_REQUIRE_BROWSER=1) or skip, saying what is missing."""
    if os.environ.get("OBSERVATORY_REQUIRE_BROWSER") == "1":
        pytest.fail(message + "; OBSERVATORY_REQUIRE_BROWSER=1 says it must be here")
    pytest.skip(message)


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    import shutil

    executable = os.environ.get("OBSERVATORY_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable:
        browser_missing("Chromium is not installed (apt-get install chromium; CI installs it)")
    return executable


@pytest.fixture(scope="session")
def playwright_api(chromium_executable):
    """playwright.sync_api, for the browser tests (with Chromium there to drive)."""
    try:
        import playwright.sync_api
    except ImportError as exc:
        browser_missing(f"Playwright cannot be imported ({exc}; make install installs it)")
    return playwright.sync_api


@pytest.fixture(scope="module")
def browser(playwright_api, chromium_executable):
    """Chromium, launched once for the tests of a module (each opens contexts of its own: browser_support.py)."""
    with playwright_api.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=chromium_executable, args=["--no-sandbox"])
        yield instance
        instance.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where the browser tests' screenshots go: $OBSERVATORY_SCREENSHOTS, else a temporary directory."""
    directory = Path(os.environ.get("OBSERVATORY_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


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
    from traces.store import ClickHouseStore

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
