"""`manage.py runplatform`: serve web + API + OTLP/HTTP, OTLP/gRPC and background work in one process."""
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from observatory.runtime import SpoolInUse
from observatory.serve import PlatformServer


class Command(BaseCommand):
    help = "Run the platform (web, JSON API, OTLP/HTTP on the web port, OTLP/gRPC, writer, decomposition)."

    def add_arguments(self, parser):
        parser.add_argument("--http", default=None, help=f"host:port for the web server (default {settings.HTTP_BIND})")
        parser.add_argument("--grpc", default=None, help=f"host:port for OTLP/gRPC (default {settings.OTLP_GRPC_BIND})")
        parser.add_argument("--no-grpc", action="store_true")

    def handle(self, *args, http=None, grpc=None, no_grpc=False, **options):
        server = PlatformServer(http, grpc, grpc_enabled=False if no_grpc else None)
        try:
            server.start()
        except SpoolInUse as exc:
            raise CommandError(str(exc)) from exc
        server.install_signal_handlers()
        mode = "embedded (SQLite + chdb)" if settings.EMBEDDED_MODE else "server"
        self.stdout.write(f"LLM latency observatory running in {mode} mode")
        self.stdout.write(f"  web + API + OTLP/HTTP  http://{server.http_bind.rsplit(':', 1)[0]}:{server.http_port}")
        if server.grpc_port:
            self.stdout.write(f"  OTLP/gRPC              {server.grpc_bind.rsplit(':', 1)[0]}:{server.grpc_port}")
        self.stdout.flush()
        server.serve_forever()
