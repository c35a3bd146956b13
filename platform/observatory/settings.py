"""All settings, read from the environment: embedded mode by default, server mode when service URLs are set."""
from __future__ import annotations

import os
import secrets as _secrets  # stdlib; aliased so nothing here looks like a module of ours
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlparse

BASE_DIR = Path(__file__).resolve().parent.parent.parent  # the repository root


def env(name: str, default: str | None = None) -> str | None:
    """A setting from NAME, or from the file named by NAME_FILE (for Docker/K8s secrets)."""
    file_name = os.environ.get(f"{name}_FILE")
    if file_name:
        return Path(file_name).read_text().strip()
    return os.environ.get(name, default)


def envbool(name: str, default: bool) -> bool:
    value = env(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def envint(name: str, default: int) -> int:
    value = env(name)
    return default if value in (None, "") else int(value)


def envfloat(name: str, default: float) -> float:
    value = env(name)
    return default if value in (None, "") else float(value)


def envchoice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env(name) or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: one of {', '.join(choices)}")
    return value


DATA_DIR = Path(env("OBSERVATORY_DATA_DIR", str(BASE_DIR / ".data"))).resolve()


def _secret_key() -> str:
    configured = env("SECRET_KEY")
    if configured:
        return configured
    # Embedded mode: a key generated once and kept beside the data, so sessions survive restarts.
    path = DATA_DIR / "secret_key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_secrets.token_urlsafe(48))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = envbool("DEBUG", False)
ALLOWED_HOSTS = [h.strip() for h in (env("ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]") or "").split(",") if h.strip()]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "tenancy",
    "ingest",
    "traces",
    "slo",
    "alerts",
    "notify",
    "regressions",
    "tuning",
    "rollouts",
    "loops",
    "observatory",
    # The web dashboard (top-level dashboards/): server-rendered pages over the same data and roles as the API.
    "dashboards",
    # Login throttling (docs/api.md, "Throttling"); its tables hold the failed attempts and lockouts.
    "axes",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Compresses what goes out (pages, API answers, the static files below), when the client accepts it.
    "django.middleware.gzip.GZipMiddleware",
    # The dashboard's static files, straight from the apps' static directories (no collectstatic step).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "observatory.middleware.ApiMethods",
    # Last, as django-axes asks: it answers the locked-out login attempts.
    "axes.middleware.AxesMiddleware",
]
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]

ROOT_URLCONF = "observatory.urls"
WSGI_APPLICATION = "observatory.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


# SQLite (embedded mode): WAL so readers never wait for the writer; a busy timeout so writers wait their turn;
# and transactions that take the write lock when they begin (BEGIN IMMEDIATE). A deferred transaction that read
# first and then writes fails at once with "database is locked" when another connection wrote in between (the
# busy timeout does not apply to that upgrade); several worker threads (regression runs, rollouts' beat, tuning
# trials, ingest) write the same file, so every transaction starts as a writer and waits instead.
SQLITE_OPTIONS = {"timeout": 20, "init_command": "PRAGMA journal_mode=WAL;", "transaction_mode": "IMMEDIATE"}


def database_from_url(url: str) -> dict:
    """DATABASE_URL → Django DATABASES entry (postgres:// or postgresql://, sqlite:///path)."""
    parsed = urlparse(url)
    if parsed.scheme in {"postgres", "postgresql", "pgsql"}:
        options = dict(parse_qsl(parsed.query))
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parsed.path.lstrip("/")) or "postgres",
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            "CONN_MAX_AGE": envint("DATABASE_CONN_MAX_AGE", 60),
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": options,
        }
    if parsed.scheme == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": unquote(parsed.path) or ":memory:",
                "OPTIONS": dict(SQLITE_OPTIONS)}
    raise ValueError(f"DATABASE_URL: unsupported scheme {parsed.scheme!r} (use postgresql:// or sqlite:///)")


DATABASE_URL = env("DATABASE_URL")
if DATABASE_URL:
    DATABASES = {"default": database_from_url(DATABASE_URL)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(DATA_DIR / "observatory.sqlite3"),
            "OPTIONS": dict(SQLITE_OPTIONS),
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# ClickHouse: a server over HTTP when CLICKHOUSE_URL is set, else chdb in this process.
CLICKHOUSE_URL = env("CLICKHOUSE_URL")
CLICKHOUSE_DATABASE = env("CLICKHOUSE_DATABASE", "observatory")
CLICKHOUSE_CHDB_PATH = env("CLICKHOUSE_CHDB_PATH", str(DATA_DIR / "chdb"))
CLICKHOUSE_CLUSTER = env("CLICKHOUSE_CLUSTER", "") or ""
CLICKHOUSE_RETENTION_DAYS = envint("CLICKHOUSE_RETENTION_DAYS", 30)
EMBEDDED_MODE = not CLICKHOUSE_URL

# Ingest limits and the durable spool between the receivers and ClickHouse.
INGEST = {
    "MAX_BODY_BYTES": envint("INGEST_MAX_BODY_BYTES", 16 * 1024 * 1024),
    "MAX_DECOMPRESSED_BYTES": envint("INGEST_MAX_DECOMPRESSED_BYTES", 64 * 1024 * 1024),
    "MAX_ATTRIBUTES_PER_SPAN": envint("INGEST_MAX_ATTRIBUTES_PER_SPAN", 256),
    "MAX_ATTRIBUTE_VALUE_BYTES": envint("INGEST_MAX_ATTRIBUTE_VALUE_BYTES", 16 * 1024),
    "MAX_EVENTS_PER_SPAN": envint("INGEST_MAX_EVENTS_PER_SPAN", 128),
    "MAX_SPAN_AGE_SECONDS": envint("INGEST_MAX_SPAN_AGE_SECONDS", 7 * 24 * 3600),
    "MAX_SPAN_FUTURE_SECONDS": envint("INGEST_MAX_SPAN_FUTURE_SECONDS", 3600),
    "MAX_SPAN_DURATION_SECONDS": envint("INGEST_MAX_SPAN_DURATION_SECONDS", 24 * 3600),
    # The C fast path of protobuf decoding (ingest/_otlp_fast.c), when it is built; false: Python only.
    "FAST_DECODER": envbool("INGEST_FAST_DECODER", True),
    "SPOOL_DIR": env("INGEST_SPOOL_DIR", str(DATA_DIR / "spool")),
    "SPOOL_MAX_BYTES": envint("INGEST_SPOOL_MAX_BYTES", 2 * 1024 * 1024 * 1024),
    "SPOOL_SEGMENT_BYTES": envint("INGEST_SPOOL_SEGMENT_BYTES", 64 * 1024 * 1024),
    "SPOOL_FSYNC": envbool("INGEST_SPOOL_FSYNC", True),
    "WRITER_BATCH_SPANS": envint("INGEST_WRITER_BATCH_SPANS", 40000),
    "WRITER_MAX_DELAY_SECONDS": envfloat("INGEST_WRITER_MAX_DELAY_SECONDS", 0.5),
    "DECOMPOSE_INTERVAL_SECONDS": envfloat("INGEST_DECOMPOSE_INTERVAL_SECONDS", 0.5),
    # How long the decomposition remembers which traces it wrote (traces/trace_filter.py): a trace it
    # has not seen in that window is new to the store and needs no lookup. Only for the one process
    # writing the store: embedded mode always is; in server mode set it when a single platform process
    # ingests. 0: every trace is looked up in ClickHouse (exact whatever the delay between spans).
    "TRACE_WINDOW_SECONDS": envfloat("INGEST_TRACE_WINDOW_SECONDS", 3600.0 if EMBEDDED_MODE else 0.0),
    "RETRY_AFTER_SECONDS": envint("INGEST_RETRY_AFTER_SECONDS", 5),
    # Backpressure (ingest/backpressure.py): exports get 503 / UNAVAILABLE while the data accepted but not
    # yet queryable is beyond either bound (0: no bound), except during a ClickHouse outage (then only the
    # spool's own bound applies).
    "BACKLOG_MAX_BYTES": envint("INGEST_BACKLOG_MAX_BYTES", 256 * 1024 * 1024),
    "BACKLOG_MAX_SECONDS": envfloat("INGEST_BACKLOG_MAX_SECONDS", 30.0),
    # The decomposition's backlog (traces/backlog.py): the writer waits while this many traces wait.
    "DECOMPOSE_MAX_PENDING_TRACES": envint("INGEST_DECOMPOSE_MAX_PENDING_TRACES", 50_000),
    # Traces per decomposition step; a step is the unit between checkpoints and the point where a stop lands.
    "DECOMPOSE_CHUNK_TRACES": envint("INGEST_DECOMPOSE_CHUNK_TRACES", 5000),
    # Spool records kept in memory for the writer (as spooled bytes; their in-memory memos add ~30%).
    "SPOOL_CACHE_BYTES": envint("INGEST_SPOOL_CACHE_BYTES", 256 * 1024 * 1024),
    "ROLLUP_INTERVAL_SECONDS": envfloat("ROLLUP_INTERVAL_SECONDS", 30.0),
    "ROLLUP_SETTLE_SECONDS": envfloat("ROLLUP_SETTLE_SECONDS", 120.0),
    "KEY_CACHE_SECONDS": envfloat("INGEST_KEY_CACHE_SECONDS", 30.0),
}
DATA_UPLOAD_MAX_MEMORY_SIZE = INGEST["MAX_BODY_BYTES"]

HTTP_BIND = env("OBSERVATORY_HTTP_BIND", "127.0.0.1:8000")
HTTP_THREADS = envint("OBSERVATORY_HTTP_THREADS", 8)
# The web port's server (observatory/http_server.py): connections are held by an event loop, requests run
# on HTTP_THREADS threads once their body has arrived.
HTTP = {
    "MAX_CONNECTIONS": envint("OBSERVATORY_HTTP_MAX_CONNECTIONS", 10_000),
    "HEADER_TIMEOUT_SECONDS": envfloat("OBSERVATORY_HTTP_HEADER_TIMEOUT_SECONDS", 10.0),
    "MAX_HEADER_BYTES": envint("OBSERVATORY_HTTP_MAX_HEADER_BYTES", 64 * 1024),
    "KEEPALIVE_SECONDS": envfloat("OBSERVATORY_HTTP_KEEPALIVE_SECONDS", 75.0),
    "BODY_TIMEOUT_SECONDS": envfloat("OBSERVATORY_HTTP_BODY_TIMEOUT_SECONDS", 60.0),
}
# SIGTERM (observatory/serve.py): bodies still arriving get DRAIN_SECONDS, the writer and decomposition go on
# that long, then everything stops at its next boundary; the process is gone within TIMEOUT_SECONDS.
SHUTDOWN = {
    "DRAIN_SECONDS": envfloat("OBSERVATORY_SHUTDOWN_DRAIN_SECONDS", 4.0),
    "TIMEOUT_SECONDS": envfloat("OBSERVATORY_SHUTDOWN_TIMEOUT_SECONDS", 15.0),
}
OTLP_GRPC_BIND = env("OBSERVATORY_OTLP_GRPC_BIND", "127.0.0.1:4317")
OTLP_GRPC_ENABLED = envbool("OBSERVATORY_OTLP_GRPC_ENABLED", True)

# Celery: Redis/RabbitMQ in server mode; a broker on the local filesystem in embedded mode.
CELERY_BROKER_URL = env("CELERY_BROKER_URL", "") or "filesystem://"
_fs_broker = DATA_DIR / "celery-broker"
CELERY_BROKER_TRANSPORT_OPTIONS = (
    {
        "data_folder_in": str(_fs_broker / "out"),
        "data_folder_out": str(_fs_broker / "out"),
        "processed_folder": str(_fs_broker / "processed"),
        # Broadcast/pidbox exchanges; kombu's default is ./control in the working directory.
        "control_folder": str(_fs_broker / "control"),
        "store_processed": False,
    }
    if CELERY_BROKER_URL == "filesystem://"
    else {}
)
CELERY_RESULT_BACKEND = env("CELERY_RESULT_BACKEND") or None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", False)
# Unset: queues namespaced by the metadata database when the broker is shared (observatory/celery_app.py).
CELERY_QUEUE_PREFIX = env("CELERY_QUEUE_PREFIX")
# The Celery worker (thread pool) and beat inside `runplatform`: on by default when ClickHouse is chdb, whose
# data directory only that process may open (docs/slo.md).
OBSERVATORY_INPROCESS_WORKER = envbool("OBSERVATORY_INPROCESS_WORKER", EMBEDDED_MODE)
OBSERVATORY_INPROCESS_WORKER_THREADS = envint("OBSERVATORY_INPROCESS_WORKER_THREADS", 4)
# host:port where a standalone `celery worker` serves its own Prometheus /metrics (delivery counters, attempt
# durations: what that worker sent); empty = none. Use with `--pool threads` (a prefork pool's children keep
# their counters to themselves).
OBSERVATORY_WORKER_METRICS_BIND = env("OBSERVATORY_WORKER_METRICS_BIND", "")
# Per-SLO series on /metrics (objective, state, budget, burn rates; labelled with project and SLO names, and
# /metrics has no token): false leaves them out (docs/slo.md#prometheus-metrics).
OBSERVATORY_METRICS_SLO_SERIES = envbool("OBSERVATORY_METRICS_SLO_SERIES", True)

# SLO evaluation (platform/slo, docs/slo.md).
SLO = {
    # Beat interval of slo.evaluate_all. Each cycle evaluates the second it runs at (windows end now), so a 14.4×
    # page tier trips at most this long after the requests that make it burn have arrived (docs/alerts.md, "From
    # the first bad request to the page").
    "EVALUATE_INTERVAL_SECONDS": envfloat("SLO_EVALUATE_INTERVAL_SECONDS", 5.0),
    "SETTLE_SECONDS": envfloat("SLO_SETTLE_SECONDS", 120.0),
    "BUILD_BUDGET_SECONDS": envfloat("SLO_BUILD_BUDGET_SECONDS", 20.0),
    "STATUS_RETENTION_DAYS": envint("SLO_STATUS_RETENTION_DAYS", 90),
}

# Golden datasets and regression runs (platform/regressions, docs/regressions.md).
REGRESSIONS = {
    # Seconds without a heartbeat after which a running run is taken to have lost its worker and is resumed.
    "STALE_SECONDS": envfloat("REGRESSIONS_STALE_SECONDS", 60.0),
    # A queued run not taken by a worker within this many seconds is enqueued again by the sweep.
    "QUEUED_GRACE_SECONDS": envfloat("REGRESSIONS_QUEUED_GRACE_SECONDS", 30.0),
    "SWEEP_INTERVAL_SECONDS": envfloat("REGRESSIONS_SWEEP_INTERVAL_SECONDS", 15.0),
    # How long the analysis waits for the decomposed rows of the last requests (usually ~1 s).
    "ROW_WAIT_SECONDS": envfloat("REGRESSIONS_ROW_WAIT_SECONDS", 30.0),
    # A target whose requests show no engine figures this long into that wait is taken as untraced.
    "UNTRACED_GRACE_SECONDS": envfloat("REGRESSIONS_UNTRACED_GRACE_SECONDS", 5.0),
    "MAX_REQUESTS": envint("REGRESSIONS_MAX_REQUESTS", 200_000),
    # How long a starting (or resumed) run waits for its target to answer before it ends in error.
    "TARGET_WAIT_SECONDS": envfloat("REGRESSIONS_TARGET_WAIT_SECONDS", 60.0),
    # The managed fleet's gateway for group targets (default: from the fleet file, as `manage.py engine`).
    "GATEWAY_URL": env("REGRESSIONS_GATEWAY_URL", ""),
    # Where a run's client spans go (OTLP/HTTP /v1/traces of this platform); default: the web port
    # (OBSERVATORY_HTTP_BIND, or what runplatform serves on). Workers in other processes need it in server mode.
    "OTLP_ENDPOINT": env("REGRESSIONS_OTLP_ENDPOINT", ""),
    "OTLP_GRPC_ENDPOINT": env("REGRESSIONS_OTLP_GRPC_ENDPOINT", ""),  # host:port for real vLLM config replicas
}

# Tuning studies (platform/tuning, docs/tuning.md).
TUNING = {
    # Seconds without a heartbeat after which a study's worker is taken as gone and the study resumed.
    "STALE_SECONDS": envfloat("TUNING_STALE_SECONDS", 60.0),
    "QUEUED_GRACE_SECONDS": envfloat("TUNING_QUEUED_GRACE_SECONDS", 30.0),
    "SWEEP_INTERVAL_SECONDS": envfloat("TUNING_SWEEP_INTERVAL_SECONDS", 15.0),
    "MAX_TRIALS": envint("TUNING_MAX_TRIALS", 1000),
    # Workers that run one study's trials at once (Celery tasks `tuning.trials` beside the study's own): in
    # embedded mode the in-process worker's threads share one interpreter, so 1; more with worker processes.
    "PARALLEL_TRIALS": envint("TUNING_PARALLEL_TRIALS", 1 if EMBEDDED_MODE else 2),
    # The confirmation replay's highest rate (requests/s): real-time simulated replicas share this host's CPUs.
    "CONFIRM_MAX_RATE": envfloat("TUNING_CONFIRM_MAX_RATE", 20.0),
    "CONFIRM_ITEMS": envint("TUNING_CONFIRM_ITEMS", 200),
    # Where the winner misses the SLOs at its predicted goodput, it is replayed again at these shares of it, in
    # turn, until it meets them: the confirmed goodput is the highest rate at which it did.
    "CONFIRM_RATE_STEPS": tuple(float(x) for x in (env("TUNING_CONFIRM_RATE_STEPS") or "1,0.8,0.6").split(",")
                                if x.strip()),
    # Simulated requests per rate a goodput search replays (more: steadier figures, slower trials).
    "SIM_REQUESTS": envint("TUNING_SIM_REQUESTS", 400),
    # Robust re-scoring: the best distinct candidates (and the current config) re-scored over this many seeds.
    "RESCORE_CANDIDATES": envint("TUNING_RESCORE_CANDIDATES", 5),
    "RESCORE_SEEDS": envint("TUNING_RESCORE_SEEDS", 5),
    # Engine models calibrated from a group's traffic (tuning/calibration.py, docs/tuning.md#engine-models):
    # the engine-served requests with engine timings a window needs, the periodic calibration's window and
    # interval (0 = off), and the held-out error (p50 TTFT or TPOT) above which a study refuses the model.
    "CALIBRATION_MIN_REQUESTS": envint("TUNING_CALIBRATION_MIN_REQUESTS", 200),
    "CALIBRATION_WINDOW_HOURS": envfloat("TUNING_CALIBRATION_WINDOW_HOURS", 1.0),
    "CALIBRATION_INTERVAL_SECONDS": envfloat("TUNING_CALIBRATION_INTERVAL_SECONDS", 3600.0),
    "MODEL_ERROR_BOUND": envfloat("TUNING_MODEL_ERROR_BOUND", 0.20),
    # How often the worker measures each newest model's error on the latest traffic (and looks for groups due for
    # a calibration), over how many minutes of traffic, and the fewest requests it measures on.
    "CALIBRATION_CHECK_SECONDS": envfloat("TUNING_CALIBRATION_CHECK_SECONDS", 300.0),
    "MODEL_LIVE_WINDOW_MINUTES": envfloat("TUNING_MODEL_LIVE_WINDOW_MINUTES", 15.0),
    "MODEL_LIVE_MIN_REQUESTS": envint("TUNING_MODEL_LIVE_MIN_REQUESTS", 50),
    # A newest model whose error on the latest traffic is above MODEL_ERROR_BOUND raises an alert of this severity
    # (kind engine_model_drift) through the project's channels; its diagnosis names the cost that moved.
    "MODEL_DRIFT_SEVERITY": envchoice("TUNING_MODEL_DRIFT_SEVERITY", "ticket", ("ticket", "page")),
}

# The closed loop (platform/loops, docs/loops.md): a page to a promoted config when a project's policy allows it.
LOOPS = {
    # The beat's clock of loops (studies and rollouts advance on their own beats).
    "SWEEP_INTERVAL_SECONDS": envfloat("LOOPS_SWEEP_INTERVAL_SECONDS", 10.0),
    # The severity of a loop's notifications (each step is one), routed by the channels' severity filters.
    "NOTIFY_SEVERITY": envchoice("LOOPS_NOTIFY_SEVERITY", "ticket", ("ticket", "page")),
    # No approval link is accepted after this long, whatever its policy said (7 d).
    "MAX_APPROVAL_SECONDS": envint("LOOPS_MAX_APPROVAL_SECONDS", 7 * 86400),
}

# Rollouts (platform/rollouts, docs/rollouts.md).
ROLLOUTS = {
    # The beat's clock of canary steps: every active rollout is advanced this often.
    "SWEEP_INTERVAL_SECONDS": envfloat("ROLLOUTS_SWEEP_INTERVAL_SECONDS", 5.0),
    # How long one worker may hold a rollout's tick before another may take it (a worker that died mid-tick).
    "TICK_LEASE_SECONDS": envfloat("ROLLOUTS_TICK_LEASE_SECONDS", 60.0),
    # How long the fleet controller may be unreachable (a restart) before the rollout pauses with that reason.
    "FLEET_GRACE_SECONDS": envfloat("ROLLOUTS_FLEET_GRACE_SECONDS", 60.0),
}

# Notification channels and webhook delivery (platform/notify, docs/notify.md).
NOTIFY = {
    # CIDRs, addresses or host names that outbound webhooks may reach although private/loopback/link-local
    # (comma-separated), e.g. "127.0.0.1,10.0.0.0/8,hooks.internal". Metadata addresses need an exact entry.
    "ALLOW_PRIVATE_DESTINATIONS": [
        s.strip() for s in (env("NOTIFY_ALLOW_PRIVATE_DESTINATIONS", "") or "").split(",") if s.strip()
    ],
    "CONNECT_TIMEOUT_SECONDS": envfloat("NOTIFY_CONNECT_TIMEOUT_SECONDS", 5.0),
    "READ_TIMEOUT_SECONDS": envfloat("NOTIFY_READ_TIMEOUT_SECONDS", 10.0),
    "TOTAL_TIMEOUT_SECONDS": envfloat("NOTIFY_TOTAL_TIMEOUT_SECONDS", 30.0),
    "MAX_REDIRECTS": envint("NOTIFY_MAX_REDIRECTS", 3),
    "BACKOFF_BASE_SECONDS": envfloat("NOTIFY_BACKOFF_BASE_SECONDS", 30.0),
    "BACKOFF_MAX_SECONDS": envfloat("NOTIFY_BACKOFF_MAX_SECONDS", 3600.0),
    "BACKOFF_JITTER": envfloat("NOTIFY_BACKOFF_JITTER", 0.25),
    "MAX_ATTEMPTS": envint("NOTIFY_MAX_ATTEMPTS", 31),  # 30 s doubling to 1 h: ≥ 24 h between first and last
    "RETRY_AFTER_MAX_SECONDS": envfloat("NOTIFY_RETRY_AFTER_MAX_SECONDS", 6 * 3600.0),
    "LEASE_SECONDS": envfloat("NOTIFY_LEASE_SECONDS", 120.0),
    "CONCURRENCY": envint("NOTIFY_CONCURRENCY", 8),
    "PER_CHANNEL_BATCH": envint("NOTIFY_PER_CHANNEL_BATCH", 4),
    "EXTERNAL_URL": env("NOTIFY_EXTERNAL_URL", "") or f"http://{HTTP_BIND}",
    "DELIVER_INTERVAL_SECONDS": envfloat("NOTIFY_DELIVER_INTERVAL_SECONDS", 10.0),  # beat: notify.deliver_due
    # Finished deliveries (succeeded, failed, dead, test sends) and their attempts are deleted this long after
    # their last change; 0 keeps them for ever. Pending and sending deliveries are never deleted.
    "DELIVERY_RETENTION_DAYS": envfloat("NOTIFY_DELIVERY_RETENTION_DAYS", 30.0),
    "PRUNE_INTERVAL_SECONDS": envfloat("NOTIFY_PRUNE_INTERVAL_SECONDS", 3600.0),  # beat: notify.prune_deliveries
    "PRUNE_BATCH_SIZE": envint("NOTIFY_PRUNE_BATCH_SIZE", 1000),  # deliveries per DELETE transaction
    "PRUNE_MAX_SECONDS": envfloat("NOTIFY_PRUNE_MAX_SECONDS", 30.0),  # per run; the next run continues
}

# Alert lifecycle, silences, diagnosis and the latency regression detector (platform/alerts, docs/alerts.md).
ALERTS = {
    # pending → firing once the condition has held this long. A page fires at the first evaluation: its tier's short
    # window (5 m for the 1 h tier) is what keeps a blip from paging, as in the SRE Workbook's multiwindow alerts.
    "PAGE_FOR_SECONDS": envfloat("ALERTS_PAGE_FOR_SECONDS", 0.0),
    "TICKET_FOR_SECONDS": envfloat("ALERTS_TICKET_FOR_SECONDS", 290.0),
    # Beat interval of the regression detector and of repeats (alerts.detect_regressions, alerts.check_repeats).
    "CHECK_INTERVAL_SECONDS": envfloat("ALERTS_CHECK_INTERVAL_SECONDS", 60.0),
    # 0: each SLO's repeat_interval (regressions: REGRESSION_REPEAT_INTERVAL_SECONDS).
    "REPEAT_INTERVAL_SECONDS": envfloat("ALERTS_REPEAT_INTERVAL_SECONDS", 0.0),
    "DIAGNOSIS_BASELINE_MIN_SECONDS": envfloat("ALERTS_DIAGNOSIS_BASELINE_MIN_SECONDS", 1800.0),
    "REGRESSION_ENABLED": envbool("ALERTS_REGRESSION_ENABLED", True),
    "REGRESSION_WINDOW_SECONDS": envfloat("ALERTS_REGRESSION_WINDOW_SECONDS", 300.0),
    "REGRESSION_BASELINE_SECONDS": envfloat("ALERTS_REGRESSION_BASELINE_SECONDS", 1800.0),
    "REGRESSION_RATIO": envfloat("ALERTS_REGRESSION_RATIO", 1.5),
    "REGRESSION_MIN_REQUESTS": envint("ALERTS_REGRESSION_MIN_REQUESTS", 30),
    "REGRESSION_METRICS": tuple(
        m.strip() for m in (env("ALERTS_REGRESSION_METRICS", "e2e_ms,ttft_ms") or "").split(",") if m.strip()),
    "REGRESSION_SEVERITY": env("ALERTS_REGRESSION_SEVERITY", "ticket"),
    "REGRESSION_REPEAT_INTERVAL_SECONDS": envfloat("ALERTS_REGRESSION_REPEAT_INTERVAL_SECONDS", 4 * 3600.0),
    # Base URL put in notifications (links to /api/v1/alerts/<fingerprint>); empty: no link.
    "PUBLIC_URL": env("OBSERVATORY_PUBLIC_URL", "") or "",
}

# Failed authentication (tenancy/throttle.py): API tokens per client address; logins per user and address
# (django-axes, below).
API_AUTH = {
    "FAILURE_LIMIT": envint("API_AUTH_FAILURE_LIMIT", 20),
    "FAILURE_WINDOW_SECONDS": envint("API_AUTH_FAILURE_WINDOW_SECONDS", 60),
    "COOLOFF_SECONDS": envint("API_AUTH_COOLOFF_SECONDS", 60),
}
# Reverse proxies in front of the platform whose X-Forwarded-For is believed (0: the socket's address is the
# client's).
TRUSTED_PROXIES = envint("OBSERVATORY_TRUSTED_PROXIES", 0)
# Logins (the admin's, the dashboard's): after LOGIN_FAILURE_LIMIT wrong passwords for one user from one address,
# that user is locked out from that address for LOGIN_COOLOFF_MINUTES (429); `manage.py axes_reset_username
# NAME` (or axes_reset_ip, axes_reset) unlocks at once.
AXES_FAILURE_LIMIT = envint("LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = __import__("datetime").timedelta(minutes=envfloat("LOGIN_COOLOFF_MINUTES", 15.0))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_CLIENT_IP_CALLABLE = "tenancy.throttle.axes_client_address"
AXES_RESET_ON_SUCCESS = True
AXES_HTTP_RESPONSE_CODE = 429
# The throttles' counters: this process's memory by default; CACHE_URL=redis://host:6379/1 shares them between
# platform processes.
CACHE_URL = env("CACHE_URL", "") or ""
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": CACHE_URL}
    if CACHE_URL else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "observatory"}
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
# collectstatic target for deployments that serve /static/ elsewhere; the platform serves them itself (whitenoise).
STATIC_ROOT = os.environ.get("STATIC_ROOT") or None
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = False
# The vendored files carry their version in their name; the rest changes with the platform: an hour.
WHITENOISE_MAX_AGE = 3600

# The dashboard's session login (same users, projects and roles as the API).
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_AGE = envint("SESSION_COOKIE_AGE_SECONDS", 12 * 3600)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "filters": {"shedded_exports": {"()": "observatory.log_filters.SheddedExports"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.request": {"filters": ["shedded_exports"]},
        # uvicorn's own messages ("Started server process", each 503 at the connection limit) stay quiet
        # unless something goes wrong.
        "uvicorn.error": {"level": "WARNING"},
        # Celery logs every task received/succeeded and every beat send at INFO: several lines every 10 s
        # for the delivery tick alone. Task failures stay visible (ERROR); LOG_LEVEL=DEBUG shows them all.
        **{name: {"level": "DEBUG" if env("LOG_LEVEL", "INFO") == "DEBUG" else "WARNING"}
           for name in ("celery.app.trace", "celery.worker.strategy", "celery.beat")},
    },
}
