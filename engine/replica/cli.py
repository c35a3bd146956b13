"""Command line of the simulated replica: ``python -m engine.replica --config FILE ...``.

Flag names follow ``vllm serve`` where vLLM has the flag (``--host``, ``--port``,
``--served-model-name``, ``--otlp-traces-endpoint``, ``--seed``,
``--enable-prompt-tokens-details``); ``--config`` is an
engine config file (YAML or JSON with vLLM's knob names, see ``engine/config.py``) and
``--group`` the replica group stamped on spans. As with vLLM, the OTLP protocol comes from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (gRPC by default) and headers from
``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` / ``OTEL_EXPORTER_OTLP_HEADERS``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import prometheus_client

from engine.cli_args import bounded_int, integer, non_negative_float, port_number
from engine.config import ConfigError, EngineConfig
from engine.replica.embeddings import DEFAULT_DIMENSION, MAX_DIMENSION
from engine.replica.server import DEFAULT_SHUTDOWN_TIMEOUT, ReplicaServer, run_replica
from engine.replica.spans import build_replica_tracer_provider


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.replica",
        description="A simulated vLLM replica: vLLM's OpenAI-compatible API, llm_request spans and "
        "Prometheus metrics, driven in real time by the engine simulator.",
    )
    parser.add_argument("--config", required=True, help="engine config file (YAML or JSON, vLLM knob names)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, help="port to bind (default 8000, as vLLM; 0 = any)")
    parser.add_argument("--group", type=_non_empty, default="default", help="replica group name stamped on spans")
    parser.add_argument("--served-model-name", type=_non_empty, default=None,
                        help="model name in the API and metrics (default: the config's model)")
    parser.add_argument("--otlp-traces-endpoint", default=None,
                        help="where to export llm_request spans (gRPC host:port unless "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); default: the OTel environment")
    parser.add_argument("--seed", type=integer, default=0, help="seed of the simulator and output lengths")
    parser.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
                        help="as vLLM's flag: every usage says how many prompt tokens the prefix cache served "
                        "(prompt_tokens_details.cached_tokens)")
    parser.add_argument("--embedding-dimension", type=bounded_int(at_least=1, at_most=MAX_DIMENSION),
                        default=DEFAULT_DIMENSION,
                        help="dimension of POST /v1/embeddings vectors, a hashed bag of words standing in for an "
                        "embedding model (default %(default)s)")
    parser.add_argument("--shutdown-timeout", type=non_negative_float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                        help="seconds to let in-flight requests finish on SIGTERM/SIGINT before aborting them")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # As vLLM's API server does: no `*_created` series next to every counter and histogram.
    prometheus_client.disable_created_metrics()
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = EngineConfig.load(args.config)
    except OSError as exc:
        print(f"error: cannot read engine config {args.config}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"error: invalid engine config {args.config}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    try:
        provider = build_replica_tracer_provider(config, args.group, endpoint=args.otlp_traces_endpoint,
                                                 served_model_name=args.served_model_name)
        server = ReplicaServer(
            config,
            host=args.host,
            port=args.port,
            group=args.group,
            served_model_name=args.served_model_name,
            tracer_provider=provider,
            seed=args.seed,
            shutdown_timeout=args.shutdown_timeout,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            embedding_dimension=args.embedding_dimension,
        )
    except (ValueError, LookupError) as exc:  # a config the simulator cannot run (no profile, KV cache too small)
        reason = exc.args[0] if isinstance(exc, LookupError) and exc.args else exc  # KeyError quotes its message
        print(f"error: the simulator cannot run this config: {reason}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_replica(server))
    except OSError as exc:  # e.g. the port is taken
        print(f"error: cannot serve on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        provider.shutdown()  # flushes what the batch processor still holds
    return 0
