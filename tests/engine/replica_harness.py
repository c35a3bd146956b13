"""Test support for the simulated replica tests: start a real replica, talk to it over real sockets.

No tests live here; the ``test_replica_*`` files import it (pytest puts this folder on
``sys.path``, there being no ``__init__.py``). The replica runs on its own event-loop
thread (``engine.replica.background.BackgroundReplica``); clients here are plain blocking
``http.client`` connections so the times they measure are what a client sees.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.replica import replica_resource_attributes
from engine.replica.background import BackgroundReplica

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def in_memory_tracing(config: EngineConfig, group: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    """A provider with the replica's resource whose spans land in memory (independent of the OTel env)."""
    exporter = InMemorySpanExporter()
    resource = Resource.create({"service.name": "vllm", **replica_resource_attributes(config, group)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def start_replica(config: EngineConfig | None = None, *, group: str = "baseline", **kwargs):
    """A started ``BackgroundReplica`` and the exporter that receives its spans."""
    config = config or EngineConfig()
    provider, exporter = in_memory_tracing(config, group)
    replica = BackgroundReplica(config, group=group, tracer_provider=provider, shutdown_timeout=2.0, **kwargs)
    replica.start()
    return replica, exporter


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path or "/"


@dataclasses.dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]
    started: float  # perf_counter before connecting
    finished: float  # perf_counter after the last byte

    def json(self):
        return json.loads(self.body)


def request(method: str, url: str, body=None, *, headers: dict[str, str] | None = None, raw: bytes | None = None,
            timeout: float = 30.0) -> Reply:
    """One HTTP request on a fresh connection; ``body`` is sent as JSON, ``raw`` as is."""
    started = time.perf_counter()
    connection, path = _connection(url, timeout)
    try:
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        connection.request(method, path, body=payload, headers=all_headers)
        response = connection.getresponse()
        data = response.read()
        return Reply(response.status, data, {k.lower(): v for k, v in response.getheaders()}, started,
                     time.perf_counter())
    finally:
        connection.close()


def post(url: str, body=None, **kwargs) -> Reply:
    return request("POST", url, body, **kwargs)


def get(url: str, **kwargs) -> Reply:
    return request("GET", url, **kwargs)


@dataclasses.dataclass
class Stream:
    status: int
    events: list  # decoded JSON objects, in order ("[DONE]" kept as the string)
    started: float  # perf_counter before connecting
    first_content: float | None  # perf_counter when the first event carrying generated text arrived
    finished: float  # perf_counter after the stream ended
    content_type: str

    @property
    def texts(self) -> list[str]:
        out = []
        for event in self.events:
            if isinstance(event, dict) and event.get("choices"):
                choice = event["choices"][0]
                text = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
                if text:
                    out.append(text)
        return out


def _has_content(event) -> bool:
    if not isinstance(event, dict) or not event.get("choices"):
        return False
    choice = event["choices"][0]
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


def stream(url: str, body: dict, *, headers: dict[str, str] | None = None, stop_after_events: int | None = None,
           timeout: float = 60.0) -> Stream:
    """POST a streaming request and read its SSE events as they arrive (optionally hanging up early)."""
    started = time.perf_counter()
    connection, path = _connection(url, timeout)
    events: list = []
    first_content = None
    try:
        connection.request("POST", path, body=json.dumps(body).encode(),
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        content_type = response.getheader("Content-Type", "")
        if response.status != 200:
            events.append(json.loads(response.read()))
            return Stream(response.status, events, started, None, time.perf_counter(), content_type)
        while True:
            line = response.fp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            event = "[DONE]" if data == b"[DONE]" else json.loads(data)
            if first_content is None and _has_content(event):
                first_content = time.perf_counter()
            events.append(event)
            if event == "[DONE]":
                break
            if stop_after_events is not None and len(events) >= stop_after_events:
                break
        return Stream(response.status, events, started, first_content, time.perf_counter(), content_type)
    finally:
        connection.close()


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted label pairs): value}."""
    text = get(url + "/metrics").body.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(url: str, name: str, **labels) -> float:
    """The value of one sample (labels model_name/engine filled in when not given); KeyError when absent."""
    labels.setdefault("model_name", MODEL)
    labels.setdefault("engine", "0")
    return metric_samples(url)[(name, tuple(sorted(labels.items())))]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def spans_by_request_id(exporter: InMemorySpanExporter) -> dict[str, object]:
    return {span.attributes["gen_ai.request.id"]: span for span in exporter.get_finished_spans()}
