"""The replica supervisor with real child processes: health, crash and restart with backoff, drain, replacement."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from engine.launcher.managed_process import CRASHED, DRAINING, HEALTHY, STOPPED, UNHEALTHY, PortAllocator, parse_load
from engine.launcher.process_groups import kill_recorded_processes, process_alive, process_start_ticks
from engine.launcher.supervision_policy import SupervisorPolicy, backoff_delay
from engine.launcher.supervisor import ReplacementFailed, Supervisor
from engine.launcher.vllm_command import LaunchCommand

FAKE = str(Path(__file__).with_name("launcher_fake_replica.py"))

FAST = SupervisorPolicy(
    health_interval=0.15, health_timeout=0.5, unhealthy_threshold=2, startup_timeout=5.0,
    startup_poll_interval=0.05, backoff_initial=0.1, backoff_max=0.4, backoff_multiplier=2.0,
    backoff_jitter=0.2, stable_after=0.6, drain_timeout=5.0, drain_poll_interval=0.1, terminate_grace=1.0,
)


def fake(*extra: str):
    def build(port: int) -> LaunchCommand:
        return LaunchCommand(argv=(sys.executable, FAKE, "--port", str(port), *extra), env={"FAKE_REPLICA": "1"})
    return build


def free_base_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def supervising(tmp_path, *, seed: int, policy: SupervisorPolicy = FAST, **options):
    """A Supervisor on free ports in ``tmp_path``, closed (every process stopped) on the way out."""
    supervisor = Supervisor(tmp_path, base_port=free_base_port(), policy=policy, seed=seed, **options)
    try:
        yield supervisor
    finally:
        await supervisor.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=30))


# ---------------------------------------------------------------------------------------------- pure parts
def test_backoff_grows_exponentially_is_capped_and_jittered_downwards():
    policy = SupervisorPolicy(backoff_initial=1.0, backoff_max=8.0, backoff_multiplier=2.0, backoff_jitter=0.25)
    rng = random.Random(7)
    for attempt, base in enumerate([1, 2, 4, 8, 8, 8]):
        delays = [backoff_delay(attempt, policy, rng) for _ in range(200)]
        assert all(base * 0.75 <= d <= base for d in delays), (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > 0.1 * base  # jitter really spreads restarts
    assert backoff_delay(10_000, policy, rng) <= 8.0


def test_policy_rejects_nonsense_with_every_reason():
    with pytest.raises(ValueError) as caught:
        SupervisorPolicy(health_interval=0, unhealthy_threshold=0, backoff_jitter=1.5, health_path="health")
    message = str(caught.value)
    for needle in ("health_interval", "unhealthy_threshold", "backoff_jitter", "health_path"):
        assert needle in message
    with pytest.raises(ValueError, match="unknown supervision setting"):
        SupervisorPolicy.from_dict({"health_intervall": 1})
    with pytest.raises(ValueError, match="backoff_initial"):
        SupervisorPolicy(backoff_initial=10, backoff_max=1)


def test_parse_load_sums_running_and_waiting_over_label_sets():
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m{x}"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0\n'
        "vllm:num_preemptions_total 4.0\n"
    )
    assert parse_load(text) == 6
    assert parse_load("vllm:num_requests_running 0\nvllm:num_requests_waiting 0.0 1712345678\n") == 0
    assert parse_load("process_cpu_seconds_total 1.0\n") is None
    assert parse_load("vllm:num_requests_running NaN\n") is None


def test_port_allocator_skips_ports_in_use_and_its_own():
    base = free_base_port()
    allocator = PortAllocator("127.0.0.1", base, span=50)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base))
        squatter.listen()
        first = allocator.allocate()
        assert first != base
        second = allocator.allocate()
        assert second not in (base, first)
    allocator.release(first)
    assert allocator.allocate() in (base, first)
    with pytest.raises(ValueError):
        PortAllocator("127.0.0.1", 0)


# ---------------------------------------------------------------------------------------------- real processes
def test_replica_starts_healthy_and_reports_its_state(tmp_path):
    async def scenario():
        async with supervising(tmp_path, seed=1) as supervisor:
            [replica] = supervisor.spawn_group("baseline", replicas=1, command_factory=fake(),
                                               config_version="cfg-000000000001", backend="simulator")
            assert await replica.wait_healthy(10)
            state = replica.to_dict()
            assert state["group"] == "baseline" and state["config_version"] == "cfg-000000000001"
            assert state["state"] == HEALTHY and state["restarts"] == 0 and state["last_exit_code"] is None
            assert state["pid"] == replica.pid and process_alive(replica.pid, state["start_ticks"])
            assert os.getpgid(replica.pid) == replica.pid  # its own process group
            assert state["url"] == f"http://127.0.0.1:{replica.port}" and state["since"].endswith("Z")
            log_text = Path(state["log"]).read_text()
            assert "fake replica on" in log_text and "start #1" in log_text and "FAKE_REPLICA=1" in log_text
            assert supervisor.state()["processes"][0]["name"] == replica.name
            pid = replica.pid
        assert not process_alive(pid)
        assert replica.state == STOPPED
    run(scenario())


def test_crash_restarts_with_backoff_then_stays_up(tmp_path):
    starts = tmp_path / "starts"
    seen_states: list[str] = []

    async def scenario():
        async with supervising(tmp_path, seed=2, on_change=lambda p: seen_states.append(p.state)) as supervisor:
            [replica] = supervisor.spawn_group(
                "baseline", replicas=1, backend="simulator", config_version=None,
                command_factory=fake("--starts-file", str(starts), "--fail-first", "3", "--crash-after", "0.3",
                                     "--exit-code", "3"),
            )
            await until(lambda: replica.restarts == 3 and replica.state == HEALTHY, what="three restarts")
            assert replica.last_exit_code == 3
            assert CRASHED in seen_states
            # Gaps between starts grow with the backoff (0.1, 0.2, 0.4 s before jitter; 0.3 s of life each).
            times = [float(line.split()[2]) for line in starts.read_text().splitlines()]
            gaps = [b - a - 0.3 for a, b in zip(times, times[1:])]
            assert gaps[0] >= 0.1 * 0.8 - 0.05 and gaps[2] >= 0.4 * 0.8 - 0.05, gaps
            assert replica.backoff_step == 3
            # Healthy for longer than stable_after: the backoff starts over.
            await until(lambda: replica.backoff_step == 0, what="backoff reset after a stable period")
            pid = replica.pid
            os.kill(pid, signal.SIGKILL)
            await until(lambda: replica.restarts == 4 and replica.state == HEALTHY, what="restart after kill -9")
            assert replica.last_exit_code == -signal.SIGKILL and replica.pid != pid
    run(scenario())


def test_failed_health_checks_restart_the_replica(tmp_path):
    starts = tmp_path / "starts"

    async def scenario():
        states: list[str] = []
        async with supervising(tmp_path, seed=3, on_change=lambda p: states.append(p.state)) as supervisor:
            [replica] = supervisor.spawn_group(
                "baseline", replicas=1, backend="simulator", config_version=None,
                command_factory=fake("--starts-file", str(starts), "--fail-first", "1", "--unhealthy-after", "0.2"),
            )
            await until(lambda: replica.restarts == 1 and replica.state == HEALTHY, what="restart of unhealthy")
            assert UNHEALTHY in states and CRASHED in states
            assert replica.last_exit_code == 0  # stopped by our SIGTERM (the fake exits 0 on it)
            assert len(starts.read_text().splitlines()) == 2
    run(scenario())


def test_startup_timeout_and_missing_executable_are_reported(tmp_path):
    async def scenario():
        policy = dataclasses.replace(FAST, startup_timeout=0.5)
        async with supervising(tmp_path, policy=policy, seed=4) as supervisor:
            slow = supervisor.spawn(name="slow", group="g", role="replica", backend="simulator",
                                    port=supervisor.ports.allocate(), command_factory=fake("--startup-delay", "30"))
            missing = supervisor.spawn(
                name="missing", group="g", role="replica", backend="vllm", port=supervisor.ports.allocate(),
                command_factory=lambda port: LaunchCommand(argv=("/nonexistent/vllm", "serve"), env={}),
            )
            await until(lambda: slow.restarts >= 1, what="restart after startup timeout")
            assert "not healthy within 0.5s" in (slow.last_error or "") or slow.state != HEALTHY
            await until(lambda: missing.restarts >= 1, what="retry of a missing executable")
            assert "cannot start '/nonexistent/vllm'" in missing.last_error
            assert missing.pid is None
    run(scenario())


def test_replacement_drains_the_old_replica_before_stopping_it(tmp_path):
    busy = tmp_path / "busy"
    busy.write_text("1")
    events: list[str] = []

    async def scenario():
        async with supervising(tmp_path, seed=5) as supervisor:
            [old] = supervisor.spawn_group("canary", replicas=1, command_factory=fake("--busy-file", str(busy)),
                                           config_version="cfg-old", backend="simulator")
            assert await old.wait_healthy(10)
            old_pid = old.pid

            async def switch(new):
                assert all(p.state == HEALTHY for p in new)
                assert old.state == HEALTHY  # traffic moves before the old replica is touched
                events.append("switched:" + ",".join(p.url for p in new))

            task = asyncio.ensure_future(supervisor.replace_group(
                "canary", replicas=1, command_factory=fake(), config_version="cfg-new", backend="simulator",
                switch=switch, ready_timeout=10))
            await until(lambda: old.state == DRAINING, what="old replica draining")
            assert events and events[0].startswith("switched:http://127.0.0.1:")
            await asyncio.sleep(0.5)
            assert old.state == DRAINING and process_alive(old_pid)  # busy: kept alive
            busy.unlink()
            result = await task
            assert result["stopped"] == {old.name: "idle"}
            assert not process_alive(old_pid) and old.state == STOPPED
            [new] = supervisor.processes(group="canary")
            assert new.config_version == "cfg-new" and new.port != old.port and new.name.endswith("g2-r1")
            assert supervisor.state()["retired"][-1]["name"] == old.name
    run(scenario())


def test_drain_timeout_then_sigkill_for_a_replica_that_ignores_sigterm(tmp_path):
    busy = tmp_path / "busy"
    busy.write_text("1")

    async def scenario():
        policy = dataclasses.replace(FAST, terminate_grace=0.4)
        async with supervising(tmp_path, policy=policy, seed=6) as supervisor:
            [stubborn] = supervisor.spawn_group(
                "g", replicas=1, backend="simulator", config_version=None,
                command_factory=fake("--busy-file", str(busy), "--ignore-sigterm"))
            assert await stubborn.wait_healthy(10)
            reason = await supervisor.retire(stubborn, drain=True, timeout=0.5)
            assert reason == "timeout"
            assert stubborn.state == STOPPED and stubborn.last_exit_code == -signal.SIGKILL
            assert not process_alive(stubborn.pid)
    run(scenario())


def test_failed_replacement_keeps_the_old_replicas_serving(tmp_path):
    async def scenario():
        async with supervising(tmp_path, seed=7) as supervisor:
            [old] = supervisor.spawn_group("g", replicas=1, command_factory=fake(), config_version="a",
                                           backend="simulator")
            assert await old.wait_healthy(10)

            switched = []

            async def switch(new):
                switched.append(new)

            with pytest.raises(ReplacementFailed, match="did not become healthy"):
                await supervisor.replace_group(
                    "g", replicas=1, config_version="b", backend="simulator", switch=switch, ready_timeout=1.0,
                    command_factory=fake("--unhealthy-after", "0"))
            assert not switched
            assert supervisor.processes(group="g") == [old] and old.state == HEALTHY

            async def refusing_gateway(new):
                raise RuntimeError("gateway answered 400")

            with pytest.raises(ReplacementFailed, match="gateway answered 400"):
                await supervisor.replace_group(
                    "g", replicas=1, config_version="c", backend="simulator", switch=refusing_gateway,
                    ready_timeout=5.0, command_factory=fake())
            assert supervisor.processes(group="g") == [old] and old.state == HEALTHY
            assert all(p["state"] == STOPPED for p in supervisor.state()["retired"])
    run(scenario())


def test_kill_recorded_processes_stops_orphans_but_not_a_reused_pid(tmp_path):
    import subprocess

    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        ticks = process_start_ticks(orphan.pid)
        assert kill_recorded_processes([{"pid": orphan.pid, "start_ticks": (ticks or 0) + 1}], grace=0.2) == []
        assert orphan.poll() is None  # same pid, different start time: not ours
        assert kill_recorded_processes([{"pid": orphan.pid, "start_ticks": ticks}, {"pid": "x"}], grace=2) \
            == [orphan.pid]
        assert orphan.wait(5) == -signal.SIGTERM
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
