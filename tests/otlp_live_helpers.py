"""Client-side helpers for tests against a live platform: OTLP over HTTP (protobuf/JSON) and gRPC, the
JSON API, /metrics, a process that holds the chdb directory (ClickHouse unavailable), and raw span
counts read from the chdb directory of a stopped platform.

Importable from any test module (tests/ is on sys.path through tests/conftest.py).
"""
from __future__ import annotations

import base64
import datetime as dt
import gzip
import http.client
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.parse
import uuid
from urllib.parse import urlparse, urlunparse

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_ID_FIELDS = {"traceId", "spanId", "parentSpanId"}


# -- encodings -------------------------------------------------------------------------------------
def to_otlp_json(request: ExportTraceServiceRequest | bytes) -> bytes:
    """The OTLP/JSON form of an export request (hex ids, integer enums, camelCase keys)."""
    if isinstance(request, bytes):
        parsed = ExportTraceServiceRequest()
        parsed.ParseFromString(request)
        request = parsed
    document = MessageToDict(request, use_integers_for_enums=True)

    def fix(node):
        if isinstance(node, dict):
            for key, value in list(node.items()):
                if key in _ID_FIELDS and isinstance(value, str):
                    node[key] = base64.b64decode(value).hex()
                else:
                    fix(value)
        elif isinstance(node, list):
            for item in node:
                fix(item)

    fix(document)
    return json.dumps(document).encode()


# -- sending ---------------------------------------------------------------------------------------
def post_traces(process, key: str, body: bytes, *, as_json: bool = False, gzipped: bool = False):
    """POST /v1/traces; returns (status, headers, body)."""
    headers = {
        "Content-Type": "application/json" if as_json else "application/x-protobuf",
        "Authorization": f"Bearer {key}",
    }
    if gzipped:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return process.post("/v1/traces", body, headers)


def grpc_export(target: str, key: str, body: bytes, timeout: float = 30):
    """TraceService/Export over gRPC with raw bytes; returns (grpc.StatusCode, trailing metadata dict)."""
    import grpc

    with grpc.insecure_channel(target) as channel:
        export = channel.unary_unary(EXPORT_METHOD, request_serializer=None, response_deserializer=None)
        try:
            _, call = export.with_call(body, metadata=(("authorization", f"Bearer {key}"),), timeout=timeout)
            return call.code(), dict(call.trailing_metadata() or ())
        except grpc.RpcError as exc:
            return exc.code(), dict(exc.trailing_metadata() or ())


# -- reading back ----------------------------------------------------------------------------------
def requests_for(process, token: str, trace_id: str) -> list[dict]:
    status, body = process.get(f"/api/v1/requests?trace_id={trace_id}", token)
    assert status == 200, body
    return body["requests"]


def summary_total(process, token: str, hours: float = 48) -> int:
    """Request rows counted by /api/v1/latency/summary over the last `hours` (no grouping)."""
    now = dt.datetime.now(dt.timezone.utc)
    params = urllib.parse.urlencode({
        "group_by": "",
        "since": (now - dt.timedelta(hours=hours)).isoformat().replace("+00:00", "Z"),
        "until": (now + dt.timedelta(hours=1)).isoformat().replace("+00:00", "Z"),
    })
    status, body = process.get(f"/api/v1/latency/summary?{params}", token)
    assert status == 200, body
    return sum(group["count"] for group in body["groups"])


def readyz(process) -> dict:
    _, body = process.get("/readyz")
    return body


def metrics_text(process) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", process.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` (optionally with a label substring) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{", 1)[0]
        if metric == name and labels in head:
            total += float(value)
    return total


def wait_for(predicate, timeout: float, interval: float = 0.05, message: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(message or "condition not met")


# -- ClickHouse unavailable: another process holds the chdb directory ---------------------------
_HOLDER = textwrap.dedent("""
    import sys, time
    import clickhouse_connect
    client = clickhouse_connect.get_client(dsn="chdb://" + sys.argv[1])
    client.query("SELECT 1")
    print("HOLDING", flush=True)
    while True:
        time.sleep(60)
""")


class ChdbHolder:
    """Opens a chdb data directory in a helper process and keeps it: in embedded mode the platform then
    cannot open its trace store (chdb allows one process per directory) and sees StoreUnavailable."""

    def __init__(self, chdb_path: str):
        self.chdb_path = str(chdb_path)
        self.proc: subprocess.Popen | None = None

    def acquire(self, timeout: float = 60) -> "ChdbHolder":
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, self.chdb_path], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "HOLDING" not in line:
            self.proc.kill()
            raise RuntimeError(f"could not hold {self.chdb_path}: {line} {self.proc.stderr.read()[-2000:]}")
        return self

    def release(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


# -- raw span counts (the platform must be stopped: it owns the chdb directory while it runs) ------
def stored_span_counts(chdb_path: str, trace_ids: list[str], database: str = "observatory") -> dict[str, int]:
    """{'distinct': distinct (trace, span) pairs, 'final': rows after FINAL} for these traces in `spans`."""
    code = textwrap.dedent(f"""
        import json, sys
        import clickhouse_connect
        client = clickhouse_connect.get_client(dsn="chdb://" + sys.argv[1])
        traces = json.loads(sys.stdin.read())
        table = "`{database}`.`spans`"
        distinct = client.query(
            f"SELECT uniqExact(trace_id, span_id) FROM {{table}} WHERE trace_id IN {{{{t:Array(String)}}}}",
            parameters={{"t": traces}}).result_rows[0][0]
        final = client.query(
            f"SELECT count() FROM {{table}} FINAL WHERE trace_id IN {{{{t:Array(String)}}}}",
            parameters={{"t": traces}}).result_rows[0][0]
        print(json.dumps({{"distinct": distinct, "final": final}}))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(chdb_path)], input=json.dumps(trace_ids),
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def stored_trace_totals(chdb_path: str, acked: list[str], database: str = "observatory") -> dict[str, int]:
    """What a stopped platform's store holds, against the trace ids it acknowledged: span rows (distinct and
    after FINAL), traces with spans (all, and among `acked`), live request rows, their distinct traces, and
    those complete (client → gateway → engine, every component known). Per-trace figures are read out and
    compared here (an IN over hundreds of thousands of ids would be checked row by row)."""
    code = textwrap.dedent(f"""
        import json, sys
        import clickhouse_connect
        client = clickhouse_connect.get_client(dsn="chdb://" + sys.argv[1])
        db = "`{database}`"
        spans = client.query(f"SELECT trace_id, uniqExact(span_id) FROM {{db}}.spans GROUP BY trace_id").result_rows
        final = client.query(f"SELECT count() FROM {{db}}.spans FINAL").result_rows[0][0]
        requests = client.query(
            f"SELECT trace_id, count(), countIf(length(JSONExtractArrayRaw(hops)) = 3 AND network_ms IS NOT NULL "
            f"AND overhead_ms IS NOT NULL AND queue_ms IS NOT NULL AND prefill_ms IS NOT NULL "
            f"AND decode_ms IS NOT NULL) FROM {{db}}.llm_requests FINAL WHERE is_deleted = 0 GROUP BY trace_id"
        ).result_rows
        print(json.dumps({{"spans": spans, "final": final, "requests": requests}}))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(chdb_path)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    stored = json.loads(out.stdout.strip().splitlines()[-1])
    wanted = set(acked)
    span_traces = {trace_id for trace_id, _ in stored["spans"]}
    return {
        "spans": sum(n for _, n in stored["spans"]),
        "span_traces": len(span_traces),
        "span_traces_acked": len(span_traces & wanted),
        "spans_final": stored["final"],
        "requests": sum(n for _, n, _ in stored["requests"]),
        "request_traces": len({trace_id for trace_id, _, _ in stored["requests"]}),
        "requests_complete": sum(c for trace_id, _, c in stored["requests"] if trace_id in wanted),
    }


def assert_stored_exactly_once(chdb_path: str, acked: list[str], spans_per_trace: int = 3) -> dict[str, int]:
    """Every acknowledged trace is stored once, with its one complete request row, and nothing else is."""
    totals = stored_trace_totals(chdb_path, acked)
    n = len(set(acked))
    assert len(acked) == n, "the same trace was acknowledged twice"
    expected = {"spans": spans_per_trace * n, "span_traces": n, "span_traces_acked": n,
                "spans_final": spans_per_trace * n, "requests": n, "request_traces": n, "requests_complete": n}
    assert totals == expected, totals
    return totals


def _server_mode_database() -> tuple[str, str] | None:
    """(admin URL, URL of a new empty database) when the suite runs against PostgreSQL."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        return None
    import psycopg

    name = f"observatory_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parsed = urlparse(url)
    return url, urlunparse(parsed._replace(path=f"/{name}"))


def _drop_database(admin_url: str, db_url: str) -> None:
    import psycopg

    name = urlparse(db_url).path.lstrip("/")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
