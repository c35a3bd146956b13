"""Synthetic request rows for the benchmarks, generated inside ClickHouse (INSERT … SELECT from numbers()).

Millions of rows in seconds: a Python loop or an OTLP export would take minutes and measure
ingest instead of the query under test. The rows look like a mixed fleet: three services, three
models, ~10% on a canary engine config and replica group, prompts of 50-8k tokens, the five
components drawn independently and e2e their sum (the decomposition's identity), 1 in 97 an
error. Their hours are marked touched, as the request builder does, so rollups and SLO buckets
are built from them exactly as from ingested rows.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import time

from traces import rollups

_INSERT = (
    "INSERT INTO {table} (project_id, trace_id, request_key, request_id, start_time, service, model, engine_config, "
    "replica_group, prompt_tokens, completion_tokens, prompt_bucket, e2e_ms, ttft_ms, engine_ttft_ms, tpot_ms, "
    "network_ms, overhead_ms, queue_ms, prefill_ms, decode_ms, hops, status, version, is_deleted, retention_days) "
    "SELECT {{project_id:UInt32}}, lower(hex(sipHash128(number))), lower(hex(sipHash64(number))), '', "
    "fromUnixTimestamp64Micro(toInt64({{start_us:Int64}} + number * {{step_us:Int64}})), "
    "['chat-app', 'agent', 'batch'][number % 3 + 1], "
    "['meta-llama/Llama-3.1-8B-Instruct', 'meta-llama/Llama-3.1-70B-Instruct', "
    " 'Qwen/Qwen2.5-32B-Instruct'][number % 7 % 3 + 1], "
    "['baseline', 'canary'][number % 10 = 0 ? 2 : 1], ['stable', 'canary'][number % 10 = 0 ? 2 : 1], "
    "toUInt32(p), toUInt32(c), multiIf(p < 256, '<256', p < 1024, '<1k', p < 4096, '<4k', p < 16384, '<16k', '>=16k'), "
    "net + ovh + q + pre + dec, "
    "if({{ttft_missing_every:UInt32}} > 0 AND number % {{ttft_missing_every:UInt32}} = 0, NULL, net + ovh / 2 + q + pre), "
    "q + pre, dec / greatest(c - 1, 1), net, ovh, q, pre, dec, '[]', if(number % 97 = 0, 'error', 'ok'), "
    "{{version:UInt64}}, 0, {{retention:UInt16}} "
    "FROM (SELECT number, 50 + sipHash64(number, 1) % 8000 AS p, 16 + sipHash64(number, 2) % 600 AS c, "
    "      1 + sipHash64(number, 3) % 2000 / 100 AS net, 2 + sipHash64(number, 4) % 1000 / 100 AS ovh, "
    "      sipHash64(number, 5) % 20000 / 100 AS q, p / 40 AS pre, c * (8 + sipHash64(number, 6) % 2000 / 100) AS dec "
    "      FROM numbers({{rows:UInt64}}))"
)


@contextlib.contextmanager
def platform_store(data_dir: str, project_name: str):
    """`(store, project_id)` of a platform's data directory, opened in this process while the platform is
    not running (chdb lets one process open it) and closed on leaving; the ClickHouse schema is migrated."""
    os.environ["OBSERVATORY_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "observatory.settings")
    import django

    django.setup()
    from tenancy.models import Project

    from traces import ch_migrate
    from traces.store import get_store, reset_store

    store = get_store()
    try:
        ch_migrate.apply(store, log=lambda *_: None)
        yield store, Project.objects.get(name=project_name).id
    finally:
        reset_store()


def seed_requests(store, project_id: int, *, rows: int, start: dt.datetime, end: dt.datetime,
                  retention_days: int = 30, ttft_missing_every: int = 0) -> int:
    """`rows` request rows evenly spread over [start, end) (every `ttft_missing_every`-th without a ttft when
    > 0), and the touches of their hours; returns the rows' version."""
    step_us = int((end - start).total_seconds() * 1e6 / rows)
    version = time.time_ns()
    store.tenant_command(
        _INSERT.format(table=store.table("llm_requests")),
        project_id=project_id,
        parameters={"start_us": int(start.timestamp() * 1e6), "step_us": step_us, "rows": rows, "version": version,
                    "retention": retention_days, "ttft_missing_every": ttft_missing_every},
    )
    first_hour = start.replace(minute=0, second=0, microsecond=0)
    hours = set()
    hour = first_hour
    while hour < end:
        hours.add(int(hour.timestamp()))
        hour += dt.timedelta(hours=1)
    rollups.record_touches(store, project_id, hours, version)
    return version


_SPANS_INSERT = (
    "INSERT INTO {table} (project_id, trace_id, span_id, parent_span_id, start_time, end_time, name, kind, "
    "service_name, attributes, llm_convention, retention_days) "
    "SELECT {{project_id:UInt32}}, lower(hex(sipHash128(intDiv(number, 3)))), lower(hex(sipHash64(number))), "
    "if(number % 3 = 0, '', lower(hex(sipHash64(number - 1)))), "
    "fromUnixTimestamp64Nano(toInt64({{start_ns:Int64}} + intDiv(number, 3) * {{step_ns:Int64}} + number % 3 * 2000000)), "
    "fromUnixTimestamp64Nano(toInt64({{start_ns:Int64}} + intDiv(number, 3) * {{step_ns:Int64}} + 900000000 - number % 3 * 2000000)), "
    "['chat meta-llama/Llama-3.1-8B-Instruct', 'chat meta-llama/Llama-3.1-8B-Instruct', 'llm_request'][number % 3 + 1], "
    "[3, 2, 2][number % 3 + 1], ['chat-app', 'llm-gateway', 'vllm'][number % 3 + 1], "
    "map('gen_ai.request.model', 'meta-llama/Llama-3.1-8B-Instruct', 'gen_ai.usage.input_tokens', toString(sipHash64(number) % 8000)), "
    "['genai', 'genai', 'vllm'][number % 3 + 1], {{retention:UInt16}} "
    "FROM numbers({{first:UInt64}}, {{rows:UInt64}})"
)


def seed_spans(store, project_id: int, *, traces: int, start: dt.datetime, end: dt.datetime,
               retention_days: int = 30) -> None:
    """`traces` stored client → gateway → engine traces (3 spans each) spread over [start, end), with one
    request row each, as a store that has been ingesting for a while holds: what the ingest benchmark's
    `--preload` puts in front of the spans it then sends, so that lookups by trace id pay for a full store."""
    step_ns = int((end - start).total_seconds() * 1e9 / traces)
    for first in range(0, traces, 1_000_000):  # bounded memory per INSERT … SELECT
        count = min(1_000_000, traces - first)
        store.tenant_command(
            _SPANS_INSERT.format(table=store.table("spans")),
            project_id=project_id,
            parameters={"start_ns": int(start.timestamp() * 1e9), "step_ns": step_ns, "first": first * 3,
                        "rows": count * 3, "retention": retention_days},
        )
    seed_requests(store, project_id, rows=traces, start=start, end=end, retention_days=retention_days)
