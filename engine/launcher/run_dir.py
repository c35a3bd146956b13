"""The fleet controller's run directory: its files (tokens, state, pid, lock, routes), written atomically, and the
cleanup after a controller that died."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from pathlib import Path
from typing import Any

from engine.launcher.managed_process import now_iso
from engine.launcher.process_groups import kill_recorded_processes

# Files in the run directory.
CONTROL_TOKEN_FILE = "control.token"
GATEWAY_TOKEN_FILE = "gateway.token"
STATE_FILE = "controller.json"
PID_FILE = "controller.pid"
LOCK_FILE = "controller.lock"
CONTROLLER_LOG = "controller.log"
ROUTES_FILE = "gateway-routes.json"


def read_or_create_token(path: Path) -> str:
    """A secret kept in a 0600 file: read it if present (tightening loose permissions), else create it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        token = path.read_text(encoding="utf-8").strip()
        if len(token) >= 16:
            return token
        path.unlink()  # empty or truncated: start over
        return read_or_create_token(path)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(token + "\n")
    return token


def write_json_atomic(path: Path, data: object, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=False, default=str)
        handle.write("\n")
    os.replace(temporary, path)


class RunDirLock:
    """An exclusive lock on ``<run_dir>/controller.lock``: held for the controller's life, freed by the kernel on death.

    A pid file can go stale when a controller is killed; a flock cannot, so "is a controller
    running here?" is answered by trying to take the lock.
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @classmethod
    def held(cls, run_dir: Path) -> bool:
        """Whether another process holds the lock (a live controller)."""
        if not (run_dir / LOCK_FILE).exists():
            return False
        probe = cls(run_dir)
        if probe.acquire():
            probe.release()
            return False
        return True


def read_state_file(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def clean_stale_run_dir(run_dir: Path) -> list[int]:
    """After a controller died without cleaning up: stop the processes it recorded, drop its pid file.

    Only call this when ``RunDirLock.held`` is False. Returns the pids that were stopped.
    """
    state = read_state_file(run_dir) or {}
    records = [p for p in state.get("processes", []) if isinstance(p, dict)]
    stopped = kill_recorded_processes(records)
    with contextlib.suppress(FileNotFoundError):
        (run_dir / PID_FILE).unlink()
    if state and state.get("state") != "stopped":
        state["state"] = "stopped"
        state["stopped_at"] = now_iso()
        state["note"] = "the controller was not running; its processes were cleaned up"
        for record in records:
            if record.get("state") != "stopped":
                record["state"] = "stopped"
        write_json_atomic(run_dir / STATE_FILE, state)
    return stopped


def read_pid(run_dir: Path) -> int | None:
    """The pid in ``controller.pid``, or None (no file, or not a pid)."""
    try:
        return int((run_dir / PID_FILE).read_text(encoding="utf-8").split()[0])
    except (OSError, ValueError, IndexError):
        return None
