"""One replica of an engine config started outside any fleet for the length of a job (a regression run's config
target), on a free port of 127.0.0.1: the simulator in real time (`python -m engine.replica`), or a real `vllm
serve` started with the launcher's command (every knob on its argv; vLLM's CPU build where there is no GPU). Its
llm_request spans go where the caller says, with the headers it gives (an ingest key)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

from engine.config import EngineConfig
from engine.launcher.process_groups import signal_group
from engine.launcher.vllm_command import (
    find_vllm_executable,
    render_simulator_command,
    render_vllm_command,
    write_config_file,
)

BACKENDS = ("simulator", "vllm")


class ReplicaStartError(RuntimeError):
    """The replica cannot be started on this host (its backend is not installed)."""


class ConfigReplica:
    """``config`` (vLLM knob names) served by ``backend`` as replica group ``group``. ``otlp_endpoint`` is an
    OTLP/HTTP traces URL for the simulator and a gRPC host:port for vLLM (which exports over gRPC only). Its
    config file and log are ``directory/<name>.json`` and ``directory/<name>.log``."""

    def __init__(self, config: Mapping, *, group: str, name: str, directory: Path, otlp_endpoint: str,
                 otlp_headers: Mapping[str, str], backend: str = "simulator", served_model_name: str | None = None,
                 seed: int = 0):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        self.config = dict(config)
        self.group, self.name, self.directory = group, name, Path(directory)
        self.otlp_endpoint, self.otlp_headers = otlp_endpoint, dict(otlp_headers)
        self.backend, self.served_model_name, self.seed = backend, served_model_name, seed
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> str:
        """Start the process (it answers once it has loaded); its OpenAI base URL. ReplicaStartError when the
        backend is not installed here."""
        config = EngineConfig.from_dict(self.config)
        self.directory.mkdir(parents=True, exist_ok=True)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        env = dict(os.environ)
        if self.backend == "vllm":
            executable = find_vllm_executable()
            if executable is None:
                raise ReplicaStartError("this target runs on real vLLM, which is not installed here (make vllm)")
            command = render_vllm_command(
                config, host="127.0.0.1", port=self.port, served_model_name=self.served_model_name,
                otlp_traces_endpoint=self.otlp_endpoint, otlp_protocol="grpc", otlp_headers=self.otlp_headers,
                group=self.group, vllm_executable=executable)
            if config.kv_cache_memory_bytes is not None:
                env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the flag sizes the cache; both would conflict
        else:
            path = write_config_file(config, self.directory / f"{self.name}.json")
            command = render_simulator_command(
                config, config_path=path, host="127.0.0.1", port=self.port, group=self.group,
                otlp_traces_endpoint=self.otlp_endpoint, otlp_protocol="http/protobuf",
                otlp_headers=self.otlp_headers, seed=self.seed)
        with open(self.directory / f"{self.name}.log", "ab") as log:
            self.process = subprocess.Popen(command.argv, env={**env, **command.env}, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        return self.base_url

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # Its whole process group: vLLM runs an engine core and a worker beside its API server.
        if not signal_group(self.process.pid, signal.SIGTERM):
            return
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
