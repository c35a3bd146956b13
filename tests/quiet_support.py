"""Quiet stretches: the few test stretches whose figures are timed on the wall clock run while the other suite waits.

.ci/run runs the embedded and the server suites side by side on one host. Most tests only wait on live processes,
so the two share two cores well. A few measure latency on the wall clock and judge it against a bound: a simulated
replica serving load in real time, whose spans a calibration then fits, reads a neighbour's CPU burst as a slower
engine (the replica's loop and its frontend fall behind; the rows record that as longer decodes and TTFTs). Such a
stretch runs inside ``quiet()``: it waits for the other suite's running test to end, and the other suite's next test
waits for the stretch to end.

The mechanism is a readers-writer lock on two files in ``TESTS_QUIET_LOCK_DIR`` (.ci/run sets it to its scratch
directory): every test holds ``tests.lock`` shared from its setup to its teardown (``running_test``, from the
conftest's hook); ``quiet()`` drops its own share and takes the lock alone. A turnstile (``turnstile.lock``, which
every test passes through and a quiet stretch holds while it waits) keeps the next tests from overtaking a waiting
stretch. Without the variable (one suite alone: ``make test``) both do nothing. A stretch that cannot have the lock
within ``QUIET_WAIT_SECONDS`` (a neighbour stuck in one test) runs anyway, with a warning, rather than hang CI.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
import warnings
from collections.abc import Iterator

QUIET_WAIT_SECONDS = 900.0
_POLL_SECONDS = 0.1
_held: dict[str, int] = {}  # lock directory -> the fd of its tests.lock while this process runs a test (shared)


def _directory() -> str | None:
    return os.environ.get("TESTS_QUIET_LOCK_DIR") or None


def _open(directory: str, name: str) -> int:
    return os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT, 0o644)


def _pass_turnstile(directory: str) -> None:
    gate = _open(directory, "turnstile.lock")
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)  # blocks while a quiet stretch waits for, or holds, the tests' lock
    finally:
        os.close(gate)  # closing releases it


@contextlib.contextmanager
def running_test() -> Iterator[None]:
    """Hold the tests' lock shared while one test runs (its setup, call and teardown)."""
    directory = _directory()
    if directory is None:
        yield
        return
    _pass_turnstile(directory)
    fd = _open(directory, "tests.lock")
    fcntl.flock(fd, fcntl.LOCK_SH)
    outer = _held.get(directory)
    _held[directory] = fd
    try:
        yield
    finally:
        if outer is None:
            _held.pop(directory, None)
        else:
            _held[directory] = outer
        os.close(fd)


def _lock_within(fd: int, operation: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)


@contextlib.contextmanager
def quiet(what: str, wait_seconds: float = QUIET_WAIT_SECONDS) -> Iterator[float]:
    """Run the body while no test of the other suite runs; yields the seconds it waited for that."""
    directory = _directory()
    if directory is None:
        yield 0.0
        return
    started = time.monotonic()
    deadline = started + wait_seconds
    own = _held.get(directory)
    fd = own if own is not None else _open(directory, "tests.lock")
    fcntl.flock(fd, fcntl.LOCK_UN)  # this process's own share would keep it waiting on itself
    gate = _open(directory, "turnstile.lock")
    alone = False
    waited = None
    try:
        if _lock_within(gate, fcntl.LOCK_EX, deadline):
            try:
                alone = _lock_within(fd, fcntl.LOCK_EX, deadline)
            finally:
                os.close(gate)  # once alone, the next tests queue on the tests' lock itself
        else:
            os.close(gate)
        if not alone:
            warnings.warn(f"{what}: the other suite's test did not end within {wait_seconds:.0f} s; running it "
                          f"beside that test", stacklevel=3)
        waited = time.monotonic() - started
        yield waited
    finally:
        if waited is not None:
            held = time.monotonic() - started - waited
            with open(os.path.join(directory, "quiet.log"), "a") as log:  # .ci/run prints it: what the stretches cost
                log.write(f"{what}: waited {waited:.1f} s for the other suite's test, then held it off "
                          f"{held:.1f} s{'' if alone else ' (not alone: the wait ran out)'}\n")
        if own is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)  # back to this test's share
        else:
            os.close(fd)
