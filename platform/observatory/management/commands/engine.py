"""`manage.py engine up|status|down|render|calibrate`: the managed engine's CLI, wired to this platform.

`engine calibrate --project P --group G [--since 1h] [--json FILE] [--no-wait]` fits the group's engine model to
the traffic it served (tuning.calibration): the platform's worker fits it; the command waits, prints the fitted
constants and the held-out error, and writes the model to FILE. Exit 0 fitted, 1 failed (the reason printed),
3 refused (too little traffic, a config change in the window, an unknown group).

A thin wrapper over ``python -m engine`` (``engine.launcher.cli``): before ``up`` it
points the fleet's spans at this platform's OTLP endpoint with the engine's ingest key
(unless ``ENGINE_OTLP_ENDPOINT`` is already set) and keeps the run directory in the
platform's data directory. Every flag is the engine CLI's own.
"""
import argparse
import datetime as dt
import json
import os
import re
import sys
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from fleet.wiring import engine_environment
from jobs.commands import EXIT_ERROR, JobCommand, project_named
from tuning import calibration
from tuning.models import ModelState

from engine.launcher.cli import main
from engine.sim import traffic_fit as F


def apply_engine_environment(argv: list[str], *, project: str = "default") -> None:
    """Fill in the platform's wiring for the engine CLI without overriding what the user set."""
    if argv and argv[0] == "up" and not os.environ.get("ENGINE_OTLP_ENDPOINT"):
        wiring = engine_environment(project)
    else:
        wiring = {"ENGINE_RUN_DIR": os.path.join(str(settings.DATA_DIR), "engine")}
    if "--fleet" in argv or any(a.startswith("--fleet=") for a in argv) or os.environ.get("ENGINE_FLEET"):
        wiring.pop("ENGINE_RUN_DIR", None)  # a fleet file of one's own keeps its own run_dir
    for name, value in wiring.items():
        os.environ.setdefault(name, value)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def duration(text: str) -> dt.timedelta:
    """'90s', '30m', '1h', '2d' as a timedelta (argparse type)."""
    match = _DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 1h or 2d")
    unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match.group(2)]
    return dt.timedelta(**{unit: float(match.group(1))})


def calibrate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="manage.py engine calibrate",
                                     description="Fit a replica group's engine model to the traffic it served.")
    parser.add_argument("--project", required=True, help="the project whose traffic is read")
    parser.add_argument("--group", required=True, help="the replica group of the managed fleet")
    parser.add_argument("--since", type=duration, default=dt.timedelta(hours=1),
                        help="the window, ending now (default 1h; at most 7d)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the model (JSON) to this file")
    parser.add_argument("--no-wait", action="store_true", help="queue the calibration and return")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the worker to start it (default 600)")
    return parser


def model_lines(data: dict) -> list[str]:
    lines = [f"engine model {data['id']}: group {data['group']}, config {data['config_version']} — {data['state']}"]
    if data["reason"]:
        lines.append(f"  {data['reason']}")
    if data["state"] != "fitted":
        return lines
    lines.append(f"  window {data['window']['since']} → {data['window']['until']}: {data['fit_requests']} fitting "
                 f"+ {data['held_out_requests']} held-out requests, fitted in {data['fit_seconds']:.1f} s")
    for name, value in sorted(data["constants"].items()):
        published = data["published"].get(name)
        change = f" ({value / published - 1:+.1%} from the published {published:.4g})" if published else ""
        lines.append(f"  {name} = {value:.4g}{change}")
    held = data["held_out_error"]  # in the fit's order of figures (JSONB in PostgreSQL keeps keys its own way)
    order = [f"{figure}_p{q}" for figure in F.FIGURES for q in F.QUANTILES]
    lines.append("  held-out error: " + ", ".join(f"{k} {held[k]:+.1%}" for k in order if k in held))
    verdict = "within" if data["reliable"] else "ABOVE"
    lines.append(f"  p50 TTFT/TPOT worst {data['held_out_worst']:.1%}: {verdict} the bound of "
                 f"{data['error_bound']:.0%} a tuning study holds the model to")
    return lines


def calibrate(command: BaseCommand, args: list[str]) -> int:
    options = calibrate_parser().parse_args(args)
    try:
        project = project_named(options.project)
    except CommandError as exc:  # no such project
        command.stderr.write(f"error: {exc}")
        return EXIT_ERROR
    until = dt.datetime.now(dt.timezone.utc)
    try:
        model = calibration.create(project, group=options.group, since=until - options.since, until=until,
                                   created_by="command", read_traces=not settings.EMBEDDED_MODE)
    except calibration.CalibrationError as exc:
        command.stderr.write(f"error: {exc}")
        return EXIT_ERROR
    command.stdout.write(f"engine model {model.id} of group {options.group} queued (window {options.since})")
    if options.no_wait:
        return 0
    waiter = JobCommand(stdout=command.stdout, stderr=command.stderr)
    try:
        model = waiter.wait(model, calibration.MODELS, start_timeout=options.timeout,
                            not_started=f"engine model {model.id} was not started within {options.timeout:g} s: is "
                            "the platform's worker running?", progress=lambda m: f"  {m.state}…")
    except CommandError as exc:  # not started, or Ctrl-C
        command.stderr.write(f"error: {exc}")
        return EXIT_ERROR
    data = calibration.summary(model)
    for line in model_lines(data):
        command.stdout.write(line)
    if options.json_path:
        Path(options.json_path).write_text(json.dumps(data, indent=2) + "\n")
    return 0 if model.state == ModelState.FITTED else 1


class Command(BaseCommand):
    help = ("Manage the engine fleet (gateway + vLLM or simulator replicas): up [--detach] | status | down | render;"
            " calibrate --project P --group G [--since 1h] [--json FILE]: fit the group's engine model to its traffic.")

    def run_from_argv(self, argv):
        # The engine CLI parses its own flags (sub-commands, --fleet, --detach, ...).
        args = list(argv[2:])
        if args[:1] == ["calibrate"]:
            sys.exit(calibrate(self, args[1:]))
        if args[:1] not in (["-h"], ["--help"]):
            apply_engine_environment(args)
        sys.exit(main(args))

    def handle(self, *args, **options):  # call_command("engine", "status")
        if args[:1] == ("calibrate",):
            return str(calibrate(self, list(args[1:])))
        apply_engine_environment(list(args))
        return str(main(list(args)))
