"""Start a real platform process on a scratch data directory for benchmarks (and keep its key/token)."""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import django
import psycopg

ROOT = Path(__file__).resolve().parents[2]


def free_port_pair() -> int:
    """A port p with p and p + 1 both free (a fleet's two replicas take consecutive ports)."""
    for _ in range(50):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MANAGE_MANY_MARK = "manage_many:"
_MANAGE_MANY = f"""
import io, json, sys
from django.core.management import call_command
outs = []
for call in json.loads(sys.stdin.read()):
    buffer = io.StringIO()
    call_command(*call, stdout=buffer)
    outs.append(buffer.getvalue().strip())
print({_MANAGE_MANY_MARK!r} + json.dumps(outs))
"""


def _migrations_key() -> str:
    """A digest of every migration (and Django's version): a migrated template made from other migrations is not
    used."""
    digest = hashlib.sha256(django.get_version().encode())
    for path in sorted((ROOT / "platform").glob("*/migrations/*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _migrate(env: dict) -> None:
    subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"], env=env, check=True,
                   capture_output=True, text=True)


def _with_database(url: str, dbname: str) -> str:
    return urlunparse(urlparse(url)._replace(path=f"/{dbname}"))


def _postgres(url: str, dbname: str):
    return psycopg.connect(_with_database(url, dbname), autocommit=True)


def copy_migrated_database(env: dict) -> bool:
    """Fill the metadata database `env` names (an empty PostgreSQL database of DATABASE_URL, or the SQLite file of
    OBSERVATORY_DATA_DIR) from a template migrated once per set of migrations, instead of migrating it afresh:
    `migrate` costs ~3.5 s of CPU, and the test suites start a hundred platforms on two cores. The `migrate` that
    follows then finds nothing to apply (or applies what the template lacks). False, with nothing changed, when the
    database is not empty or not one of those."""
    key = _migrations_key()
    url = env.get("DATABASE_URL", "")
    if url.startswith(("postgres://", "postgresql://")):
        target = urlparse(url).path.lstrip("/")
        template = f"observatory_tpl_{key}"
        with _postgres(url, "postgres") as admin:
            if not admin.execute("select 1 from pg_database where datname = %s", (template,)).fetchone():
                building = f"{template}_{os.getpid()}_{int(time.time() * 1000) % 100000}"
                admin.execute(f'CREATE DATABASE "{building}"')
                try:
                    _migrate({**env, "DATABASE_URL": _with_database(url, building)})
                    admin.execute(f'ALTER DATABASE "{building}" RENAME TO "{template}"')
                except (subprocess.CalledProcessError, psycopg.Error):
                    admin.execute(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)')
                    if not admin.execute("select 1 from pg_database where datname = %s", (template,)).fetchone():
                        raise
            with _postgres(url, target) as conn:
                if conn.execute("select count(*) from pg_tables where schemaname = 'public'").fetchone()[0]:
                    return False
            admin.execute(f'DROP DATABASE "{target}" WITH (FORCE)')
            admin.execute(f'CREATE DATABASE "{target}" TEMPLATE "{template}"')
        return True
    if url:
        return False
    target = Path(env["OBSERVATORY_DATA_DIR"]) / "observatory.sqlite3"
    if target.exists() and target.stat().st_size:
        return False
    template = Path(tempfile.gettempdir()) / "observatory-db-templates" / key / "observatory.sqlite3"
    if not template.exists():
        template.parent.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=template.parent.parent))
        _migrate({**env, "OBSERVATORY_DATA_DIR": str(building)})
        try:
            building.rename(template.parent)
        except OSError:  # another process made it meanwhile
            shutil.rmtree(building, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(template) as source, sqlite3.connect(target) as copy:
        source.backup(copy)
    return True


class PlatformProcess:
    """`manage.py runplatform` in a child process with its own data directory (and, in server mode, the
    DATABASE_URL given by the caller). Used by benchmarks and by the tests' live-platform fixtures."""

    def __init__(self, data_dir: str | None = None, extra_env: dict | None = None, grpc: bool = False,
                 args: tuple[str, ...] = ()):
        self.args = tuple(args)  # more runplatform options (e.g. --with-engine)
        self.root = ROOT  # the checkout whose manage.py runs (benchmarks may compare another one)
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="observatory-")
        self.data_dir = data_dir or self._tmp.name
        self.env = {**os.environ, "OBSERVATORY_DATA_DIR": self.data_dir, "LOG_LEVEL": os.environ.get("OBSERVATORY_TEST_LOG_LEVEL", "WARNING"), **(extra_env or {})}
        self.port = free_port()
        self.grpc_port = free_port() if grpc else None
        self.proc = None
        self.log_path = Path(self.data_dir) / "platform.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def manage(self, *args: str) -> str:
        out = subprocess.run([sys.executable, str(self.root / "manage.py"), *args], env=self.env, check=True,
                             capture_output=True, text=True)
        return out.stdout.strip()

    def manage_many(self, *calls: tuple[str, ...]) -> list[str]:
        """Several management commands, in order, in one process (starting manage.py costs 1-4 s here, most of
        it Django's set-up): each one's stdout, stripped. The first that fails stops the rest and raises
        CalledProcessError, as manage() does. A first `migrate` starts from a migrated template
        (copy_migrated_database) when OBSERVATORY_MIGRATED_TEMPLATES=1 (the test suites set it)."""
        if calls and calls[0][0] == "migrate" and self.env.get("OBSERVATORY_MIGRATED_TEMPLATES") == "1":
            copy_migrated_database(self.env)
        out = subprocess.run([sys.executable, str(self.root / "manage.py"), "shell", "-c", _MANAGE_MANY],
                             env=self.env, input=json.dumps([list(call) for call in calls]), check=True,
                             capture_output=True, text=True)
        line = next(line for line in reversed(out.stdout.splitlines()) if line.startswith(_MANAGE_MANY_MARK))
        return json.loads(line[len(_MANAGE_MANY_MARK):])

    def setup(self) -> tuple[str, str]:
        _, key, token = self.manage_many(("migrate", "-v0"), ("create_ingest_key", "--project", "bench"),
                                         ("create_api_token", "--user", "bench", "--role", "viewer"))
        return key, token

    def start(self, timeout: float = 60, attempts: int = 3) -> None:
        """Start and wait for /readyz; if a port picked by free_port() was taken meanwhile, retry with new ones."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except RuntimeError as exc:
                if "address already in use" not in str(exc).lower() or attempt == attempts - 1:
                    raise
                self.port = free_port()
                self.grpc_port = free_port() if self.grpc_port else None

    def _start_once(self, timeout: float) -> None:
        grpc_args = ["--grpc", f"127.0.0.1:{self.grpc_port}"] if self.grpc_port else ["--no-grpc"]
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(self.root / "manage.py"), "runplatform", "--http", f"127.0.0.1:{self.port}", *grpc_args,
             *self.args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                status, _ = self.get("/readyz")
                if status == 200:
                    return
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"platform exited: {self.log_tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"platform did not become ready: {self.log_tail()}")

    def log_tail(self, chars: int | None = 4000) -> str:
        """The log's last `chars` characters (None: all of it, across restarts)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text if chars is None else text[-chars:]

    def post(self, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        result = response.status, {k.lower(): v for k, v in response.getheaders()}, data
        conn.close()
        return result

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until the spool is drained into ClickHouse and the decomposition has caught up."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            status, body = self.get("/readyz")
            if status == 200 and body.get("spool_pending_bytes") == 0 and body.get("decomposition_pending") == 0:
                return
            time.sleep(0.05)
        raise TimeoutError(f"platform did not become idle: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no chance to flush anything."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def get(self, path: str, token: str | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        body = response.read()
        conn.close()
        return response.status, json.loads(body or b"{}")

    def stop(self, cleanup: bool = True) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        if cleanup and self._tmp:
            self._tmp.cleanup()
