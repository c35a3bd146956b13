"""Replaying a dataset version against a target (and, paired, its baseline): targets, the plan, the sends.

Targets:
- `group:NAME` (or a bare NAME): a replica group of the managed fleet, through its gateway with the
  `X-Engine-Group` header, which routes to that group only, whatever its weight (0 included: a canary not yet
  given traffic);
- `http(s)://host:port/v1`: any OpenAI-compatible base URL, directly.

Every request is an OpenTelemetry CLIENT span (service `llm-regression`) sent with its `traceparent` and the
run's attributes (`llm_observatory.regression.{run_id,item_id,arm,repetition}`), exported to this platform's
own OTLP endpoint with the project's engine ingest key. Its trace id is kept with the result, so the result
joins the platform's decomposed request row (queue, prefill, decode, overhead, network) exactly, without
asking the client for timings it cannot see.

The sending runs in an asyncio loop on a thread of its own (no Django there); the run's thread drains finished
requests from a queue, writes them, beats the heartbeat and watches for a cancel.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import queue as queue_module
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from django.conf import settings
from fleet.state import fleet_spec, fleet_state

from engine.config import EngineConfig
from engine.launcher.config_replica import BACKENDS
from engine.loadgen import arrivals
from engine.loadgen.client import RequestRecord, RequestSender
from engine.tokens import count_tokens

from . import cache_sweep
from .datasets import json_problem

SERVICE_NAME = "llm-regression"
TRACER_NAME = "regressions.runner"
RUN_ATTRIBUTE = "llm_observatory.regression.run_id"
ITEM_ATTRIBUTE = "llm_observatory.regression.item_id"
ARM_ATTRIBUTE = "llm_observatory.regression.arm"
REPETITION_ATTRIBUTE = "llm_observatory.regression.repetition"
GROUP_HEADER = "X-Engine-Group"  # engine.gateway.proxy.GROUP_HEADER
PROBE_TIMEOUT = 5.0
DEFAULT_MAX_TOKENS = 256
READ_BUFSIZE = 10 * 1024 * 1024


class TargetError(ValueError):
    pass


def parse_target(text: str) -> dict:
    """`group:NAME`, NAME, or an http(s) base URL → the stored target; raises TargetError."""
    text = (text or "").strip()
    if not text:
        raise TargetError("the target is empty: give group:NAME or an http(s) base URL such as "
                          "http://127.0.0.1:8000/v1")
    if "://" in text:
        parts = urlsplit(text)
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise TargetError(f"the target URL has an invalid port: {text!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise TargetError(f"the target URL must be an http(s) base URL such as http://127.0.0.1:8000/v1 "
                              f"(got {text!r})")
        return {"kind": "url", "url": text.rstrip("/")}
    name = text.removeprefix("group:")
    if not name or len(name) > 100 or not all(c.isalnum() or c in "-_." for c in name):
        raise TargetError(f"{text!r} is neither a replica group name (group:NAME) nor an http(s) URL")
    return {"kind": "group", "group": name}


def config_target(config: Any) -> dict:
    """An engine config (vLLM knob names) started for the run as a simulated replica; raises TargetError naming
    each problem of the config."""
    if not isinstance(config, dict):
        raise TargetError("the target config must be a mapping of vLLM knobs (model, max_num_seqs, ...)")
    problem = json_problem(config, "the target config")
    if problem:
        raise TargetError(problem)
    try:
        parsed = EngineConfig.from_dict(config)
        problems = parsed.problems()
    except (TypeError, ValueError) as exc:
        problems = [str(exc)]
    if problems:
        raise TargetError("the target config cannot run: " + "; ".join(problems))
    return {"kind": "config", "config": dict(config), "version": parsed.version}


VLLM_START_SECONDS = 240.0  # how much longer a run waits for a real vLLM it started to answer


def backend_of(spec: dict) -> dict:
    """The backend keys a config target keeps: {"backend": "vllm", "served_model_name"?} (real `vllm serve`)."""
    backend = spec.get("backend", "simulator")
    if backend not in BACKENDS:
        raise TargetError(f"backend must be simulator or vllm, not {backend!r}")
    out = {"backend": backend}
    if spec.get("served_model_name"):
        out["served_model_name"] = str(spec["served_model_name"])
    return out


def gateway_base_url() -> str:
    """The managed fleet's gateway (OpenAI API base URL): REGRESSIONS["GATEWAY_URL"], else the fleet file's."""
    configured = settings.REGRESSIONS.get("GATEWAY_URL")
    if configured:
        return configured.rstrip("/")
    return fleet_spec().gateway_url.rstrip("/") + "/v1"


def endpoint_of(target: dict) -> tuple[str, dict[str, str]]:
    """(OpenAI base URL, extra headers) of a stored target (a config target's once its replica runs)."""
    if target["kind"] == "config":
        return target["url"], {}
    if target["kind"] == "group":
        return gateway_base_url(), {GROUP_HEADER: target["group"]}
    return target["url"], {}


async def _probe(base_url: str, headers: dict[str, str], timeout: float) -> str:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(base_url + "/models", headers=headers) as response:
                body = await response.read()
                if response.status != 200:
                    raise TargetError(f"GET {base_url}/models answered {response.status}: "
                                      f"{body[:200].decode('utf-8', 'replace')}")
                try:
                    models = json.loads(body).get("data") or []
                    model = models[0]["id"]
                except (ValueError, AttributeError, LookupError, TypeError):
                    raise TargetError(f"GET {base_url}/models did not list a model") from None
                return str(model)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise TargetError(f"the target {base_url} does not answer ({type(exc).__name__}: {exc})"[:400]) from None


def check_target(target: dict, timeout: float = PROBE_TIMEOUT) -> str:
    """The model the target serves; raises TargetError when it does not answer (or the group is unknown). A
    config target is started by the run itself: its config was checked when parsed."""
    if target["kind"] == "config":
        return target["config"].get("model", "")
    if target["kind"] == "group":
        state = fleet_state()
        if not state.get("running"):
            raise TargetError(f"group {target['group']!r}: the managed engine fleet is not running "
                              "(start it with `make up` or `manage.py engine up`)")
        groups = [g.get("name") for g in (state["fleet"] or {}).get("groups", [])]
        if target["group"] not in groups:
            raise TargetError(f"the fleet has no replica group {target['group']!r} (groups: {', '.join(groups)})")
    base_url, headers = endpoint_of(target)
    return asyncio.run(_probe(base_url, headers, timeout))


# -- the plan ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Slot:
    seq: int
    item: dict  # DatasetItem.as_dict()
    repetition: int
    arm: str
    warmup: bool
    offset: float  # seconds from the start of its phase
    phase: int = 0  # arms in turn: phases run one after another, the next once every request of the last ended
    in_order: bool = False  # sent once the request before it ended (a cache sweep's pass)


def _offsets(options: dict, count: int) -> list[float]:
    rate = options.get("rate")
    rate = math.inf if rate in (None, "inf") else float(rate)
    seed = int(options.get("seed", 0))
    if options.get("arrival", "poisson") == "constant":
        stream = arrivals.constant_offsets(rate)
    else:
        stream = arrivals.poisson_offsets(rate, seed=seed, burstiness=float(options.get("burstiness", 1.0)))
    return list(itertools.islice(stream, count))


def plan(items: list[dict], options: dict, *, paired: bool) -> list[Slot]:
    """Warm-up requests first (the first `warmup` items, candidate then baseline), then every item ×
    repetition. Paired with arms `together` (the default), both arms of an item are sent at the same moment,
    their order alternating; with arms `in_turn`, the baseline's whole replay (phase 0) comes before the
    candidate's (phase 1), each with the same arrival times and its own warm-up, so the two never share the
    machine (two real vLLM servers on one CPU host would split its cores). A cache sweep (never paired) adds a
    phase per threshold after the candidate's: every item once, in dataset order, one at a time
    (regressions.cache_sweep)."""
    units: list[tuple[dict, int, bool]] = []
    for n in range(int(options.get("warmup", 0))):
        units.append((items[n % len(items)], n, True))
    for repetition in range(int(options.get("repetitions", 1))):
        for item in items:
            units.append((item, repetition, False))
    offsets = _offsets(options, len(units))
    slots: list[Slot] = []
    if paired and options.get("arms") == "in_turn":
        for phase, arm in enumerate(("baseline", "candidate")):
            for (item, repetition, warmup), offset in zip(units, offsets):
                slots.append(Slot(len(slots), item, repetition, arm, warmup, offset, phase))
        return slots
    for index, ((item, repetition, warmup), offset) in enumerate(zip(units, offsets)):
        arms = ["candidate"]
        if paired:
            arms = ["candidate", "baseline"] if index % 2 == 0 else ["baseline", "candidate"]
        for arm in arms:
            slots.append(Slot(len(slots), item, repetition, arm, warmup, offset))
    sweep = options.get("cache_sweep")
    for phase, threshold in enumerate(sweep["thresholds"] if sweep else (), start=1):
        # After the candidate's replay (the cache bypassed), each threshold's pass: every item once, in order.
        for item in items:
            slots.append(Slot(len(slots), item, 0, cache_sweep.arm_of(threshold), False, 0.0, phase, True))
    return slots


def rebase(slots: list[Slot]) -> list[Slot]:
    """What is left of a plan, each phase's offsets counted from its first remaining request (a resumed run
    sends at once what it had not sent)."""
    first: dict[int, float] = {}
    for slot in slots:
        first.setdefault(slot.phase, slot.offset)
    return [dataclasses.replace(s, offset=s.offset - first[s.phase]) for s in slots]


# -- sending -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ItemContent:
    """What RequestSender needs of a request, from a dataset item."""

    prompt: str | None
    messages: tuple[dict, ...] | None
    input_tokens: int
    max_tokens: int
    params: dict

    @classmethod
    def of(cls, item: dict) -> ItemContent:
        params = dict(item.get("params") or {})
        max_tokens = int(params.pop("max_tokens", DEFAULT_MAX_TOKENS))
        if item.get("messages") is not None:
            messages = tuple(dict(m) for m in item["messages"])
            return cls(None, messages, sum(count_tokens(m["content"]) for m in messages), max_tokens, params)
        return cls(item["prompt"], None, count_tokens(item["prompt"]), max_tokens, params)

    def for_endpoint(self, endpoint: str) -> ItemContent:
        return self


class ItemSender(RequestSender):
    """A RequestSender whose body is the item's: its parameters as given (greedy by default, no ignore_eos
    unless the item asks), streamed with usage."""

    def body(self, content: ItemContent) -> dict[str, Any]:
        # The load generator's body without its benchmark's ignore_eos; the item's parameters never hold the keys
        # that define the measurement (max_tokens is taken out of them, stream is not one a dataset may set).
        body = super().body(content)
        del body["ignore_eos"]
        body.update(content.params)
        return body


@dataclasses.dataclass
class Endpoint:
    base_url: str
    headers: dict[str, str]
    model: str


class Replay:
    """Sends `slots` from a thread of its own; finished (slot, record) pairs appear on `finished`."""

    def __init__(self, slots: list[Slot], endpoints: dict[str, Endpoint], *, run_id: int, tracer_provider,
                 max_concurrency: int | None, timeout: float, time_limit: float | None):
        self.slots = slots
        self.endpoints = endpoints
        self.run_id = run_id
        self.tracer = tracer_provider.get_tracer(TRACER_NAME)
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.time_limit = time_limit
        self.finished: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self.error: BaseException | None = None
        self.stopped_early = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name=f"regression-run-{run_id}", daemon=True)
        self.done = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        loop, main = self._loop, self._main
        if loop is not None and main is not None:
            loop.call_soon_threadsafe(main.cancel)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._send_all())
        except asyncio.CancelledError:
            self.stopped_early = True
        except BaseException as exc:  # noqa: BLE001 - reported to the run's thread
            self.error = exc
        finally:
            self.done.set()

    async def _send_all(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._main = asyncio.current_task()
        semaphore = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout),
                                         read_bufsize=READ_BUFSIZE) as session:
            senders: dict[tuple[str, str], ItemSender] = {}
            for arm, endpoint in self.endpoints.items():
                for kind in ("chat", "completions"):
                    path = "/chat/completions" if kind == "chat" else "/completions"
                    senders[(arm, kind)] = ItemSender(
                        session, api_url=endpoint.base_url + path, model=endpoint.model, endpoint=kind,
                        stream=True, tracer=self.tracer, headers=endpoint.headers, keep_output=True)

            async def one(slot: Slot, run_start: float) -> None:
                content = ItemContent.of(slot.item)
                sender = senders[(slot.arm, "chat" if content.messages is not None else "completions")]
                record = RequestRecord(index=slot.seq, scheduled_ms=slot.offset * 1000.0)
                attributes = {RUN_ATTRIBUTE: str(self.run_id), ITEM_ATTRIBUTE: slot.item["id"],
                              ARM_ATTRIBUTE: slot.arm, REPETITION_ATTRIBUTE: slot.repetition}
                if semaphore is None:
                    await sender.send(record, content, run_start, attributes)
                else:
                    async with semaphore:
                        await sender.send(record, content, run_start, attributes)
                self.finished.put((slot, record, time.time() - (record.e2e_ms or 0) / 1000.0))

            tasks: list[asyncio.Task] = []
            try:
                for phase in sorted({slot.phase for slot in self.slots}):
                    run_start = time.perf_counter()
                    for slot in (s for s in self.slots if s.phase == phase):
                        delay = run_start + slot.offset - time.perf_counter()
                        if self.time_limit is not None and slot.offset > self.time_limit:
                            self.stopped_early = True
                            break
                        if delay > 0:
                            await asyncio.sleep(delay)
                        tasks.append(asyncio.create_task(one(slot, run_start)))
                        if slot.in_order:
                            await tasks[-1]
                    await asyncio.gather(*tasks)  # the next phase starts once every request of this one ended
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise


async def reset_prefix_cache(base_url: str, headers: dict[str, str]) -> str:
    """POST /reset_prefix_cache on the server (vLLM with VLLM_SERVER_DEV_MODE=1); a sentence saying what
    happened (targets without it are left as they are)."""
    root = base_url.removesuffix("/v1")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(root + "/reset_prefix_cache", headers=headers) as response:
                if response.status == 200:
                    return "prefix cache reset"
                return f"prefix cache not reset: {root}/reset_prefix_cache answered {response.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return f"prefix cache not reset: {type(exc).__name__}"
