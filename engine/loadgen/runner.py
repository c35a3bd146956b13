"""Runs a load: plans the arrivals and contents, sends every request on time, and returns the measurements.

The run's clock starts right before the first request is due; requests are created as
tasks at their arrival times (a late one is sent at once, never skipped) and, with
``max_concurrency``, wait for a free slot as in vLLM's ``--max-concurrency``. The
duration is measured to the end of the last request, as vLLM's benchmark does.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import gc
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
from opentelemetry.sdk.trace import TracerProvider

from engine.loadgen import arrivals
from engine.loadgen.client import RequestRecord, RequestSender
from engine.loadgen.metrics import Summary, summarize
from engine.loadgen.report import Progress
from engine.loadgen.spec import LoadSpec
from engine.loadgen.workload import RequestContent, Workload
from engine.telemetry import build_tracer_provider

SERVICE_NAME = "llm-loadgen"
TRACER_NAME = "engine.loadgen"
RESULT_FORMAT = "llm-loadgen/1"
# aiohttp's default read buffer (64 KiB) limits one SSE line; a long chunk (big usage, tool calls) must fit.
READ_BUFSIZE = 10 * 1024 * 1024


class LoadError(RuntimeError):
    """A run that could not start (e.g. the model list is unreachable); the message says why."""


@dataclasses.dataclass(frozen=True)
class PlannedRequest:
    index: int
    offset: float  # seconds from the start of the run
    content: RequestContent


@dataclasses.dataclass
class RequestPlan:
    """The arrival offsets of a run (all known up front) and the contents, built one by one as they are sent."""

    offsets: list[float]
    workload: Workload
    trace: list[arrivals.TraceEntry] | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def content(self, index: int) -> RequestContent:
        if self.trace is None:
            return self.workload.content(index)
        entry = self.trace[index]
        return self.workload.content(
            index,
            prompt=entry.prompt,
            messages=entry.messages,
            input_tokens=entry.input_tokens,
            output_tokens=entry.output_tokens,
        )

    def __iter__(self) -> Iterator[PlannedRequest]:
        for index, offset in enumerate(self.offsets):
            yield PlannedRequest(index, offset, self.content(index))


def arrival_offsets(spec: LoadSpec) -> tuple[list[float], list[arrivals.TraceEntry] | None]:
    """Every send offset of the run (bounded by ``num_requests`` and ``duration``), and the trace when replaying."""
    trace = None
    if spec.arrival == "poisson":
        stream = arrivals.poisson_offsets(spec.rate, seed=spec.seed, burstiness=spec.burstiness)
    elif spec.arrival == "constant":
        stream = arrivals.constant_offsets(spec.rate)
    elif spec.arrival == "burst":
        if spec.burst_size is not None:
            stream = arrivals.burst_offsets(spec.burst_size, spec.burst_interval)
        else:
            stream = arrivals.on_off_offsets(spec.rate, spec.burst_on, spec.burst_off)
    elif spec.arrival == "replay":
        trace = arrivals.load_trace(spec.trace)
        stream = list(arrivals.replay_offsets(trace, spec.replay_speed))
    else:
        raise ValueError(f"unknown arrival process {spec.arrival!r}")
    offsets = list(arrivals.bounded(stream, count=spec.num_requests, duration=spec.duration))
    if trace is not None:
        trace = trace[: len(offsets)]
    return offsets, trace


def plan_requests(spec: LoadSpec) -> RequestPlan:
    """The plan of a validated spec; raises WorkloadFileError for a bad dataset or trace file."""
    workload = Workload(spec.dataset, input_len=spec.input_len, output_len=spec.output_len, seed=spec.seed,
                        shared_prefix_len=spec.shared_prefix_len)
    offsets, trace = arrival_offsets(spec)
    return RequestPlan(offsets=offsets, workload=workload, trace=trace)


@dataclasses.dataclass
class LoadResult:
    """A finished run: its spec, the model used, when it started, every request's record and the summary."""

    spec: LoadSpec
    model: str
    started_at: float  # Unix seconds at the start of the run
    duration: float  # seconds, first send to last completion
    records: list[RequestRecord]
    summary: Summary

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RESULT_FORMAT,
            "config": self.spec.to_dict(),
            "model": self.model,
            "started_at": self.started_at,
            "started_at_iso": datetime.datetime.fromtimestamp(self.started_at, datetime.timezone.utc).isoformat(),
            "duration": self.duration,
            "summary": self.summary.to_dict(),
            "requests": [record.to_dict() for record in self.records],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadResult:
        if data.get("format") != RESULT_FORMAT:
            raise ValueError(f"not a load generator result (format {data.get('format')!r}, expected {RESULT_FORMAT})")
        return cls(
            spec=LoadSpec.from_dict(data["config"]),
            model=data["model"],
            started_at=float(data["started_at"]),
            duration=float(data["duration"]),
            records=[RequestRecord.from_dict(item) for item in data["requests"]],
            summary=Summary.from_dict(data["summary"]),
        )

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=1, allow_nan=False)
            handle.write("\n")


def load_result(path: str) -> LoadResult:
    """Read a result written by ``LoadResult.write_json`` (``--json FILE``)."""
    with open(path, encoding="utf-8") as handle:
        return LoadResult.from_dict(json.load(handle))


def _auth_headers(spec: LoadSpec) -> dict[str, str]:
    return {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}


async def discover_model(session: aiohttp.ClientSession, spec: LoadSpec) -> str:
    """The first model listed at ``GET {base_url}/models`` (OpenAI ``{"data": [{"id": ...}]}``)."""
    url = spec.models_url
    try:
        async with session.get(url, headers=_auth_headers(spec), timeout=aiohttp.ClientTimeout(total=30)) as response:
            body = await response.read()
            if response.status != 200:
                raise LoadError(f"GET {url} answered {response.status}: {body[:200].decode('utf-8', 'replace')}")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise LoadError(f"cannot list models at {url}: {type(exc).__name__}: {exc}") from None
    try:
        data = json.loads(body)
        models = [item["id"] for item in data["data"] if isinstance(item, dict) and isinstance(item.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise LoadError(f"GET {url} did not return an OpenAI model list") from None
    if not models:
        raise LoadError(f"GET {url} lists no models; pass --model")
    return models[0]


async def run_load(
    spec: LoadSpec,
    *,
    tracer_provider: TracerProvider | None = None,
    progress: Progress | None = None,
) -> LoadResult:
    """Run ``spec`` and return every measurement.

    Spans go to ``tracer_provider``; without one, a provider for service "llm-loadgen"
    is built from ``spec.otlp_*`` or the OTEL_EXPORTER_OTLP_* environment (spans are
    dropped when neither names an endpoint), and flushed and shut down at the end.
    Raises SpecError for an invalid spec, WorkloadFileError for a bad dataset/trace and
    LoadError when no model is given and none can be listed. Failed requests do not raise.
    """
    spec.validate()
    plan = plan_requests(spec)
    owned_provider = tracer_provider is None
    if tracer_provider is None:
        tracer_provider = build_tracer_provider(
            SERVICE_NAME, endpoint=spec.otlp_endpoint, protocol=spec.otlp_protocol, headers=spec.otlp_headers
        )
    tracer = tracer_provider.get_tracer(TRACER_NAME)
    try:
        connector = aiohttp.TCPConnector(limit=spec.max_concurrency or 0, keepalive_timeout=60)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=spec.timeout), read_bufsize=READ_BUFSIZE
        ) as session:
            model = spec.model or await discover_model(session, spec)
            sender = RequestSender(
                session,
                api_url=spec.api_url,
                model=model,
                endpoint=spec.endpoint,
                stream=spec.stream,
                tracer=tracer,
                api_key=spec.api_key,
                extra_body=dict(spec.extra_body or {}),
            )
            records, started_at, duration = await _dispatch(plan, sender, spec.max_concurrency, progress)
    finally:
        if progress is not None:
            progress.close()
        if owned_provider:
            # Exporting may block on the network: keep it off the event loop.
            await asyncio.to_thread(_flush_and_shutdown, tracer_provider)
    summary = summarize(records, duration, goodput=spec.goodput, percentiles=spec.percentiles)
    return LoadResult(spec=spec, model=model, started_at=started_at, duration=duration, records=records,
                      summary=summary)


def _flush_and_shutdown(provider: TracerProvider) -> None:
    provider.force_flush()
    provider.shutdown()


async def _dispatch(
    plan: RequestPlan, sender: RequestSender, max_concurrency: int | None, progress: Progress | None
) -> tuple[list[RequestRecord], float, float]:
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # A full collection over every object of a big process (a Django command, a test session) pauses the
    # loop for tens of ms, which would show up as latency that the server never caused. Objects that exist
    # before the run are moved out of the collector's sight; what the run allocates is still collected.
    gc.collect()
    gc.freeze()

    async def one(record: RequestRecord, content: RequestContent, run_start: float) -> RequestRecord:
        if semaphore is None:
            await sender.send(record, content, run_start)
        else:
            async with semaphore:
                await sender.send(record, content, run_start)
        if progress is not None:
            progress.advance(record)
        return record

    if progress is not None:
        progress.start(len(plan))
    tasks: list[asyncio.Task] = []
    started_at = time.time()
    run_start = time.perf_counter()
    try:
        for planned in plan:  # the content is built before waiting, so building never delays a send
            delay = run_start + planned.offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record = RequestRecord(index=planned.index, scheduled_ms=planned.offset * 1000.0)
            tasks.append(asyncio.create_task(one(record, planned.content, run_start)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - run_start
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        gc.unfreeze()
    return records, started_at, duration


def run_load_sync(
    spec: LoadSpec, *, tracer_provider: TracerProvider | None = None, progress: Progress | None = None
) -> LoadResult:
    """``run_load`` in a new event loop (for scripts, management commands and tests)."""
    return asyncio.run(run_load(spec, tracer_provider=tracer_provider, progress=progress))
