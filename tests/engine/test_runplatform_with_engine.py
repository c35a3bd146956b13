"""What `make up` runs: `manage.py runplatform --with-engine --load R` on a fresh data directory. The simulated
fleet (two replica groups behind the gateway) starts with the platform, the background load's requests arrive
decomposed with their replica group and engine config, and SIGTERM sent twice (as make and process managers
do: to the whole group, then to the children again) still drains and stops the fleet, leaving nothing behind."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest
from benchkit.harness import PlatformProcess, free_port, free_port_pair

# `make up` end to end (the fleet, load, SIGTERM): run once, in embedded mode, `make up`'s default.
pytestmark = pytest.mark.one_suite(suite="embedded")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_make_up_runs_the_fleet_with_load_and_stops_it_on_sigterm(tmp_path):
    gateway, control, replicas = free_port(), free_port(), free_port_pair()
    process = PlatformProcess(
        data_dir=str(tmp_path / "data"), args=("--with-engine", "--load", "4"),
        extra_env={"ENGINE_GATEWAY_BIND": f"127.0.0.1:{gateway}", "ENGINE_CONTROL_BIND": f"127.0.0.1:{control}",
                   "ENGINE_REPLICA_BASE_PORT": str(replicas)},
    )
    try:
        process.manage("migrate", "-v0")
        process.manage("create_ingest_key", "--project", "default")
        token = process.manage("create_api_token", "--user", "admin", "--role", "admin", "--project", "default")
        process.start(timeout=120)
        assert all(_listening(port) for port in (gateway, control, replicas, replicas + 1)), process.log_tail()

        since = urllib.parse.quote(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 600)))
        path = f"/api/v1/latency/summary?group_by=replica_group,engine_config&since={since}&exact=1"
        deadline = time.monotonic() + 90
        groups: dict = {}
        while time.monotonic() < deadline:
            status, body = process.get(path, token)
            assert status == 200, body
            # Requests whose engine span is still on its way have the gateway's hop only: the group the
            # gateway routed to, no engine config yet. Those with the engine hop have both.
            groups = {(g["key"]["replica_group"], g["key"]["engine_config"]): g for g in body["groups"]
                      if g["key"]["engine_config"]}
            # ... and a group's first rows may still wait for their gateway hop (network_ms needs both).
            if {group for group, _ in groups} == {"baseline", "canary"} and all(
                    figures["network_ms"]["p50"] is not None for figures in groups.values()):
                break
            time.sleep(1)
        assert {group for group, _ in groups} == {"baseline", "canary"}, (body, process.log_tail())
        status, fleet = process.get("/api/v1/engine", token)
        assert status == 200 and fleet["running"] is True, fleet
        configs = {group["name"]: group["config_version"] for group in fleet["fleet"]["groups"]}
        for (group, config), figures in groups.items():
            assert config == configs[group], (groups, configs)  # the group's engine config version
            assert figures["count"] >= 1 and figures["queue_ms"]["p50"] is not None  # decomposed by the engine hop
            assert figures["network_ms"]["p50"] is not None  # through the gateway: a client and a gateway hop

        process.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        process.proc.send_signal(signal.SIGTERM)  # during the shutdown: ignored, the drain goes on
        try:
            code = process.proc.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the platform did not exit within 120 s of SIGTERM:\n{process.log_tail(8000)}")
        assert code == 0, process.log_tail()
        log = process.log_tail(20_000)
        assert "already shutting down" in log and "engine fleet 'embedded': stopped" in log, log
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_listening(p) for p in (gateway, control, replicas, replicas + 1)):
            time.sleep(0.2)
        assert not any(_listening(p) for p in (gateway, control, replicas, replicas + 1)), "the fleet outlived its platform"
    finally:
        process.stop()
        # whatever happened above, leave no fleet running
        subprocess.run([sys.executable, "-m", "engine", "down"], env={**process.env,
                       "ENGINE_RUN_DIR": str(tmp_path / "data" / "engine")}, capture_output=True, timeout=120)
