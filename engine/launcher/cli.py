"""``python -m engine``: bring a fleet up or down, show its state, render a replica's launch command.

    python -m engine up [--fleet FILE] [--detach] [--timeout S]
    python -m engine status [--fleet FILE] [--json]
    python -m engine down [--fleet FILE] [--timeout S]
    python -m engine render --config FILE [--backend vllm|simulator] [--host H] [--port P] ...
    python -m engine tiny-model DIR [--size test|study] [--check]

``up`` runs the fleet controller in the foreground until Ctrl-C; with ``--detach`` it
starts the controller in the background (pid, state and log in the run directory) and
returns once the gateway and every replica are healthy, or fails with the reason and
the log to read (stopping what it started). ``status`` exits 0 when everything is
healthy, 1 when the fleet is degraded or starting, 3 when no controller runs. ``down``
is idempotent and also cleans up after a controller that died.

The fleet file defaults to ``$ENGINE_FLEET`` or ``engine/fleets/embedded.yaml``; the
``ENGINE_*`` overrides of ``engine.launcher.fleet_spec`` apply (``ENGINE_GATEWAY_BIND``,
``ENGINE_OTLP_ENDPOINT``, ``ENGINE_OTLP_HEADERS``, ...).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from engine import tiny_model
from engine.cli_args import bounded_float
from engine.config import ConfigError, EngineConfig
from engine.launcher.control_api import build_control_app
from engine.launcher.control_client import ControlUnavailable, control_request
from engine.launcher.fleet_controller import FleetController
from engine.launcher.fleet_spec import BACKENDS, FleetSpec, FleetSpecError
from engine.launcher.managed_process import now_iso
from engine.launcher.process_groups import process_alive, signal_group
from engine.launcher.run_dir import (
    CONTROL_TOKEN_FILE,
    CONTROLLER_LOG,
    RunDirLock,
    clean_stale_run_dir,
    read_pid,
    read_state_file,
)
from engine.launcher.vllm_command import (
    DETAILED_TRACE_MODULES,
    OTLP_PROTOCOLS,
    render_simulator_command,
    render_vllm_command,
)

EMBEDDED_FLEET = Path(__file__).resolve().parent.parent / "fleets" / "embedded.yaml"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3


def default_fleet_file() -> str:
    return os.environ.get("ENGINE_FLEET") or str(EMBEDDED_FLEET)


# Positive seconds, below a day.
_timeout_seconds = bounded_float(above=0, below=86400)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="start the fleet (controller, gateway, replicas)")
    up.add_argument("--fleet", default=None, help="fleet YAML file (default: $ENGINE_FLEET or the embedded fleet)")
    up.add_argument("--detach", action="store_true", help="run in the background; return once healthy")
    up.add_argument("--timeout", type=_timeout_seconds, default=None,
                    help="with --detach: seconds to wait for health (default: the backends' startup timeout + 30)")

    status = commands.add_parser("status", help="show the gateway and replicas")
    status.add_argument("--fleet", default=None)
    status.add_argument("--json", action="store_true", help="print the controller's full state as JSON")

    down = commands.add_parser("down", help="stop everything gracefully (idempotent)")
    down.add_argument("--fleet", default=None)
    down.add_argument("--timeout", type=_timeout_seconds, default=120.0,
                      help="seconds to wait for a graceful stop before killing (default 120)")

    render = commands.add_parser("render", help="print the command that starts one replica for a config")
    render.add_argument("--config", required=True, help="engine config file (YAML or JSON)")
    render.add_argument("--backend", choices=BACKENDS, default="vllm")
    render.add_argument("--host", default="127.0.0.1")
    render.add_argument("--port", type=int, default=8101)
    render.add_argument("--group", default="baseline", help="replica group (a resource attribute on spans)")
    render.add_argument("--served-model-name", default=None)
    render.add_argument("--otlp-traces-endpoint", default=None)
    render.add_argument("--otlp-protocol", choices=OTLP_PROTOCOLS, default="grpc")
    render.add_argument("--collect-detailed-traces", choices=DETAILED_TRACE_MODULES, default=None)
    render.add_argument("--json", action="store_true", help="print {argv, env} as JSON")

    tiny = commands.add_parser("tiny-model", help="build a random-weight Llama model and tokenizer for real vLLM on CPU")
    tiny.add_argument("directory", help="where to write the model (created)")
    tiny.add_argument("--size", choices=("test", "study"), default="test",
                      help="test: 2 layers, hidden 128; study: 4 layers, hidden 512 (default: test)")
    tiny.add_argument("--check", action="store_true", help="print the SHA-256 of every file written")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m engine`` (and ``manage.py engine``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors; callers want a status
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if args.command == "render":
        return _render(args)
    if args.command == "tiny-model":
        return _tiny_model(args)
    try:
        spec = FleetSpec.load(args.fleet or default_fleet_file())
    except FleetSpecError as exc:
        _err(f"invalid fleet file {exc.source or args.fleet}:")
        for problem in exc.problems:
            _err(f"  - {problem}")
        return EXIT_USAGE
    if args.command == "up":
        return _up_detached(spec, args.timeout) if args.detach else _up_foreground(spec)
    if args.command == "status":
        return _status(spec, as_json=args.json)
    return _down(spec, args.timeout)


def _err(message: str) -> None:
    print(message, file=sys.stderr)


# ---------------------------------------------------------------------------------------------- tiny-model
def _tiny_model(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        directory = tiny_model.build(args.directory, args.size)
    except OSError as exc:
        _err(f"cannot write the model into {args.directory}: {exc}")
        return EXIT_FAILED
    spec = tiny_model.SIZES[args.size]
    print(f"built a {spec.name} Llama model ({spec.num_parameters / 1e6:.1f} M parameters, {spec.num_layers} layers, "
          f"hidden {spec.hidden_size}, vocab {spec.vocab_size}) in {directory} in {time.monotonic() - started:.1f} s")
    if args.check:
        for name, digest in tiny_model.checksums(directory).items():
            print(f"{digest}  {name}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- render
def _render(args: argparse.Namespace) -> int:
    try:
        config = EngineConfig.load(args.config)
    except FileNotFoundError:
        _err(f"no such config file: {args.config}")
        return EXIT_USAGE
    except ConfigError as exc:
        _err(f"invalid engine config {args.config}:")
        for problem in exc.problems:
            _err(f"  - {problem}")
        return EXIT_USAGE
    try:
        if args.backend == "vllm":
            command = render_vllm_command(
                config, host=args.host, port=args.port, served_model_name=args.served_model_name,
                otlp_traces_endpoint=args.otlp_traces_endpoint, otlp_protocol=args.otlp_protocol,
                collect_detailed_traces=args.collect_detailed_traces, group=args.group,
            )
        else:
            command = render_simulator_command(
                config, config_path=os.path.abspath(args.config), host=args.host, port=args.port, group=args.group,
                served_model_name=args.served_model_name, otlp_traces_endpoint=args.otlp_traces_endpoint,
                otlp_protocol=args.otlp_protocol,
            )
    except ValueError as exc:
        _err(str(exc))
        return EXIT_USAGE
    print(json.dumps(command.to_dict(), indent=2) if args.json else command.shell())
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- up
def _up_foreground(spec: FleetSpec) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if RunDirLock.held(spec.run_dir):
        _err(f"a fleet controller already runs in {spec.run_dir} (pid {read_pid(spec.run_dir) or '?'}); "
             "see `python -m engine status`")
        return EXIT_FAILED

    def ready(controller: FleetController) -> None:
        print(_summary(controller.snapshot()), flush=True)

    controller = FleetController(spec, control_app=build_control_app)
    try:
        return asyncio.run(controller.run(on_ready=ready))
    except KeyboardInterrupt:
        return EXIT_OK


def _up_detached(spec: FleetSpec, timeout: float | None) -> int:
    run_dir = spec.run_dir
    if RunDirLock.held(run_dir):
        _err(f"a fleet controller already runs in {run_dir} (pid {read_pid(run_dir) or '?'}); "
             "see `python -m engine status`")
        return EXIT_FAILED
    run_dir.mkdir(parents=True, exist_ok=True)
    if timeout is None:
        timeout = max(spec.policy_for(g.backend).startup_timeout for g in spec.groups) + 30.0
    log_path = run_dir / CONTROLLER_LOG
    argv = [sys.executable, "-m", "engine", "up", "--fleet", spec.source or default_fleet_file()]
    with open(log_path, "ab") as log_file:
        log_file.write(f"\n=== {now_iso()} python -m engine up --detach\n".encode())
        log_file.flush()
        controller = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                      start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout
    snapshot = None
    while True:
        code = controller.poll()
        if code is not None:
            _err(f"the fleet controller exited with status {code} before the fleet was healthy.")
            _err(f"controller log: {log_path}")
            for line in _tail(log_path, 15):
                _err(f"  | {line}")
            return EXIT_FAILED
        snapshot = fetch_fleet(spec) or snapshot
        if snapshot and snapshot.get("state") == "running":
            print(_summary(snapshot))
            return EXIT_OK
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    _err(f"the fleet did not become healthy within {timeout:g}s; stopping it.")
    for process in _not_healthy(snapshot):
        _err(f"  {process.get('name')}: {process.get('state')} — {process.get('last_error') or 'no error recorded'}")
        _err(f"    log: {process.get('log')}")
    _err(f"controller log: {log_path}")
    _down(spec, 60.0, quiet=True)
    return EXIT_FAILED


def _not_healthy(snapshot: dict | None) -> list[dict]:
    if not snapshot:
        return []
    processes = ([snapshot["gateway"]] if snapshot.get("gateway") else []) + list(snapshot.get("replicas") or [])
    return [p for p in processes if isinstance(p, dict) and p.get("state") != "healthy"]


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - 8192, 0))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def _summary(snapshot: dict) -> str:
    lines = [f"engine fleet {snapshot.get('fleet')!r} is {snapshot.get('state')}",
             f"  gateway (OpenAI-compatible)  {snapshot.get('gateway_url')}/v1",
             f"  control API                  {snapshot.get('control_url')} "
             f"(token in {Path(snapshot.get('run_dir', '.')) / CONTROL_TOKEN_FILE})"]
    for group in snapshot.get("groups") or []:
        lines.append(f"  group {group.get('name')}: weight {group.get('weight'):g}, {group.get('replicas')} "
                     f"{group.get('backend')} replica(s), {group.get('config_version')} "
                     f"({', '.join(group.get('upstreams') or [])})")
    lines.append(f"  run directory                {snapshot.get('run_dir')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- status
def fetch_fleet(spec: FleetSpec, timeout: float = 2.0) -> dict | None:
    """``GET /fleet`` from the running controller, or None when it does not answer."""
    return _control_call(spec, "GET", "/fleet", timeout=timeout)


def _control_call(spec: FleetSpec, method: str, path: str, body: dict | None = None,
                  timeout: float = 5.0) -> dict | None:
    """The controller's answer to one control call, or None when no controller answers."""
    try:
        return control_request(spec, method, path, body, timeout=timeout)[1]
    except ControlUnavailable:
        return None


def _status(spec: FleetSpec, *, as_json: bool) -> int:
    running = RunDirLock.held(spec.run_dir)
    snapshot = fetch_fleet(spec) if running else None
    if snapshot is None:
        recorded = read_state_file(spec.run_dir)
        if running and recorded:
            recorded["note"] = "the controller runs but its control API does not answer; showing its last state file"
            snapshot = recorded
        else:
            result = {"fleet": spec.name, "state": "not running", "run_dir": str(spec.run_dir)}
            if recorded and recorded.get("state") not in (None, "stopped"):
                result["note"] = "a controller died without stopping its processes; `python -m engine down` " \
                                 "cleans up"
            print(json.dumps(result, indent=2) if as_json else
                  f"engine fleet {spec.name!r}: not running (run directory {spec.run_dir})"
                  + (f"\n  note: {result['note']}" if "note" in result else ""))
            return EXIT_NOT_RUNNING
    if as_json:
        print(json.dumps(snapshot, indent=2))
    else:
        print(format_status(snapshot))
    return EXIT_OK if snapshot.get("state") == "running" and running else EXIT_FAILED


def format_status(snapshot: dict) -> str:
    """A table of the gateway and the replicas, with the groups' weights and config versions above it."""
    lines = [f"engine fleet {snapshot.get('fleet')!r}: {snapshot.get('state')} "
             f"(controller pid {snapshot.get('pid')}, since {snapshot.get('started_at')})"]
    if snapshot.get("note"):
        lines.append(f"  note: {snapshot['note']}")
    for group in snapshot.get("groups") or []:
        transition = group.get("transition")
        extra = ""
        if transition:
            extra = f", replacing {transition.get('from_version')} -> {transition.get('to_version')} " \
                    f"({transition.get('phase')})"
        elif (group.get("last_transition") or {}).get("phase") == "failed":
            extra = f", last replacement failed: {group['last_transition'].get('error')}"
        lines.append(f"  group {group.get('name')}: weight {group.get('weight'):g}, "
                     f"{group.get('config_version')}, {group.get('replicas')} {group.get('backend')} replica(s){extra}")
    header = ("NAME", "GROUP", "BACKEND", "CONFIG", "PORT", "PID", "STATE", "RESTARTS", "EXIT", "SINCE")
    rows = [header]
    processes = ([snapshot["gateway"]] if snapshot.get("gateway") else []) + list(snapshot.get("replicas") or [])
    for p in processes:
        rows.append((
            str(p.get("name")), str(p.get("group")), str(p.get("backend")), str(p.get("config_version") or "-"),
            str(p.get("port")), str(p.get("pid") or "-"), str(p.get("state")), str(p.get("restarts")),
            "-" if p.get("last_exit_code") is None else str(p.get("last_exit_code")), str(p.get("since")),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append("")
    lines.extend("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
    failing = [p for p in processes if p.get("state") != "healthy" and p.get("last_error")]
    for p in failing:
        lines.append(f"  {p.get('name')}: {p.get('last_error')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- down
def _down(spec: FleetSpec, timeout: float, *, quiet: bool = False) -> int:
    run_dir = spec.run_dir
    say = (lambda message: None) if quiet else print
    if not RunDirLock.held(run_dir):
        stopped = clean_stale_run_dir(run_dir) if run_dir.exists() else []
        if stopped:
            say(f"engine fleet {spec.name!r}: the controller was gone; stopped {len(stopped)} leftover "
                f"process(es) ({', '.join(map(str, stopped))})")
        else:
            say(f"engine fleet {spec.name!r}: not running")
        return EXIT_OK
    pid = read_pid(run_dir)
    answer = _control_call(spec, "POST", "/fleet/stop", body={})
    if answer is None and pid:
        # The control API does not answer (hung or still starting): SIGTERM asks for the same graceful stop.
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while RunDirLock.held(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    if RunDirLock.held(run_dir):
        _err(f"the controller (pid {pid}) did not stop within {timeout:g}s; killing it and its processes")
        if pid:
            _signal(pid, signal.SIGKILL)
        kill_deadline = time.monotonic() + 10
        while RunDirLock.held(run_dir) and time.monotonic() < kill_deadline:
            time.sleep(0.1)
        clean_stale_run_dir(run_dir)
    # The lock goes when the controller is done; give the interpreter a moment to exit too.
    exit_deadline = time.monotonic() + 5
    while pid and process_alive(pid) and time.monotonic() < exit_deadline:
        time.sleep(0.05)
    say(f"engine fleet {spec.name!r}: stopped")
    return EXIT_OK


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        _err(f"not allowed to signal pid {pid}")
    if sig == signal.SIGKILL:
        signal_group(pid, sig)  # the detached controller leads its own group
