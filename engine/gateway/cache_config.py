"""The response cache's configuration, one per replica group: the ``cache`` object of a routes group or fleet group.

    cache:
      nondeterministic: false     # also cache requests that sample (no temperature 0, no seed)
      max_entry_bytes: 262144     # an answer (plus its key) larger than this is not stored
      exact: {enabled: true, ttl_s: 300, max_entries: 10000}
      semantic: {enabled: true, embeddings_url: http://127.0.0.1:8101/v1/embeddings, model: NAME,
                 threshold: 0.92, ttl_s: 600, max_entries: 100000, timeout_s: 0.5, api_key_env: null,
                 client_threshold: false}  # true: X-Observatory-Cache-Threshold sets a request's threshold
      store: memory               # or redis://host:port/db (rediss:// for TLS)
      key_prefix: llm-gateway-cache
      store_timeout_s: 0.25       # each Redis call
      password_env: null          # the variable holding the Redis password

Every field is optional; a missing ``cache`` (or one with neither kind enabled) is off.
``parse_cache`` raises ``CacheConfigError`` naming the field (``cache.semantic.threshold: ...``);
the routes parser turns it into a RoutesError, the fleet file into one of its problems.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

MEMORY_STORE = "memory"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MAX_TTL_S = 30 * 86400.0
_MAX_URL = 2048
_MAX_MODEL = 512


class CacheConfigError(ValueError):
    """A cache configuration that cannot be used; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ExactSpec:
    enabled: bool = False
    ttl_s: float = 300.0
    max_entries: int = 10_000


@dataclasses.dataclass(frozen=True)
class SemanticSpec:
    enabled: bool = False
    embeddings_url: str | None = None
    model: str | None = None
    threshold: float = 0.92
    ttl_s: float = 600.0
    max_entries: int = 100_000
    timeout_s: float = 0.5
    api_key_env: str | None = None
    # Whether a request may set its own threshold (X-Observatory-Cache-Threshold): for measuring one, e.g. a
    # regression run's threshold sweep; off by default.
    client_threshold: bool = False


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    exact: ExactSpec = ExactSpec()
    semantic: SemanticSpec = SemanticSpec()
    nondeterministic: bool = False
    max_entry_bytes: int = 256 * 1024
    store: str = MEMORY_STORE
    key_prefix: str = "llm-gateway-cache"
    store_timeout_s: float = 0.25
    password_env: str | None = None

    @property
    def enabled(self) -> bool:
        return self.exact.enabled or self.semantic.enabled

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise CacheConfigError(f"{where}: must be true or false, got {value!r}")
    return value


def _number(value: object, where: str, *, low: float, high: float) -> float:
    """A finite number in (low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CacheConfigError(f"{where}: must be a number, got {value!r}")
    if not low < value <= high:
        raise CacheConfigError(f"{where}: must be > {low:g} and ≤ {high:g}, got {value!r}")
    return float(value)


def _integer(value: object, where: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CacheConfigError(f"{where}: must be an integer in {low}..{high}, got {value!r}")
    return value


def _env_name(value: object, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _ENV_NAME.match(value):
        raise CacheConfigError(f"{where}: must be an environment variable name, got {value!r}")
    return value


def _url(value: object, where: str, schemes: tuple[str, ...]) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_URL:
        raise CacheConfigError(f"{where}: must be a URL of at most {_MAX_URL} characters, got {value!r}")
    url = value.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise CacheConfigError(f"{where}: {url!r} is malformed: {exc}") from None
    if parts.scheme not in schemes:
        raise CacheConfigError(f"{where}: {url!r} must start with {' or '.join(s + '://' for s in schemes)}")
    if not parts.hostname:
        raise CacheConfigError(f"{where}: {url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise CacheConfigError(f"{where}: {url!r} must not carry credentials (use the *_env options)")
    if parts.fragment:
        raise CacheConfigError(f"{where}: {url!r} must not have a fragment")
    return url


def _store(value: object, where: str) -> str:
    if value == MEMORY_STORE:
        return value
    if not isinstance(value, str):
        raise CacheConfigError(f"{where}: must be 'memory' or a redis:// URL, got {value!r}")
    url = _url(value, where, ("redis", "rediss"))
    parts = urlsplit(url)
    if parts.query:
        raise CacheConfigError(f"{where}: {url!r} must not have a query")
    database = parts.path.strip("/")
    if database and (not database.isdigit() or int(database) > 1_000_000):
        raise CacheConfigError(f"{where}: the database in {url!r} must be a number (redis://host:port/0)")
    return url


def _fields(value: object, where: str, cls) -> dict:
    if not isinstance(value, Mapping):
        raise CacheConfigError(f"{where}: must be an object, got {type(value).__name__}")
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(str(key) for key in value if key not in known)
    if unknown:
        raise CacheConfigError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return dict(value)


def _exact(value: object, where: str) -> ExactSpec:
    data = _fields(value, where, ExactSpec)
    defaults = ExactSpec()
    return ExactSpec(
        enabled=_bool(data.get("enabled", defaults.enabled), f"{where}.enabled"),
        ttl_s=_number(data.get("ttl_s", defaults.ttl_s), f"{where}.ttl_s", low=0, high=_MAX_TTL_S),
        max_entries=_integer(data.get("max_entries", defaults.max_entries), f"{where}.max_entries",
                             low=1, high=10_000_000),
    )


def _semantic(value: object, where: str) -> SemanticSpec:
    data = _fields(value, where, SemanticSpec)
    defaults = SemanticSpec()
    enabled = _bool(data.get("enabled", defaults.enabled), f"{where}.enabled")
    url = data.get("embeddings_url")
    model = data.get("model")
    if url is not None or enabled:
        if url is None:
            raise CacheConfigError(f"{where}.embeddings_url: required when the semantic cache is enabled")
        url = _url(url, f"{where}.embeddings_url", ("http", "https"))
    if model is not None or enabled:
        if not isinstance(model, str) or not model.strip() or len(model) > _MAX_MODEL:
            raise CacheConfigError(f"{where}.model: the embedding model's name is required when the semantic cache "
                                   f"is enabled (a string of at most {_MAX_MODEL} characters), got {model!r}")
    return SemanticSpec(
        enabled=enabled,
        embeddings_url=url,
        model=model,
        threshold=_number(data.get("threshold", defaults.threshold), f"{where}.threshold", low=0, high=1),
        ttl_s=_number(data.get("ttl_s", defaults.ttl_s), f"{where}.ttl_s", low=0, high=_MAX_TTL_S),
        max_entries=_integer(data.get("max_entries", defaults.max_entries), f"{where}.max_entries",
                             low=1, high=1_000_000),
        timeout_s=_number(data.get("timeout_s", defaults.timeout_s), f"{where}.timeout_s", low=0, high=30),
        api_key_env=_env_name(data.get("api_key_env"), f"{where}.api_key_env"),
        client_threshold=_bool(data.get("client_threshold", defaults.client_threshold), f"{where}.client_threshold"),
    )


def parse_cache(value: object, where: str = "cache") -> CacheSpec | None:
    """The cache of one group from its decoded ``cache`` object; None when absent or with no kind enabled."""
    if value is None:
        return None
    data = _fields(value, where, CacheSpec)
    defaults = CacheSpec()
    prefix = data.get("key_prefix", defaults.key_prefix)
    if not isinstance(prefix, str) or not _KEY_PREFIX.match(prefix):
        raise CacheConfigError(f"{where}.key_prefix: must be 1-64 letters, digits, '_', '.', ':' or '-', "
                               f"got {prefix!r}")
    spec = CacheSpec(
        exact=_exact(data.get("exact", {}), f"{where}.exact"),
        semantic=_semantic(data.get("semantic", {}), f"{where}.semantic"),
        nondeterministic=_bool(data.get("nondeterministic", defaults.nondeterministic), f"{where}.nondeterministic"),
        max_entry_bytes=_integer(data.get("max_entry_bytes", defaults.max_entry_bytes), f"{where}.max_entry_bytes",
                                 low=1024, high=64 * 1024 * 1024),
        store=_store(data.get("store", defaults.store), f"{where}.store"),
        key_prefix=prefix,
        store_timeout_s=_number(data.get("store_timeout_s", defaults.store_timeout_s), f"{where}.store_timeout_s",
                                low=0, high=10),
        password_env=_env_name(data.get("password_env"), f"{where}.password_env"),
    )
    return spec if spec.enabled else None
