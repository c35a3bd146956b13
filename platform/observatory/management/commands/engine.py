"""`manage.py engine up|status|down|render`: the managed engine's CLI, wired to this platform.

A thin wrapper over ``python -m engine`` (``engine.launcher.cli``): before ``up`` it
points the fleet's spans at this platform's OTLP endpoint with the engine's ingest key
(unless ``ENGINE_OTLP_ENDPOINT`` is already set) and keeps the run directory in the
platform's data directory. Every flag is the engine CLI's own.
"""
import os
import sys

from django.core.management.base import BaseCommand

from observatory.engine_link import engine_environment


def apply_engine_environment(argv: list[str], *, project: str = "default") -> None:
    """Fill in the platform's wiring for the engine CLI without overriding what the user set."""
    if argv and argv[0] == "up" and not os.environ.get("ENGINE_OTLP_ENDPOINT"):
        wiring = engine_environment(project)
    else:
        from django.conf import settings

        wiring = {"ENGINE_RUN_DIR": os.path.join(str(settings.DATA_DIR), "engine")}
    if "--fleet" in argv or any(a.startswith("--fleet=") for a in argv) or os.environ.get("ENGINE_FLEET"):
        wiring.pop("ENGINE_RUN_DIR", None)  # a fleet file of one's own keeps its own run_dir
    for name, value in wiring.items():
        os.environ.setdefault(name, value)


class Command(BaseCommand):
    help = "Manage the engine fleet (gateway + vLLM or simulator replicas): up [--detach] | status | down | render."

    def run_from_argv(self, argv):
        # The engine CLI parses its own flags (sub-commands, --fleet, --detach, ...).
        from engine.launcher.cli import main

        args = list(argv[2:])
        if args[:1] not in (["-h"], ["--help"]):
            apply_engine_environment(args)
        sys.exit(main(args))

    def handle(self, *args, **options):  # call_command("engine", "status")
        from engine.launcher.cli import main

        apply_engine_environment(list(args))
        return str(main(list(args)))
