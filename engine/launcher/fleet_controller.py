"""The fleet controller: runs the replica groups and the gateway of one fleet as supervised processes.

It owns one run directory. It keeps the gateway's route table (a JSON file it rewrites,
and the gateway's ``PUT /admin/routes``) in step with the replicas that serve, replaces a
group's replicas when its config changes, changes traffic weights, adds and removes
run-time groups, and serves the control API (``control_api``) that asks for all this.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from engine.addresses import host_port
from engine.config import EngineConfig
from engine.launcher.fleet_spec import GATEWAY_STARTUP_TIMEOUT, GROUP_NAME, FleetSpec, GroupSpec
from engine.launcher.managed_process import HEALTHY, CommandFactory, ManagedProcess, now_iso
from engine.launcher.process_groups import process_start_ticks
from engine.launcher.run_dir import (
    CONTROL_TOKEN_FILE,
    GATEWAY_TOKEN_FILE,
    PID_FILE,
    ROUTES_FILE,
    STATE_FILE,
    RunDirLock,
    clean_stale_run_dir,
    read_or_create_token,
    read_pid,
    write_json_atomic,
)
from engine.launcher.supervisor import ReplacementFailed, Supervisor
from engine.launcher.vllm_command import (
    LaunchCommand,
    render_simulator_command,
    render_vllm_command,
    write_config_file,
)

log = logging.getLogger(__name__)


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
    """Runs one fleet: replica groups, the gateway, route updates, config replacements and the control API.

    ``control_app`` builds the control API's application for this controller
    (``engine.launcher.control_api.build_control_app``); it is served on the spec's control address.
    """

    def __init__(self, spec: FleetSpec, *, control_app: Callable[[FleetController], web.Application]):
        self.spec = spec
        self._control_app = control_app
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
            pid = read_pid(self.run_dir)
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
            # Signal handlers only where they can be had: a loop outside the main thread (RuntimeError) or one without
            # them (NotImplementedError) is left to its owner, who stops the controller with request_stop.
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
                group=group.name, vllm_executable=vllm_executable, threads=self.spec.vllm_cpu_threads,
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
            bind = host_port(host, port)
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
            cache = group.spec.cache.as_dict() if group.spec.cache is not None else None  # null: no cache
            routes.append({"name": name, "weight": weight, "upstreams": [p.url for p in serving], "cache": cache})
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
        if not GROUP_NAME.match(name):
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
        app = self._control_app(self)
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
