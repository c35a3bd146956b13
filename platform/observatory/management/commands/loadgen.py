"""`manage.py loadgen`: the engine's load generator, its client spans sent to this platform.

A thin wrapper over ``python -m engine.loadgen``: unless an OTLP endpoint is given
(``--otlp-endpoint`` or the OTel environment), the client spans go to this platform's
OTLP/HTTP endpoint with the engine's ingest key, so each request's outermost hop is
decomposed together with the gateway's and the replica's spans.
"""
import os
import sys

from django.core.management.base import BaseCommand
from fleet.wiring import engine_environment

from engine.loadgen.cli import main


class Command(BaseCommand):
    help = "Generate load against an OpenAI-compatible endpoint (default: the engine gateway) and report latency."

    def run_from_argv(self, argv):
        args = list(argv[2:])
        wants_help = any(a in ("-h", "--help") for a in args)
        if not wants_help and "--otlp-endpoint" not in args and not os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        ):
            for name, value in engine_environment().items():
                if name.startswith("OTEL_"):
                    os.environ.setdefault(name, value)
        sys.exit(main(args))

    def handle(self, *args, **options):
        return str(main(list(args)))
