"""The closed loop, unattended, on a simulated fleet (or on real vLLM): its load doubles (five-fold on real vLLM), and
the times from then to the page, the study done, the canary taking traffic, the promotion and the SLO's burn back under 1.

    PYTHONPATH=platform python -m loops.bench [--engine simulator|vllm] [--json FILE]

A platform in embedded mode (`runplatform --with-engine`, in a scratch data directory) runs a fleet of one group,
`base`: Llama-3.1-8B on a simulated H100 with max_num_seqs 2, which serves RATE requests/s through the gateway but
not twice that. Its engine model is calibrated from 90 s of that traffic; the project's policy is `auto` (at most
x2 on max_num_seqs, the winner confirmed on replicas, one 30 s canary step at 50 %, a 3-minute watch); the SLO is
TTFT <= 1 s at 99 % over the group, paged by a tier of 10 minutes and 1 minute (the default 1 h and 5 m would keep
its burn above 1 for five minutes after the fix). Then a second load of the same rate starts. The simulated replicas
stand in for GPUs (none here), in real time on this host's cores.

BENCH lines (seconds):
- loop_page_s: the load raised → the loop started by the page;
- loop_study_done_s, loop_rollout_started_s, loop_canary_s (its replica up and taking traffic), loop_promoted_s,
  loop_burn_below_1_s: the page → each step;
- loop_restored_s: the page → the loop's end (restored at the watch's end).
tests/loops/test_loops_live.py runs the same scenario (`run`) and asserts on its steps.

``--engine vllm`` runs the same loop on real vLLM (its CPU build, `make vllm`, serving the study-size tiny Llama,
`make tiny-models`): group `real` with max_num_seqs 2 under answers of 200-400 tokens at 0.35 req/s for seven
minutes, then 1.75 req/s, more than two sequences at once serve; a TTFT SLO of 4 s; no confirmation of the study's
winner (on two cores its `vllm serve` would share them with the saturated group), its canary a real replica; a
20-minute watch. Opt-in (about 45 minutes on 2 cores) and in no suite: it prints the same BENCH lines with a
`loop_vllm_` prefix.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml
from benchkit.harness import ROOT, PlatformProcess, free_port, free_port_pair

from engine.launcher.vllm_command import find_vllm_executable

BASE = {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "H100", "tensor_parallel_size": 1,
        "max_num_seqs": 2, "max_num_batched_tokens": 2048}
RATE = 3.5  # requests/s; doubled, more than max_num_seqs 2 serves (about 6/s)
# Prompts long enough that TTFT (prefill, tens of ms on an H100) stands above the real-time replica's lag on a loaded
# host, which the calibration would otherwise read as error.
LOAD = ("--input-len", "800:1600", "--output-len", "30:60")
SLO = {"name": "base-ttft", "sli": "ttft_ms", "threshold_ms": 1000, "objective": "99%",
       "filters": {"replica_group": ["base"]}, "min_requests": 20, "min_bad": 5,
       "tiers": [{"name": "page-fast", "severity": "page", "long_window": "10m", "short_window": "1m",
                  "factor": 14.4}]}
POLICY = {"mode": "auto", "cooldown": "6h", "knobs": {"max_num_seqs": {"max_factor": 2}},
          "min_confidence": {"model_error": 0.3, "confirmation": True},
          "plan": {"steps": [{"canary": 50, "interval": 30}], "compare_with": "group",
                   "analysis": {"settle_seconds": 3, "window_seconds": 12, "look_every_seconds": 3,
                                "min_requests": 20, "max_extensions": 1}},
          "study": {"trials": 6, "window_hours": 1}, "watch": "3m"}
# Settings of the platform the scenario runs on: short sweeps, small studies and confirmations, and a model error
# bound of 30 % (20 % by default): the simulated replica runs in real time on cores it shares with the platform, the
# gateway and the load, and its lags read as model error (docs/tuning.md); a GPU's replicas keep their own time.
PLATFORM_ENV = {"TUNING_MODEL_ERROR_BOUND": "0.3", "TUNING_CALIBRATION_MIN_REQUESTS": "100",
                "TUNING_MODEL_LIVE_MIN_REQUESTS": "40",
                "TUNING_SWEEP_INTERVAL_SECONDS": "2", "TUNING_QUEUED_GRACE_SECONDS": "3",
                "TUNING_CONFIRM_ITEMS": "60", "TUNING_CONFIRM_MAX_RATE": "8", "TUNING_SIM_REQUESTS": "200",
                "TUNING_RESCORE_CANDIDATES": "2", "TUNING_RESCORE_SEEDS": "2",
                "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2", "REGRESSIONS_QUEUED_GRACE_SECONDS": "3",
                "ROLLOUTS_SWEEP_INTERVAL_SECONDS": "1", "LOOPS_SWEEP_INTERVAL_SECONDS": "2"}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What differs between the simulated fleet and real vLLM: the group, its load, the SLO and the policy."""
    group: str
    rate: float  # requests/s of each load (``surge`` more of them raise it)
    load: tuple[str, ...]  # the load generator's length arguments (and --model)
    slo: dict
    policy: dict
    env: dict  # the platform's settings
    warmup: float  # seconds of healthy traffic before the calibration (its minimum request count, and some)
    prefix: str  # of the BENCH lines
    backend: str = "simulator"  # the group's replicas: "simulator" or "vllm" (real vLLM's CPU build)
    surge: int = 1  # loads of ``rate`` started beside the first: the regression (1 doubles the load)


SIMULATED = Scenario("base", RATE, LOAD, SLO, POLICY, PLATFORM_ENV, 90.0, "loop")
# Real vLLM's CPU build, its model on one thread (the launcher's default on 2 cores): the study-size tiny Llama
# decodes at ~6-10 ms a token, so answers of 200-400 tokens hold each of the group's two sequences for 2-3 s. At
# 0.35 req/s, with the SLO at 4 s, the two sequences keep up (queues of up to ~1 s); five-fold (1.75 req/s) they do
# not, and the queue grows until the page. How much two sequences serve varies from run to run on this host: tripled
# (1.05 req/s) paged after 90 s in one run and not in ten minutes in another; quadrupled (1.4 req/s), served at
# 1.44 req/s, burned 8.8x over 10 minutes and never paged (2026-11-30). Seven minutes of the healthy start (about
# 150 requests) calibrate the model. --rate sets another host's healthy rate.
# The policy asks for the model within its bound but no confirmation on replicas: here the confirmation's `vllm serve`
# shares the two cores with the saturated group (it met the SLOs at no rate, 2026-11-30), so the canary is the last
# word. It is compared with a baseline twin started beside it, not with the group: the group's replica, minutes of
# queue behind, completed no request within the canary's window, and the canary stayed inconclusive (2026-11-30).
# The canary is judged on what the loop is for (TTFT and queue time, 10 %), TPOT only beyond +50 %: four sequences
# decode more slowly than two, by design, and 87 canary requests could not rule out the +1.7 ms it cost (2026-11-30).
VLLM_CANARY_METRICS = [{"metric": "ttft_ms"}, {"metric": "queue_ms"},
                       {"metric": "tpot_ms", "tolerance": 0.5, "must_pass": False}]
REAL_VLLM = Scenario(
    "real", 0.35, ("--model", "tiny-study", "--input-len", "16:128", "--output-len", "200:400"),
    {**SLO, "name": "real-ttft", "threshold_ms": 4000, "filters": {"replica_group": ["real"]}},
    {**POLICY, "plan": {**POLICY["plan"], "steps": [{"canary": 50, "interval": 90}], "compare_with": "twin",
                        "analysis": {**POLICY["plan"]["analysis"], "window_seconds": 60, "min_requests": 10,
                                     "max_extensions": 2, "mde": 0.5, "metrics": VLLM_CANARY_METRICS}},
     "study": {"trials": 6, "window_hours": 1}, "min_confidence": {"model_error": 0.3, "confirmation": False},
     "watch": "20m"},
    {**PLATFORM_ENV, "TUNING_CALIBRATION_MIN_REQUESTS": "60", "TUNING_MODEL_LIVE_MIN_REQUESTS": "20",
     "TUNING_CONFIRM_ITEMS": "60", "TUNING_CONFIRM_MAX_RATE": "4"}, 420.0, "loop_vllm", backend="vllm", surge=4)
VLLM_CONFIG = {"gpu_type": "CPU", "max_num_seqs": 2, "kv_cache_memory_bytes": 128 * 1024 * 1024}
ACTIVE = ("studying", "awaiting_approval", "rolling_out", "watching")

Api = Callable[..., tuple[int, dict]]


def start_load(env: dict, gateway: int, seed: int, log: Path, scenario: Scenario = SIMULATED) -> subprocess.Popen:
    """A Poisson load of the scenario's rate through the gateway for up to an hour."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "engine.loadgen", "--base-url", f"http://127.0.0.1:{gateway}/v1", "--arrival",
             "poisson", "--rate", str(scenario.rate), "--duration", "3600", "--quiet", "--timeout", "300",
             *scenario.load, "--seed", str(seed)], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def until(what: str, check: Callable, timeout: float, every: float = 1.0, tail: Callable[[], str] = str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:g} s\n{tail()}")


def _time(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


def run(api: Api, load: Callable[[int], None], *, tail: Callable[[], str] = str, channel_url: str | None = None,
        scenario: Scenario = SIMULATED) -> dict:
    """The scenario through the platform's API (``api(method, path, body)`` with an admin token of project
    default); ``load(seed)`` starts one more load. Returns the loop (its steps), the model and the times."""
    if channel_url:
        assert api("POST", "/api/v1/channels", {"name": "oncall", "kind": "webhook", "url": channel_url})[0] == 201
    status, body = api("POST", "/api/v1/slos", scenario.slo)
    assert status == 201, body
    status, policy = api("PUT", "/api/v1/loop-policies", scenario.policy)
    assert status == 200, policy
    load(1)
    time.sleep(scenario.warmup)  # a healthy start, long enough to calibrate the group's engine model
    status, model = api("POST", "/api/v1/engine-models", {"group": scenario.group, "window_hours": 1})
    assert status == 202, model

    def fitted():
        body = api("GET", f"/api/v1/engine-models/{model['id']}")[1]
        return body if body["state"] not in ("queued", "fitting") else None

    model = until("a fitted engine model", fitted, 300, tail=tail)
    # On real vLLM a model outside the bound is a finding, not a failed bench: the loop then refuses to act on it,
    # and that is what the bench reports.
    assert model["state"] == "fitted" and (model["reliable"] or scenario.backend != "simulator"), {k: model.get(k) for k in (
        "state", "reason", "held_out_error", "live", "fit_requests")}
    assert not api("GET", "/api/v1/loops")[1]["loops"], "healthy traffic started a loop"

    def no_loop() -> str:  # what the platform saw instead: the SLO's status, its alerts and what they pointed at
        slo = api("GET", f"/api/v1/slos/{scenario.slo['name']}")[1]
        alerts = api("GET", "/api/v1/alerts")[1].get("alerts", [])
        seen = "; ".join(f"{a.get('title')} ({a.get('state')}, {(a.get('diagnosis') or {}).get('dominant_component')})"
                         for a in alerts) or "none"
        return f"SLO: {json.dumps(slo.get('status', slo), default=str)[:2000]}\nalerts: {seen}\n{tail()}"

    raised = time.time()
    for seed in range(2, 2 + scenario.surge):
        load(seed)
    # Real vLLM's queue grows more slowly than the simulated fleet's: its page took 90 s in one run and more than 300
    # s in another (2026-11-30).
    loop = until("a loop started by the page", lambda: next(iter(api("GET", "/api/v1/loops")[1]["loops"]), None),
                 600 if scenario.backend == "vllm" else 300, tail=no_loop)

    def ended():
        body = api("GET", f"/api/v1/loops/{loop['id']}")[1]
        return body if body["state"] not in ACTIVE else None

    final = until("the loop's end", ended, 1200 + policy["watch_seconds"], every=2, tail=tail)
    page = _time(final["created_at"])
    steps = {s["step"]: s for s in final["steps"]}
    times = {"page": page - raised}
    at = {name: _time(steps[key]["at"]) for name, key in (
        ("study_done", "proposed"), ("rollout_started", "rollout_started"), ("promoted", "promoted"),
        ("burn_below_1", "burn_below_1"), ("restored", "restored")) if key in steps}
    if final.get("rollout"):  # the canary taking traffic: its replica up, the gateway's weight set
        rollout = api("GET", f"/api/v1/rollouts/{final['rollout']}")[1]
        weighted = [t["at"] for t in rollout.get("transitions", []) if t["action"] == "canary-weight"]
        if weighted:
            at["canary"] = _time(weighted[0])
    times.update((name, when - page) for name, when in sorted(at.items(), key=lambda item: item[1]))
    return {"loop": final, "steps": steps, "model": model, "times": times}


def warm_up(env: dict, gateway: int, log: Path) -> None:
    """Real vLLM's first requests are slow (one-off allocations and compilations): served before the SLO exists, at
    a rate its two sequences keep up with, then a minute and more of nothing, so that they are out of the SLO's
    short window when it is created. Without it the SLO paged during the healthy start."""
    with open(log, "wb") as out:
        subprocess.run([sys.executable, "-m", "engine.loadgen", "--base-url", f"http://127.0.0.1:{gateway}/v1",
                        "--arrival", "poisson", "--rate", "0.5", "--duration", "20", "--quiet", "--timeout", "120",
                        *REAL_VLLM.load, "--seed", "99"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                       timeout=600, check=True)
    time.sleep(70)


def fleet_spec(root: Path, scenario: Scenario, model: str | None, executable: str | None) -> dict:
    """The fleet file: one group of one replica, simulated or real vLLM."""
    ports = {"gateway": free_port(), "control": free_port(), "replicas": free_port_pair()}
    spec = {"name": "loop-bench", "run_dir": str(root / "engine"),
            "gateway": {"bind": f"127.0.0.1:{ports['gateway']}"}, "control": {"bind": f"127.0.0.1:{ports['control']}"},
            "replicas": {"host": "127.0.0.1", "base_port": ports["replicas"]},
            "telemetry": {"otlp_protocol": "http/protobuf"},
            "groups": [{"name": scenario.group, "weight": 100, "replicas": 1, "backend": "simulator",
                        "config": BASE}]}
    if scenario.backend == "vllm":
        spec["vllm"] = {"executable": executable}
        spec["telemetry"] = {"otlp_protocol": "grpc"}  # vLLM exports its spans over gRPC only
        spec["groups"] = [{"name": scenario.group, "weight": 100, "replicas": 1, "backend": "vllm",
                           "served_model_name": "tiny-study", "config": {"model": model, **VLLM_CONFIG}}]
    return spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("simulator", "vllm"), default="simulator",
                        help="the group's replicas: simulated (default) or real vLLM's CPU build (opt-in, ~45 min)")
    parser.add_argument("--model", default=str(ROOT / ".data" / "models" / "tiny-study"),
                        help="with --engine vllm: the model directory (make tiny-models)")
    parser.add_argument("--rate", type=float, default=None,
                        help="with --engine vllm: requests/s of the healthy load, five-fold later (default 0.35; one "
                             "that the group serves with two sequences and not with five times the load, on this host)")
    parser.add_argument("--model-bound", type=float, default=None,
                        help="the largest held-out error of the engine model that the study and the policy accept "
                             "(default 0.3; at most 1). Real vLLM's CPU build on a shared 2-core host is modelled "
                             "less well than that: a looser bound lets the loop go on, with the confirmation on real "
                             "replicas as the last word")
    parser.add_argument("--json", help="write the loop and the times to this file")
    args = parser.parse_args(argv)
    scenario, model, executable = SIMULATED, None, None
    if args.engine == "vllm":
        scenario, executable, model = REAL_VLLM, find_vllm_executable(), str(Path(args.model).resolve())
        if args.rate:
            scenario = dataclasses.replace(scenario, rate=args.rate)
        if executable is None:
            print("error: vLLM is not installed: run `make vllm`", file=sys.stderr)
            return 2
        if not (Path(model) / "config.json").exists():
            print(f"error: no model in {model}: run `make tiny-models`", file=sys.stderr)
            return 2
    if args.model_bound is not None:
        if not 0 < args.model_bound <= 1:
            parser.error("--model-bound: a fraction in (0, 1]")
        scenario = dataclasses.replace(
            scenario, env={**scenario.env, "TUNING_MODEL_ERROR_BOUND": str(args.model_bound)},
            policy={**scenario.policy, "min_confidence": {**scenario.policy["min_confidence"],
                                                          "model_error": args.model_bound}})
    real = scenario.backend == "vllm"
    with tempfile.TemporaryDirectory(prefix="observatory-loop-bench-") as scratch:
        root = Path(scratch)
        spec = fleet_spec(root, scenario, model, executable)
        fleet = root / "fleet.yaml"
        fleet.write_text(yaml.safe_dump(spec, sort_keys=False))
        gateway = int(spec["gateway"]["bind"].rsplit(":", 1)[1])
        process = PlatformProcess(data_dir=str(root / "data"), args=("--with-engine",), grpc=real,
                                  extra_env={**scenario.env, "ENGINE_FLEET": str(fleet)})
        _, _, token = process.manage_many(("migrate", "-v0"), ("create_ingest_key", "--project", "default"),
                                          ("create_api_token", "--user", "bench", "--role", "admin", "--project",
                                           "default"))

        def api(method: str, path: str, body=None) -> tuple[int, dict]:
            request = urllib.request.Request(process.url + path, method=method,
                                             data=None if body is None else json.dumps(body).encode(),
                                             headers={"Authorization": f"Bearer {token}",
                                                      "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    return response.status, json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read() or b"{}")

        loads: list[subprocess.Popen] = []
        process.start(timeout=360 if real else 180)
        try:
            if real:
                warm_up(process.env, gateway, root / "warm-up.log")
            result = run(api, lambda seed: loads.append(start_load(process.env, gateway, seed,
                                                                   root / f"load-{seed}.log", scenario)),
                         tail=lambda: process.log_tail(3000), scenario=scenario)
        finally:
            for load in loads:
                load.terminate()
            process.stop()
    final, model = result["loop"], result["model"]
    print(f"engine model {model['id']}: {'within' if model['reliable'] else 'outside'} its bound; held-out error "
          + ", ".join(f"{name} {value:+.0%}" for name, value in sorted(model["held_out_error"].items())))
    print(f"loop {final['id']} ({args.engine}): {final['state']} ({final['reason']})")
    for step in final["steps"]:
        print(f"#   {step['at']} {step['step']}: {step['reason']}")
    for name, value in result["times"].items():
        print(f"BENCH {scenario.prefix}_{name}_s={value:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0 if final["state"] == "restored" else 1


if __name__ == "__main__":
    sys.exit(main())
