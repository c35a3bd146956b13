"""What the tests that run a fleet share: free ports and a fleet file for it, the engine's command line and control
API, and a live platform beside it with its set-up done (`open_fleet_platform`), whether the platform runs the fleet
(`runplatform --with-engine`, as `make up` does) or the test does; in server mode that platform gets a PostgreSQL
database of its own."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from benchkit.harness import ROOT, PlatformProcess, free_port, free_port_pair
from otlp_live_helpers import _drop_database, _server_mode_database

LLAMA_8B_H100 = {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "H100", "tensor_parallel_size": 1}


# -- one world per test directory ------------------------------------------------------------------------------------
# pytest gives a directory without __init__.py (every one here: an __init__.py would make tests/rollouts the package
# `rollouts`, the platform app's name) no package of its own, so a scope="package" fixture lives until the session
# ends: the live worlds of regressions, tuning and rollouts (a platform, a fleet, a load at a few requests/s) kept
# running under every later directory's tests. closed_with_directory closes one when the last test of its directory
# has run (tests/conftest.py: pytest_runtest_teardown), and at the latest when its fixture ends.
_OPEN_WORLDS: dict[Path, contextlib.ExitStack] = {}


@contextlib.contextmanager
def closed_with_directory(directory: Path, manager):
    """``manager``'s value, for the tests under ``directory``: exited after the last of them."""
    with contextlib.ExitStack() as stack:
        value = stack.enter_context(manager)
        _OPEN_WORLDS[directory] = stack
        try:
            yield value
        finally:
            _OPEN_WORLDS.pop(directory, None)


def close_finished_worlds(item, nextitem) -> None:
    """Exit the worlds of the directories whose last test ``item`` was."""
    for directory in [d for d in _OPEN_WORLDS if item.path.is_relative_to(d)]:
        if nextitem is None or not nextitem.path.is_relative_to(directory):
            _OPEN_WORLDS.pop(directory).close()


# -- the fleet -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FleetPorts:
    gateway: int
    control: int
    replicas: int  # the first replica's port; the next replicas take the ports after it

    @classmethod
    def free(cls) -> FleetPorts:
        return cls(free_port(), free_port(), free_port_pair())


def group(name: str, config: dict, *, backend: str = "simulator", weight: int = 100, replicas: int = 1,
          **fields) -> dict:
    """One replica group of a fleet file (``fields``: seed, served_model_name, ...)."""
    return {"name": name, "weight": weight, "replicas": replicas, "backend": backend, **fields,
            "config": dict(config)}


def exporting_to(process: PlatformProcess, key: str, grpc: bool = False) -> dict:
    """A fleet file's telemetry section for a fleet sending its spans to a live platform with ingest key ``key``:
    over OTLP/gRPC (the platform started with ``grpc=True``; vLLM exports over gRPC only) or OTLP/HTTP."""
    endpoint = f"127.0.0.1:{process.grpc_port}" if grpc else f"{process.url}/v1/traces"
    return {"otlp_endpoint": endpoint, "otlp_protocol": "grpc" if grpc else "http/protobuf",
            "otlp_headers": {"authorization": f"Bearer {key}"}}


def write_fleet(path: Path, *, name: str, run_dir: Path, ports: FleetPorts, groups: list[dict], telemetry: dict,
                **sections) -> Path:
    """A fleet file on ``ports`` with ``groups``; ``sections`` adds others (vllm, supervision, ...)."""
    spec = {"name": name, "run_dir": str(run_dir), "gateway": {"bind": f"127.0.0.1:{ports.gateway}"},
            "control": {"bind": f"127.0.0.1:{ports.control}"},
            "replicas": {"host": "127.0.0.1", "base_port": ports.replicas},
            **sections, "telemetry": telemetry, "groups": groups}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def unreachable_fleet_file(directory: Path, groups: str) -> Path:
    """A fleet file with ``groups`` (YAML flow lines) whose controller is not running (its control port refuses),
    with a control token: what reads the fleet takes the groups from the file."""
    port = free_port()
    run_dir = directory / "engine"
    run_dir.mkdir()
    (run_dir / "control.token").write_text("t" * 43)
    path = directory / "fleet.yaml"
    path.write_text(f"name: away\nrun_dir: {run_dir}\ncontrol: {{bind: \"127.0.0.1:{port}\"}}\n"
                    f"gateway: {{bind: \"127.0.0.1:{free_port()}\"}}\ngroups:\n{groups}")
    return path


def run_engine(fleet_file, *args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m engine ARGS --fleet FILE` from the checkout, in ``env``; by default this process's environment less
    its ENGINE_* and OTEL_* settings, so that the fleet file alone says where the fleet listens and sends."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "OTEL_"))}
    return subprocess.run([sys.executable, "-m", "engine", *args, "--fleet", str(fleet_file)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def fleet_control(control_url: str, run_dir: Path, method: str, path: str,
                  body: dict | None = None) -> tuple[int, dict]:
    """A call to a fleet controller's control API, with the token it keeps in its run directory."""
    token = (Path(run_dir) / "control.token").read_text().strip()
    request = urllib.request.Request(control_url + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- a live platform beside it -------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class FleetPlatform:
    """A live platform and the fleet whose spans it receives, as `open_fleet_platform` set them up."""

    process: PlatformProcess
    root: Path  # the platform's data directory, the fleet file and the fleet's run directory are below it
    fleet_file: Path | None  # None: the platform's own fleet (as `make up`)
    ports: FleetPorts
    keys: dict[str, str]  # ingest keys by project
    tokens: dict[str, str]  # API tokens (project default) by user; the first is the API client's default
    outputs: list[str]  # what the extra set-up commands printed, in order

    @property
    def token(self) -> str:
        return next(iter(self.tokens.values()))

    @property
    def gateway(self) -> int:
        return self.ports.gateway

    def api(self, method: str, path: str, body=None, token: str | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.process.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token or self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def manage_py(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """`manage.py ARGS` with the platform's settings (its data directory, its database)."""
        return subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=self.process.env,
                              capture_output=True, text=True, timeout=timeout)

    def cli(self, *args: str, timeout: float = 600) -> tuple[int, str]:
        """`manage.py ARGS`: its exit status and what it printed (stdout, then stderr)."""
        out = self.manage_py(*args, timeout=timeout)
        return out.returncode, out.stdout + out.stderr


@contextlib.contextmanager
def open_fleet_platform(root: Path, *, groups: list[dict] | None, name: str = "test-fleet", env: dict | None = None,
                        with_engine: bool = True, args: tuple[str, ...] = (), grpc: bool = False,
                        vllm_executable: str | None = None, keys: tuple[str, ...] = ("default", "other"),
                        tokens: tuple[tuple[str, str], ...] = (("ops", "operator"),),
                        setup: tuple[tuple[str, ...], ...] = (), start_timeout: float = 180,
                        cls: type[FleetPlatform] = FleetPlatform, **fields):
    """A started platform (a ``cls`` made with ``fields``) with an ingest key for each project of ``keys``, an API
    token in project default for each (user, role) of ``tokens``, and the ``setup`` commands' outputs; stopped (and
    its database dropped) afterwards. Its fleet:

    - ``groups`` given: the fleet file ``root``/fleet.yaml named ``name`` (ENGINE_FLEET). With ``with_engine`` the
      platform runs it and tells it where to send spans; otherwise the test starts it (``run_engine(...)``) and it
      sends them to the platform with project default's key, over gRPC where the platform has it (``grpc``).
    - ``groups`` None: the platform's own fleet (``with_engine``, as `make up`), on free ports.
    """
    ports = FleetPorts.free()
    fleet_file = root / "fleet.yaml" if groups is not None else None
    wiring = {"ENGINE_FLEET": str(fleet_file)} if fleet_file else {
        "ENGINE_GATEWAY_BIND": f"127.0.0.1:{ports.gateway}", "ENGINE_CONTROL_BIND": f"127.0.0.1:{ports.control}",
        "ENGINE_REPLICA_BASE_PORT": str(ports.replicas)}
    database = _server_mode_database()
    process = PlatformProcess(
        data_dir=str(root / "data"), args=(("--with-engine",) if with_engine else ()) + tuple(args), grpc=grpc,
        extra_env={**({"DATABASE_URL": database[1]} if database else {}), **wiring, **(env or {})})
    try:
        # One manage.py process for the whole set-up (one each would cost seconds apiece on a loaded host).
        _, *outputs = process.manage_many(
            ("migrate", "-v0"), *(("create_ingest_key", "--project", project) for project in keys),
            *(("create_api_token", "--user", user, "--role", role, "--project", "default") for user, role in tokens),
            *setup)
        made_keys = dict(zip(keys, outputs))
        made_tokens = dict(zip((user for user, _ in tokens), outputs[len(keys):]))
        if fleet_file:
            telemetry = ({"otlp_protocol": "grpc" if vllm_executable else "http/protobuf"} if with_engine
                         else exporting_to(process, made_keys["default"], grpc=grpc))
            write_fleet(fleet_file, name=name, run_dir=root / "engine", ports=ports, groups=groups,
                        telemetry=telemetry, **({"vllm": {"executable": vllm_executable}} if vllm_executable else {}))
        process.start(timeout=start_timeout)
        yield cls(process=process, root=root, fleet_file=fleet_file, ports=ports, keys=made_keys, tokens=made_tokens,
                  outputs=outputs[len(keys) + len(tokens):], **fields)
    finally:
        process.stop()
        if database:
            _drop_database(*database)
