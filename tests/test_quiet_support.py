"""tests/quiet_support.py: a quiet stretch waits for the other suite's running test, and the other suite's next test
waits for the stretch, even one that asked while the stretch was waiting. The other suite is a real second process."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import quiet_support
from quiet_support import quiet

pytestmark = pytest.mark.mode_independent

TESTS = Path(__file__).resolve().parent
# One test of "the other suite": holds the tests' lock as the conftest's hook does, for argv[2] seconds, and writes
# when it got in and left (time.monotonic(), the same clock across processes on one host).
NEIGHBOUR = """
import sys, time
from quiet_support import running_test
started = time.monotonic()
with running_test():
    entered = time.monotonic()
    time.sleep(float(sys.argv[2]))
    left = time.monotonic()
open(sys.argv[1], "w").write(f"{started} {entered} {left}")
"""


def _neighbour(tmp_path: Path, name: str, seconds: float, directory: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / name
    env = {**os.environ, "TESTS_QUIET_LOCK_DIR": str(directory), "PYTHONPATH": str(TESTS)}
    return subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(out), str(seconds)], env=env), out


@pytest.fixture
def locks(monkeypatch, tmp_path) -> Path:
    """The lock directory, set for this process (and the processes it starts) as .ci/run sets it."""
    directory = tmp_path / "locks"
    directory.mkdir()
    monkeypatch.setenv("TESTS_QUIET_LOCK_DIR", str(directory))
    return directory


def _neighbour_under_way(tmp_path: Path, seconds: float, directory: Path) -> tuple[subprocess.Popen, Path]:
    """A neighbour's test of ``seconds``, started and under way (holding its share) when this returns."""
    process, out = _neighbour(tmp_path, "first", seconds, directory)
    deadline = time.monotonic() + 20
    while not (directory / "tests.lock").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    return process, out


def _times(process: subprocess.Popen, out: Path) -> tuple[float, float, float]:
    assert process.wait(timeout=30) == 0
    started, entered, left = map(float, out.read_text().split())
    return started, entered, left


def test_without_the_directory_a_quiet_stretch_does_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("TESTS_QUIET_LOCK_DIR", raising=False)
    with quiet("nothing") as waited:
        assert waited == 0.0
    assert not list(tmp_path.iterdir())


def test_a_quiet_stretch_waits_for_the_running_test_and_holds_off_the_next(locks, tmp_path):
    first, first_out = _neighbour_under_way(tmp_path, 1.5, locks)
    with quiet_support.running_test():  # this process's own test, as under the conftest's hook
        second = None
        asked = time.monotonic()
        with quiet("a timed stretch") as waited:
            got_in = time.monotonic()
            # A test the neighbour starts while this stretch runs waits for it.
            second, second_out = _neighbour(tmp_path, "second", 0.1, locks)
            time.sleep(1.0)
            left = time.monotonic()
        _, first_entered, first_left = _times(first, first_out)
        assert first_entered < asked and got_in >= first_left, "the stretch began before the running test ended"
        assert waited == pytest.approx(got_in - asked, abs=0.05) and waited > 0.5
        second_started, second_entered, _ = _times(second, second_out)
        assert second_started < left and second_entered >= left, "a test ran during the stretch"
    line = (locks / "quiet.log").read_text()
    assert line.startswith("a timed stretch: waited ") and "then held it off 1." in line, line


def test_a_test_that_asks_while_a_stretch_waits_goes_after_it(locks, tmp_path):
    first, first_out = _neighbour_under_way(tmp_path, 1.5, locks)
    # The stretch asks in a second process; then the neighbour's next test asks. The turnstile keeps that test
    # from overtaking the waiting stretch, though the tests' lock is only ever shared between the two tests.
    stretch_out = tmp_path / "stretch"
    stretch = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom quiet_support import quiet\n"
         "with quiet('x'):\n    entered = time.monotonic(); time.sleep(1.0); left = time.monotonic()\n"
         "open(sys.argv[1], 'w').write(f'{entered} {left}')", str(stretch_out)],
        env={**os.environ, "PYTHONPATH": str(TESTS)})
    time.sleep(0.5)  # the stretch is waiting on the first test
    second, second_out = _neighbour(tmp_path, "second", 0.1, locks)
    assert stretch.wait(timeout=30) == 0
    entered, left = map(float, stretch_out.read_text().split())
    _, _, first_left = _times(first, first_out)
    second_started, second_entered, _ = _times(second, second_out)
    assert entered >= first_left
    assert second_started < entered and second_entered >= left, "the next test overtook the waiting stretch"


def test_a_stretch_that_cannot_have_the_lock_runs_anyway_and_says_so(locks, tmp_path):
    first, first_out = _neighbour_under_way(tmp_path, 2.0, locks)
    with pytest.warns(UserWarning, match="did not end within 0 s"):
        with quiet("a stretch", wait_seconds=0.3) as waited:
            assert 0.25 <= waited < 1.5
    _times(first, first_out)
    assert "(not alone: the wait ran out)" in (locks / "quiet.log").read_text()
