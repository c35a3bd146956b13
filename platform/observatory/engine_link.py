"""Wires the managed engine (gateway, replicas, load generator) to this platform's OTLP endpoint.

The engine imports nothing from Django; the platform hands it the standard OTel
environment instead: where to send spans (this platform's OTLP/HTTP endpoint) and an
ingest key of the project its traffic belongs to. That key is created once and kept
in the data directory (mode 0600), so restarts do not pile up keys; a revoked or lost
key is replaced.
"""
from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings
from django.db import transaction

ENGINE_KEY_NAME = "managed engine"


def _key_file(project: str) -> Path:
    return Path(settings.DATA_DIR) / "engine" / f"ingest-key-{project}"


def engine_ingest_key(project: str = "default") -> str:
    """The ingest key the managed engine uses for ``project`` (created, with the project, when missing or revoked)."""
    from tenancy.models import IngestKey, Project, hash_secret

    path = _key_file(project)
    if path.exists():
        raw = path.read_text(encoding="utf-8").strip()
        if raw and IngestKey.objects.filter(
            key_hash=hash_secret(raw), revoked_at__isnull=True, project__name=project
        ).exists():
            return raw
    with transaction.atomic():
        proj, _ = Project.objects.get_or_create(name=project)
        _, raw = IngestKey.issue(proj, name=ENGINE_KEY_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(raw + "\n")
    return raw


def _reachable(bind: str) -> str:
    """host:port to reach a server bound to ``bind`` from this host (a wildcard address becomes 127.0.0.1)."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def platform_grpc_endpoint(grpc_bind: str | None = None) -> str:
    """host:port of this platform's OTLP/gRPC receiver, as vLLM's --otlp-traces-endpoint takes it."""
    return _reachable(grpc_bind or settings.OTLP_GRPC_BIND)


def platform_traces_url(http_bind: str | None = None) -> str:
    return f"http://{_reachable(http_bind or settings.HTTP_BIND)}/v1/traces"


def engine_environment(project: str = "default", http_bind: str | None = None) -> dict[str, str]:
    """Environment pointing the fleet (``ENGINE_OTLP_*``) and the load generator (``OTEL_*``) at this platform.

    Both export OTLP/HTTP protobuf to the web port with the engine's ingest key; the
    run directory sits in the platform's data directory.
    """
    url = platform_traces_url(http_bind)
    key = engine_ingest_key(project)
    return {
        "ENGINE_RUN_DIR": str(Path(settings.DATA_DIR) / "engine"),
        "ENGINE_OTLP_ENDPOINT": url,
        "ENGINE_OTLP_PROTOCOL": "http/protobuf",
        "ENGINE_OTLP_HEADERS": f"authorization=Bearer {key}",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"authorization=Bearer%20{key}",
    }


class EngineCompanion:
    """The simulated fleet and a gentle load that ``make up`` runs next to the platform, stopped with it.

    The fleet controller is started detached (``python -m engine up --detach``, which returns
    once the gateway and replicas are healthy) and stopped with ``engine down``; the load
    generator is a child process sending Poisson traffic through the gateway for as long as
    the platform runs. Both export their spans to this platform.
    """

    def __init__(self, *, fleet: str | None = None, load_rate: float = 0.0, http_bind: str | None = None,
                 project: str = "default"):
        self.fleet = fleet
        self.load_rate = load_rate
        wiring = engine_environment(project, http_bind)
        if fleet or os.environ.get("ENGINE_FLEET"):
            wiring.pop("ENGINE_RUN_DIR")  # a fleet file of one's own keeps its own run_dir
        self.env = {**wiring, **os.environ}  # what the user set wins over the platform's wiring
        self.load_process = None
        self.started = False

    def _engine(self, *args: str, timeout: float | None = None):
        import subprocess
        import sys

        argv = [sys.executable, "-m", "engine", *args]
        if self.fleet:
            argv += ["--fleet", self.fleet]
        return subprocess.run(argv, env=self.env, timeout=timeout, check=False)

    def start(self) -> None:
        import threading

        result = self._engine("up", "--detach")
        if result.returncode != 0:
            raise RuntimeError("the engine fleet did not start (see the message above)")
        self.started = True
        if self.load_rate > 0:
            self._stopping = threading.Event()
            self._load_thread = threading.Thread(target=self._keep_load_running, name="engine-load", daemon=True)
            self._load_thread.start()

    # The load generator plans a run's arrivals up front and keeps every request's record, so
    # an endless background load is a chain of bounded runs rather than one unbounded one.
    LOAD_RUN_SECONDS = 300

    def _keep_load_running(self) -> None:
        import subprocess
        import sys

        gateway = self.env.get("ENGINE_GATEWAY_BIND") or "127.0.0.1:8100"
        argv = [sys.executable, "-m", "engine.loadgen", "--base-url", f"http://{gateway}/v1",
                "--arrival", "poisson", "--rate", str(self.load_rate), "--duration", str(self.LOAD_RUN_SECONDS),
                "--quiet", "--timeout", "120"]
        seed = 0
        while not self._stopping.is_set():
            seed += 1
            self.load_process = subprocess.Popen(argv + ["--seed", str(seed)], env=self.env,
                                                 stdout=subprocess.DEVNULL)
            self.load_process.wait()
            # A failing run (gateway down, say) is retried, but not in a tight loop.
            self._stopping.wait(0 if self.load_process.returncode == 0 else 10)

    def stop(self) -> None:
        import subprocess

        if getattr(self, "_stopping", None) is not None:
            self._stopping.set()
        if self.load_process is not None and self.load_process.poll() is None:
            self.load_process.terminate()
            try:
                self.load_process.wait(15)
            except subprocess.TimeoutExpired:
                self.load_process.kill()
        if self.started:
            self.started = False
            self._engine("down", timeout=180)


def _fleet_spec():
    """The fleet file the platform manages, read the way ``manage.py engine`` reads it (FleetSpecError)."""
    from engine.launcher.cli import default_fleet_file
    from engine.launcher.fleet import FleetSpec

    env = dict(os.environ)
    if not env.get("ENGINE_FLEET"):
        # The default fleet runs from the platform's data directory (as `manage.py engine up` starts it);
        # a fleet file of one's own keeps its own run_dir.
        env.setdefault("ENGINE_RUN_DIR", str(Path(settings.DATA_DIR) / "engine"))
    return FleetSpec.load(default_fleet_file(), env=env)


def fleet_state() -> dict:
    """The managed engine fleet as its controller reports it (``GET /fleet``), for the platform's API.

    ``running`` is False, with the last recorded state if there is one, when no controller
    answers. Reads the fleet file and run directory the way ``manage.py engine`` does.
    """
    from engine.launcher.cli import fetch_fleet
    from engine.launcher.fleet import FleetSpecError, read_state_file

    try:
        spec = _fleet_spec()
    except FleetSpecError as exc:
        return {"running": False, "fleet": None, "error": "invalid fleet file", "problems": exc.problems}
    snapshot = fetch_fleet(spec, timeout=2.0)
    if snapshot is not None:
        return {"running": True, "fleet": snapshot}
    return {"running": False, "fleet": None, "last_state": read_state_file(spec.run_dir)}


def fleet_groups() -> tuple[list[dict], bool]:
    """The fleet's replica groups (dicts with name, config, weight, and upstreams and dynamic when a controller
    reported them) and whether a controller answered: the running controller's, else its last recorded state's,
    else the fleet file's. Raises FleetUnavailable when the fleet file cannot be read."""
    from engine.launcher.fleet import FleetSpecError

    state = fleet_state()
    fleet = state.get("fleet") or state.get("last_state") or {}
    groups = [g for g in fleet.get("groups") or [] if isinstance(g, dict)]
    if groups:
        return groups, bool(state.get("running"))
    try:
        spec = _fleet_spec()
    except FleetSpecError as exc:
        raise FleetUnavailable(f"the fleet file cannot be read: {'; '.join(exc.problems)}") from None
    return [g.to_dict() for g in spec.groups], False


class FleetUnavailable(RuntimeError):
    """No fleet controller answers (not started, stopped, restarting), or the fleet file cannot be read."""


def fleet_control(method: str, path: str, body: dict | None = None, *, timeout: float = 10.0) -> tuple[int, dict]:
    """One call to the fleet controller's control API: (HTTP status, JSON body). Raises FleetUnavailable, with the
    reason, when no controller answers."""
    from engine.launcher.fleet import ControlUnavailable, FleetSpecError, control_request

    try:
        spec = _fleet_spec()
    except FleetSpecError as exc:
        raise FleetUnavailable(f"the fleet file cannot be read: {'; '.join(exc.problems)}") from None
    try:
        return control_request(spec, method, path, body, timeout=timeout)
    except ControlUnavailable as exc:
        raise FleetUnavailable(str(exc)) from None
