"""Latency of the JSON API per endpoint (p50 of sequential calls), one platform process with seeded data.

    python -m apikit.bench [--calls 200] [--root PATH]

`--root` starts the platform from another checkout (its manage.py, this virtualenv), so the same client
measures two versions of the API side by side (docs/benchmarks.md: the input layer cost less than 10%).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchkit.harness import PlatformProcess
from benchkit.payloads import ChainTemplate


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--root", default=None, help="checkout to start the platform from (default: this one)")
    args = parser.parse_args(argv)

    platform = PlatformProcess(extra_env={"API_AUTH_FAILURE_LIMIT": "100000000"})
    if args.root:
        platform.root = Path(args.root)
    platform.manage("migrate", "-v0")
    key = platform.manage("create_ingest_key", "--project", "bench")
    token = platform.manage("create_api_token", "--user", "bench", "--role", "admin", "--project", "bench")
    platform.start()
    try:
        paths = seed(platform, key, token)
        for name, path in paths.items():
            latencies = []
            for _ in range(args.calls):
                started = time.perf_counter()
                status = get(platform, path, token)
                latencies.append((time.perf_counter() - started) * 1000)
                if status != 200:
                    raise SystemExit(f"{path}: HTTP {status}")
            print(f"BENCH api_{name}_p50_ms={statistics.median(latencies):.2f} ms")
    finally:
        platform.stop()


def get(platform: PlatformProcess, path: str, token: str) -> int:
    request = urllib.request.Request(platform.url + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def send(platform: PlatformProcess, method: str, path: str, token: str, body: dict) -> dict:
    request = urllib.request.Request(platform.url + path, data=json.dumps(body).encode(), method=method,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def seed(platform: PlatformProcess, key: str, token: str) -> dict[str, str]:
    """Requests, an SLO, a silence, a channel; returns {endpoint name: path}."""
    body, trace_ids = ChainTemplate(traces=200).batch()
    platform.post("/v1/traces", body, {"Content-Type": "application/x-protobuf", "Authorization": f"Bearer {key}"})
    platform.wait_idle(120)
    send(platform, "POST", "/api/v1/slos", token,
         {"name": "bench-ttft", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99%"})
    silence = send(platform, "POST", "/api/v1/silences", token,
                   {"matchers": ["slo=bench-ttft"], "duration": "1d", "comment": "bench"})
    channel = send(platform, "POST", "/api/v1/channels", token,
                   {"name": "bench", "kind": "webhook", "url": "https://hooks.example.com/x"})
    fingerprint = subprocess.run(
        [sys.executable, str(platform.root / "manage.py"), "shell", "-c",
         "import hashlib; from django.utils import timezone; from alerts.models import Alert; "
         "from slo.models import SLO; s = SLO.objects.get(name='bench-ttft'); "
         "f = hashlib.sha256(b'bench').hexdigest(); "
         "Alert.objects.create(project_id=s.project_id, kind='slo_burn', severity='page', state='firing', "
         "fingerprint=f, slo=s, labels={'slo': s.name}, started_at=timezone.now()); print(f)"],
        env=platform.env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return {
        "requests": f"/api/v1/requests?trace_id={trace_ids[0]}",
        "summary": "/api/v1/latency/summary?group_by=model",
        "engine": "/api/v1/engine",
        "slos": "/api/v1/slos",
        "slo": "/api/v1/slos/bench-ttft",
        "slo_history": "/api/v1/slos/bench-ttft/history?limit=100",
        "alerts": "/api/v1/alerts?state=firing,pending",
        "alert": f"/api/v1/alerts/{fingerprint}",
        "silences": "/api/v1/silences",
        "channels": "/api/v1/channels",
        "channel": f"/api/v1/channels/{channel['channel']['id']}",
        "deliveries": f"/api/v1/channels/{channel['channel']['id']}/deliveries?limit=50",
        "silence_list_filtered": "/api/v1/silences?status=active&limit=10",
        **({"silence": f"/api/v1/silences/{silence['silence']['id']}"}),
    }


if __name__ == "__main__":
    main()
