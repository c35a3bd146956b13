"""Command line of the load generator: ``python -m engine.loadgen`` (and ``manage.py loadgen``).

Exit codes: 0 when at least one request succeeded, 1 when none did or the run could not
start (e.g. no model could be listed), 2 for invalid arguments or input files,
130 when interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from engine.cli_args import bounded_float, finite_float, integer
from engine.loadgen.report import ProgressBar, format_summary
from engine.loadgen.runner import LoadError, run_load_sync
from engine.loadgen.spec import (
    ARRIVALS,
    DEFAULT_BASE_URL,
    ENDPOINTS,
    OTLP_PROTOCOLS,
    SHAREGPT,
    LengthRange,
    LoadSpec,
    parse_goodput,
)
from engine.loadgen.workload import WorkloadFileError

# Requests/s; "inf" sends everything at once (the sign is checked by LoadSpec.problems, naming the flag).
_rate = bounded_float(allow_inf=True)


def _length(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _percentiles(text: str) -> tuple[float, ...]:
    values = []
    for part in text.split(","):
        value = finite_float(part.strip())
        if not 0 < value < 100:
            raise argparse.ArgumentTypeError(f"percentile {part.strip()!r} must be strictly between 0 and 100")
        values.append(value)
    return tuple(values)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.loadgen",
        description=(
            "Drive an OpenAI-compatible endpoint and measure TTFT, TPOT, ITL and end-to-end latency as vLLM's "
            "serving benchmark does; each request is an OTel CLIENT span whose traceparent reaches the server."
        ),
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI-compatible base URL (default %(default)s)")
    target.add_argument("--model", help="model name (default: the first one GET {base-url}/models lists)")
    target.add_argument("--endpoint", choices=ENDPOINTS, default="completions",
                        help="/v1/completions or /v1/chat/completions (default %(default)s)")
    target.add_argument("--no-stream", dest="stream", action="store_false",
                        help="non-streaming requests: only end-to-end latency is measured")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    target.add_argument("--timeout", type=finite_float, default=600.0,
                        help="seconds allowed per request, whole response included (default %(default)s)")
    target.add_argument("--extra-body", type=_json_object, help="JSON object merged into every request body")

    load = parser.add_argument_group("arrivals")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="arrival process (default %(default)s)")
    load.add_argument("--rate", type=_rate, default=1.0,
                      help="requests/s for poisson/constant (inf: all at once) and on/off bursts (default %(default)s)")
    load.add_argument("--burstiness", type=finite_float, default=1.0,
                      help="poisson: gamma shape of the gaps as vLLM's --burstiness; 1 = Poisson (default %(default)s)")
    load.add_argument("--burst-size", type=integer, help="burst: requests sent together")
    load.add_argument("--burst-interval", type=finite_float, help="burst: seconds between bursts")
    load.add_argument("--burst-on", type=finite_float, help="burst on/off: seconds sending at --rate")
    load.add_argument("--burst-off", type=finite_float, help="burst on/off: seconds silent")
    load.add_argument("--trace", help="replay: JSONL trace with offset/timestamp per line")
    load.add_argument("--replay-speed", type=finite_float, default=1.0, help="replay: speed factor (default %(default)s)")
    load.add_argument("--num-requests", type=integer, help="number of requests")
    load.add_argument("--duration", type=finite_float, help="seconds during which requests are sent")
    load.add_argument("--max-concurrency", type=integer, help="most requests in flight at once")

    content = parser.add_argument_group("request contents")
    content.add_argument("--dataset", default=SHAREGPT,
                         help="'sharegpt' (synthetic ShareGPT-like lengths) or a JSONL file with prompt/messages")
    content.add_argument("--input-len", type=_length, help="prompt tokens: N (fixed) or LO:HI (uniform)")
    content.add_argument("--output-len", type=_length, help="output tokens: N (fixed) or LO:HI (uniform)")
    content.add_argument("--seed", type=integer, default=0, help="seed of arrivals and lengths (default %(default)s)")
    content.add_argument("--shared-prefix-len", type=integer, default=0, metavar="TOKENS",
                         help="synthetic prompts start with the same TOKENS tokens (a shared system prompt the "
                              "engine's prefix cache can serve); lengths stay as drawn (default 0)")

    results = parser.add_argument_group("results")
    results.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                         help="SLOs for goodput as vLLM: ttft:MS tpot:MS e2el:MS (any subset)")
    results.add_argument("--percentiles", type=_percentiles, default=(90.0, 99.0),
                         help="comma-separated percentiles besides the median (default 90,99)")
    results.add_argument("--json", metavar="FILE", help="write the config, summary and every request to FILE")
    results.add_argument("--quiet", action="store_true", help="no progress bar")

    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument("--otlp-endpoint", help="OTLP endpoint for the client spans (default: $OTEL_EXPORTER_OTLP_*)")
    telemetry.add_argument("--otlp-protocol", choices=OTLP_PROTOCOLS, help="OTLP protocol (default grpc)")
    telemetry.add_argument("--otlp-header", type=_header, action="append", default=[], metavar="KEY=VALUE",
                           help="header for the OTLP exporter, e.g. authorization='Bearer KEY' (repeatable)")
    return parser


def spec_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LoadSpec:
    """The spec the arguments describe; every problem is an argparse error (exit code 2)."""
    try:
        goodput = parse_goodput(args.goodput) if args.goodput else None
    except ValueError as exc:
        parser.error(f"argument --goodput: {exc}")
    spec = LoadSpec(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        stream=args.stream,
        arrival=args.arrival,
        rate=args.rate,
        burstiness=args.burstiness,
        burst_size=args.burst_size,
        burst_interval=args.burst_interval,
        burst_on=args.burst_on,
        burst_off=args.burst_off,
        trace=args.trace,
        replay_speed=args.replay_speed,
        num_requests=args.num_requests,
        duration=args.duration,
        max_concurrency=args.max_concurrency,
        dataset=args.dataset,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        shared_prefix_len=args.shared_prefix_len,
        extra_body=args.extra_body,
        goodput=goodput,
        percentiles=args.percentiles,
        api_key=args.api_key or None,
        timeout=args.timeout,
        otlp_endpoint=args.otlp_endpoint,
        otlp_protocol=args.otlp_protocol,
        otlp_headers=dict(args.otlp_header) or None,
    )
    problems = spec.problems()
    if problems:
        parser.error("; ".join(problems))
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        spec = spec_from_args(args, parser)
    except SystemExit as exc:  # argparse: --help (0) or an argument error (2, message already printed)
        return exc.code if isinstance(exc.code, int) else 2
    progress = None if args.quiet else ProgressBar(sys.stderr)
    try:
        result = run_load_sync(spec, progress=progress)
    except WorkloadFileError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except LoadError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    print(format_summary(result.summary, model=result.model, max_concurrency=spec.max_concurrency))
    if args.json:
        try:
            result.write_json(args.json)
        except OSError as exc:
            print(f"{parser.prog}: error: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0 if result.summary.completed else 1
