"""Start a real platform process on a scratch data directory for benchmarks (and keep its key/token)."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PlatformProcess:
    def __init__(self, data_dir: str | None = None, extra_env: dict | None = None):
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="observatory-bench-")
        self.data_dir = data_dir or self._tmp.name
        self.env = {**os.environ, "OBSERVATORY_DATA_DIR": self.data_dir, "LOG_LEVEL": "WARNING", **(extra_env or {})}
        self.port = free_port()
        self.proc = None

    def manage(self, *args: str) -> str:
        out = subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=self.env, check=True,
                             capture_output=True, text=True)
        return out.stdout.strip()

    def setup(self) -> tuple[str, str]:
        self.manage("migrate", "-v0")
        key = self.manage("create_ingest_key", "--project", "bench")
        token = self.manage("create_api_token", "--user", "bench", "--role", "viewer")
        return key, token

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runplatform", "--http", f"127.0.0.1:{self.port}", "--no-grpc"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                status, _ = self.get("/readyz")
                if status == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"platform exited: {self.proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError("platform did not become ready")

    def get(self, path: str, token: str | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        body = response.read()
        conn.close()
        return response.status, json.loads(body or b"{}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._tmp:
            self._tmp.cleanup()
