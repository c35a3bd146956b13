"""`manage.py runplatform`: serve web + API + OTLP/HTTP, OTLP/gRPC and background work in one process."""
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from observatory.background import start_background
from observatory.companion import EngineCompanion
from observatory.runtime import SpoolInUse
from observatory.serve import PlatformServer, end_process


class Command(BaseCommand):
    help = "Run the platform (web, JSON API, OTLP/HTTP on the web port, OTLP/gRPC, writer, decomposition)."

    def add_arguments(self, parser):
        parser.add_argument("--http", default=None, help=f"host:port for the web server (default {settings.HTTP_BIND})")
        parser.add_argument("--grpc", default=None, help=f"host:port for OTLP/gRPC (default {settings.OTLP_GRPC_BIND})")
        parser.add_argument("--no-grpc", action="store_true")
        parser.add_argument(
            "--with-engine", action="store_true",
            help="also run the managed engine fleet (gateway + replicas; the simulator on CPU), "
            "its spans sent here, and stop it on exit",
        )
        parser.add_argument("--fleet", default=None, help="fleet file for --with-engine (default: the embedded fleet)")
        parser.add_argument(
            "--load", type=float, default=0.0, metavar="REQ_PER_S",
            help="with --with-engine: a background Poisson load through the gateway (e.g. 0.5)",
        )

    def handle(self, *args, http=None, grpc=None, no_grpc=False, with_engine=False, fleet=None, load=0.0,
               **options):
        if load < 0 or load != load:
            raise CommandError("--load must be a rate >= 0 (requests per second)")
        server = PlatformServer(http, grpc, grpc_enabled=False if no_grpc else None)
        try:
            server.start()
        except SpoolInUse as exc:
            raise CommandError(str(exc)) from exc
        server.install_signal_handlers()
        # What this process serves on, for the code that sends to it (a regression run's client spans); a port 0
        # or an --http or --grpc option differ from the settings.
        settings.HTTP_BIND = f"{server.http_bind.rsplit(':', 1)[0]}:{server.http_port}"
        if server.grpc_port:  # where real vLLM replicas a run starts send their spans (OTLP/gRPC only)
            settings.OTLP_GRPC_BIND = f"{server.grpc_bind.rsplit(':', 1)[0]}:{server.grpc_port}"
        # Celery worker + beat in this process (OBSERVATORY_INPROCESS_WORKER); stopped with the server, before
        # the trace store closes.
        server.background = start_background()
        mode = "embedded (SQLite + chdb)" if settings.EMBEDDED_MODE else "server"
        self.stdout.write(f"LLM latency observatory running in {mode} mode")
        self.stdout.write(f"  web + API + OTLP/HTTP  http://{server.http_bind.rsplit(':', 1)[0]}:{server.http_port}")
        if server.grpc_port:
            self.stdout.write(f"  OTLP/gRPC              {server.grpc_bind.rsplit(':', 1)[0]}:{server.grpc_port}")
        companion = None
        if with_engine:
            companion = EngineCompanion(fleet=fleet, load_rate=load, http_bind=f"127.0.0.1:{server.http_port}")
            try:
                companion.start()
            except RuntimeError as exc:
                server.stop()
                raise CommandError(str(exc)) from exc
            gateway = companion.env.get("ENGINE_GATEWAY_BIND") or "127.0.0.1:8100"
            self.stdout.write(f"  engine gateway         http://{gateway}/v1  (python manage.py engine status)")
            if load:
                self.stdout.write(f"  background load        {load:g} req/s Poisson through the gateway")
        self.stdout.flush()
        try:
            server.serve_forever()
        finally:
            if companion is not None:
                companion.stop()
        end_process(0)
