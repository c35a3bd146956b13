"""The Docker files agree with the code: settings names, ports, commands (no Docker engine needed)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

pytestmark = pytest.mark.mode_independent  # no database, no broker: CI runs it once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
SETTINGS = ROOT / "platform" / "observatory" / "settings.py"

# Values for the variables compose.yaml requires (${VAR:?...}), used when rendering it here.
REQUIRED_VARS = {"SECRET_KEY": "test-secret", "POSTGRES_PASSWORD": "pg-secret", "CLICKHOUSE_PASSWORD": "ch-secret"}
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR:?error} with the given variables."""

    def substitute(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if variables.get(name):
            return variables[name]
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            raise AssertionError(f"compose requires {name}: {arg}")
        return ""

    return _INTERPOLATION.sub(substitute, value)


def settings_env_names() -> set[str]:
    """Every environment variable settings.py reads (env/envbool/envint/envfloat("NAME"))."""
    return set(re.findall(r"\benv(?:bool|int|float)?\(\s*\"([A-Z][A-Z0-9_]*)\"", SETTINGS.read_text()))


def management_commands() -> set[str]:
    return {p.stem for p in (ROOT / "platform").glob("*/management/commands/*.py") if not p.stem.startswith("_")}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def platform_env(compose) -> dict[str, str]:
    env = compose["services"]["platform"]["environment"]
    assert isinstance(env, dict), "platform.environment should be a mapping"
    return {key: interpolate(str(value), REQUIRED_VARS) for key, value in env.items()}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in (DOCKER / "Dockerfile").read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        instruction, _, args = current.partition(" ")
        lines.append((instruction.upper(), args.strip()))
        current = ""
    return lines


def exec_form(args: str) -> list[str]:
    value = yaml.safe_load(args)  # JSON arrays are YAML
    assert isinstance(value, list), f"use the exec form (a JSON array): {args}"
    return value


def test_settings_grep_finds_the_known_names():
    names = settings_env_names()
    assert {"DATABASE_URL", "CLICKHOUSE_URL", "CELERY_BROKER_URL", "SECRET_KEY", "ALLOWED_HOSTS",
            "OBSERVATORY_DATA_DIR", "OBSERVATORY_HTTP_BIND", "OBSERVATORY_OTLP_GRPC_BIND"} <= names


def test_compose_services(compose):
    assert set(compose["services"]) == {"platform", "worker", "beat", "postgres", "clickhouse", "redis"}
    for name in ("worker", "beat"):
        service = compose["services"][name]
        # Celery runs the same image and settings; the platform service applies the migrations first.
        assert service["image"] == compose["services"]["platform"]["image"]
        environment = dict(service["environment"])
        if name == "worker":  # a thread pool serving its own /metrics (delivery counters)
            assert environment.pop("OBSERVATORY_WORKER_METRICS_BIND") == "0.0.0.0:9464"
            assert environment.pop("OBSERVATORY_METRICS_SLO_SERIES") == "false"  # no duplicate per-SLO series
            assert service["command"][service["command"].index("--pool") + 1] == "threads"
            assert service["expose"] == ["9464"]
        assert environment == compose["services"]["platform"]["environment"]
        assert service["entrypoint"][:3] == ["celery", "-A", "observatory.celery_app"]
        assert service["command"][0] == name
        assert "platform" in service["depends_on"]
    images = {name: service.get("image", "") for name, service in compose["services"].items()}
    assert images["postgres"].startswith("postgres:16")
    assert images["clickhouse"].startswith("clickhouse/clickhouse-server")
    assert images["redis"].startswith("redis:7")
    build = compose["services"]["platform"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()


def test_platform_env_names_are_settings_the_code_reads(platform_env):
    known = settings_env_names()
    # settings.env() also reads NAME_FILE for every NAME (Docker/K8s secrets).
    known |= {f"{name}_FILE" for name in known}
    unknown = set(platform_env) - known
    assert not unknown, f"compose sets variables settings.py never reads: {sorted(unknown)}"
    assert {"DATABASE_URL", "CLICKHOUSE_URL", "CELERY_BROKER_URL", "ALLOWED_HOSTS", "SECRET_KEY"} <= set(platform_env)


def test_platform_env_points_at_the_services(compose, platform_env):
    database = urlparse(platform_env["DATABASE_URL"])
    postgres_env = {k: interpolate(str(v), REQUIRED_VARS) for k, v in compose["services"]["postgres"]["environment"].items()}
    assert database.scheme in {"postgres", "postgresql"}
    assert (database.hostname, database.port) == ("postgres", 5432)
    assert database.username == postgres_env["POSTGRES_USER"]
    assert database.password == postgres_env["POSTGRES_PASSWORD"]
    assert database.path.lstrip("/") == postgres_env["POSTGRES_DB"]

    clickhouse = urlparse(platform_env["CLICKHOUSE_URL"])
    clickhouse_env = {k: interpolate(str(v), REQUIRED_VARS)
                      for k, v in compose["services"]["clickhouse"]["environment"].items()}
    assert (clickhouse.scheme, clickhouse.hostname, clickhouse.port) == ("http", "clickhouse", 8123)
    assert clickhouse.username == clickhouse_env["CLICKHOUSE_USER"]
    assert clickhouse.password == clickhouse_env["CLICKHOUSE_PASSWORD"]

    broker = urlparse(platform_env["CELERY_BROKER_URL"])
    assert (broker.scheme, broker.hostname, broker.port) == ("redis", "redis", 6379)
    hosts = platform_env["ALLOWED_HOSTS"].split(",")
    assert "localhost" in hosts and "platform" in hosts


def test_compose_ports_and_dependencies(compose):
    platform = compose["services"]["platform"]
    published = {interpolate(str(p), {}).rsplit(":", 1)[-1] for p in platform["ports"]}
    assert published == {"8000", "4317"}
    for service in ("postgres", "clickhouse", "redis"):
        assert "ports" not in compose["services"][service], f"{service} should not be published on the host"
        assert "healthcheck" in compose["services"][service], f"{service} needs a healthcheck"
        assert platform["depends_on"][service]["condition"] == "service_healthy"
    assert "/ping" in " ".join(compose["services"]["clickhouse"]["healthcheck"]["test"])


def test_compose_volumes_are_declared(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if not source.startswith((".", "/")):
                used.add(source)
    assert used and used <= declared
    assert any(v.endswith(":/data") for v in compose["services"]["platform"]["volumes"])


def test_dockerfile(platform_env):
    instructions = dockerfile_instructions()
    by_name: dict[str, list[str]] = {}
    for name, args in instructions:
        by_name.setdefault(name, []).append(args)
    assert instructions[0] == ("FROM", "python:3.11-slim")
    user = by_name["USER"][-1].split(":")[0]
    assert user not in {"root", "0"}
    assert set(" ".join(by_name["EXPOSE"]).split()) == {"8000", "4317"}
    assert "OBSERVATORY_DATA_DIR=/data" in " ".join(by_name["ENV"])
    assert platform_env["OBSERVATORY_DATA_DIR"] == "/data"
    assert '"/data"' in by_name["VOLUME"][-1] or by_name["VOLUME"][-1] == "/data"
    for args in by_name["COPY"]:
        *sources, _target = shlex.split(args)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} does not exist"


def test_entrypoint_and_cmd_use_commands_that_exist():
    instructions = dict(dockerfile_instructions())  # the last ENTRYPOINT/CMD wins, as in Docker
    entrypoint = exec_form(instructions["ENTRYPOINT"])
    cmd = exec_form(instructions["CMD"])
    script = ROOT / entrypoint[0].removeprefix("/app/")
    assert script.exists() and os.access(script, os.X_OK), f"{script} missing or not executable"
    script_text = script.read_text()
    assert 'exec "$@"' in script_text

    commands = management_commands()
    called = re.findall(r"manage\.py\s+([a-z_]+)", script_text)
    assert called == ["migrate", "migrate_clickhouse"]
    assert "migrate_clickhouse" in commands

    assert cmd[:3] == ["python", "manage.py", "runplatform"] and "runplatform" in commands
    assert cmd[cmd.index("--http") + 1] == "0.0.0.0:8000"
    assert cmd[cmd.index("--grpc") + 1] == "0.0.0.0:4317"


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], check=False, capture_output=True, text=True)
        if probe.returncode == 0:
            return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def test_docker_compose_config_accepts_the_file():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no `docker compose` plugin or docker-compose binary here; the YAML checks above still ran")
    env = {**os.environ, **REQUIRED_VARS}
    result = subprocess.run([*cli, "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"],
                            check=False, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
