"""Real vLLM calibrated from the traffic it served, measured against its own noise.

    python -m tuning.bench_vllm [--minutes 10] [--heldout-seconds 120] [--no-study] [--model DIR] [--json FILE]

Needs vLLM's CPU build and the study-size tiny model (``make bench-vllm`` has both). It starts a platform in
embedded mode whose fleet is one group of real ``vllm serve`` (gpu_type CPU, the study-size tiny Llama), measures what
the group serves when kept busy (on a slower host every rate below is scaled down by it: ``REFERENCE_CAPACITY``), sends
``--minutes`` of mixed Poisson traffic through the gateway with ``python -m engine.loadgen`` (one minute per
segment, cycling through the rates and length mixes of ``TRAINING``), and calibrates the group's engine model from
it through the API (``POST /api/v1/engine-models``). Then it serves two held-out workloads, another rate and another
length mix (``HELDOUT``), each twice with the same seed (interleaved: A, B, A, B), and evaluates the model on each
run's window (``POST /api/v1/engine-models/{id}/evaluate``): p50 and p95 of the engine core's TTFT, of TPOT and of
queue time, predicted against observed. Beside it, on the same windows and figures:

- real vLLM against itself: each run's observed quantiles as the prediction of the other run's (the same
  requests at the same offsets), (other − this) / this, the queue's over max(this, the model's queue floor);
- the published CPU profile (``engine/sim/profiles.py``, fitted on dedicated benchmark runs by
  ``engine.bench.vllm_cpu``), the constants the traffic fit started from (``"constants": "published"``).

A figure is within 20 % when |error| ≤ 0.2. Prints BENCH lines: per workload and figure the model's error, how many
figures each of the three gets within 20 % (per workload and in all), and the fit's time.

Then (unless ``--no-study``) a tuning study of the group on all that traffic, with the calibrated model (``STUDY_*``;
a model the study refuses, its error above the bound, is reported and the study runs marked unreliable), its winner
replayed on real `vllm serve` processes at its predicted goodput and then at lower shares of it until it meets the
SLOs: ``BENCH vllm_traffic_study_confirmed_share_pct``, the confirmed goodput as a share of the predicted one.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchkit.harness import ROOT, PlatformProcess, free_port, free_port_pair

from engine.cli_args import positive_float
from engine.launcher.vllm_command import find_vllm_executable
from engine.sim import traffic_fit as F

GROUP = "real"
SERVED_NAME = "tiny-study"
BOUND = 0.20
FIGURES = tuple(f"{figure}_p{q}" for figure in F.FIGURES for q in F.QUANTILES)
# Lengths are the load generator's (synthetic words); the tiny model's tokenizer makes ~2.3 tokens of each, so the
# longest prompt here (~1,150 tokens) and answer stay within its 2,048 positions.
SHORT, LONG, ANSWERS = ("16:128", "16:64"), ("200:500", "16:48"), ("16:128", "64:160")


@dataclasses.dataclass(frozen=True)
class Load:
    name: str
    rate: float  # requests/s, Poisson
    input_len: str
    output_len: str
    seed: int
    what: str

    def argv(self, gateway: str, seconds: float) -> list[str]:
        return [sys.executable, "-m", "engine.loadgen", "--base-url", f"http://{gateway}/v1", "--model", SERVED_NAME,
                "--arrival", "poisson", "--rate", str(self.rate), "--duration", str(seconds), "--seed",
                str(self.seed), "--input-len", self.input_len, "--output-len", self.output_len, "--timeout", "120",
                "--quiet"]

    def scaled(self, scale: float) -> Load:
        """The same load at ``scale`` times its rate."""
        return self if scale == 1.0 else dataclasses.replace(
            self, rate=round(self.rate * scale, 3), what=f"{self.what}, scaled to {self.rate * scale:.2f} req/s")


# The calibration traffic: one minute each, in this order, cycled for --minutes. The rates stay well under what
# the group serves on a quiet host (a first version at 2-7 req/s saturated it while other work shared the cores:
# queues of 3-19 s, which no constant explains and which real vLLM does not repeat from one run to the next).
TRAINING = (
    Load("short-2", 2.0, *SHORT, 11, "chat-length prompts, 2 req/s"),
    Load("long-1", 1.0, *LONG, 12, "long prompts, 1 req/s"),
    Load("short-3", 3.0, *SHORT, 13, "chat-length prompts, 3 req/s"),
    Load("answers-1", 1.0, *ANSWERS, 14, "long answers, 1 req/s"),
    Load("short-1", 1.0, *SHORT, 15, "chat-length prompts, 1 req/s"),
    Load("long-2", 2.0, *LONG, 16, "long prompts, 2 req/s"),
)
# Held out: a rate the traffic never had, and a length mix it never had (mid-length prompts and answers).
HELDOUT = (
    Load("rate", 4.5, *SHORT, 21, "chat-length prompts at 4.5 req/s (the traffic had 1-3)"),
    Load("lengths", 1.5, "64:256", "32:96", 22, "mid-length prompts and answers at 1.5 req/s (a mix the traffic "
         "never had)"),
)


# The rates above were chosen on quiet 2-core hosts with AVX-512. On such a host the probe below (after the warm-up:
# the chat-length mix, CAPACITY_CONCURRENCY requests at a time, CAPACITY_REQUESTS in all) measured 11.3-20.6 req/s over
# six runs (2026-11-30). A host that serves less (an AVX2-only one prefilled several times slower and saturated at these
# rates: TTFT p50 17-47 s, requests timing out) gets every rate scaled by its capacity over REFERENCE_CAPACITY, the low
# end of those runs, and never up, so the traffic stays about as far below what the group serves as where the rates
# were chosen. The traffic then runs until it has served MIN_TRAFFIC_REQUESTS (at most three times --minutes), so the
# calibration has the 200 requests it needs, and each held-out run lasts --heldout-seconds / scale, so it holds as many
# requests as unscaled (an evaluation needs 50).
REFERENCE_CAPACITY = 10.0
CAPACITY_CONCURRENCY = 16
CAPACITY_REQUESTS = 160
MIN_TRAFFIC_REQUESTS = 300


# The study after the held-out runs: the group's knobs searched in the simulator with the traffic-calibrated model,
# its winner replayed on real vLLM at its predicted goodput, then at lower shares of it (CONFIRM_STEPS) until it
# meets the SLOs: the confirmed goodput as a share of the predicted one is the figure (today's target: >= 90 %).
STUDY_SPACE = {"max_num_seqs": [2, 4, 8, 16, 32, 64], "max_num_batched_tokens": [512, 1024, 2048, 4096, 8192]}
STUDY_SLO = {"ttft_ms": 1000, "tpot_ms": 100}
STUDY_TARGET = 0.9
STUDY_TRIALS = 16
CONFIRM_STEPS = "1,0.95,0.9,0.85,0.8,0.7,0.6"
CONFIRM_MAX_RATE = 16.0  # above what the tiny model serves on 2 cores within these SLOs: never the cap


def fleet_yaml(root: Path, model: str, executable: str) -> Path:
    """One group of real vLLM (CPU build) serving ``model``: 16 sequences at once, a 128 MiB KV cache."""
    spec = {"name": "bench-calibration", "run_dir": str(root / "engine"),
            "gateway": {"bind": f"127.0.0.1:{free_port()}"}, "control": {"bind": f"127.0.0.1:{free_port()}"},
            "replicas": {"host": "127.0.0.1", "base_port": free_port_pair()},
            "telemetry": {"otlp_protocol": "grpc"}, "vllm": {"executable": executable},
            "groups": [{"name": GROUP, "weight": 100, "replicas": 1, "backend": "vllm", "served_model_name": SERVED_NAME,
                        "config": {"model": model, "gpu_type": "CPU", "max_num_seqs": 16,
                                   "kv_cache_memory_bytes": 128 * 1024 * 1024}}]}
    path = root / "fleet.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


class Platform:
    """A platform in embedded mode running the fleet (``runplatform --with-engine``), with an operator token."""

    def __init__(self, root: Path, fleet: Path):
        self.fleet = json.loads(fleet.read_text())
        self.gateway = self.fleet["gateway"]["bind"]
        # No periodic calibration, no live-error beat: the bench asks for what it measures.
        self.process = PlatformProcess(data_dir=str(root / "data"), args=("--with-engine",), grpc=True,
                                       extra_env={"ENGINE_FLEET": str(fleet),
                                                  "TUNING_CALIBRATION_INTERVAL_SECONDS": "0",
                                                  "TUNING_CALIBRATION_CHECK_SECONDS": "86400",
                                                  "TUNING_CONFIRM_RATE_STEPS": CONFIRM_STEPS,
                                                  "TUNING_CONFIRM_MAX_RATE": str(CONFIRM_MAX_RATE)})
        self.token = ""

    def start(self) -> None:
        _, _, self.token = self.process.manage_many(
            ("migrate", "-v0"), ("create_ingest_key", "--project", "default"),
            ("create_api_token", "--user", "bench", "--role", "operator", "--project", "default"))
        self.process.start(timeout=360)

    def api(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(self.process.url + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def serve(self, load: Load, seconds: float) -> tuple[dt.datetime, dt.datetime, dict]:
        """Send ``load`` for ``seconds`` through the gateway; its window (from just before the first request to
        just after the last answer) and the load generator's summary."""
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            since = dt.datetime.now(dt.timezone.utc)
            done = subprocess.run([*load.argv(self.gateway, seconds), "--json", out.name], cwd=ROOT,
                                  env=self.process.env, capture_output=True, text=True, timeout=seconds + 600)
            until = dt.datetime.now(dt.timezone.utc)
            if done.returncode != 0:
                raise RuntimeError(f"the load {load.name} failed ({done.returncode}): {done.stderr[-2000:]}")
            summary = json.loads(Path(out.name).read_text())["summary"]
        return since, until, summary

    def capacity(self) -> dict:
        """The chat-length mix sent CAPACITY_CONCURRENCY at a time, CAPACITY_REQUESTS in all: the load generator's
        summary, whose request_throughput is what the group serves when it is kept busy."""
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            argv = [sys.executable, "-m", "engine.loadgen", "--base-url", f"http://{self.gateway}/v1", "--model",
                    SERVED_NAME, "--rate", "inf", "--num-requests", str(CAPACITY_REQUESTS), "--max-concurrency",
                    str(CAPACITY_CONCURRENCY), "--seed", "2", "--input-len", SHORT[0], "--output-len", SHORT[1],
                    "--timeout", "300", "--quiet", "--json", out.name]
            done = subprocess.run(argv, cwd=ROOT, env=self.process.env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"the capacity probe failed ({done.returncode}): {done.stderr[-2000:]}")
            return json.loads(Path(out.name).read_text())["summary"]

    def settle(self) -> None:
        """The last spans exported (vLLM's batch exporter: 0.2 s), ingested and decomposed."""
        time.sleep(3)
        self.process.wait_idle(timeout=120)

    def calibrate(self, since: dt.datetime) -> dict:
        hours = (dt.datetime.now(dt.timezone.utc) - since).total_seconds() / 3600
        status, model = self.api("POST", "/api/v1/engine-models", {"group": GROUP, "window_hours": hours})
        if status != 202:
            raise RuntimeError(f"the calibration was refused ({status}): {model}")
        deadline = time.monotonic() + 1800
        while model["state"] in ("queued", "fitting") and time.monotonic() < deadline:
            time.sleep(2)
            status, model = self.api("GET", f"/api/v1/engine-models/{model['id']}")
        if model["state"] != "fitted":
            raise RuntimeError(f"the calibration ended {model['state']}: {model.get('reason')}")
        return model

    def evaluate(self, model_id: int, since: dt.datetime, until: dt.datetime, constants: str) -> dict:
        status, seen = self.api("POST", f"/api/v1/engine-models/{model_id}/evaluate",
                                {"since": since.isoformat(), "until": until.isoformat(), "constants": constants})
        if status != 200:
            raise RuntimeError(f"the evaluation was refused ({status}): {seen}")
        return seen

    def study(self, hours: float, log) -> dict:
        """A study of the group on its traffic of the last ``hours``, confirmed on real vLLM; the study as the API
        shows it (with its confirmation). A model the study refuses (its error above the bound) is reported, and the
        study then runs marked unreliable: the figure is still measured, and says so."""
        body = {"group": GROUP, "workload": "traffic", "window_hours": hours, "space": STUDY_SPACE,
                "trials": STUDY_TRIALS, "slo": STUDY_SLO, "target": STUDY_TARGET, "confirm": True}
        status, study = self.api("POST", "/api/v1/tuning-studies", body)
        refused = None
        if status == 409 and any(p.get("field") == "engine_model" for p in study.get("problems") or []):
            refused = study
            log(f"# the study refused the calibrated model: {study.get('error') or study}")
            status, study = self.api("POST", "/api/v1/tuning-studies", {**body, "allow_unreliable": True})
        if status != 201:
            raise RuntimeError(f"the study was refused ({status}): {study}")
        deadline = time.monotonic() + 3600
        phase = None
        while study["state"] not in ("done", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(5)
            status, study = self.api("GET", f"/api/v1/tuning-studies/{study['id']}")
            if study.get("phase") != phase:
                phase = study.get("phase")
                log(f"# study {study['id']}: {study['state']}, {phase}; load average {_load_average()}")
        status, study = self.api("GET", f"/api/v1/tuning-studies/{study['id']}")  # with its confirmation
        study["refused_model"] = refused
        return study

    def stop(self) -> None:
        self.process.stop()


def against_itself(this: dict[str, float], other: dict[str, float], floor: float) -> dict[str, float]:
    """Real vLLM against itself: ``other``'s observed quantiles as the prediction of ``this`` run's, the error as
    the model's is measured ((other − this) / this, the queue's over max(this, floor))."""
    out = {}
    for name in FIGURES:
        if name in this and name in other:
            scale = max(this[name], floor) if name.startswith("queue_ms") else this[name]
            if scale > 0:
                out[name] = (other[name] - this[name]) / scale
    return out


def within(errors: dict[str, float], bound: float = BOUND) -> int:
    return sum(1 for value in errors.values() if math.isfinite(value) and abs(value) <= bound)


def _load_average() -> str:
    return "/".join(f"{value:.1f}" for value in os.getloadavg())


def rate_scale(capacity: float) -> float:
    """How much to scale the bench's rates on a host whose group serves ``capacity`` req/s of the chat-length mix."""
    if not math.isfinite(capacity) or capacity <= 0:
        raise RuntimeError(f"the capacity probe measured {capacity} req/s: the group served nothing")
    return min(1.0, capacity / REFERENCE_CAPACITY)


def run(*, minutes: float, heldout_seconds: float, model: str, executable: str, log=print,
        keep: bool = False, study: bool = True, scale: float | None = None) -> dict[str, Any]:
    """The whole bench; every figure in a dict (``report`` prints it). ``keep``: leave the platform's data directory
    (its trace store holds every request) and vLLM's log behind. ``scale``: the rates' scale, instead of the one the
    capacity probe gives."""
    root = Path(tempfile.mkdtemp(prefix="bench-calibration-vllm-"))
    platform = Platform(root, fleet_yaml(root, model, executable))
    started, load_before = time.monotonic(), _load_average()
    try:
        platform.start()
        log(f"# platform and real vLLM up in {time.monotonic() - started:.0f} s ({root}); load average "
            f"{_load_average()} (1/5/15 min, {os.cpu_count()} cores)")
        platform.serve(Load("warm-up", 2.0, *SHORT, 1, "warm-up"), 10)  # one-off allocations, outside the window
        probe = platform.capacity()
        measured_scale = rate_scale(probe["request_throughput"])
        scale = measured_scale if scale is None else scale
        log(f"# capacity: {probe['request_throughput']:.2f} req/s of chat-length prompts {CAPACITY_CONCURRENCY} at a "
            f"time (reference {REFERENCE_CAPACITY:g}; {_served(probe)}): rates scaled by {scale:.2f}")
        time.sleep(2)
        segments = max(1, round(minutes))
        traffic_since = dt.datetime.now(dt.timezone.utc)
        sent, index = 0, 0
        while index < segments or (sent < MIN_TRAFFIC_REQUESTS and index < 3 * segments):
            load = TRAINING[index % len(TRAINING)].scaled(scale)
            _, _, summary = platform.serve(load, 60 * minutes / segments)
            sent += summary["completed"]
            index += 1
            count = f"{index}/{segments}" if index <= segments else \
                f"{index} ({sent} of the {MIN_TRAFFIC_REQUESTS} requests wanted)"
            log(f"# traffic {count}: {load.what}: {_served(summary)}; load average {_load_average()}")
        platform.settle()
        asked = time.monotonic()
        fitted = platform.calibrate(traffic_since)
        fit_wall = time.monotonic() - asked
        log(f"# model {fitted['id']} fitted from {fitted['fit_requests']} + {fitted['held_out_requests']} held-out "
            f"requests in {fitted['fit_seconds']:.1f} s: " + ", ".join(
                f"{name} {value:.4g} (published {fitted['published'][name]:.4g})"
                for name, value in sorted(fitted["constants"].items())))
        windows: dict[str, list[tuple[dt.datetime, dt.datetime, dict]]] = {load.name: [] for load in HELDOUT}
        for _ in range(2):
            for load in HELDOUT:  # at a scaled rate, for longer: as many requests as the unscaled run holds
                since, until, summary = platform.serve(load.scaled(scale), heldout_seconds / scale)
                windows[load.name].append((since, until, summary))
                log(f"# held out {load.name} run {len(windows[load.name])}: {_served(summary)}; load average "
                    f"{_load_average()}")
                time.sleep(2)
        platform.settle()
        workloads = {}
        for load in HELDOUT:
            runs = [{"model": platform.evaluate(fitted["id"], since, until, "model"),
                     "published": platform.evaluate(fitted["id"], since, until, "published"),
                     "sent": summary["completed"], "failed": summary["failed"]}
                    for since, until, summary in windows[load.name]]
            floor = runs[0]["model"]["queue_floor_ms"]
            for this, other in ((runs[0], runs[1]), (runs[1], runs[0])):
                this["itself"] = against_itself(this["model"]["observed"], other["model"]["observed"], floor)
            workloads[load.name] = {"what": load.what, "runs": runs}
        studied = None
        if study:
            hours = (dt.datetime.now(dt.timezone.utc) - traffic_since).total_seconds() / 3600
            studied = platform.study(hours, log)
    finally:
        platform.stop()
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return {"minutes": minutes, "heldout_seconds": heldout_seconds, "traffic_requests": sent, "model": fitted,
            "capacity": probe["request_throughput"], "rate_scale": scale, "traffic_minutes": index * minutes / segments,
            "fit_wall_seconds": fit_wall, "workloads": workloads, "study": studied,
            "seconds": time.monotonic() - started,
            "load_average": {"start": load_before, "end": _load_average()}}


def _served(summary: dict) -> str:
    failed = f", {summary['failed']} failed ({summary.get('errors')})" if summary["failed"] else ""
    return (f"{summary['completed']} requests{failed}, TTFT p50 {summary.get('median_ttft_ms') or 0:.0f} ms, TPOT p50 "
            f"{summary.get('median_tpot_ms') or 0:.1f} ms (client side)")


def counts(result: dict[str, Any]) -> dict[str, dict[str, tuple[int, int]]]:
    """{workload or "all": {"model" | "itself" | "published": (within 20 %, figures)}} over both runs."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    total = {"model": [0, 0], "itself": [0, 0], "published": [0, 0]}
    for name, workload in result["workloads"].items():
        out[name] = {}
        for side in total:
            errors = [run[side] if side == "itself" else run[side]["error"] for run in workload["runs"]]
            good, of = sum(within(e) for e in errors), sum(len(e) for e in errors)
            out[name][side] = (good, of)
            total[side][0] += good
            total[side][1] += of
    out["all"] = {side: (good, of) for side, (good, of) in total.items()}
    return out


def _pct(value: float | None) -> str:
    return "nan" if value is None or not math.isfinite(value) else f"{100 * value:+.1f}"


def report(result: dict[str, Any], out=print) -> None:
    model = result["model"]
    out(f"# real vLLM (CPU build, {SERVED_NAME}), group {GROUP}: {result['traffic_requests']} requests of mixed "
        f"Poisson traffic in {result['traffic_minutes']:g} min; held-out runs of "
        f"{result['heldout_seconds'] / result['rate_scale']:g} s, each twice; rates scaled by {result['rate_scale']:.2f} (capacity {result['capacity']:.2f} req/s, reference "
        f"{REFERENCE_CAPACITY:g})")
    out(f"BENCH vllm_traffic_capacity_req_per_s={result['capacity']:.2f} req/s (chat-length prompts, "
        f"{CAPACITY_CONCURRENCY} at a time; the rates' scale {result['rate_scale']:.2f})")
    out(f"BENCH vllm_traffic_fit_seconds={model['fit_seconds']:.1f} s ({model['fit_requests']} requests fitted, "
        f"{model['held_out_requests']} held out; {result['fit_wall_seconds']:.1f} s from the API call to fitted)")
    out(f"BENCH vllm_traffic_fit_held_out_slice_within_20pct={within(model['held_out_error'])}/"
        f"{len(model['held_out_error'])} figures (the calibration window's last fifth)")
    for name, workload in result["workloads"].items():
        runs = workload["runs"]
        out(f"# {name}: {workload['what']}; requests replayed {runs[0]['model']['requests']} and "
            f"{runs[1]['model']['requests']} (sent {runs[0]['sent']} and {runs[1]['sent']})")
        out(f"#   {'figure':14} {'observed ms 1/2':>17} {'model % 1/2':>15} {'itself % 1/2':>15} "
            f"{'published % 1/2':>17}")
        for figure in FIGURES:
            observed = [run["model"]["observed"].get(figure) for run in runs]
            out(f"#   {figure:14} {observed[0] or 0:8.2f}/{observed[1] or 0:<8.2f} "
                f"{_pct(runs[0]['model']['error'].get(figure)):>7}/{_pct(runs[1]['model']['error'].get(figure)):<7} "
                f"{_pct(runs[0]['itself'].get(figure)):>7}/{_pct(runs[1]['itself'].get(figure)):<7} "
                f"{_pct(runs[0]['published']['error'].get(figure)):>8}/{_pct(runs[1]['published']['error'].get(figure))}")
        for figure in FIGURES:
            errors = [run["model"]["error"].get(figure) for run in runs]
            out(f"BENCH vllm_traffic_model_{name}_{figure}_error_pct={_pct(errors[0])} % (run 1; run 2: "
                f"{_pct(errors[1])} %; real run 2 against run 1: {_pct(runs[0]['itself'].get(figure))} %)")
    for name, sides in counts(result).items():
        label = "heldout" if name == "all" else name
        model_good, of = sides["model"]
        out(f"BENCH vllm_traffic_model_{label}_within_20pct={model_good}/{of} figures (traffic-calibrated constants)")
        out(f"BENCH vllm_traffic_real_vs_itself_{label}_within_20pct={sides['itself'][0]}/{sides['itself'][1]} "
            "figures (each run against the other, same figures)")
        out(f"BENCH vllm_traffic_published_{label}_within_20pct={sides['published'][0]}/{sides['published'][1]} "
            "figures (the benchmark-fitted CPU profile, engine/sim/profiles.py)")
    study = result.get("study")
    if study:
        report_study(study, out)
    out(f"# the whole bench took {result['seconds'] / 60:.1f} min; load average {result['load_average']['start']} at "
        f"its start, {result['load_average']['end']} at its end (1/5/15 min, {os.cpu_count()} cores)")


def report_study(study: dict, out=print) -> None:
    model = study.get("engine_model") or {}
    best, current = study.get("best") or {}, study.get("current") or {}
    confirmation = study.get("confirmation") or {}
    out(f"# study {study['id']}: {study['state']}{' (' + str(study.get('error')) + ')' if study.get('error') else ''};"
        f" engine model {model.get('id')} ({model.get('source')}){', marked unreliable' if model.get('unreliable') else ''}"
        f"; SLOs {STUDY_SLO} for {STUDY_TARGET:.0%} of requests")
    if study.get("refused_model"):
        out(f"# the study first refused the model: {study['refused_model'].get('error')}")
    out(f"# current {_knobs(current.get('config'))}: predicted goodput {current.get('goodput') or 0:.2f} req/s; "
        f"winner {_knobs(best.get('config'))}: {best.get('goodput') or 0:.2f} req/s (simulated)")
    for step in confirmation.get("steps") or []:
        attained = "-" if step.get("attainment") is None else f"{step['attainment']:.1%}"
        out(f"#   replayed on real vLLM at {step['rate']:.2f} req/s: {attained} met the SLOs "
            f"({'met' if step.get('met') else 'missed'})")
    if confirmation.get("statement") or confirmation.get("skipped") or confirmation.get("error"):
        out(f"# {confirmation.get('statement') or confirmation.get('skipped') or confirmation.get('error')}")
    share = confirmation.get("confirmed_share")
    out(f"BENCH vllm_traffic_study_confirmed_share_pct={'nan' if share is None else f'{100 * share:.0f}'} % "
        f"(confirmed goodput {confirmation.get('confirmed_goodput') or 0:.2f} of the predicted "
        f"{best.get('goodput') or 0:.2f} req/s on real vLLM; the study used the traffic-calibrated model)")


def _knobs(config: dict | None) -> str:
    config = config or {}
    return ", ".join(f"{knob}={config.get(knob)}" for knob in STUDY_SPACE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tuning.bench_vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of calibration traffic (default 10)")
    parser.add_argument("--heldout-seconds", type=float, default=120.0,
                        help="seconds of each held-out run at the unscaled rates, longer by 1/scale where the rates "
                             "are scaled (two workloads, two runs each; default 120)")
    parser.add_argument("--model", default=str(ROOT / ".data" / "models" / "tiny-study"),
                        help="the model directory (python -m engine tiny-model DIR --size study)")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    parser.add_argument("--no-study", action="store_true",
                        help="skip the tuning study on the calibrated model and its confirmation on real vLLM")
    parser.add_argument("--rate-scale", type=positive_float, default=None,
                        help="scale every rate by this instead of by the measured capacity over the reference")
    parser.add_argument("--keep", action="store_true",
                        help="keep the platform's data directory (every request in its trace store) and vLLM's log")
    args = parser.parse_args(argv)
    executable = find_vllm_executable()
    if executable is None:
        print("error: vLLM is not installed: run `make vllm`", file=sys.stderr)
        return 2
    model = str(Path(args.model).resolve())
    if not (Path(model) / "config.json").exists():
        print(f"error: no model in {model}: run `make tiny-models`", file=sys.stderr)
        return 2
    result = run(minutes=args.minutes, heldout_seconds=args.heldout_seconds, model=model, executable=executable,
                 log=lambda line: print(line, flush=True), keep=args.keep, study=not args.no_study,
                 scale=args.rate_scale)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
