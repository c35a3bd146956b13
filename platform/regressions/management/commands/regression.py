"""`manage.py regression run --project P --dataset NAME --target GROUP|URL [--baseline RUN|GROUP|URL] [--rate R]
[--concurrency C] [--repetitions N] [--gates FILE] [--cache-sweep T1,T2,... [--max-false-hit-rate PCT]]
[--json OUT]`: exit 0 pass, 1 fail, 2 inconclusive, 3 error.

The run is created in the metadata database and executed by the platform's worker (Celery): in embedded mode
only the platform process may open the trace store, so this command never touches it. It shows the progress,
waits for the verdict, prints the summary table; Ctrl-C cancels the run. `regression show RUN` prints a run.
"""
import json
import sys
from pathlib import Path

from django.core.management.base import CommandError
from jobs.commands import EXIT_ERROR, JobCommand, project_named, read_yaml

from regressions import cache_sweep, service
from regressions.models import RegressionRun, RunState

EXIT = {"pass": 0, "fail": 1, "inconclusive": 2}


def _fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def _thresholds(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--cache-sweep must be comma-separated numbers such as 0.85,0.9,0.95 (got "
                           f"{text[:100]!r})") from None


def summary_lines(run: RegressionRun) -> list[str]:
    comparison = run.comparison or {}
    lines = [f"regression run {run.id}: {run.dataset_version.dataset.name} v{run.dataset_version.number} "
             f"against {run.label} — {run.state}{(' ' + run.verdict) if run.verdict else ''}"]
    if run.error:
        lines.append(f"error: {run.error}")
    summary = run.summary or {}
    for arm in ("baseline", "candidate"):
        data = summary.get(arm)
        if data:
            lines.append(f"  {arm:<9} requests {data['requests']}, errors {data['errors']} "
                         f"({_fmt(data['error_rate'])}%), pass rate {_fmt(data['pass_rate'])}%, "
                         f"p95 TTFT {_fmt(data['ttft_ms']['p95'])} ms, p95 e2e {_fmt(data['e2e_ms']['p95'])} ms")
    if summary.get("synthetic_note"):
        lines.append(f"  note: {summary['synthetic_note']}")
    if comparison.get("note"):
        lines.append(f"  note: {comparison['note']}")
    if summary.get("cache_sweep"):
        lines.extend(cache_sweep.report_lines(summary["cache_sweep"]))
    if comparison.get("gates"):
        lines.append(f"  {'gate':<22} {'baseline':>10} {'candidate':>10} {'shift':>9} {'interval':>21} {'p':>8}  verdict")
        for gate in comparison["gates"]:
            name = gate["metric"] + (f" {gate['stat']}" if gate.get("stat") else "")
            ci = gate.get("ci")
            interval = f"[{ci[0]:.1f}, {ci[1]:.1f}]" if ci else "-"
            p = gate.get("p_value")
            lines.append(f"  {name:<22} {_fmt(gate.get('baseline')):>10} {_fmt(gate.get('candidate')):>10} "
                         f"{_fmt(gate.get('shift')):>9} {interval:>21} {('-' if p is None else f'{p:.2g}'):>8}  "
                         f"{gate['verdict']}")
        for gate in comparison["gates"]:
            if gate["verdict"] != "pass":
                lines.append(f"  {gate['verdict'].upper()}: {gate['reason']}")
    return lines


def run_json(run: RegressionRun) -> dict:
    comparison = run.comparison or {}
    gates = [{"metric": g["metric"] + (f":{g['stat']}" if g.get("stat") else ""), "baseline": g.get("baseline"),
              "candidate": g.get("candidate"), "shift": g.get("shift"), "ci": g.get("ci"),
              "p_value": g.get("p_value"), "passed": g.get("passed"), "verdict": g.get("verdict"),
              "reason": g.get("reason")} for g in comparison.get("gates", [])]
    results = run.results.filter(warmup=False)
    return {"run_id": run.id, "verdict": run.verdict or None, "state": run.state, "gates": gates,
            "items": results.count(), "errors": results.filter(success=False).count(),
            "error": run.error or None, "summary": run.summary,
            "cache_sweep": (run.summary or {}).get("cache_sweep")}


class ProgressBar:
    """The progress text of a run being waited for. Off a terminal it changes with the count of written requests
    only, not with the state alone: a log gets one line a step."""

    WIDTH = 30

    def __init__(self, tty: bool):
        self.tty = tty
        self.count: int | None = None
        self.text = ""

    def __call__(self, run: RegressionRun) -> str:
        if self.tty or run.progress_done != self.count:
            self.count = run.progress_done
            total = max(run.progress_total, 1)
            filled = int(self.WIDTH * min(self.count, total) / total)
            bar = "#" * filled + "." * (self.WIDTH - filled)
            self.text = f"[{bar}] {self.count}/{run.progress_total} {run.state}"
        return self.text


class Command(JobCommand):
    help = "Replay a golden dataset against a target and judge it against a baseline (docs/regressions.md)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        run = sub.add_parser("run", help="run a dataset against a target and wait for the verdict")
        run.add_argument("--project", required=True)
        run.add_argument("--dataset", required=True)
        run.add_argument("--dataset-version", type=int, default=None)
        run.add_argument("--target", default=None, help="group:NAME (or NAME) of the managed fleet, or a base URL")
        run.add_argument("--target-config", default=None,
                         help="or: an engine config file (YAML/JSON, vLLM knobs) started for the run as a simulated "
                              "replica")
        run.add_argument("--baseline-config", default=None,
                         help="an engine config file started for the run and replayed alongside (paired)")
        run.add_argument("--baseline", default=None,
                         help="a run id to compare with, or a group/URL replayed alongside (paired mode); "
                              "default: the last passing run of this dataset and target")
        run.add_argument("--rate", default="inf", help="requests/s (Poisson), or inf (default: all at once)")
        run.add_argument("--arrival", choices=service.ARRIVALS, default="poisson")
        run.add_argument("--burstiness", type=float, default=1.0)
        run.add_argument("--concurrency", type=int, default=None, help="maximum requests in flight")
        run.add_argument("--repetitions", type=int, default=1)
        run.add_argument("--warmup", type=int, default=0, help="warm-up requests, not counted")
        run.add_argument("--time-limit", type=float, default=None, help="stop sending after this many seconds")
        run.add_argument("--seed", type=int, default=0)
        run.add_argument("--reset-prefix-cache", action="store_true")
        run.add_argument("--arms", choices=service.ARMS_ORDERS, default="together",
                         help="paired runs: both arms of an item at once (together), or the baseline's whole replay "
                              "then the candidate's (in_turn: for targets that share one machine)")
        run.add_argument("--gates", default=None, help="gates file (YAML or JSON); default gates otherwise")
        run.add_argument("--cache-sweep", default=None, metavar="THRESHOLDS",
                         help="measure the target gateway's semantic-cache threshold at these comma-separated "
                              "thresholds (0.8,0.85,0.9,0.95): after the replay with the cache bypassed, a pass per "
                              "threshold; the group's cache must say semantic.client_threshold: true")
        run.add_argument("--max-false-hit-rate", type=float, default=cache_sweep.DEFAULT_MAX_FALSE_HIT_RATE,
                         help="percent: the recommended threshold is the lowest whose false-hit rate is within it "
                              "(default %(default)s)")
        run.add_argument("--json", default=None, help="write the result as JSON to this file")
        run.add_argument("--no-wait", action="store_true", help="print the run id and return")
        run.add_argument("--start-timeout", type=float, default=90.0,
                         help="give up (exit 3) when no worker has started the run after this many seconds")
        show = sub.add_parser("show", help="print a run's summary")
        show.add_argument("run_id", type=int)
        show.add_argument("--json", default=None)

    def handle(self, *args, action, **options):
        if action == "show":
            run = RegressionRun.objects.filter(id=options["run_id"]).first()
            if run is None:
                raise CommandError(f"no run {options['run_id']}")
            self._report(run, options["json"])
            return None
        return self._run(**options)

    def _run(self, **o):
        project = project_named(o["project"])
        gates = read_yaml(o["gates"], "gates") if o["gates"] else None
        configs = {key: read_yaml(o[key], "config") for key in ("target_config", "baseline_config") if o[key]}
        rate = o["rate"]
        try:
            rate = "inf" if str(rate).lower() == "inf" else float(rate)
        except ValueError:
            raise CommandError(f"--rate must be a number or inf (got {rate!r})") from None
        options = {"rate": rate, "arrival": o["arrival"], "burstiness": o["burstiness"],
                   "max_concurrency": o["concurrency"], "repetitions": o["repetitions"], "warmup": o["warmup"],
                   "time_limit_s": o["time_limit"], "seed": o["seed"], "reset_prefix_cache": o["reset_prefix_cache"],
                   "arms": o["arms"]}
        if o["cache_sweep"]:
            options["cache_sweep"] = {"thresholds": _thresholds(o["cache_sweep"]),
                                      "max_false_hit_rate": o["max_false_hit_rate"]}
        try:
            run = service.create_run(project, dataset=o["dataset"], version=o["dataset_version"], target=o["target"],
                                     baseline=o["baseline"], options=options, gates=gates, created_by="manage.py",
                                     **configs)
        except service.RunError as exc:
            raise CommandError("; ".join(exc.problems)) from None
        run = self.follow(run, service.RUNS, f"regression run {run.id} queued ({run.progress_total} requests)",
                          no_wait=o["no_wait"], start_timeout=o["start_timeout"],
                          not_started=f"no platform worker started run {run.id} within {o['start_timeout']:g} s: is "
                                      "the platform running (make up)? The run was cancelled.",
                          progress=ProgressBar(sys.stdout.isatty()))
        return None if run is None else self._report(run, o["json"])

    def _report(self, run: RegressionRun, json_path: str | None):
        for line in summary_lines(run):
            self.stdout.write(line)
        if json_path:
            Path(json_path).write_text(json.dumps(run_json(run), indent=2))
        if run.state != RunState.DONE:
            sys.exit(EXIT_ERROR)
        sys.exit(EXIT[run.verdict])
