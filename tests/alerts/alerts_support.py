"""Support for the alerts tests: a migrated in-process ClickHouse store, seeded request rows, a recording HTTP
receiver, and Django objects (projects, users, SLOs, channels) built the way the platform builds them.

chdb runs one embedded server per process: `open_store()` opens a temporary directory and the returned
`close()` shuts it down again, so later tests in this pytest process may open their own directory.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import http.server
import json
import random
import tempfile
import threading
import time
import uuid

UTC = dt.timezone.utc
REQUEST_COLUMNS = (
    "project_id", "trace_id", "request_key", "request_id", "start_time", "service", "model", "engine_config",
    "prompt_tokens", "completion_tokens", "prompt_bucket", "e2e_ms", "ttft_ms", "engine_ttft_ms", "tpot_ms",
    "network_ms", "network_client_gateway_ms", "network_gateway_engine_ms", "overhead_ms", "queue_ms",
    "prefill_ms", "decode_ms", "hops", "status", "version", "is_deleted", "retention_days", "replica_group",
    "cached_prompt_tokens", "served_from", "lookup_ms",
)


def open_store(path: str | None = None, database: str = "observatory"):
    """A migrated ClickHouseStore on a scratch chdb directory; returns (store, close)."""
    from traces import ch_migrate
    from traces.store import ClickHouseStore

    tmp = None
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="alerts-chdb-")
        path = f"{tmp.name}/chdb"
    store = ClickHouseStore(url=None, chdb_path=path, database=database)
    ch_migrate.apply(store, log=lambda *_: None)

    def close():
        store.close()
        if tmp is not None:
            tmp.cleanup()

    return store, close


@contextlib.contextmanager
def installed_store():
    """A scratch store (open_store) that traces.store.get_store() hands out until the block ends."""
    import traces.store as store_module

    scratch, close = open_store()
    previous, store_module._store = store_module._store, scratch
    try:
        yield scratch
    finally:
        store_module._store = previous
        close()


def request_row(project_id: int, start: dt.datetime, *, service="chat", model="llama-8b", engine_config="cfg-a",
                prompt_tokens=300, completion_tokens=50, prompt_bucket="<1k", network=5.0, overhead=3.0,
                queue=10.0, prefill=40.0, decode=500.0, status="ok", ttft=None, client_gateway=None,
                gateway_engine=None, replica_group="", cached_prompt_tokens=None, served_from="engine",
                lookup_ms=None) -> dict:
    """One decomposed request; e2e and TTFT follow from the components (TTFT = all but decode). A response-cache
    hit (served_from exact_cache | semantic_cache) is decomposed as docs/decomposition.md says: queue, prefill and
    decode 0, the lookup beside the gateway's overhead (give those components yourself)."""
    lookup = lookup_ms or 0.0
    e2e = network + lookup + overhead + queue + prefill + decode
    ttft = network + lookup + overhead + queue + prefill if ttft is None else ttft
    return {
        "project_id": project_id, "trace_id": uuid.uuid4().hex, "request_key": uuid.uuid4().hex[:16],
        "request_id": "", "start_time": start.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f"),
        "service": service, "model": model, "engine_config": engine_config, "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "prompt_bucket": prompt_bucket, "e2e_ms": e2e, "ttft_ms": ttft,
        "engine_ttft_ms": ttft - network if served_from == "engine" else None,
        "tpot_ms": decode / max(completion_tokens - 1, 1), "network_ms": network,
        "network_client_gateway_ms": client_gateway, "network_gateway_engine_ms": gateway_engine,
        "overhead_ms": overhead, "queue_ms": queue, "prefill_ms": prefill, "decode_ms": decode, "hops": "[]",
        "status": status, "version": 1, "is_deleted": 0, "retention_days": 30, "replica_group": replica_group,
        "cached_prompt_tokens": cached_prompt_tokens, "served_from": served_from, "lookup_ms": lookup_ms,
    }


def insert_requests(store, rows: list[dict]) -> None:
    lines = "\n".join(json.dumps([row[c] for c in REQUEST_COLUMNS]) for row in rows)
    store.insert_encoded("llm_requests", REQUEST_COLUMNS, lines.encode(), "JSONCompactEachRow")


def insert_touched(store, rows: list[dict]) -> None:
    """insert_requests, then record the rows' hours in request_hour_touches as the request builder does, so that
    SLO evaluation builds their hours into buckets once closed."""
    from traces.rollups import record_touches

    insert_requests(store, rows)
    for project_id in {row["project_id"] for row in rows}:
        hours = {int(dt.datetime.strptime(row["start_time"], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp())
                 // 3600 * 3600 for row in rows if row["project_id"] == project_id}
        record_touches(store, project_id, hours, time.time_ns())


def spread(project_id: int, since: dt.datetime, until: dt.datetime, n: int, seed: int = 1, **kwargs) -> list[dict]:
    """`n` requests evenly spread over [since, until), with ±10% jitter on each component."""
    rng = random.Random(seed)
    step = (until - since) / n
    rows = []
    for i in range(n):
        jittered = {k: (v * rng.uniform(0.9, 1.1) if isinstance(v, float) and k in (
            "network", "overhead", "queue", "prefill", "decode") else v) for k, v in kwargs.items()}
        rows.append(request_row(project_id, since + step * i, **jittered))
    return rows


class Receiver:
    """A real HTTP server on 127.0.0.1 recording every POST (headers and JSON body); answers 200."""

    def __init__(self):
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive with Content-Length, as most webhook receivers answer

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    receiver.requests.append({"headers": {k.lower(): v for k, v in self.headers.items()},
                                              "body": json.loads(body or b"null"), "path": self.path,
                                              "at": time.time()})
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def bodies(self) -> list[dict]:
        with self.lock:
            return [r["body"] for r in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def parse_metrics(text: str) -> dict[str, dict[frozenset, float]]:
    """Prometheus text format → {sample name: {frozenset of label items: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, dict[frozenset, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return samples


def scrape_metrics(base_url: str) -> dict[str, dict[frozenset, float]]:
    """A live platform's /metrics (no token), parsed by parse_metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        return parse_metrics(response.read().decode())


# -- server mode: a fresh PostgreSQL database shared by several platform processes --------------------------------
def server_mode_urls() -> tuple[str, str] | None:
    """(DATABASE_URL, CELERY_BROKER_URL) when the suite runs in server mode with a real broker, else None."""
    import os

    database = os.environ.get("DATABASE_URL", "")
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if not database.startswith(("postgres://", "postgresql://")) or not broker.startswith(("redis://", "amqp://")):
        return None
    return database, broker


def create_database(admin_url: str) -> str:
    """A new empty PostgreSQL database next to `admin_url`'s; returns its URL."""
    from urllib.parse import urlparse, urlunparse

    import psycopg

    name = f"observatory_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunparse(urlparse(admin_url)._replace(path=f"/{name}"))


def drop_database(admin_url: str, db_url: str) -> None:
    from urllib.parse import urlparse

    import psycopg

    name = urlparse(db_url).path.lstrip("/")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def sql(db_url: str, query: str, *params) -> list[tuple]:
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()
