"""Synthetic request rows for the benchmarks, generated inside ClickHouse (INSERT … SELECT from numbers()).

Millions of rows in seconds: a Python loop or an OTLP export would take minutes and measure
ingest instead of the query under test. The rows look like a mixed fleet: three services, three
models, ~10% on a canary engine config and replica group, prompts of 50-8k tokens, the five
components drawn independently and e2e their sum (the decomposition's identity), 1 in 97 an
error. Their hours are marked touched, as the request builder does, so rollups and SLO buckets
are built from them exactly as from ingested rows.
"""
from __future__ import annotations

import datetime as dt
import time

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


def seed_requests(store, project_id: int, *, rows: int, start: dt.datetime, end: dt.datetime,
                  retention_days: int = 30, ttft_missing_every: int = 0) -> int:
    """`rows` request rows evenly spread over [start, end) (every `ttft_missing_every`-th without a ttft when
    > 0), and the touches of their hours; returns the rows' version."""
    from traces import rollups

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
