"""The one module that talks to ClickHouse: chdb in-process (embedded) or a server over HTTP, with tenant-checked queries."""
from __future__ import annotations

import datetime as dt
import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlparse

import clickhouse_connect
import numpy as np
import orjson
from clickhouse_connect.driver.exceptions import ClickHouseError
from django.conf import settings

log = logging.getLogger(__name__)

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JSON_OUTPUT_SETTINGS = "output_format_json_quote_64bit_integers = 0, output_format_json_quote_denormals = 0"


class StoreUnavailable(Exception):
    """ClickHouse cannot be reached (server down, or the chdb data directory is held by another process)."""


class TenantFilterMissing(ValueError):
    """A query on tenant data was written without the project filter."""


def identifier(name: str) -> str:
    """Quote an identifier that came from an allow-list; refuse anything that is not a plain name."""
    if not _IDENTIFIER.match(name):
        raise ValueError(f"not a valid identifier: {name!r}")
    return f"`{name}`"


class ClickHouseStore:
    """A connection to the trace store: one client per thread.

    A ClickHouse server gets one HTTP client per thread. chdb lets one process open
    a data directory; each client there is a connection (a session of its own) to
    the one embedded server of the process, which runs queries from several
    connections at the same time. So the span writer's inserts, the decomposition's
    queries and API reads no longer wait for each other behind one lock (they did,
    up to ~40% of an ingest run's time).
    """

    def __init__(self, *, url: str | None, chdb_path: str | None, database: str, cluster: str = ""):
        self.url = url
        self.chdb_path = chdb_path
        self.database = database
        self.cluster = cluster
        self.embedded = not url
        identifier(database)
        self._local = threading.local()
        self._chdb_lock = threading.Lock()  # guards the list below
        self._chdb_clients: list[tuple[threading.Thread, Any]] = []  # every embedded client open, by thread
        self._generation = 0  # close() makes every thread's client stale
        self._bootstrapped = False
        # Shutdown: once closing, new calls are refused (StoreUnavailable) and close() waits for the calls
        # in flight: an interpreter that exits, or a chdb closed, under a thread still inside chdb crashes.
        self._calls = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._closing = False

    # -- connections ---------------------------------------------------------------------------
    def _connect(self, database: str | None):
        try:
            if self.embedded:
                return clickhouse_connect.get_client(dsn=f"chdb://{self.chdb_path}")
            parsed = urlparse(self.url)
            options = dict(parse_qsl(parsed.query))
            return clickhouse_connect.get_client(
                host=parsed.hostname or "localhost",
                port=parsed.port or (8443 if parsed.scheme == "https" else 8123),
                username=unquote(parsed.username or "default"),
                password=unquote(parsed.password or ""),
                secure=parsed.scheme == "https",
                database=database or "default",
                connect_timeout=float(options.get("connect_timeout", 5)),
                send_receive_timeout=float(options.get("timeout", 60)),
                autogenerate_session_id=False,
            )
        except Exception as exc:  # the driver raises several types for "cannot connect"
            raise StoreUnavailable(f"ClickHouse unavailable: {exc}") from exc

    def _client(self):
        if self.embedded:
            local = self._local
            client = getattr(local, "client", None)
            if client is None or local.generation != self._generation:
                client = local.client = self._embedded_client()
                local.generation = self._generation
            return client
        client = getattr(self._local, "client", None)
        if client is None:
            if not self._bootstrapped:
                bootstrap = self._connect(None)
                on_cluster = f" ON CLUSTER {identifier(self.cluster)}" if self.cluster else ""
                bootstrap.command(f"CREATE DATABASE IF NOT EXISTS {identifier(self.database)}{on_cluster}")
                bootstrap.close()
                self._bootstrapped = True
            client = self._local.client = self._connect(self.database)
        return client

    def _embedded_client(self):
        """A new chdb connection for the calling thread (closing those of threads that have ended)."""
        with self._chdb_lock:
            current = threading.current_thread()
            alive = []
            for thread, client in self._chdb_clients:
                if thread.is_alive() and thread is not current:
                    alive.append((thread, client))
                else:
                    _close_quietly(client)
            self._chdb_clients = alive
            client = self._connect(None)
            if not self._bootstrapped:
                client.command(f"CREATE DATABASE IF NOT EXISTS {identifier(self.database)}")
                self._bootstrapped = True
            self._chdb_clients.append((current, client))
            return client

    def _run(self, fn):
        with self._calls:
            if self._closing:
                raise StoreUnavailable("ClickHouse store is closing (the platform is shutting down)")
            self._in_flight += 1
        try:
            return self._call(fn)
        finally:
            with self._calls:
                self._in_flight -= 1
                if not self._in_flight:
                    self._calls.notify_all()

    def _call(self, fn):
        try:
            return fn(self._client())
        except StoreUnavailable:
            raise
        except ClickHouseError as exc:
            if _is_connection_error(exc):
                self._drop_client()
                raise StoreUnavailable(str(exc)) from exc
            raise
        except OSError as exc:
            self._drop_client()
            raise StoreUnavailable(str(exc)) from exc

    def _drop_client(self) -> None:
        if not self.embedded:
            client = getattr(self._local, "client", None)
            self._local.client = None
            if client is not None:
                try:
                    client.close()
                except Exception:  # closing a broken connection may fail too; nothing to do
                    pass

    # -- public API ----------------------------------------------------------------------------
    def table(self, name: str) -> str:
        """Fully qualified, quoted name of one of our tables."""
        return f"{identifier(self.database)}.{identifier(name)}"

    def ping(self) -> bool:
        try:
            self._run(lambda c: c.query("SELECT 1"))
            return True
        except StoreUnavailable:
            return False

    def command(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        """DDL and maintenance statements (no tenant data is returned)."""
        return self._run(lambda c: c.command(sql, parameters=parameters))

    def query(self, sql: str, *, project_id: int, parameters: dict[str, Any] | None = None) -> list[tuple]:
        """A query on tenant data. The SQL must filter on `{project_id:UInt32}`; values go as parameters."""
        params = _tenant_parameters(sql, project_id, parameters)
        return self._run(lambda c: c.query(sql, parameters=params).result_rows)

    def tenant_command(self, sql: str, *, project_id: int, parameters: dict[str, Any] | None = None) -> Any:
        """A statement on tenant data that returns no rows (INSERT … SELECT); same tenant rule as query()."""
        params = _tenant_parameters(sql, project_id, parameters)
        return self._run(lambda c: c.command(sql, parameters=params))

    def system_query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[tuple]:
        """Queries on our own bookkeeping tables (migration state, sizes); never on tenant rows."""
        return self._run(lambda c: c.query(sql, parameters=parameters).result_rows)

    def insert_encoded(self, table: str, column_names: Sequence[str], data: bytes, fmt: str,
                       settings: dict[str, Any] | None = None) -> None:
        """Insert rows already encoded in a ClickHouse input format (parsed by ClickHouse, not Python)."""
        if not data:
            return
        identifier(table)
        target = f"{self.database}.{table}"
        self._run(lambda c: c.raw_insert(target, list(column_names), insert_block=data, settings=settings, fmt=fmt))

    def query_json(self, sql: str, *, project_id: int, parameters: dict[str, Any] | None = None) -> list[list]:
        """Like query(), decoding the rows with the C JSON parser: much faster for large results.
        `sql` must not have a SETTINGS clause of its own."""
        params = _tenant_parameters(sql, project_id, parameters)
        # The output settings go in the statement: passed as settings, the embedded (chdb) driver
        # reads system.settings, SETs each one and restores it afterwards, five extra queries per
        # call that cost more than the decomposition's own small queries.
        sql = f"{sql} SETTINGS {_JSON_OUTPUT_SETTINGS}"
        raw = self._run(lambda c: c.raw_query(sql, parameters=params, fmt="JSONCompactEachRow"))
        if not raw:
            return []
        # One orjson call for the whole answer (rows are one JSON array per line, never containing a
        # raw newline) instead of one per row.
        return orjson.loads(b"[" + raw.strip().replace(b"\n", b",") + b"]")

    def query_uint64(self, sql: str, *, project_id: int, parameters: dict[str, Any] | None = None):
        """A one-column UInt64 query on tenant data, as a numpy array (millions of values without a
        Python int each); same tenant rule as query()."""
        params = _tenant_parameters(sql, project_id, parameters)
        raw = self._run(lambda c: c.raw_query(sql, parameters=params, fmt="RowBinary"))
        return np.frombuffer(raw or b"", dtype="<u8")

    def calls_in_flight(self) -> int:
        return self._in_flight

    def shutdown(self, timeout: float) -> bool:
        """Refuse new calls, wait up to `timeout` s for those in flight, then close; False (and nothing
        closed) if some call was still running: the caller must not close chdb under it."""
        deadline = time.monotonic() + timeout
        with self._calls:
            self._closing = True
            while self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._calls.wait(remaining)
        self.close()
        return True

    def close(self) -> None:
        """Close every connection (call it once the threads using the store are done with it)."""
        if self.embedded:
            with self._chdb_lock:
                clients, self._chdb_clients = self._chdb_clients, []
                self._generation += 1
                self._bootstrapped = False
            for _thread, client in clients:
                _close_quietly(client)
            self._local = threading.local()
            return
        self._drop_client()


def _close_quietly(client) -> None:
    try:
        client.close()
    except Exception:  # closing a broken connection may fail too; nothing to do
        log.debug("closing a ClickHouse client failed", exc_info=True)


def utc_naive(t: dt.datetime) -> dt.datetime:
    """A time as a query parameter for a DateTime64 column: in UTC, without its zone (an aware time is converted, a
    naive one is taken to be UTC already)."""
    return t.astimezone(dt.timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def string_set(name: str, values: list) -> tuple[str, Any]:
    """`(sql, parameter)` for `column IN <sql>` with parameters={name: parameter}: the set of these strings.

    Why not always `IN {name:Array(String)}`: ClickHouse parses an array parameter element by element
    as a literal, ~2 µs per element, and the decomposition passes ~5,000 trace ids per query. When no
    string holds a comma or a character needing escapes (ids never do), they go as one String split
    by ClickHouse: ~40% less CPU per query, the same constant set for the primary key and skip
    indexes. Anything else (and the empty set) keeps the array parameter."""
    identifier(name)
    try:
        joined = ",".join(values)
    except TypeError:  # not all strings
        joined = None
    if values and joined is not None and joined.count(",") == len(values) - 1 \
            and not any(c in joined for c in _PLAIN_UNSAFE):
        return f"splitByChar(',', {{{name}:String}})", _ArrayLiteral(joined)
    return f"{{{name}:Array(String)}}", list(values)


def _tenant_parameters(sql: str, project_id: int, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The query's parameters with the project set last (a caller cannot override it); refuses SQL
    that does not filter on `{project_id:UInt32}`."""
    if "{project_id:UInt32}" not in sql:
        raise TenantFilterMissing("tenant queries must filter on project_id = {project_id:UInt32}")
    params = dict(parameters or {})
    params["project_id"] = int(project_id)
    for name, value in params.items():
        if value.__class__ is list and value:
            params[name] = _string_array(value)
    return params


class _ArrayLiteral:
    """A bound value rendered once by us; clickhouse-connect binds objects it does not know by str()."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


# What clickhouse-connect escapes inside a quoted string (binding.must_escape), apart from the quote.
_MUST_ESCAPE = ("\\", "`", "\t", "\n")


def _string_array(values: list):
    """A list of strings as the literal clickhouse-connect would render, `['a', 'b']`, built with one
    join when no element needs escaping. Its own rendering escapes character by character in a
    Python generator (~3 µs per 32-character trace id), which made binding the trace ids of a
    decomposition cycle a visible share of ingest's CPU. Anything else is returned unchanged."""
    try:
        joined = "', '".join(values)
    except TypeError:  # not all strings
        return values
    if joined.count("'") != 2 * (len(values) - 1) or any(c in joined for c in _MUST_ESCAPE):
        return values  # some element holds a character that needs escaping
    return _ArrayLiteral(f"['{joined}']")


# Characters that a String parameter rendered by string_set must not hold (besides its separator):
# what clickhouse-connect would escape (it is bypassed there) and what ClickHouse unescapes.
_PLAIN_UNSAFE = ("\\", "\t", "\n", "\r", "'", "`")


def _is_connection_error(exc: Exception) -> bool:
    text = str(exc)
    return any(
        marker in text
        for marker in (
            "Error initializing EmbeddedServer",
            "Connection refused",
            "Failed to establish",
            "Max retries exceeded",
            "timed out",
            "Connection aborted",
            "RemoteDisconnected",
        )
    )


_store: ClickHouseStore | None = None
_store_lock = threading.Lock()
# Whether this process runs the ingest pipeline (the process runner says so): with chdb, the only process that may
# open the store.
_pipeline_here = False


def set_pipeline_here(here: bool) -> None:
    global _pipeline_here
    _pipeline_here = here


def pipeline_here() -> bool:
    return _pipeline_here


def get_store() -> ClickHouseStore:
    """The process-wide store built from Django settings."""
    global _store
    if _store is None:
        with _store_lock:
            if _store is None:
                _store = ClickHouseStore(
                    url=settings.CLICKHOUSE_URL,
                    chdb_path=settings.CLICKHOUSE_CHDB_PATH,
                    database=settings.CLICKHOUSE_DATABASE,
                    cluster=settings.CLICKHOUSE_CLUSTER,
                )
    return _store


def reset_store() -> None:
    """Close and forget the process-wide store (tests, and after a fork)."""
    global _store
    with _store_lock:
        if _store is not None:
            _store.close()
        _store = None
