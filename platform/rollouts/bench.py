"""Rollouts on a live platform and a simulated fleet: `python -m rollouts.bench [--aa 20] [--rate 10]`.

The fleet runs Llama-3.1-8B on simulated H100s (real-time replicas of the engine simulator), behind the gateway,
with a Poisson load; the platform (`runplatform`, its beat advancing rollouts every second) reads its spans.

- **Time to rollback**: group `base` (tensor_parallel_size 2) takes `--rate` requests/s of 1500-3000-token prompts;
  a rollout moves it to tensor_parallel_size 1, which doubles each prompt's prefill compute (TTFT shift measured
  and printed; TPOT rises too), with the default analysis (10 s settle, 60 s window, a look every 10 s), the
  default comparison with a baseline twin (the old config on one replica, at the canary's weight) and a canary
  at 5%. The figure is the time from the canary taking traffic (its `canary-weight` transition) to the rollback
  (target ≤ 3 min). `--compare-with group` runs the same against the loaded group itself, which shows why the
  twin is the default: the canary's lone replica at 5% is nearly idle and can look faster than the group.
- **False rollbacks over A/A rollouts**: `--aa` rollouts of a config that differs from the group's only in
  gpu_memory_utilization 0.90 → 0.89 (the platform refuses an identical config; this knob changes nothing at this
  load), four groups at a time, canary at 50% for 80 s, up to one extension. Counted: promoted, paused
  (inconclusive), rolled back (false rollbacks; target ≤ 1).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchkit.harness import PlatformProcess, free_port, free_port_pair

ROOT = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FLEET = """\
name: rollout-bench
run_dir: {run_dir}
gateway: {{bind: "127.0.0.1:{gateway}"}}
control: {{bind: "127.0.0.1:{control}"}}
replicas: {{host: 127.0.0.1, base_port: {replicas}}}
telemetry:
  otlp_endpoint: {platform}/v1/traces
  otlp_protocol: http/protobuf
  otlp_headers: {{authorization: "Bearer {key}"}}
groups:
{groups}
"""
GROUP = """  - name: {name}
    weight: {weight}
    replicas: 1
    backend: simulator
    seed: {seed}
    config: {config}
"""


class Bench:
    def __init__(self, root: Path, groups: dict[str, dict], rate: float, load_args: tuple[str, ...] = ()):
        self.root = root
        self.process = PlatformProcess(data_dir=str(root / "data"), extra_env={
            "ROLLOUTS_SWEEP_INTERVAL_SECONDS": "1", "ROLLOUTS_TICK_LEASE_SECONDS": "20"})
        self.fleet_file = root / "fleet.yaml"
        self.process.env["ENGINE_FLEET"] = str(self.fleet_file)
        self.groups = groups
        self.rate = rate
        self.load_args = load_args
        self.gateway = free_port()
        self.control = free_port()
        self.load = None

    def __enter__(self) -> Bench:
        self.process.manage("migrate", "-v0")
        key = self.process.manage("create_ingest_key", "--project", "default")
        self.token = self.process.manage("create_api_token", "--user", "bench", "--role", "admin",
                                         "--project", "default")
        weight = round(100 / len(self.groups), 3)
        groups = "".join(GROUP.format(name=name, weight=weight, seed=i + 1, config=json.dumps(config))
                         for i, (name, config) in enumerate(self.groups.items()))
        self.fleet_file.write_text(FLEET.format(run_dir=self.root / "engine", gateway=self.gateway,
                                                control=self.control, replicas=free_port_pair(),
                                                platform=self.process.url, key=key, groups=groups))
        self.process.start(timeout=180)
        up = self.engine("up", "--detach")
        if up.returncode != 0:
            raise RuntimeError(up.stdout + up.stderr)
        log = open(self.root / "load.log", "wb")
        self.load = subprocess.Popen(
            [sys.executable, "-m", "engine.loadgen", "--base-url", f"http://127.0.0.1:{self.gateway}/v1",
             "--arrival", "poisson", "--rate", str(self.rate), "--duration", "7200", "--quiet", "--timeout", "120",
             "--model", MODEL, "--seed", "1", *self.load_args], env=self.process.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        time.sleep(15)  # some baseline traffic first
        return self

    def __exit__(self, *exc) -> None:
        if self.load is not None:
            self.load.terminate()
            self.load.wait(30)
        self.engine("down")
        self.process.stop()

    def engine(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine", *args, "--fleet", str(self.fleet_file)],
                              env=self.process.env, capture_output=True, text=True, timeout=300, cwd=ROOT)

    def api(self, method: str, path: str, body=None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.process.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def start(self, group: str, config: dict, plan: dict | None) -> dict:
        status, body = self.api("POST", "/api/v1/rollouts?project=default",
                                {"group": group, "config": config, **({"plan": plan} if plan else {})})
        if status != 201:
            raise RuntimeError(f"rollout refused: {body}")
        return body

    def wait(self, rollout_ids: list[int], timeout: float) -> dict[int, dict]:
        deadline = time.monotonic() + timeout
        done: dict[int, dict] = {}
        while time.monotonic() < deadline and len(done) < len(rollout_ids):
            for rollout_id in rollout_ids:
                if rollout_id in done:
                    continue
                status, body = self.api("GET", f"/api/v1/rollouts/{rollout_id}")
                if status == 200 and body["state"] in ("promoted", "rolled_back", "paused", "failed", "aborted"):
                    done[rollout_id] = body
            time.sleep(1.0)
        for rollout_id in rollout_ids:
            if rollout_id not in done:
                _, done[rollout_id] = self.api("GET", f"/api/v1/rollouts/{rollout_id}")
        return done

    def wait_canaries_gone(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = json.loads(self.engine("status", "--json").stdout or "{}")
            if not any(g.get("dynamic") for g in status.get("groups") or []):
                return
            time.sleep(1)


def _at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def time_to_rollback(rate: float, compare_with: str = "twin") -> None:
    base = {"model": MODEL, "gpu_type": "H100", "tensor_parallel_size": 2}
    bad = {"tensor_parallel_size": 1}
    long_prompts = ("--input-len", "1500:3000", "--output-len", "50:150")
    with tempfile.TemporaryDirectory(prefix="bench-rollouts-") as tmp, \
            Bench(Path(tmp), {"base": base}, rate, long_prompts) as b:
        rollout = b.start("base", bad, {"steps": [{"canary": 5, "interval": 600}], "compare_with": compare_with})
        final = b.wait([rollout["id"]], timeout=900)[rollout["id"]]
        transitions = final.get("transitions") or []
        took = next((t for t in transitions if t["action"] == "canary-weight"), None)
        ended = transitions[-1] if transitions else None
        print(f"rollout {rollout['id']} (tensor_parallel_size 2 → 1 on 1500-3000-token prompts, canary 5% of "
              f"{rate:g} req/s, compared with the {compare_with}): {final['state']}")
        print(f"  reason: {final.get('reason')}")
        if final["state"] != "rolled_back" or took is None:
            print("BENCH rollout_time_to_rollback_s=nan s (not rolled back)")
            return
        seconds = (_at(ended["at"]) - _at(took["at"])).total_seconds()
        ttft = next((m for m in ended["figures"].get("metrics", []) if m["metric"] == "ttft_ms"), {})
        status, analysis = b.api("GET", f"/api/v1/rollouts/{rollout['id']}/analyses/{ended['figures']['analysis']}")
        full = next((m for m in analysis.get("figures", {}).get("metrics", []) if m["metric"] == "ttft_ms"), {})
        if full.get("baseline_median") and full.get("canary_median"):
            shift = 100 * (full["canary_median"] / full["baseline_median"] - 1)
            print(f"BENCH rollout_bad_canary_ttft_p50_shift_pct={shift:.0f} % (measured: baseline p50 "
                  f"{full['baseline_median']:.1f} ms, canary {full['canary_median']:.1f} ms)")
        print(f"BENCH rollout_canary_requests_at_rollback={ended['figures']['counts']['canary']} requests")
        print(f"BENCH rollout_time_to_rollback_s={seconds:.0f} s (target <= 180; TTFT HL shift "
              f"{ttft.get('hl_shift', float('nan')):.1f} ms)")


def aa_rollouts(count: int, rate: float, parallel: int = 4) -> None:
    base = {"model": MODEL, "gpu_type": "H100", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9}
    same = {"gpu_memory_utilization": 0.89}
    groups = {f"g{i}": dict(base) for i in range(parallel)}
    plan = {"steps": [{"canary": 50, "interval": 80}], "analysis": {"max_extensions": 1}}
    outcomes: dict[str, int] = {"promoted": 0, "rolled_back": 0, "paused": 0, "other": 0}
    reasons = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-rollouts-") as tmp, Bench(Path(tmp), groups, rate) as b:
        configs = {name: dict(base) for name in groups}
        done = 0
        while done < count:
            batch = {}
            for name in groups:
                if done + len(batch) >= count:
                    break
                target = same if configs[name].get("gpu_memory_utilization") == 0.9 else {"gpu_memory_utilization": 0.9}
                batch[name] = (b.start(name, target, plan)["id"], target)
            results = b.wait([rid for rid, _ in batch.values()], timeout=600)
            for name, (rid, target) in batch.items():
                state = results[rid]["state"]
                outcomes[state if state in outcomes else "other"] += 1
                if state == "promoted":
                    configs[name] = {**configs[name], **target}
                elif state != "rolled_back":
                    b.api("POST", f"/api/v1/rollouts/{rid}/abort")
                if state == "rolled_back":
                    reasons.append(results[rid]["reason"])
            done += len(batch)
            b.wait_canaries_gone()
            print(f"  {done}/{count}: {outcomes}", flush=True)
    for reason in reasons:
        print(f"  false rollback: {reason}")
    print(f"BENCH rollout_aa_false_rollbacks={outcomes['rolled_back']} of {count} (target <= 1; promoted "
          f"{outcomes['promoted']}, paused inconclusive {outcomes['paused']}, other {outcomes['other']}; "
          f"{time.monotonic() - started:.0f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s through the gateway")
    parser.add_argument("--aa", type=int, default=20, help="A/A rollouts (0: skip)")
    parser.add_argument("--skip-rollback", action="store_true")
    parser.add_argument("--compare-with", choices=("twin", "group"), default="twin",
                        help="the time-to-rollback rollout's baseline (the A/A rollouts use the default, twin)")
    args = parser.parse_args(argv)
    if not args.skip_rollback:
        time_to_rollback(args.rate, args.compare_with)
    if args.aa:
        aa_rollouts(args.aa, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
