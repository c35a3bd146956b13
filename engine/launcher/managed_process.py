"""One supervised process (vLLM, the simulator or the gateway) and the asyncio task that keeps it alive.

Each supervised process runs in its own process group (so a vLLM server and the
workers it forks are signalled together), writes stdout and stderr to a log file in
the run directory, and is watched by one asyncio task:

- ``starting`` until ``GET /health`` answers 200 (or ``startup_timeout`` passes: then it
  is killed and restarted);
- ``healthy`` / ``unhealthy`` from a probe every ``health_interval``; after
  ``unhealthy_threshold`` consecutive failures it is restarted;
- ``crashed`` when it exited on its own (or was stopped for failing its health checks or
  its startup timeout); it is restarted after an exponential backoff with jitter, capped
  at ``backoff_max``; the backoff starts over once a process has stayed healthy for
  ``stable_after`` seconds;
- ``draining`` when it is being retired: no restarts; it is stopped once
  ``vllm:num_requests_running + vllm:num_requests_waiting`` from its ``/metrics`` has
  read 0 twice in a row, or after ``drain_timeout``;
- ``stopped`` after SIGTERM (and SIGKILL once ``terminate_grace`` has passed).
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from engine.addresses import host_port
from engine.launcher.process_groups import process_start_ticks, signal_group
from engine.launcher.supervision_policy import SupervisorPolicy, backoff_delay
from engine.launcher.vllm_command import LaunchCommand

log = logging.getLogger(__name__)

STARTING = "starting"
HEALTHY = "healthy"
UNHEALTHY = "unhealthy"
DRAINING = "draining"
STOPPED = "stopped"
CRASHED = "crashed"
STATES = (STARTING, HEALTHY, UNHEALTHY, DRAINING, STOPPED, CRASHED)

# vLLM's gauges of requests in the engine; their sum is 0 when a replica is idle.
LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")

CommandFactory = Callable[[int], LaunchCommand]
"""Builds the command for a given port (the port can change when a restart finds it taken)."""


def now_iso(timestamp: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(time.time() if timestamp is None else timestamp, tz=dt.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class PortAllocator:
    """Free TCP ports from ``base_port`` upwards, never handing out one this supervisor already uses."""

    def __init__(self, host: str = "127.0.0.1", base_port: int = 8101, span: int = 1000):
        if not isinstance(base_port, int) or isinstance(base_port, bool) or not 1 <= base_port <= 65535:
            raise ValueError(f"base_port must be an integer in 1..65535, not {base_port!r}")
        self.host = host
        self.base_port = base_port
        self.span = span
        self._reserved: set[int] = set()

    def reserve(self, port: int) -> None:
        self._reserved.add(port)

    def release(self, port: int) -> None:
        self._reserved.discard(port)

    def is_free(self, port: int) -> bool:
        """Whether a server could bind ``port`` now (tested with SO_REUSEADDR, as aiohttp/uvicorn bind)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, port))
            except OSError:
                return False
        return True

    def allocate(self) -> int:
        for port in range(self.base_port, min(self.base_port + self.span, 65536)):
            if port not in self._reserved and self.is_free(port):
                self._reserved.add(port)
                return port
        raise RuntimeError(
            f"no free port in {self.base_port}..{min(self.base_port + self.span, 65536) - 1} on {self.host}"
        )


class ManagedProcess:
    """One supervised process (a replica, or the gateway) and the task that keeps it alive."""

    def __init__(
        self,
        *,
        name: str,
        group: str,
        role: str,
        backend: str,
        config_version: str | None,
        host: str,
        port: int,
        command_factory: CommandFactory,
        policy: SupervisorPolicy,
        log_path: Path,
        session_factory: Callable[[], aiohttp.ClientSession],
        ports: PortAllocator | None,
        on_change: Callable[[ManagedProcess], None],
        rng: random.Random,
    ):
        self.name = name
        self.group = group
        self.role = role
        self.backend = backend
        self.config_version = config_version
        self.host = host
        self.port = port
        self.command_factory = command_factory
        self.policy = policy
        self.log_path = log_path
        self._session_factory = session_factory
        self._ports = ports
        self._on_change = on_change
        self._rng = rng

        self.state = STARTING
        self.since = time.time()
        self.pid: int | None = None
        self.start_ticks: int | None = None
        self.restarts = 0
        self.last_exit_code: int | None = None
        self.last_error: str | None = None
        self.started_at: float | None = None
        self._healthy_since: float | None = None
        self._attempt = 0  # backoff step; reset after a stable period
        self._process: subprocess.Popen | None = None
        self._retiring = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._healthy_event = asyncio.Event()

    # ------------------------------------------------------------------ public
    @property
    def url(self) -> str:
        return f"http://{host_port(self.host, self.port)}"

    @property
    def backoff_step(self) -> int:
        """How many restarts in a row the backoff has counted (0 after a stable period)."""
        return self._attempt

    @property
    def retiring(self) -> bool:
        return self._retiring.is_set()

    def start(self) -> None:
        """Spawn the process and begin watching it (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"supervise-{self.name}")

    async def wait_healthy(self, timeout: float) -> bool:
        """True once the process has answered its health check; False on timeout or when it is retired."""
        if self.state == HEALTHY:
            return True
        waiter = asyncio.ensure_future(self._healthy_event.wait())
        retired = asyncio.ensure_future(self._retiring.wait())
        try:
            await asyncio.wait({waiter, retired}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            retired.cancel()
        return self._healthy_event.is_set() and not self.retiring

    async def drain(self, timeout: float | None = None) -> str:
        """Stop restarting, wait until idle (or ``timeout``), then stop; returns why: idle, timeout or exited."""
        timeout = self.policy.drain_timeout if timeout is None else timeout
        await self._retire(DRAINING)
        reason = "exited"
        deadline = time.monotonic() + timeout
        idle_reads = 0
        while self._alive():
            load = await self.read_load()
            # Two idle reads in a row: a request the gateway forwarded just before the switch has shown up by then.
            idle_reads = idle_reads + 1 if load == 0 else 0
            if idle_reads >= 2:
                reason = "idle"
                break
            if time.monotonic() >= deadline:
                reason = "timeout"
                break
            await asyncio.sleep(min(self.policy.drain_poll_interval, max(deadline - time.monotonic(), 0.01)))
        log.info("%s drained (%s)", self.name, reason)
        await self._terminate()
        self._set_state(STOPPED)
        return reason

    async def stop(self, grace: float | None = None) -> None:
        """Stop now: SIGTERM to the process group (it finishes what it can), SIGKILL after ``grace``."""
        await self._retire(DRAINING if self._alive() else STOPPED)
        await self._terminate(grace)
        self._set_state(STOPPED)

    async def read_load(self) -> int | None:
        """Requests running + waiting from ``/metrics`` (vLLM's gauges), or None when it cannot be read."""
        try:
            session = self._session_factory()
            timeout = aiohttp.ClientTimeout(total=self.policy.health_timeout)
            async with session.get(self.url + self.policy.metrics_path, timeout=timeout) as response:
                if response.status != 200:
                    return None
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
        return parse_load(text)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "group": self.group,
            "role": self.role,
            "backend": self.backend,
            "config_version": self.config_version,
            "host": self.host,
            "port": self.port,
            "url": self.url,
            "pid": self.pid,
            "pgid": self.pid,  # the process leads its own group
            "start_ticks": self.start_ticks,
            "state": self.state,
            "restarts": self.restarts,
            "backoff_step": self._attempt,
            "last_exit_code": self.last_exit_code,
            "last_error": self.last_error,
            "since": now_iso(self.since),
            "log": str(self.log_path),
        }

    # ------------------------------------------------------------------ internals
    def _set_state(self, state: str, error: str | None = None) -> None:
        if error is not None:
            self.last_error = error
        if state == self.state:
            return
        self.state = state
        self.since = time.time()
        if state == HEALTHY:
            self._healthy_event.set()
        elif state != UNHEALTHY:  # still up while unhealthy; anything else means it is not serving
            self._healthy_event.clear()
        log.info("%s (%s, port %s) is %s%s", self.name, self.group, self.port, state,
                 f": {error}" if error else "")
        self._notify()

    def _notify(self) -> None:
        try:
            self._on_change(self)
        except Exception:  # a faulty listener must not kill supervision
            log.exception("state listener failed for %s", self.name)

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    async def _retire(self, state: str) -> None:
        if not self._retiring.is_set():
            self._retiring.set()
            if self.state not in (STOPPED,):
                self._set_state(state)
        if self._task is not None and self._task is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        try:
            while not self.retiring:
                outcome = await self._run_once()
                if self.retiring:
                    break
                if outcome != "exited":
                    await self._terminate()
                self._set_state(CRASHED, self.last_error)
                delay = backoff_delay(self._attempt, self.policy, self._rng)
                self._attempt += 1
                log.warning("%s restarting in %.2fs (restart #%d)", self.name, delay, self.restarts + 1)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._retiring.wait(), timeout=delay)
                if self.retiring:
                    break
                self.restarts += 1
                self._move_port_if_taken()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # supervision must not die silently; the process is left in a known state
            log.exception("supervision of %s failed", self.name)
            self._set_state(CRASHED, f"supervisor error: {exc}")

    def _move_port_if_taken(self) -> None:
        if self._ports is None or self._ports.is_free(self.port):
            return
        old = self.port
        self._ports.release(old)
        self.port = self._ports.allocate()
        log.warning("%s: port %s is taken by another process; moving to %s", self.name, old, self.port)

    async def _run_once(self) -> str:
        """Start the process and watch it; returns exited, unhealthy or startup-timeout (or stop when retired)."""
        self._set_state(STARTING)
        self._healthy_since = None
        if not self._spawn():
            return "exited"
        policy = self.policy
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.startup_timeout
        next_probe = loop.time()
        failures = 0
        while True:
            if self.retiring:
                return "stop"
            code = self._process.poll()
            if code is not None:
                self._record_exit(code)
                return "exited"
            now = loop.time()
            if now >= next_probe:
                ok, problem = await self._probe()
                if self.retiring:
                    return "stop"
                if self._process.poll() is not None:
                    continue  # it died during the probe: report the exit, not a failed probe
                now = loop.time()
                if self.state == STARTING:
                    if ok:
                        self._healthy_since = now
                        self.last_error = None
                        self._set_state(HEALTHY)
                        next_probe = now + policy.health_interval
                    elif now >= deadline:
                        self.last_error = (
                            f"not healthy within {policy.startup_timeout:g}s of starting ({problem}); "
                            f"see {self.log_path}"
                        )
                        return "startup-timeout"
                    else:
                        next_probe = now + policy.startup_poll_interval
                else:
                    if ok:
                        failures = 0
                        if self.state == UNHEALTHY:
                            self._healthy_since = now
                            self._set_state(HEALTHY)
                        if self._attempt and now - (self._healthy_since or now) >= policy.stable_after:
                            self._attempt = 0  # stable again: the next crash restarts quickly
                    else:
                        failures += 1
                        self._healthy_since = None
                        self._set_state(UNHEALTHY, f"health check failed {failures}x: {problem}")
                        if failures >= policy.unhealthy_threshold:
                            self.last_error = (
                                f"health check failed {failures} times in a row ({problem}); restarting"
                            )
                            return "unhealthy"
                    next_probe = now + policy.health_interval
            # Wake often enough to notice an exit quickly, without probing more than asked.
            wait = max(0.0, min(next_probe - loop.time(), 0.1))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._retiring.wait(), timeout=wait)

    def _spawn(self) -> bool:
        try:
            command = self.command_factory(self.port)
        except Exception as exc:
            self.last_error = f"cannot build the command: {exc}"
            self.last_exit_code = None
            log.error("%s: %s", self.name, self.last_error)
            return False
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(command.env)
        with open(self.log_path, "ab") as log_file:
            header = f"\n=== {now_iso()} start #{self.restarts + 1} of {self.name} on port {self.port}: " \
                     f"{command.shell(redact=True)}\n"
            log_file.write(header.encode("utf-8", "replace"))
            log_file.flush()
            try:
                process = subprocess.Popen(
                    list(command.argv),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own session and process group: signals reach its workers too
                    close_fds=True,
                )
            except OSError as exc:
                self.last_error = f"cannot start {command.argv[0]!r}: {exc.strerror or exc}"
                self.last_exit_code = None
                log_file.write(f"=== {self.last_error}\n".encode("utf-8", "replace"))
                log.error("%s: %s", self.name, self.last_error)
                return False
        self._process = process
        self.pid = process.pid
        self.start_ticks = process_start_ticks(process.pid)
        self.started_at = time.time()
        self._notify()
        return True

    def _record_exit(self, code: int) -> None:
        self.last_exit_code = code
        how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else \
            f"exit code {code}"
        self.last_error = f"exited unexpectedly ({how}); see {self.log_path}"
        # Workers it forked (vLLM's engine core, TP ranks) may outlive it and hold the GPU: end them too.
        if self.pid is not None:
            signal_group(self.pid, signal.SIGKILL)

    async def _probe(self) -> tuple[bool, str]:
        try:
            session = self._session_factory()
            timeout = aiohttp.ClientTimeout(total=self.policy.health_timeout)
            async with session.get(self.url + self.policy.health_path, timeout=timeout) as response:
                await response.read()
                if response.status == 200:
                    return True, ""
                return False, f"GET {self.policy.health_path} answered {response.status}"
        except asyncio.TimeoutError:
            return False, f"GET {self.policy.health_path} timed out after {self.policy.health_timeout:g}s"
        except (aiohttp.ClientError, OSError) as exc:
            return False, f"GET {self.policy.health_path} failed: {exc.__class__.__name__}"

    async def _terminate(self, grace: float | None = None) -> None:
        """SIGTERM the process group, wait up to ``grace``, then SIGKILL what is left."""
        process = self._process
        if process is None:
            return
        grace = self.policy.terminate_grace if grace is None else grace
        pgid = process.pid
        if process.poll() is None:
            signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if process.poll() is None:
                log.warning("%s ignored SIGTERM for %.1fs; sending SIGKILL", self.name, grace)
        # SIGKILL the whole group: the leader if it is still there, and any worker that outlived it.
        signal_group(pgid, signal.SIGKILL)
        while process.poll() is None:
            await asyncio.sleep(0.02)
        self.last_exit_code = process.returncode


def parse_load(text: str) -> int | None:
    """Sum of vLLM's running and waiting gauges (over all label sets) in a Prometheus text exposition."""
    seen = False
    total = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = len(line)
        for stop in ("{", " "):
            index = line.find(stop)
            if index != -1:
                name_end = min(name_end, index)
        if line[:name_end] not in LOAD_METRICS:
            continue
        value_text = line.rsplit("}", 1)[-1].split() if "}" in line else line.split()[1:]
        if not value_text:
            continue
        try:
            value = float(value_text[0])
        except ValueError:
            continue
        if math.isfinite(value):
            total += value
            seen = True
    return int(round(total)) if seen else None
