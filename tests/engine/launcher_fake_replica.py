"""A tiny replica with controllable failures, for the supervisor tests (crash, restart, backoff, health, drain).

Serves ``GET /health`` and ``GET /metrics`` (vLLM's running/waiting gauges) with the
standard library only, so it starts in a fraction of a second. Behaviour is chosen by
flags; ``--starts-file`` counts starts so a test can make only the first N runs fail.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--starts-file", default=None, help="append one line per start; used by --fail-first")
    parser.add_argument("--fail-first", type=int, default=None,
                        help="only the first N starts misbehave (crash/unhealthy); later ones are well")
    parser.add_argument("--crash-after", type=float, default=None, help="exit with --exit-code after S seconds")
    parser.add_argument("--exit-code", type=int, default=3)
    parser.add_argument("--unhealthy-after", type=float, default=None, help="/health answers 503 after S seconds")
    parser.add_argument("--busy-file", default=None, help="report one running request while this file exists")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--startup-delay", type=float, default=0.0)
    args = parser.parse_args()

    start_index = 0
    if args.starts_file:
        with open(args.starts_file, "a+", encoding="utf-8") as handle:
            handle.seek(0)
            start_index = len(handle.read().splitlines())
            handle.write(f"{os.getpid()} {args.port} {time.time()}\n")
    misbehave = args.fail_first is None or start_index < args.fail_first

    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    time.sleep(args.startup_delay)
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                unhealthy = misbehave and args.unhealthy_after is not None and \
                    time.monotonic() - started >= args.unhealthy_after
                self._send(503 if unhealthy else 200, b"" if not unhealthy else b"unhealthy")
            elif self.path == "/metrics":
                running = 1 if args.busy_file and os.path.exists(args.busy_file) else 0
                body = (
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{engine="0",model_name="fake"}} {float(running)}\n'
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    'vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0\n'
                )
                self._send(200, body.encode())
            else:
                self._send(404, b"not found")

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep the log quiet
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    if misbehave and args.crash_after is not None:
        def crash() -> None:
            time.sleep(args.crash_after)
            sys.stdout.flush()
            os._exit(args.exit_code)
        threading.Thread(target=crash, daemon=True).start()
    print(f"fake replica on {args.host}:{args.port} (start #{start_index + 1})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
