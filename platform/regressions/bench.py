"""Regression runs against a live platform's simulated fleet: `python -m regressions.bench`.

Figures (BENCH lines):
- a 500-item run at 20 requests/s (Poisson) against one replica group, compared with the previous run of the
  same dataset and target: wall time, how long after the last request the comparison is ready (target ≤ 5 s),
  and the platform's own time per item (claim and set-up before the first request, plus the analysis after the
  last; the requests themselves are the target's time), with the analysis split into its parts;
- the false-alarm rate of `fail` over N identical A/A runs (same group as candidate and baseline, paired,
  default gates; target ≤ 5%, the 95% level);
- the smallest shift of p95 TTFT that 200 paired items detect with 80% power at the 95% level: 2.486 × the
  bootstrap standard error of the p95 difference, from each A/A run (median over the runs), in ms and as a share
  of p95 TTFT.

The fleet is the simulator (Llama-3.1-8B on an H100, vLLM's defaults) in real time on this machine: its noise
includes this machine's scheduling, which a GPU host's would not.

It lives in the regressions app (`python -m regressions.bench` is the same); regressions.bench, the name
`make bench` runs, forwards to it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchkit.harness import ROOT, PlatformProcess, free_port, free_port_pair

FLEET = """\
name: bench-regressions
run_dir: {run_dir}
gateway: {{bind: 127.0.0.1:{gateway}}}
control: {{bind: 127.0.0.1:{control}}}
replicas: {{host: 127.0.0.1, base_port: {replicas}}}
telemetry: {{otlp_protocol: http/protobuf}}
groups:
  - {{name: base, weight: 100, replicas: 1, backend: simulator,
     config: {{model: meta-llama/Llama-3.1-8B-Instruct, gpu_type: H100, tensor_parallel_size: 1}}}}
"""
WORDS = ("latency", "decode", "prefill", "queue", "cache", "token", "batch", "kernel", "replica", "gateway")


def _items(count: int) -> list[dict]:
    return [{"id": f"b{i}", "messages": [{"role": "user", "content": "Explain " + " ".join(
        WORDS[(i * 7 + k) % len(WORDS)] for k in range(20 + (i * 37) % 600))}],
        "params": {"max_tokens": 16 + (i * 13) % 48}, "evaluators": [{"type": "regex", "pattern": "\\w"}]}
        for i in range(count)]


class Api:
    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def __call__(self, method: str, path: str, body=None):
        request = urllib.request.Request(self.url + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{method} {path}: {exc.code} {exc.read()[:500]!r}") from None

    def dataset(self, name: str, items: list[dict]) -> None:
        for start in range(0, len(items), 15):  # the API takes bodies of up to 64 KiB
            chunk = items[start:start + 15]
            if start == 0:
                self("POST", "/api/v1/datasets", {"name": name, "items": chunk})
            else:
                self("POST", f"/api/v1/datasets/{name}/versions", {"items": chunk})

    def run(self, body: dict) -> dict:
        run = self("POST", "/api/v1/regression-runs", body)
        while run["state"] in ("queued", "running", "analysing"):
            time.sleep(0.5)
            run = self("GET", f"/api/v1/regression-runs/{run['id']}")
        if run["state"] != "done":
            raise RuntimeError(f"run {run['id']} ended {run['state']}: {run['error']}")
        return run


def _t(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=500, help="items of the timed run")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--aa-runs", type=int, default=20)
    parser.add_argument("--aa-items", type=int, default=200)
    parser.add_argument("--aa-concurrency", type=int, default=8)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-regressions-") as root:
        gateway, control, replicas = free_port(), free_port(), free_port_pair()
        fleet = Path(root) / "fleet.yaml"
        fleet.write_text(FLEET.format(run_dir=Path(root) / "engine", gateway=gateway, control=control,
                                      replicas=replicas))
        process = PlatformProcess(data_dir=str(Path(root) / "data"), args=("--with-engine",),
                                  extra_env={"ENGINE_FLEET": str(fleet)})
        process.manage("migrate", "-v0")
        # The managed fleet's spans go to project default (its ingest key's): the runs belong there too.
        process.manage("create_ingest_key", "--project", "default")
        token = process.manage("create_api_token", "--user", "bench", "--role", "operator", "--project", "default")
        process.start(timeout=180)
        try:
            api = Api(process.url, token)
            api.dataset("timed", _items(args.items))
            api.dataset("aa", _items(args.aa_items))
            # The first run of a dataset and target has no baseline: it becomes the one the timed run compares with.
            api.run({"dataset": "timed", "target": "group:base", "options": {"rate": args.rate}})
            started = time.monotonic()
            run = api.run({"dataset": "timed", "target": "group:base", "options": {"rate": args.rate, "seed": 1}})
            wall = time.monotonic() - started
            if run["baseline_run"] is None:
                raise RuntimeError(f"the timed run was not compared with a baseline: {run['summary']}")
            ready = _t(run["finished_at"]) - _t(run["requests_ended_at"])
            results = api("GET", f"/api/v1/regression-runs/{run['id']}/results?limit=1")
            first_sent = _t(run["started_at"])
            setup = max(0.0, first_sent - _t(run["created_at"]))
            print(f"BENCH regression_run_items={args.items} items")
            print(f"BENCH regression_run_wall_s={wall:.1f} s")
            print(f"BENCH regression_comparison_ready_after_last_request_s={ready:.2f} s")
            print(f"BENCH regression_platform_overhead_per_item_ms={(setup + ready) / args.items * 1000:.2f} ms")
            print(f"BENCH regression_rows_joined={run['summary']['rows_found']}/{run['summary']['rows_expected']} rows")
            for name, seconds in run["summary"].get("analysis_timings", {}).items():
                print(f"BENCH regression_analysis_{name.removesuffix('_s')}_s={seconds:.2f} s")
            del results

            verdicts, detectable, detectable_pct = [], [], []
            for seed in range(args.aa_runs):
                run = api.run({"dataset": "aa", "target": "group:base", "baseline": "group:base",
                               "options": {"max_concurrency": args.aa_concurrency, "seed": seed}})
                verdicts.append(run["verdict"])
                comparison = api("GET", f"/api/v1/regression-runs/{run['id']}/comparison")["comparison"]
                ttft = next(g for g in comparison["gates"] if g["metric"] == "ttft_ms")
                if ttft.get("standard_error") is not None:
                    shift = 2.486 * ttft["standard_error"]
                    detectable.append(shift)
                    detectable_pct.append(100.0 * shift / ttft["baseline"])
                print(f"# A/A run {seed}: {run['verdict']} (p95 TTFT {ttft['baseline']:.1f} → {ttft['candidate']:.1f} ms)",
                      file=sys.stderr)
            fails = verdicts.count("fail")
            if not verdicts:
                return
            print(f"BENCH regression_aa_runs={len(verdicts)} runs")
            print(f"BENCH regression_aa_false_alarm_rate={100.0 * fails / len(verdicts):.1f} %")
            print(f"BENCH regression_aa_inconclusive_rate={100.0 * verdicts.count('inconclusive') / len(verdicts):.1f} %")
            if detectable:
                print(f"BENCH regression_detectable_ttft_p95_shift_ms={statistics.median(detectable):.1f} ms")
                print(f"BENCH regression_detectable_ttft_p95_shift_pct={statistics.median(detectable_pct):.1f} %")
        finally:
            process.stop()
            subprocess.run([sys.executable, "-m", "engine", "down", "--fleet", str(fleet)], cwd=ROOT,
                           capture_output=True, timeout=180)


if __name__ == "__main__":
    main()
