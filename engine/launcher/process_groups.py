"""Processes by pid and process group (Linux): whether a pid is still the process it was, signalling a group, and
stopping what a controller that died left running."""
from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (state, ppid, pgrp, ...), or None (no such process, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # Field 2 (comm) is parenthesised and may contain spaces; the fields after it are space-separated.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields or None


def process_start_ticks(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), to tell a process from a later one with its pid."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` runs and, when ``start_ticks`` is known, is still the same process (not a reused pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    if fields is not None and fields[0] == "Z":
        return False  # exited, waiting for its parent to reap it
    if start_ticks is None:
        return True
    current = process_start_ticks(pid)
    return current is None or current == start_ticks


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not allowed to signal process group %s", pgid)
        return False


def kill_recorded_processes(records: Iterable[dict], *, grace: float = 5.0) -> list[int]:
    """Stop processes listed in a state file by a controller that died (pid + start ticks guard against reuse).

    Returns the pids that were still running and were signalled.
    """
    targets = []
    for record in records:
        pid = record.get("pid") if isinstance(record, dict) else None
        ticks = record.get("start_ticks") if isinstance(record, dict) else None
        if isinstance(pid, int) and not isinstance(pid, bool) and pid > 1 and pid != os.getpid():
            if process_alive(pid, ticks if isinstance(ticks, int) else None):
                targets.append(pid)
    for pid in targets:
        signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_group_exists(pid) for pid in targets):
        time.sleep(0.05)
    for pid in targets:
        signal_group(pid, signal.SIGKILL)
    return targets


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as exc:
        return exc.errno != errno.ESRCH
    # A zombie leader (reaped by nobody, e.g. our own orphaned child) still counts; treat it as gone.
    return _any_live_member(pgid)


def _any_live_member(pgid: int) -> bool:
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _proc_stat(int(entry))
        # fields[0] is the state, fields[2] the process group.
        if fields is not None and len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False
