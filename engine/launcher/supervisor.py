"""The supervised processes of one fleet: spawn replica groups, replace a group blue/green, report, stop everything.

A config change is a replacement, because every vLLM knob needs a restart: new
replicas start on new ports, the caller's ``switch`` callback moves the gateway to
them once they are all healthy, and only then are the old ones drained and stopped.
"""
from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import aiohttp

from engine.launcher.managed_process import CommandFactory, ManagedProcess, PortAllocator
from engine.launcher.supervision_policy import SupervisorPolicy


class Supervisor:
    """The set of supervised processes of one fleet: spawn groups, replace them, report state, stop everything."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        base_port: int = 8101,
        policy: SupervisorPolicy | None = None,
        on_change: Callable[[ManagedProcess], None] | None = None,
        seed: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.host = host
        self.policy = policy or SupervisorPolicy()
        self.ports = PortAllocator(host, base_port)
        self._on_change_callback = on_change
        self._rng = random.Random(seed)
        self._processes: dict[str, ManagedProcess] = {}
        self._retired: list[ManagedProcess] = []
        self._generation: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None
        self._group_locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ spawning
    def spawn_group(
        self,
        group: str,
        *,
        replicas: int,
        command_factory: CommandFactory,
        config_version: str | None,
        backend: str,
        policy: SupervisorPolicy | None = None,
    ) -> list[ManagedProcess]:
        """Start ``replicas`` processes for ``group`` on freshly allocated ports (a new generation)."""
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, not {replicas!r}")
        generation = self._generation.get(group, 0) + 1
        self._generation[group] = generation
        started = []
        for index in range(1, replicas + 1):
            name = f"{group}-g{generation}-r{index}"
            started.append(self.spawn(
                name=name, group=group, role="replica", backend=backend, config_version=config_version,
                port=self.ports.allocate(), command_factory=command_factory, policy=policy,
            ))
        return started

    def spawn(
        self,
        *,
        name: str,
        group: str,
        role: str,
        backend: str,
        port: int,
        command_factory: CommandFactory,
        config_version: str | None = None,
        policy: SupervisorPolicy | None = None,
        host: str | None = None,
        movable_port: bool = True,
    ) -> ManagedProcess:
        """Start one supervised process; ``movable_port=False`` pins it (the gateway's public address)."""
        if name in self._processes:
            raise ValueError(f"a process named {name!r} is already supervised")
        self.ports.reserve(port)
        process = ManagedProcess(
            name=name, group=group, role=role, backend=backend, config_version=config_version,
            host=host or self.host, port=port, command_factory=command_factory, policy=policy or self.policy,
            log_path=self.log_dir / f"{name}.log", session_factory=self._client, ports=self.ports if movable_port
            else None, on_change=self._changed, rng=self._rng,
        )
        self._processes[name] = process
        process.start()
        return process

    # ------------------------------------------------------------------ queries
    def processes(self, *, group: str | None = None, role: str | None = None) -> list[ManagedProcess]:
        """Active (not retired) processes, optionally of one group or role."""
        return [p for p in self._processes.values()
                if (group is None or p.group == group) and (role is None or p.role == role)]

    def get(self, name: str) -> ManagedProcess | None:
        return self._processes.get(name)

    def state(self) -> dict[str, object]:
        """Every process as a dict (active first, then the most recently retired)."""
        return {
            "processes": [p.to_dict() for p in self._processes.values()],
            "retired": [p.to_dict() for p in self._retired[-20:]],
        }

    async def wait_healthy(self, processes: Iterable[ManagedProcess], timeout: float) -> list[ManagedProcess]:
        """Wait until all are healthy; returns those that are not (empty on success)."""
        processes = list(processes)
        results = await asyncio.gather(*(p.wait_healthy(timeout) for p in processes))
        return [p for p, ok in zip(processes, results) if not ok]

    # ------------------------------------------------------------------ replacement and stopping
    async def replace_group(
        self,
        group: str,
        *,
        replicas: int,
        command_factory: CommandFactory,
        config_version: str | None,
        backend: str,
        switch: Callable[[Sequence[ManagedProcess]], Awaitable[None]],
        ready_timeout: float | None = None,
        drain_timeout: float | None = None,
        policy: SupervisorPolicy | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> dict[str, object]:
        """Blue/green for one group: start the new generation, switch traffic to it, drain and stop the old one.

        If the new replicas do not all become healthy within ``ready_timeout`` they are
        stopped, the old ones keep serving, and ``ReplacementFailed`` is raised.
        """
        lock = self._group_locks.setdefault(group, asyncio.Lock())
        async with lock:
            old = self.processes(group=group)
            phase = on_phase or (lambda _phase: None)
            phase("starting")
            new = self.spawn_group(group, replicas=replicas, command_factory=command_factory,
                                   config_version=config_version, backend=backend, policy=policy)
            timeout = ready_timeout if ready_timeout is not None else (policy or self.policy).startup_timeout * 2
            laggards = await self.wait_healthy(new, timeout)
            if laggards:
                problems = "; ".join(f"{p.name}: {p.last_error or p.state} (log {p.log_path})" for p in laggards)
                phase("failed")
                await asyncio.gather(*(self._retire(p, drain=False) for p in new))
                raise ReplacementFailed(f"new replicas of {group!r} did not become healthy: {problems}")
            phase("switching")
            try:
                await switch(new)
            except Exception as exc:
                phase("failed")
                await asyncio.gather(*(self._retire(p, drain=False) for p in new))
                raise ReplacementFailed(f"switching the gateway to the new replicas of {group!r} failed: {exc}") \
                    from exc
            phase("draining")
            reasons = await asyncio.gather(*(self._retire(p, drain=True, timeout=drain_timeout) for p in old))
            phase("done")
            return {
                "group": group,
                "started": [p.name for p in new],
                "stopped": {p.name: reason for p, reason in zip(old, reasons)},
            }

    async def retire(self, process: ManagedProcess, *, drain: bool, timeout: float | None = None) -> str:
        """Drain (or stop at once) one process and move it to the retired list."""
        return await self._retire(process, drain=drain, timeout=timeout)

    async def _retire(self, process: ManagedProcess, *, drain: bool, timeout: float | None = None) -> str:
        if drain:
            reason = await process.drain(timeout)
        else:
            await process.stop()
            reason = "stopped"
        if self._processes.get(process.name) is process:
            del self._processes[process.name]
            self._retired.append(process)
            del self._retired[:-50]
        self.ports.release(process.port)
        self._changed(process)
        return reason

    async def stop_all(self, *, roles_first: Sequence[str] = ("gateway",), grace: float | None = None) -> None:
        """Stop everything: the roles in ``roles_first`` first (the gateway stops taking requests), then the rest."""
        for role in roles_first:
            await asyncio.gather(*(self._stop(p, grace) for p in self.processes(role=role)))
        await asyncio.gather(*(self._stop(p, grace) for p in self.processes()))

    async def _stop(self, process: ManagedProcess, grace: float | None) -> None:
        await process.stop(grace)
        if self._processes.get(process.name) is process:
            del self._processes[process.name]
            self._retired.append(process)
        self.ports.release(process.port)
        self._changed(process)

    async def close(self) -> None:
        """Stop everything and release the HTTP session."""
        await self.stop_all()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ plumbing
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection reuse: a replica that restarts on the same port must not get a stale socket.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=64))
        return self._session

    def _changed(self, process: ManagedProcess) -> None:
        if self._on_change_callback is not None:
            self._on_change_callback(process)


class ReplacementFailed(RuntimeError):
    """A group's new replicas did not become healthy (or traffic could not be moved); the old ones keep serving."""
