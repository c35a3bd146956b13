"""The gateway's configuration: replica groups (the routes file) and its limits and timeouts, all validated.

A routes file is JSON, either a list of groups or ``{"groups": [...]}``::

    [{"name": "baseline", "weight": 90, "upstreams": ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]},
     {"name": "canary", "weight": 10, "upstreams": ["http://127.0.0.1:8103"]}]

Weights are relative (90/10 and 9/1 route alike), ≥ 0, and at least one group must
have a weight above 0. Upstream URLs are ``http(s)://host[:port][/prefix]`` without
credentials, query or fragment; an upstream belongs to one group only. A group may carry a
``cache`` object: its response cache, off without one (``cache_config.py`` has its fields).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

import orjson

from engine.gateway.cache_config import CacheConfigError, CacheSpec, parse_cache

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8100
DEFAULT_SERVICE_NAME = "llm-gateway"
MAX_GROUPS = 64
MAX_UPSTREAMS = 1024
_GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MAX_URL_LENGTH = 2048
_MAX_WEIGHT = 1_000_000


class RoutesError(ValueError):
    """A routes document (file or admin update) that cannot be used; the message says what is wrong."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One replica group: a name, a relative weight, the base URLs of its replicas and its response cache."""

    name: str
    weight: float
    upstreams: tuple[str, ...]
    cache: CacheSpec | None = None

    def as_dict(self) -> dict:
        document = {"name": self.name, "weight": self.weight, "upstreams": list(self.upstreams)}
        if self.cache is not None:
            document["cache"] = self.cache.as_dict()
        return document


def normalise_upstream_url(value: object) -> str:
    """``value`` as a clean base URL (no trailing slash), or RoutesError."""
    if not isinstance(value, str) or not value.strip():
        raise RoutesError(f"upstream URL must be a non-empty string, got {value!r}")
    url = value.strip()
    if len(url) > _MAX_URL_LENGTH:
        raise RoutesError(f"upstream URL longer than {_MAX_URL_LENGTH} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RoutesError(f"upstream URL {url!r} is malformed: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise RoutesError(f"upstream URL {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise RoutesError(f"upstream URL {url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise RoutesError(f"upstream URL {url!r} must not carry credentials")
    if parts.query or parts.fragment:
        raise RoutesError(f"upstream URL {url!r} must not have a query or fragment")
    if port == 0:
        raise RoutesError(f"upstream URL {url!r} has port 0")
    return url.rstrip("/")


def parse_weight(value: object, where: str) -> float:
    # bool is an int subclass: `true` is not a weight.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RoutesError(f"{where}: weight must be a number, got {value!r}")
    weight = float(value)
    if not math.isfinite(weight) or weight < 0:
        raise RoutesError(f"{where}: weight must be a finite number ≥ 0, got {value!r}")
    if weight > _MAX_WEIGHT:
        raise RoutesError(f"{where}: weight must be at most {_MAX_WEIGHT}, got {value!r}")
    return weight


def parse_group_name(value: object, where: str) -> str:
    if not isinstance(value, str) or not _GROUP_NAME.match(value):
        raise RoutesError(
            f"{where}: name must be 1-64 characters of letters, digits, '_', '.', '-' (starting with a letter "
            f"or digit), got {value!r}"
        )
    return value


def parse_upstream_list(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise RoutesError(f"{where}: upstreams must be a non-empty list of URLs")
    if len(value) > MAX_UPSTREAMS:
        raise RoutesError(f"{where}: at most {MAX_UPSTREAMS} upstreams")
    urls = tuple(normalise_upstream_url(item) for item in value)
    if len(set(urls)) != len(urls):
        raise RoutesError(f"{where}: an upstream is listed twice")
    return urls


def check_groups(groups: Iterable[GroupSpec]) -> tuple[GroupSpec, ...]:
    """Whole-table rules: 1..MAX_GROUPS groups, unique names, each URL in one group, some weight above 0."""
    groups = tuple(groups)
    if not groups:
        raise RoutesError("at least one replica group is required")
    if len(groups) > MAX_GROUPS:
        raise RoutesError(f"at most {MAX_GROUPS} replica groups")
    names = [group.name for group in groups]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise RoutesError(f"group names must be unique: {', '.join(duplicates)}")
    owner: dict[str, str] = {}
    for group in groups:
        for url in group.upstreams:
            if url in owner:
                raise RoutesError(f"upstream {url} is in both {owner[url]!r} and {group.name!r}")
            owner[url] = group.name
    if len(owner) > MAX_UPSTREAMS:
        raise RoutesError(f"at most {MAX_UPSTREAMS} upstreams in total")
    if not any(group.weight > 0 for group in groups):
        raise RoutesError("at least one group must have a weight above 0")
    return groups


_GROUP_FIELDS = ("name", "weight", "upstreams")
_OPTIONAL_GROUP_FIELDS = ("cache",)


def _check_group_list(items: object, not_a_list: str) -> list:
    """A list of at most MAX_GROUPS group items (checked before any item is parsed)."""
    if not isinstance(items, list):
        raise RoutesError(not_a_list)
    if len(items) > MAX_GROUPS:
        raise RoutesError(f"at most {MAX_GROUPS} replica groups")
    return items


def _group_item_name(item: object, index: int, required: tuple[str, ...]) -> str:
    """The name of the ``index``-th group item, once it is an object with known fields and the ``required`` ones."""
    where = f"group {index}"
    if not isinstance(item, dict):
        raise RoutesError(f"{where} must be an object with name, weight and upstreams")
    unknown = set(item) - set(_GROUP_FIELDS) - set(_OPTIONAL_GROUP_FIELDS)
    if unknown:
        raise RoutesError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    for key in required:
        if key not in item:
            raise RoutesError(f"{where}: missing {key!r}")
    return parse_group_name(item["name"], where)


def parse_group_cache(value: object, where: str) -> CacheSpec | None:
    try:
        return parse_cache(value)
    except CacheConfigError as exc:
        raise RoutesError(f"{where}: {exc}") from None


def parse_group(item: object, index: int) -> GroupSpec:
    name = _group_item_name(item, index, required=_GROUP_FIELDS)
    where = f"group {name!r}"
    return GroupSpec(name=name, weight=parse_weight(item["weight"], where),
                     upstreams=parse_upstream_list(item["upstreams"], where),
                     cache=parse_group_cache(item.get("cache"), where))


def parse_routes(document: object) -> tuple[GroupSpec, ...]:
    """Groups from a decoded routes document (a list of groups or ``{"groups": [...]}``)."""
    if isinstance(document, dict):
        unknown = set(document) - {"groups"}
        if unknown:
            raise RoutesError(f"unknown top-level field(s) {', '.join(sorted(map(str, unknown)))}")
        if "groups" not in document:
            raise RoutesError("missing 'groups'")
        document = document["groups"]
    _check_group_list(document, "routes must be a list of groups or an object with a 'groups' list")
    return check_groups(parse_group(item, index) for index, item in enumerate(document))


def load_routes(path: str | Path) -> tuple[GroupSpec, ...]:
    """Groups from a JSON routes file."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise RoutesError(f"cannot read routes file {path}: {exc.strerror or exc}") from None
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RoutesError(f"routes file {path} is not valid JSON: {exc}") from None
    try:
        return parse_routes(document)
    except RoutesError as exc:
        raise RoutesError(f"routes file {path}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class GatewaySettings:
    """Everything the gateway needs; durations are seconds. ``rng_seed`` makes routing reproducible (tests)."""

    groups: tuple[GroupSpec, ...]
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    admin_token: str | None = None
    # Admission: requests in flight upstream, requests waiting for a slot, and how long one may wait.
    max_concurrency: int = 256
    max_queue: int = 1024
    max_queue_wait_s: float = 10.0
    # Upstream timeouts. first_byte covers the request until the first body bytes arrive (for a
    # non-streaming completion that is the whole generation); idle is the longest gap between reads after that.
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 120.0
    idle_timeout_s: float = 60.0
    total_timeout_s: float = 600.0  # from arrival (queue wait included) to the last byte
    max_body_bytes: int = 8 * 1024 * 1024
    # A client must deliver its whole request body within this (a trickling upload cannot pin a handler).
    client_body_timeout_s: float = 30.0
    # A non-streaming upstream answer larger than this is refused (502) rather than held in memory.
    max_upstream_body_bytes: int = 64 * 1024 * 1024
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    # Consecutive failed /health probes before an upstream is taken out (a refused connection takes it out at once).
    unhealthy_after: int = 2
    models_cache_ttl_s: float = 10.0
    # How often the gateway looks for clients that hung up while it waits on an upstream.
    disconnect_poll_s: float = 0.1
    retry_after_s: float = 1.0
    service_name: str = DEFAULT_SERVICE_NAME
    rng_seed: int | None = None

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        if not all(isinstance(group, GroupSpec) for group in groups):
            groups = parse_routes([g.as_dict() if isinstance(g, GroupSpec) else g for g in groups])  # as in a file
        object.__setattr__(self, "groups", check_groups(groups))
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port!r}")
        if self.admin_token is not None and (not self.admin_token or len(self.admin_token) < 8):
            raise ValueError("admin token must be at least 8 characters")
        for name in ("max_concurrency", "max_body_bytes", "max_upstream_body_bytes", "unhealthy_after"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
        if not isinstance(self.max_queue, int) or isinstance(self.max_queue, bool) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an integer ≥ 0, got {self.max_queue!r}")
        for name in ("max_queue_wait_s", "connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s",
                     "total_timeout_s", "client_body_timeout_s", "health_interval_s", "health_timeout_s",
                     "models_cache_ttl_s", "disconnect_poll_s", "retry_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not self.service_name:
            raise ValueError("service_name must not be empty")


def parse_route_update(document: object, current: tuple[GroupSpec, ...]) -> tuple[GroupSpec, ...]:
    """The table an admin update asks for, validated as a whole.

    Two forms: ``{"weights": {"baseline": 50, "canary": 50}}`` changes weights of existing
    groups only; ``{"groups": [...]}`` is the new table (groups not listed are removed), where
    an existing group may omit ``weight``, ``upstreams`` or ``cache`` to keep its current value
    (``"cache": null`` turns its cache off).
    """
    if not isinstance(document, dict):
        raise RoutesError('body must be a JSON object: {"weights": {...}} or {"groups": [...]}')
    keys = set(document)
    if keys == {"weights"}:
        weights = document["weights"]
        if not isinstance(weights, dict) or not weights:
            raise RoutesError("'weights' must be a non-empty object mapping group names to weights")
        by_name = {spec.name: spec for spec in current}
        unknown = sorted(str(name) for name in weights if name not in by_name)
        if unknown:
            raise RoutesError(f"no such group(s): {', '.join(unknown)}")
        parsed = {name: parse_weight(value, f"group {name!r}") for name, value in weights.items()}
        return check_groups(dataclasses.replace(s, weight=parsed.get(s.name, s.weight)) for s in current)
    if keys != {"groups"}:
        raise RoutesError('body must have exactly one of "weights" or "groups"')
    items = _check_group_list(document["groups"], "'groups' must be a list")
    by_name = {spec.name: spec for spec in current}
    groups = []
    for index, item in enumerate(items):
        name = _group_item_name(item, index, required=("name",))  # an existing group may omit the rest
        existing = by_name.get(name)
        for key in ("weight", "upstreams"):
            if key not in item and existing is None:
                raise RoutesError(f"new group {name!r}: missing {key!r}")
        where = f"group {name!r}"
        weight = parse_weight(item["weight"], where) if "weight" in item else existing.weight
        upstreams = parse_upstream_list(item["upstreams"], where) if "upstreams" in item else existing.upstreams
        if "cache" in item:
            cache = parse_group_cache(item["cache"], where)
        else:
            cache = existing.cache if existing is not None else None
        groups.append(GroupSpec(name, weight, upstreams, cache))
    return check_groups(groups)
