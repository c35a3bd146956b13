"""The fleet file: gateway and control addresses, run directory, telemetry, supervision and replica groups.

``FleetSpec.load`` reads the YAML, applies the ``ENGINE_*`` environment overrides and
reports every problem at once, each naming its place in the file.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from engine.addresses import http_url, parse_bind
from engine.config import ConfigError, EngineConfig
from engine.gateway.cache_config import CacheConfigError, CacheSpec, parse_cache
from engine.launcher.supervision_policy import SupervisorPolicy
from engine.launcher.vllm_command import (
    DETAILED_TRACE_MODULES,
    ENV_VLLM_EXECUTABLE,
    OTLP_PROTOCOLS,
    encode_otlp_headers,
    find_vllm_executable,
    host_has_gpu,
)

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
GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Environment overrides (``make up`` wires the fleet to the platform with these).
ENV_GATEWAY_BIND = "ENGINE_GATEWAY_BIND"
ENV_CONTROL_BIND = "ENGINE_CONTROL_BIND"
ENV_RUN_DIR = "ENGINE_RUN_DIR"
ENV_BASE_PORT = "ENGINE_REPLICA_BASE_PORT"
ENV_OTLP_ENDPOINT = "ENGINE_OTLP_ENDPOINT"
ENV_OTLP_PROTOCOL = "ENGINE_OTLP_PROTOCOL"
ENV_OTLP_HEADERS = "ENGINE_OTLP_HEADERS"
ENV_GATEWAY_ADMIN_TOKEN = "ENGINE_GATEWAY_ADMIN_TOKEN"


class FleetSpecError(ValueError):
    """A fleet file that cannot be run; ``problems`` lists every reason, each naming where it is."""

    def __init__(self, problems: Sequence[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(prefix + "; ".join(self.problems))


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
    ``cache`` is the group's response cache at the gateway (``engine/gateway/cache_config.py``).
    """

    name: str
    weight: float
    replicas: int
    backend: str
    config: EngineConfig
    served_model_name: str | None = None
    seed: int | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cache: CacheSpec | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "weight": self.weight, "replicas": self.replicas,
                                "backend": self.backend, "config": self.config.to_dict()}
        if self.served_model_name:
            data["served_model_name"] = self.served_model_name
        if self.seed is not None:
            data["seed"] = self.seed
        if self.env:
            data["env"] = dict(self.env)
        if self.cache is not None:
            data["cache"] = self.cache.as_dict()
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
    # The CPU build's model threads per replica (fleet key vllm.cpu_threads); None: every core but one
    # (engine.launcher.vllm_command.cpu_threads).
    vllm_cpu_threads: int | None = None
    # Supervision keys the file set explicitly (so backend defaults do not override them).
    supervision_overrides: frozenset[str] = frozenset()
    source: str | None = None

    @property
    def gateway_address(self) -> tuple[str, int]:
        return parse_bind(self.gateway_bind)

    @property
    def control_address(self) -> tuple[str, int]:
        return parse_bind(self.control_bind)

    @property
    def gateway_url(self) -> str:
        return http_url(*self.gateway_address)

    @property
    def control_url(self) -> str:
        return http_url(*self.control_address)

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
        if not isinstance(name, str) or not GROUP_NAME.match(name):
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
            host, _ = parse_bind(control_bind)
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
        _unknown(vllm_section, {"executable", "cpu_threads"}, "vllm.", problems)
        vllm_executable = env.get(ENV_VLLM_EXECUTABLE) or vllm_section.get("executable")
        if vllm_executable is not None and (not isinstance(vllm_executable, str) or not vllm_executable.strip()):
            problems.append(f"vllm.executable must be a command or a path, not {vllm_executable!r}")
            vllm_executable = None
        cpu_threads = vllm_section.get("cpu_threads")
        if cpu_threads is not None and (not isinstance(cpu_threads, int) or isinstance(cpu_threads, bool)
                                        or not 1 <= cpu_threads <= 1024):
            problems.append(f"vllm.cpu_threads must be an integer in 1..1024 (the CPU build's model threads per "
                            f"replica), not {cpu_threads!r}")
            cpu_threads = None
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
            vllm_cpu_threads=cpu_threads,
            supervision_overrides=frozenset(supervision_data),
            source=source,
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_bind(value: object, where: str, problems: list[str]) -> bool:
    try:
        parse_bind(value)  # type: ignore[arg-type]
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
        _unknown(item, {"name", "weight", "replicas", "backend", "config", "served_model_name", "seed", "env",
                        "cache"}, f"{where}.", problems)
        name = item.get("name")
        if not isinstance(name, str) or not GROUP_NAME.match(name):
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
        try:
            cache = parse_cache(item.get("cache"), "cache")
        except CacheConfigError as exc:
            problems.append(f"{where}: {exc}")
            cache = None
        groups.append(GroupSpec(name=name, weight=weight, replicas=replicas, backend=backend, config=config,
                                served_model_name=served, seed=seed, env={k: str(v) for k, v in env.items()},
                                cache=cache))
    names = [g.name for g in groups]
    for duplicate in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"group names must be unique: {duplicate!r} appears {names.count(duplicate)} times")
    if groups and not any(g.weight > 0 for g in groups):
        problems.append("at least one group must have a weight above 0 (the gateway needs somewhere to send traffic)")
    return tuple(groups)
