"""A fleet of replica groups behind the gateway: its YAML spec, and the controller that runs it.

The controller owns one run directory. It starts the replica groups and the gateway as
supervised processes, keeps the gateway's route table (a JSON file it rewrites, and the
gateway's ``PUT /admin/routes``) in step with the replicas that serve, and answers a small
control API on loopback, authenticated by a bearer token kept in ``<run_dir>/control.token``
(mode 0600). The API is what ``python -m engine status|down`` and the platform's rollouts use:

``GET /fleet``
    The whole state: fleet state (``starting``, ``running``, ``degraded``, ``stopping``),
    the gateway, each group (weight, replicas, backend, config version and knobs, the
    replacement under way or the last one), and every process (group, config version,
    port, pid, state, restarts, last exit code, since, log path).
``PUT /fleet/groups/{name}/config`` with ``{"config": {<engine config>}}``
    Validates the config (400 with every problem), answers 200 ``unchanged`` when its
    version is the running one, 409 while that group is already being replaced, else 202
    and replaces the group in the background: new replicas on new ports, the gateway moved
    to them once healthy, the old ones drained then stopped. Progress is in ``GET /fleet``
    (``groups[].transition``).
``PUT /fleet/weights`` with ``{"weights": {"baseline": 90, "canary": 10}}``
    Changes traffic weights (≥ 0, at least one group above 0); 200 once the gateway has them.
``POST /fleet/stop``
    202; stops the gateway, then the replicas, then the controller.

Errors are ``{"error": "..."}`` (plus ``"problems": [...]`` for invalid configs) with 400,
401, 404, 409, 413 or 502.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from engine.config import ConfigError, EngineConfig
from engine.launcher.supervisor import (
    HEALTHY,
    CommandFactory,
    ManagedProcess,
    ReplacementFailed,
    Supervisor,
    SupervisorPolicy,
    kill_recorded_processes,
    now_iso,
    process_start_ticks,
)
from engine.launcher.vllm_command import (
    DETAILED_TRACE_MODULES,
    ENV_VLLM_EXECUTABLE,
    OTLP_PROTOCOLS,
    LaunchCommand,
    encode_otlp_headers,
    find_vllm_executable,
    host_has_gpu,
    render_simulator_command,
    render_vllm_command,
    write_config_file,
)

log = logging.getLogger(__name__)

BACKENDS = ("vllm", "simulator")
DEFAULT_GATEWAY_BIND = "127.0.0.1:8100"
DEFAULT_CONTROL_BIND = "127.0.0.1:8190"
DEFAULT_BASE_PORT = 8101
DEFAULT_RUN_DIR = ".data/engine"
# How long a replica may take to answer /health after starting, per backend, unless the fleet says otherwise:
# the simulator is up in about a second; vLLM downloads/loads weights and captures CUDA graphs.
DEFAULT_STARTUP_TIMEOUT = {"simulator": 60.0, "vllm": 1200.0}
GATEWAY_STARTUP_TIMEOUT = 30.0
MAX_REPLICAS_PER_GROUP = 64
_GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_BODY = 64 * 1024

# Environment overrides (``make up`` wires the fleet to the platform with these).
ENV_GATEWAY_BIND = "ENGINE_GATEWAY_BIND"
ENV_CONTROL_BIND = "ENGINE_CONTROL_BIND"
ENV_RUN_DIR = "ENGINE_RUN_DIR"
ENV_BASE_PORT = "ENGINE_REPLICA_BASE_PORT"
ENV_OTLP_ENDPOINT = "ENGINE_OTLP_ENDPOINT"
ENV_OTLP_PROTOCOL = "ENGINE_OTLP_PROTOCOL"
ENV_OTLP_HEADERS = "ENGINE_OTLP_HEADERS"
ENV_GATEWAY_ADMIN_TOKEN = "ENGINE_GATEWAY_ADMIN_TOKEN"

# Files in the run directory.
CONTROL_TOKEN_FILE = "control.token"
GATEWAY_TOKEN_FILE = "gateway.token"
STATE_FILE = "controller.json"
PID_FILE = "controller.pid"
LOCK_FILE = "controller.lock"
CONTROLLER_LOG = "controller.log"
ROUTES_FILE = "gateway-routes.json"


class FleetSpecError(ValueError):
    """A fleet file that cannot be run; ``problems`` lists every reason, each naming where it is."""

    def __init__(self, problems: Sequence[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(prefix + "; ".join(self.problems))


# ---------------------------------------------------------------------------------------------- spec
@dataclasses.dataclass(frozen=True)
class TelemetrySpec:
    """Where every component (gateway and replicas) sends its spans."""

    otlp_endpoint: str | None = None
    otlp_protocol: str = "grpc"
    otlp_headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    collect_detailed_traces: str | None = None

    def environment(self) -> dict[str, str]:
        """OTEL_* variables for a component that reads the standard OTel environment (the gateway)."""
        env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": self.otlp_protocol}
        if self.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = self.otlp_endpoint
        if self.otlp_headers:
            env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = encode_otlp_headers(self.otlp_headers)
        return env


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One replica group: traffic weight, replica count, backend and engine config.

    ``env`` is added to each replica's environment, e.g. ``CUDA_VISIBLE_DEVICES`` to pin a
    vLLM group to its GPUs (the launcher does not share GPUs out between replicas itself).
    """

    name: str
    weight: float
    replicas: int
    backend: str
    config: EngineConfig
    served_model_name: str | None = None
    seed: int | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "weight": self.weight, "replicas": self.replicas,
                                "backend": self.backend, "config": self.config.to_dict()}
        if self.served_model_name:
            data["served_model_name"] = self.served_model_name
        if self.seed is not None:
            data["seed"] = self.seed
        if self.env:
            data["env"] = dict(self.env)
        return data


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    """A whole fleet: gateway and control addresses, run directory, telemetry, supervision, groups."""

    name: str
    run_dir: Path
    gateway_bind: str
    control_bind: str
    replica_host: str
    base_port: int
    telemetry: TelemetrySpec
    supervision: SupervisorPolicy
    groups: tuple[GroupSpec, ...]
    gateway_admin_token: str | None = None
    # The `vllm` command for backend: vllm (fleet key vllm.executable or $ENGINE_VLLM_EXECUTABLE); None: `make vllm`'s
    # virtualenv, else `vllm` on PATH (engine.launcher.vllm_command.find_vllm_executable).
    vllm_executable: str | None = None
    # Supervision keys the file set explicitly (so backend defaults do not override them).
    supervision_overrides: frozenset[str] = frozenset()
    source: str | None = None

    @property
    def gateway_address(self) -> tuple[str, int]:
        return split_bind(self.gateway_bind)

    @property
    def control_address(self) -> tuple[str, int]:
        return split_bind(self.control_bind)

    @property
    def gateway_url(self) -> str:
        return _http_url(*self.gateway_address)

    @property
    def control_url(self) -> str:
        return _http_url(*self.control_address)

    def group(self, name: str) -> GroupSpec | None:
        return next((g for g in self.groups if g.name == name), None)

    def host_problems(self, *, has_gpu: bool | None = None) -> list[str]:
        """Why this host cannot start the fleet's vLLM groups (no `vllm` command, a GPU type without a GPU)."""
        vllm_groups = [g for g in self.groups if g.backend == "vllm"]
        if not vllm_groups:
            return []
        problems = []
        executable = self.resolve_vllm_executable()
        if executable is None or shutil.which(executable) is None:
            problems.append(f"backend vllm needs the `vllm` command{f' ({executable} is not one)' if executable else ''}"
                            ": run `make vllm` (vLLM's CPU build in .venv-vllm), install vLLM on PATH, or set "
                            "vllm.executable / $ENGINE_VLLM_EXECUTABLE")
        has_gpu = host_has_gpu() if has_gpu is None else has_gpu
        for group in vllm_groups:
            if group.config.gpu_type != "CPU" and not has_gpu:
                problems.append(f"group {group.name!r}: gpu_type {group.config.gpu_type} needs a GPU and this host "
                                "has none; use gpu_type: CPU (vLLM's CPU build) or backend: simulator")
        return problems

    def resolve_vllm_executable(self) -> str | None:
        return self.vllm_executable or find_vllm_executable()

    def policy_for(self, backend: str) -> SupervisorPolicy:
        """The supervision policy of a backend: the fleet's, with the backend's startup timeout unless set."""
        if "startup_timeout" in self.supervision_overrides:
            return self.supervision
        timeout = DEFAULT_STARTUP_TIMEOUT.get(backend, GATEWAY_STARTUP_TIMEOUT)
        return dataclasses.replace(self.supervision, startup_timeout=timeout)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "run_dir": str(self.run_dir),
            "gateway": {"bind": self.gateway_bind},
            "control": {"bind": self.control_bind},
            "replicas": {"host": self.replica_host, "base_port": self.base_port},
            "telemetry": {
                "otlp_endpoint": self.telemetry.otlp_endpoint,
                "otlp_protocol": self.telemetry.otlp_protocol,
                # Header values carry ingest keys: never echo them.
                "otlp_headers": sorted(self.telemetry.otlp_headers),
                "collect_detailed_traces": self.telemetry.collect_detailed_traces,
            },
            "groups": [g.to_dict() for g in self.groups],
        }

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> FleetSpec:
        """Read a YAML fleet file, then apply the ENGINE_* environment overrides."""
        import yaml

        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as handle:
                data = yaml.safe_load(handle)
        except OSError as exc:
            raise FleetSpecError([f"cannot read the fleet file: {exc.strerror or exc}"], source) from None
        except yaml.YAMLError as exc:
            raise FleetSpecError([f"not valid YAML: {exc}"], source) from None
        return cls.from_dict(data, env=env, source=str(Path(source).resolve()))

    @classmethod
    def from_dict(cls, data: object, *, env: Mapping[str, str] | None = None, source: str | None = None) -> FleetSpec:
        """Validate plain data; every problem is reported at once, each with its place in the file."""
        env = os.environ if env is None else env
        problems: list[str] = []
        if not isinstance(data, Mapping):
            raise FleetSpecError([f"a fleet file must be a mapping, not {type(data).__name__}"], source)
        _unknown(data, {"name", "run_dir", "gateway", "control", "replicas", "telemetry", "supervision", "groups",
                        "vllm"}, "", problems)

        name = data.get("name", "fleet")
        if not isinstance(name, str) or not _GROUP_NAME.match(name):
            problems.append(f"name must be 1-64 letters, digits, '_', '.' or '-', not {name!r}")
            name = "fleet"

        run_dir_text = env.get(ENV_RUN_DIR) or data.get("run_dir") or DEFAULT_RUN_DIR
        if not isinstance(run_dir_text, str):
            problems.append(f"run_dir must be a path, not {run_dir_text!r}")
            run_dir_text = DEFAULT_RUN_DIR
        # Relative to the working directory, as for any CLI path; `make up` runs from the repository root.
        run_dir = Path(run_dir_text).expanduser().resolve()

        gateway = _section(data, "gateway", problems)
        _unknown(gateway, {"bind", "admin_token"}, "gateway.", problems)
        gateway_bind = env.get(ENV_GATEWAY_BIND) or gateway.get("bind") or DEFAULT_GATEWAY_BIND
        _check_bind(gateway_bind, "gateway.bind" if not env.get(ENV_GATEWAY_BIND) else ENV_GATEWAY_BIND, problems)
        admin_token = env.get(ENV_GATEWAY_ADMIN_TOKEN) or gateway.get("admin_token")
        if admin_token is not None and (not isinstance(admin_token, str) or len(admin_token) < 16
                                        or any(c.isspace() for c in admin_token)):
            problems.append("gateway.admin_token must be a string of at least 16 characters without spaces "
                            "(leave it out to have one generated in the run directory)")
            admin_token = None

        control = _section(data, "control", problems)
        _unknown(control, {"bind"}, "control.", problems)
        control_bind = env.get(ENV_CONTROL_BIND) or control.get("bind") or DEFAULT_CONTROL_BIND
        where = "control.bind" if not env.get(ENV_CONTROL_BIND) else ENV_CONTROL_BIND
        if _check_bind(control_bind, where, problems):
            host, _ = split_bind(control_bind)
            if not _is_loopback(host):
                problems.append(f"{where} must be a loopback address (127.0.0.1, ::1 or localhost), not {host!r}: "
                                "the control API stops and reconfigures the fleet")

        replicas = _section(data, "replicas", problems)
        _unknown(replicas, {"host", "base_port"}, "replicas.", problems)
        replica_host = replicas.get("host", "127.0.0.1")
        if not isinstance(replica_host, str) or not replica_host or any(c.isspace() for c in replica_host):
            problems.append(f"replicas.host must be a hostname or IP address, not {replica_host!r}")
            replica_host = "127.0.0.1"
        base_port: Any = env.get(ENV_BASE_PORT) or replicas.get("base_port", DEFAULT_BASE_PORT)
        if isinstance(base_port, str) and base_port.strip().isdigit():
            base_port = int(base_port)
        if not isinstance(base_port, int) or isinstance(base_port, bool) or not 1024 <= base_port <= 65000:
            problems.append(f"replicas.base_port must be an integer in 1024..65000, not {base_port!r}")
            base_port = DEFAULT_BASE_PORT

        telemetry = _telemetry_from(_section(data, "telemetry", problems), env, problems)

        supervision_data = _section(data, "supervision", problems)
        try:
            supervision = SupervisorPolicy.from_dict(dict(supervision_data))
        except (TypeError, ValueError) as exc:
            problems.append(f"supervision: {exc}")
            supervision = SupervisorPolicy()

        groups = _groups_from(data.get("groups"), problems)
        vllm_section = _section(data, "vllm", problems)
        _unknown(vllm_section, {"executable"}, "vllm.", problems)
        vllm_executable = env.get(ENV_VLLM_EXECUTABLE) or vllm_section.get("executable")
        if vllm_executable is not None and (not isinstance(vllm_executable, str) or not vllm_executable.strip()):
            problems.append(f"vllm.executable must be a command or a path, not {vllm_executable!r}")
            vllm_executable = None
        if problems:
            raise FleetSpecError(problems, source)
        return cls(
            name=name,
            run_dir=run_dir,
            gateway_bind=gateway_bind,
            control_bind=control_bind,
            replica_host=replica_host,
            base_port=base_port,
            telemetry=telemetry,
            supervision=supervision,
            groups=groups,
            gateway_admin_token=admin_token,
            vllm_executable=vllm_executable,
            supervision_overrides=frozenset(supervision_data),
            source=source,
        )


def split_bind(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port); ValueError with the reason otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"an address must be HOST:PORT, not {text!r}")
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"an address must be HOST:PORT, not {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 address needs brackets, e.g. [::1]:8100, not {text!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, not {port}")
    return host, port


def _http_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # a wildcard bind is reached through loopback
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_bind(value: object, where: str, problems: list[str]) -> bool:
    try:
        split_bind(value)  # type: ignore[arg-type]
    except ValueError as exc:
        problems.append(f"{where}: {exc}")
        return False
    return True


def _section(data: Mapping, key: str, problems: list[str]) -> Mapping:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        problems.append(f"{key} must be a mapping, not {type(value).__name__}")
        return {}
    return value


def _unknown(section: Mapping, known: set[str], prefix: str, problems: list[str]) -> None:
    for key in section:
        if key not in known:
            problems.append(f"unknown key {prefix}{key} (known: {', '.join(sorted(known))})")


def parse_headers_text(text: str) -> dict[str, str]:
    """``key=value,key2=value2`` (values may be percent-encoded), as in OTEL_EXPORTER_OTLP_HEADERS."""
    from urllib.parse import unquote

    headers: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"header {item.strip()!r} is not key=value")
        headers[key.strip()] = unquote(value.strip())
    return headers


def _telemetry_from(section: Mapping, env: Mapping[str, str], problems: list[str]) -> TelemetrySpec:
    _unknown(section, {"otlp_endpoint", "otlp_protocol", "otlp_headers", "collect_detailed_traces"},
             "telemetry.", problems)
    endpoint = env.get(ENV_OTLP_ENDPOINT) or section.get("otlp_endpoint")
    if endpoint is not None and (not isinstance(endpoint, str) or not endpoint.strip()
                                 or any(c.isspace() for c in endpoint)):
        problems.append(f"telemetry.otlp_endpoint must be host:port or a URL, not {endpoint!r}")
        endpoint = None
    protocol = env.get(ENV_OTLP_PROTOCOL) or section.get("otlp_protocol") or "grpc"
    if protocol not in OTLP_PROTOCOLS:
        problems.append(f"telemetry.otlp_protocol must be one of {', '.join(OTLP_PROTOCOLS)}, not {protocol!r}")
        protocol = "grpc"
    headers: dict[str, str] = {}
    raw_headers = section.get("otlp_headers") or {}
    if not isinstance(raw_headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_headers.items()):
        problems.append("telemetry.otlp_headers must map header names to string values")
    else:
        headers.update(raw_headers)
    if env.get(ENV_OTLP_HEADERS):
        try:
            headers.update(parse_headers_text(env[ENV_OTLP_HEADERS]))
        except ValueError as exc:
            problems.append(f"{ENV_OTLP_HEADERS}: {exc}")
    try:
        encode_otlp_headers(headers)
    except ValueError as exc:
        problems.append(f"telemetry.otlp_headers: {exc}")
        headers = {}
    detailed = section.get("collect_detailed_traces")
    if detailed is not None and detailed not in DETAILED_TRACE_MODULES:
        problems.append(f"telemetry.collect_detailed_traces must be one of {', '.join(DETAILED_TRACE_MODULES)}, "
                        f"not {detailed!r}")
        detailed = None
    return TelemetrySpec(otlp_endpoint=endpoint, otlp_protocol=protocol, otlp_headers=headers,
                         collect_detailed_traces=detailed)


def _groups_from(items: object, problems: list[str]) -> tuple[GroupSpec, ...]:
    if not isinstance(items, list) or not items:
        problems.append("groups must be a non-empty list of replica groups")
        return ()
    groups: list[GroupSpec] = []
    for index, item in enumerate(items):
        where = f"groups[{index}]"
        if not isinstance(item, Mapping):
            problems.append(f"{where} must be a mapping with name, weight, replicas, backend and config")
            continue
        _unknown(item, {"name", "weight", "replicas", "backend", "config", "served_model_name", "seed", "env"},
                 f"{where}.", problems)
        name = item.get("name")
        if not isinstance(name, str) or not _GROUP_NAME.match(name):
            problems.append(f"{where}.name must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter "
                            f"or digit), not {name!r}")
            name = f"#{index}"
        else:
            where = f"group {name!r}"
        weight = item.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight < 0:
            problems.append(f"{where}: weight must be a number >= 0, not {weight!r}")
            weight = 0
        replicas = item.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= MAX_REPLICAS_PER_GROUP:
            problems.append(f"{where}: replicas must be an integer in 1..{MAX_REPLICAS_PER_GROUP}, not {replicas!r}")
            replicas = 1
        backend = item.get("backend", "simulator")
        if backend not in BACKENDS:
            problems.append(f"{where}: backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
            backend = "simulator"
        served = item.get("served_model_name")
        if served is not None and (not isinstance(served, str) or not served.strip()
                                   or any(c.isspace() for c in served)):
            problems.append(f"{where}: served_model_name must be a name without spaces, not {served!r}")
            served = None
        seed = item.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            problems.append(f"{where}: seed must be an integer, not {seed!r}")
            seed = None
        raw_config = item.get("config", {})
        try:
            config = EngineConfig.from_dict(raw_config if raw_config is not None else {})
        except ConfigError as exc:
            problems.extend(f"{where}.config: {problem}" for problem in exc.problems)
            continue
        env = item.get("env") or {}
        if not isinstance(env, Mapping) or not all(
                isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, (str, int)) and not isinstance(v, bool)
                for k, v in env.items()):
            problems.append(f"{where}: env must map variable names to strings (e.g. CUDA_VISIBLE_DEVICES: \"0,1\")")
            env = {}
        groups.append(GroupSpec(name=name, weight=weight, replicas=replicas, backend=backend, config=config,
                                served_model_name=served, seed=seed, env={k: str(v) for k, v in env.items()}))
    names = [g.name for g in groups]
    for duplicate in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"group names must be unique: {duplicate!r} appears {names.count(duplicate)} times")
    if groups and not any(g.weight > 0 for g in groups):
        problems.append("at least one group must have a weight above 0 (the gateway needs somewhere to send traffic)")
    return tuple(groups)


# ---------------------------------------------------------------------------------------------- run directory
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


# ---------------------------------------------------------------------------------------------- controller
@dataclasses.dataclass
class GroupRuntime:
    """What the controller knows of one group while it runs."""

    spec: GroupSpec
    weight: float
    config: EngineConfig
    serving: list[ManagedProcess] = dataclasses.field(default_factory=list)
    transition: dict[str, Any] | None = None
    last_transition: dict[str, Any] | None = None
    task: asyncio.Task | None = None
    # Added at run time through the control API (a rollout's canary), copying ``base``'s backend and model;
    # not in the fleet file, so gone when the controller restarts (whoever added it adds it again).
    base: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "dynamic": self.base is not None,
            "base": self.base,
            "weight": self.weight,
            "replicas": self.spec.replicas,
            "backend": self.spec.backend,
            "served_model_name": self.spec.served_model_name or self.config.model,
            "config_version": self.config.version,
            "config": self.config.to_dict(),
            "upstreams": [p.url for p in self.serving],
            "transition": self.transition,
            "last_transition": self.last_transition,
        }


class GatewayError(RuntimeError):
    """The gateway refused or could not take a route update."""


class FleetController:
    """Runs one fleet: replica groups, the gateway, route updates, config replacements and the control API."""

    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.run_dir = spec.run_dir
        self.state = "starting"
        self.started_at = time.time()
        self.supervisor = Supervisor(spec.run_dir, host=spec.replica_host, base_port=spec.base_port,
                                     policy=spec.supervision, on_change=self._process_changed)
        self.groups: dict[str, GroupRuntime] = {
            g.name: GroupRuntime(spec=g, weight=g.weight, config=g.config) for g in spec.groups
        }
        self.gateway: ManagedProcess | None = None
        self.control_token = ""
        self.gateway_token = ""
        self._lock = RunDirLock(spec.run_dir)
        self._stop = asyncio.Event()
        # One route change at a time: replacement switches, weight changes and reconciliation all go through it.
        self._routes_lock = asyncio.Lock()
        # The gateway's own health verdict per upstream URL (from GET /admin/routes); None when unknown.
        self._gateway_view: dict[str, bool] | None = None
        self._state_write_pending = False
        self._ever_ready = False
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, on_ready=None) -> int:
        """Start everything, serve until stopped (signal or ``POST /fleet/stop``), stop everything; exit status."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self._lock.acquire():
            pid = _read_pid(self.run_dir)
            log.error("a controller already runs in %s (pid %s)", self.run_dir, pid or "unknown")
            return 1
        try:
            stale = clean_stale_run_dir(self.run_dir)
            if stale:
                log.warning("stopped %d process(es) left by a controller that died: %s", len(stale), stale)
            (self.run_dir / PID_FILE).write_text(f"{os.getpid()}\n", encoding="utf-8")
            self.control_token = read_or_create_token(self.run_dir / CONTROL_TOKEN_FILE)
            self.gateway_token = self._gateway_token()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self.request_stop)
            try:
                await self._start_control_api()
            except OSError as exc:
                log.error("cannot serve the control API on %s: %s", self.spec.control_bind, exc.strerror or exc)
                self.state = "failed"
                self._write_state()
                return 1
            host_problems = self.spec.host_problems()
            if host_problems:
                for problem in host_problems:
                    log.error("cannot start the fleet: %s", problem)
                self.state = "failed"
                self._write_state()
                return 1
            self._start_replicas()
            self._write_state()
            starter = asyncio.ensure_future(self._start_gateway_when_replicas_are_up())
            watcher = asyncio.ensure_future(self._watch_readiness(on_ready))
            await self._stop.wait()
            for task in (starter, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self._shutdown()
            return 0
        finally:
            if self.supervisor.processes():  # an unexpected error: never leave replicas behind
                log.error("the controller is exiting abnormally; stopping its processes")
                await self.supervisor.close()
                self.state = "stopped"
                self._write_state(force=True)
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_signal_handler(sig)
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / PID_FILE).unlink()
            self._lock.release()

    def request_stop(self) -> None:
        if not self._stop.is_set():
            log.info("stopping the fleet")
            self._stop.set()

    def _start_replicas(self) -> None:
        # Keep the allocator off the addresses the gateway and the control API bind.
        self.supervisor.ports.reserve(self.spec.gateway_address[1])
        self.supervisor.ports.reserve(self.spec.control_address[1])
        for group in self.groups.values():
            group.serving = self.supervisor.spawn_group(
                group.spec.name, replicas=group.spec.replicas,
                command_factory=self._replica_factory(group.spec, group.config),
                config_version=group.config.version, backend=group.spec.backend,
                policy=self.spec.policy_for(group.spec.backend),
            )
        self._write_routes_file(self._routes())

    async def _start_gateway_when_replicas_are_up(self) -> None:
        """Start the gateway once the replicas answer (or their startup timeout passed).

        Started earlier, the gateway would find its upstreams refusing connections, take them
        out of rotation and only look again at its next probe round.
        """
        replicas = [p for group in self.groups.values() for p in group.serving]
        timeout = max(self.spec.policy_for(g.spec.backend).startup_timeout for g in self.groups.values())
        laggards = await self.supervisor.wait_healthy(replicas, timeout)
        if laggards:
            log.warning("starting the gateway although %s not healthy yet",
                        ", ".join(p.name for p in laggards) + (" is" if len(laggards) == 1 else " are"))
        gateway_host, gateway_port = self.spec.gateway_address
        gateway_policy = self.spec.supervision
        if "startup_timeout" not in self.spec.supervision_overrides:
            gateway_policy = dataclasses.replace(gateway_policy, startup_timeout=GATEWAY_STARTUP_TIMEOUT)
        # Liveness, not readiness: the gateway's /health answers 503 while no replica is up, and restarting
        # the gateway would not bring a replica back (it would only drop the requests it holds).
        gateway_policy = dataclasses.replace(gateway_policy, health_path="/metrics")
        self.gateway = self.supervisor.spawn(
            name="gateway", group="gateway", role="gateway", backend="gateway", port=gateway_port,
            host=gateway_host if gateway_host not in ("0.0.0.0", "::") else "127.0.0.1",
            command_factory=self._gateway_factory(), policy=gateway_policy, movable_port=False,
        )

    async def _watch_readiness(self, on_ready) -> None:
        while not self._stop.is_set():
            await self._reconcile_gateway()
            ready = self._all_healthy()
            new_state = "running" if ready else ("degraded" if self._ever_ready else "starting")
            if new_state != self.state and self.state not in ("stopping", "stopped"):
                self.state = new_state
                self._write_state()
            if ready and not self._ever_ready:
                self._ever_ready = True
                if on_ready is not None:
                    on_ready(self)
            await asyncio.sleep(0.3)

    def _all_healthy(self) -> bool:
        """Gateway and every serving replica healthy, as this controller and as the gateway itself see them."""
        if self.gateway is None or self.gateway.state != HEALTHY or self._gateway_view is None:
            return False
        return all(p.state == HEALTHY and self._gateway_view.get(p.url) is True
                   for g in self.groups.values() for p in g.serving)

    async def _shutdown(self) -> None:
        self.state = "stopping"
        self._write_state()
        for group in self.groups.values():
            if group.task is not None and not group.task.done():
                group.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await group.task
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.supervisor.close()
        self.state = "stopped"
        self._write_state(force=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        log.info("fleet stopped")

    # ------------------------------------------------------------------ commands for processes
    def _replica_factory(self, group: GroupSpec, config: EngineConfig) -> CommandFactory:
        telemetry = self.spec.telemetry
        host = self.spec.replica_host
        if group.backend == "simulator":
            config_path = write_config_file(config, self.run_dir / "configs" / f"{group.name}-{config.version}.json")

            def simulator(port: int) -> LaunchCommand:
                return _with_env(render_simulator_command(
                    config, config_path=config_path, host=host, port=port, group=group.name,
                    served_model_name=group.served_model_name, otlp_traces_endpoint=telemetry.otlp_endpoint,
                    otlp_protocol=telemetry.otlp_protocol, otlp_headers=telemetry.otlp_headers, seed=group.seed,
                ), group.env)
            return simulator

        vllm_executable = self.spec.resolve_vllm_executable() or "vllm"

        def vllm(port: int) -> LaunchCommand:
            return _with_env(render_vllm_command(
                config, host=host, port=port, served_model_name=group.served_model_name,
                otlp_traces_endpoint=telemetry.otlp_endpoint, otlp_protocol=telemetry.otlp_protocol,
                otlp_headers=telemetry.otlp_headers, collect_detailed_traces=telemetry.collect_detailed_traces,
                group=group.name, vllm_executable=vllm_executable,
            ), group.env)
        return vllm

    def _gateway_token(self) -> str:
        path = self.run_dir / GATEWAY_TOKEN_FILE
        if self.spec.gateway_admin_token is None:
            return read_or_create_token(path)
        # A token from the fleet file or the environment still reaches the gateway through a 0600 file, not argv.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(self.spec.gateway_admin_token + "\n")
        os.chmod(path, 0o600)
        return self.spec.gateway_admin_token

    def _gateway_factory(self) -> CommandFactory:
        host, _ = self.spec.gateway_address
        routes_path = self.run_dir / ROUTES_FILE
        token_path = self.run_dir / GATEWAY_TOKEN_FILE
        env = self.spec.telemetry.environment()

        def gateway(port: int) -> LaunchCommand:
            bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            # The token goes by file so it never shows in `ps`.
            argv = (sys.executable, "-m", "engine.gateway", "--bind", bind, "--routes", str(routes_path),
                    "--admin-token-file", str(token_path))
            return LaunchCommand(argv=argv, env=env)
        return gateway

    # ------------------------------------------------------------------ routes
    def _routes(self, overrides: Mapping[str, Sequence[ManagedProcess]] | None = None,
                weights: Mapping[str, float] | None = None) -> list[dict]:
        routes = []
        for name, group in self.groups.items():
            serving = (overrides or {}).get(name, group.serving)
            weight = (weights or {}).get(name, group.weight)
            routes.append({"name": name, "weight": weight, "upstreams": [p.url for p in serving]})
        return routes

    def _write_routes_file(self, routes: list[dict]) -> None:
        # The gateway reads this file when it (re)starts, so it always holds the current table.
        write_json_atomic(self.run_dir / ROUTES_FILE, routes)

    async def _send_routes(self, routes: list[dict], *, attempts: int = 1) -> None:
        """Write the routes file, then PUT the table to the gateway (call with ``_routes_lock`` held).

        The file is written first: a gateway that restarts reads it, so it never comes back
        with an old table. Raises GatewayError when the gateway refuses or cannot be reached.
        """
        self._write_routes_file(routes)
        gateway = self.gateway
        if gateway is None:
            return
        last_error = ""
        for attempt in range(attempts):
            try:
                async with self._client().put(gateway.url + "/admin/routes", json={"groups": routes},
                                              headers={"Authorization": f"Bearer {self.gateway_token}"},
                                              timeout=aiohttp.ClientTimeout(total=10)) as response:
                    body = await response.text()
                    if response.status == 200:
                        return
                    last_error = f"gateway answered {response.status}: {body[:300]}"
                    if 400 <= response.status < 500:
                        break  # a refusal, not a hiccup
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last_error = f"gateway unreachable: {exc.__class__.__name__}: {exc}"
            if attempt + 1 < attempts:
                await asyncio.sleep(0.5 * (attempt + 1))
        raise GatewayError(last_error)

    async def _refresh_routes(self) -> None:
        """Send the current table (it also makes the gateway probe its upstreams now); failures only logged."""
        async with self._routes_lock:
            try:
                await self._send_routes(self._routes())
            except GatewayError as exc:
                log.warning("route update not delivered (%s); the gateway reads %s when it restarts", exc,
                            ROUTES_FILE)

    async def _reconcile_gateway(self) -> None:
        """Read the gateway's table; record its health verdicts and send ours if it differs (e.g. after a restart)."""
        gateway = self.gateway
        if gateway is None or gateway.state != HEALTHY:
            self._gateway_view = None
            return
        if self._routes_lock.locked():
            return  # a route change is under way; look again next round
        async with self._routes_lock:
            try:
                async with self._client().get(gateway.url + "/admin/routes",
                                              headers={"Authorization": f"Bearer {self.gateway_token}"},
                                              timeout=aiohttp.ClientTimeout(total=5)) as response:
                    document = await response.json(content_type=None) if response.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                document = None
            view, table = _read_gateway_table(document)
            self._gateway_view = view
            if table is None:
                return
            wanted = _comparable(self._routes())
            if table != wanted:
                log.info("the gateway's route table differs from the fleet's; sending the fleet's")
                try:
                    await self._send_routes(self._routes())
                except GatewayError as exc:
                    log.warning("route update not delivered: %s", exc)

    def _process_changed(self, process: ManagedProcess) -> None:
        self._write_state()
        if self._stop.is_set():
            return
        serving = any(process in group.serving for group in self.groups.values())
        if process.role == "gateway" and process.state == HEALTHY:
            # A (re)started gateway read the routes file; send the table anyway in case it changed meanwhile.
            self._spawn_background(self._refresh_routes())
        elif process.role == "replica" and serving and process.state == HEALTHY:
            # A replica (back) up, maybe on another port: the update tells the gateway, and makes it probe
            # the replica now rather than at its next round.
            self._spawn_background(self._refresh_routes())

    def _spawn_background(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ operations (control API)
    async def set_group_config(self, name: str, config: EngineConfig, *, drain_timeout: float | None = None
                               ) -> tuple[int, dict[str, Any]]:
        """Start replacing a group's replicas with ``config``; (HTTP status, body)."""
        group = self.groups.get(name)
        if group is None:
            return 404, {"error": f"no group {name!r}; groups: {', '.join(self.groups)}"}
        if group.task is not None and not group.task.done():
            return 409, {"error": f"group {name!r} is already being replaced", "transition": group.transition}
        if self._stop.is_set():
            return 409, {"error": "the fleet is stopping"}
        if config.version == group.config.version:
            return 200, {"status": "unchanged", "group": name, "config_version": config.version}
        changes = {knob: [old, new] for knob, (old, new) in group.config.diff(config).items()}
        group.transition = {
            "from_version": group.config.version, "to_version": config.version, "phase": "starting",
            "changes": changes, "started_at": now_iso(), "error": None,
        }
        group.task = asyncio.ensure_future(self._replace(group, config, drain_timeout))
        self._write_state()
        return 202, {"status": "replacing", "group": name, "from_version": group.config.version,
                     "to_version": config.version, "changes": changes}

    async def _replace(self, group: GroupRuntime, config: EngineConfig, drain_timeout: float | None) -> None:
        transition = group.transition or {}
        previous = list(group.serving)

        def on_phase(phase: str) -> None:
            transition["phase"] = phase
            self._write_state()

        async def switch(new: Sequence[ManagedProcess]) -> None:
            async with self._routes_lock:
                group.serving = list(new)
                try:
                    await self._send_routes(self._routes(), attempts=5)
                except GatewayError:
                    group.serving = previous
                    with contextlib.suppress(GatewayError):
                        await self._send_routes(self._routes())
                    raise
                group.config = config  # from here on the new version is what serves

        try:
            result = await self.supervisor.replace_group(
                group.spec.name, replicas=group.spec.replicas,
                command_factory=self._replica_factory(group.spec, config), config_version=config.version,
                backend=group.spec.backend, switch=switch, on_phase=on_phase,
                ready_timeout=self.spec.policy_for(group.spec.backend).startup_timeout,
                drain_timeout=drain_timeout, policy=self.spec.policy_for(group.spec.backend),
            )
            transition["result"] = result
        except ReplacementFailed as exc:
            log.error("replacing group %s failed: %s", group.spec.name, exc)
            transition["phase"] = "failed"
            transition["error"] = str(exc)
        except asyncio.CancelledError:
            transition["phase"] = "cancelled"
            raise
        except Exception as exc:  # keep the controller alive and say what happened
            log.exception("replacing group %s failed", group.spec.name)
            transition["phase"] = "failed"
            transition["error"] = f"{exc.__class__.__name__}: {exc}"
        finally:
            transition["finished_at"] = now_iso()
            group.last_transition = transition
            group.transition = None
            self._write_state()

    async def set_weights(self, weights: Mapping[str, float]) -> tuple[int, dict[str, Any]]:
        new = {name: group.weight for name, group in self.groups.items()}
        new.update(weights)
        if not any(w > 0 for w in new.values()):
            return 400, {"error": "at least one group must keep a weight above 0"}
        async with self._routes_lock:
            try:
                await self._send_routes(self._routes(weights=new), attempts=3)
            except GatewayError as exc:
                with contextlib.suppress(GatewayError):
                    await self._send_routes(self._routes())
                return 502, {"error": f"the gateway did not take the new weights: {exc}"}
            for name, weight in new.items():
                self.groups[name].weight = weight
        self._write_state()
        return 200, {"weights": new}

    async def add_group(self, name: str, *, base: str, config: EngineConfig, replicas: int | None = None,
                        weight: float = 0.0) -> tuple[int, dict[str, Any]]:
        """Start a group at run time (a canary): ``base``'s backend, model name, seed and environment with another
        config, ``replicas`` (default: one) at ``weight`` (default 0: reached only through X-Engine-Group). Its
        replicas join the gateway's table as they become healthy. Idempotent: adding the same group with the same
        config again answers 200."""
        if self._stop.is_set():
            return 409, {"error": "the fleet is stopping"}
        existing = self.groups.get(name)
        if existing is not None:
            if existing.base is not None and existing.base == base and existing.config.version == config.version:
                return 200, {"status": "exists", "group": existing.to_dict()}
            why = "a group of the fleet file" if existing.base is None else \
                f"a run-time group of {existing.base!r} with config {existing.config.version}"
            return 409, {"error": f"group {name!r} already exists ({why})"}
        if not _GROUP_NAME.match(name):
            return 400, {"error": f"a group name is 1-64 letters, digits, '_', '.' or '-', not {name!r}"}
        parent = self.groups.get(base)
        if parent is None or parent.base is not None:
            return 404, {"error": f"no group {base!r} of the fleet file to base {name!r} on; groups: "
                                  f"{', '.join(n for n, g in self.groups.items() if g.base is None)}"}
        spec = dataclasses.replace(parent.spec, name=name, weight=weight, config=config,
                                   replicas=replicas or 1)
        group = GroupRuntime(spec=spec, weight=weight, config=config, base=base)
        async with self._routes_lock:
            self.groups[name] = group
            group.serving = self.supervisor.spawn_group(
                name, replicas=spec.replicas, command_factory=self._replica_factory(spec, config),
                config_version=config.version, backend=spec.backend, policy=self.spec.policy_for(spec.backend))
            try:
                await self._send_routes(self._routes(), attempts=3)
            except GatewayError as exc:  # the table also reaches the gateway when the replicas turn healthy
                log.warning("route update for new group %s not delivered: %s", name, exc)
        self._write_state()
        log.info("group %s added (base %s, config %s, %d replica(s), weight %s)", name, base, config.version,
                 spec.replicas, weight)
        return 201, {"status": "starting", "group": group.to_dict()}

    async def remove_group(self, name: str, *, drain_timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """Take a run-time group out of the gateway's table, then drain and stop its replicas. Groups of the fleet
        file cannot be removed. Removing a group that is not there answers 200 (idempotent)."""
        group = self.groups.get(name)
        if group is None:
            return 200, {"status": "absent", "group": name}
        if group.base is None:
            return 409, {"error": f"group {name!r} is in the fleet file; only groups added at run time can be "
                                  f"removed"}
        async with self._routes_lock:
            del self.groups[name]
            try:
                await self._send_routes(self._routes(), attempts=3)
            except GatewayError as exc:
                log.warning("route update without group %s not delivered: %s", name, exc)
        if group.task is not None and not group.task.done():
            group.task.cancel()
        processes = self.supervisor.processes(group=name)

        async def retire_all() -> None:
            await asyncio.gather(*(self.supervisor.retire(p, drain=True, timeout=drain_timeout) for p in processes),
                                 return_exceptions=True)
            self._write_state()

        self._spawn_background(retire_all())
        self._write_state()
        log.info("group %s removed; draining %d replica(s)", name, len(processes))
        return 202, {"status": "removing", "group": name, "replicas": [p.name for p in processes]}

    # ------------------------------------------------------------------ state
    def snapshot(self) -> dict[str, Any]:
        replicas = [p.to_dict() for p in self.supervisor.processes(role="replica")]
        return {
            "fleet": self.spec.name,
            "state": self.state,
            "pid": os.getpid(),
            "start_ticks": process_start_ticks(os.getpid()),
            "started_at": now_iso(self.started_at),
            "updated_at": now_iso(),
            "source": self.spec.source,
            "run_dir": str(self.run_dir),
            "control_url": self.spec.control_url,
            "gateway_url": self.spec.gateway_url,
            "gateway": self.gateway.to_dict() if self.gateway is not None else None,
            # The gateway's own health verdict per upstream (None until it has been read).
            "gateway_upstreams": self._gateway_view,
            "groups": [g.to_dict() for g in self.groups.values()],
            "replicas": replicas,
            "retired": self.supervisor.state()["retired"],
            # Everything with a pid, for cleaning up after a controller that died.
            "processes": [p.to_dict() for p in self.supervisor.processes()],
        }

    def _write_state(self, force: bool = False) -> None:
        """Write controller.json soon (coalescing bursts of changes into one write)."""
        if force:
            self._state_write_pending = False
            self._flush_state()
            return
        if self._state_write_pending:
            return
        self._state_write_pending = True
        try:
            asyncio.get_running_loop().call_soon(self._flush_state)
        except RuntimeError:
            self._flush_state()

    def _flush_state(self) -> None:
        self._state_write_pending = False
        try:
            write_json_atomic(self.run_dir / STATE_FILE, self.snapshot())
        except OSError as exc:
            log.error("cannot write %s: %s", STATE_FILE, exc)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._session

    # ------------------------------------------------------------------ control API
    async def _start_control_api(self) -> None:
        app = build_control_app(self)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host, port = self.spec.control_address
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        log.info("control API on %s (token in %s)", self.spec.control_url, self.run_dir / CONTROL_TOKEN_FILE)


def _with_env(command: LaunchCommand, extra: Mapping[str, str]) -> LaunchCommand:
    # The group's own variables go first so the tracing contract (OTEL_*) cannot be overridden by accident.
    return LaunchCommand(argv=command.argv, env={**extra, **command.env}) if extra else command


def _comparable(routes: list[dict]) -> list[tuple[str, float, tuple[str, ...]]]:
    return [(g["name"], float(g["weight"]), tuple(g["upstreams"])) for g in routes]


def _read_gateway_table(document: object) -> tuple[dict[str, bool] | None, list | None]:
    """(health per upstream URL, comparable table) from the gateway's ``GET /admin/routes``; Nones if unreadable."""
    try:
        groups = document["groups"]  # type: ignore[index]
        view = {u["url"]: u.get("healthy") is True for g in groups for u in g["upstreams"]}
        table = [(g["name"], float(g["weight"]), tuple(u["url"] for u in g["upstreams"])) for g in groups]
    except (TypeError, KeyError, ValueError):
        return None, None
    return view, table


def _read_pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / PID_FILE).read_text(encoding="utf-8").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _json_error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def build_control_app(controller: FleetController) -> web.Application:
    """The control API's aiohttp application (bearer-token auth, JSON in and out)."""

    @web.middleware
    async def guard(request: web.Request, handler):
        supplied = request.headers.get("Authorization", "")
        scheme, _, token = supplied.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 controller.control_token.encode()):
            token_file = controller.run_dir / CONTROL_TOKEN_FILE
            response = _json_error(401, f"missing or wrong bearer token (see {token_file})")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _json_error(413, f"request body larger than {_MAX_BODY} bytes")
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _json_error(exc.status, exc.reason)
            raise

    async def read_json(request: web.Request) -> tuple[Any, web.Response | None]:
        if request.content_length is not None and request.content_length > _MAX_BODY:
            return None, _json_error(413, f"request body larger than {_MAX_BODY} bytes")
        raw = await request.read()
        try:
            return json.loads(raw or b"null"), None
        except (ValueError, UnicodeDecodeError) as exc:
            return None, _json_error(400, f"body is not valid JSON: {exc}")

    async def get_fleet(request: web.Request) -> web.Response:
        return web.json_response(controller.snapshot())

    async def put_group_config(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body, error = await read_json(request)
        if error is not None:
            return error
        if not isinstance(body, dict) or "config" not in body or set(body) - {"config", "drain_timeout"}:
            return _json_error(400, 'body must be {"config": {<engine config>}} (optionally with "drain_timeout")')
        drain_timeout = body.get("drain_timeout")
        if drain_timeout is not None and (isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float))
                                          or not math.isfinite(drain_timeout) or not 0 < drain_timeout <= 3600):
            return _json_error(400, "drain_timeout must be a number of seconds in (0, 3600]")
        try:
            config = EngineConfig.from_dict(body["config"])
        except ConfigError as exc:
            return _json_error(400, "invalid engine config", problems=exc.problems)
        status, payload = await controller.set_group_config(name, config, drain_timeout=drain_timeout)
        return web.json_response(payload, status=status)

    async def put_weights(request: web.Request) -> web.Response:
        body, error = await read_json(request)
        if error is not None:
            return error
        weights = body.get("weights") if isinstance(body, dict) and set(body) == {"weights"} else None
        if not isinstance(weights, dict) or not weights:
            return _json_error(400, 'body must be {"weights": {"<group>": <weight>, ...}}')
        unknown = sorted(str(name) for name in weights if name not in controller.groups)
        if unknown:
            return _json_error(404, f"no such group(s): {', '.join(unknown)}")
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or not 0 <= weight <= 1_000_000:
                return _json_error(400, f"weight of {name!r} must be a number in 0..1000000, not {weight!r}")
        status, payload = await controller.set_weights(weights)
        return web.json_response(payload, status=status)

    async def put_group(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body, error = await read_json(request)
        if error is not None:
            return error
        if not isinstance(body, dict) or not {"base", "config"} <= set(body) \
                or set(body) - {"base", "config", "replicas", "weight"}:
            return _json_error(400, 'body must be {"base": "<group>", "config": {<engine config>}} (optionally '
                                    'with "replicas" and "weight")')
        replicas = body.get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS_PER_GROUP:
            return _json_error(400, f"replicas must be an integer in 1..{MAX_REPLICAS_PER_GROUP}")
        weight = body.get("weight", 0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 <= weight <= 1_000_000:
            return _json_error(400, "weight must be a number in 0..1000000")
        if not isinstance(body["base"], str):
            return _json_error(400, "base must be the name of a group of the fleet file")
        try:
            config = EngineConfig.from_dict(body["config"])
        except ConfigError as exc:
            return _json_error(400, "invalid engine config", problems=exc.problems)
        status, payload = await controller.add_group(name, base=body["base"], config=config, replicas=replicas,
                                                     weight=weight)
        return web.json_response(payload, status=status)

    async def delete_group(request: web.Request) -> web.Response:
        status, payload = await controller.remove_group(request.match_info["name"])
        return web.json_response(payload, status=status)

    async def post_stop(request: web.Request) -> web.Response:
        # Answer first, then stop: the caller learns the stop was accepted before the API goes away.
        asyncio.get_running_loop().call_later(0.05, controller.request_stop)
        return web.json_response({"status": "stopping"}, status=202)

    app = web.Application(middlewares=[guard], client_max_size=_MAX_BODY)
    app.router.add_get("/fleet", get_fleet)
    app.router.add_put("/fleet/groups/{name}/config", put_group_config)
    app.router.add_put("/fleet/groups/{name}", put_group)
    app.router.add_delete("/fleet/groups/{name}", delete_group)
    app.router.add_put("/fleet/weights", put_weights)
    app.router.add_post("/fleet/stop", post_stop)
    return app


# ---------------------------------------------------------------------------------------------- control client
class ControlUnavailable(RuntimeError):
    """No fleet controller answers at the spec's control address (the reason says why)."""


def control_request(spec: FleetSpec, method: str, path: str, body: dict | None = None, *,
                    timeout: float = 5.0) -> tuple[int, dict]:
    """One call to the running controller's control API with the run directory's token: (HTTP status, JSON
    object; a body that is not one is returned as {"error": its start}). Raises ControlUnavailable when no
    controller has run there (no token) or none answers."""
    from urllib import error as urlerror
    from urllib import request as urlrequest

    try:
        token = (spec.run_dir / CONTROL_TOKEN_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        raise ControlUnavailable(f"no fleet controller has run in {spec.run_dir} (no control token)") from None
    data = json.dumps(body).encode() if body is not None else (b"" if method != "GET" else None)
    request = urlrequest.Request(spec.control_url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urlrequest.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urlerror.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urlerror.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ControlUnavailable(f"the fleet controller at {spec.control_url} does not answer ({reason})") from None
    try:
        payload = json.loads(raw or b"{}")
    except ValueError:
        payload = {"error": raw[:300].decode("utf-8", "replace")}
    return status, payload if isinstance(payload, dict) else {"value": payload}
