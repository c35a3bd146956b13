"""The route table: replica groups chosen by weight, and inside a group the healthy replica with the fewest requests.

A request first draws its group by weight (so a 90/10 split holds whatever the replicas'
health); inside that group it goes to the healthy replica, serving the model, with the
fewest requests in flight (ties drawn at random). When that group has none left, it
falls back to the other weighted groups, drawn by weight again. Groups of weight 0 get
no traffic, not even as a fallback: weight 0 is how a canary is drained.

Upstream objects are keyed by URL and survive a table update, so the in-flight counts
and health of a replica that stays carry over, and requests still running on a replica
that was removed finish normally.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Collection, Iterable, Mapping
from urllib.parse import urlsplit

from engine.gateway.cache_config import CacheSpec
from engine.gateway.settings import GroupSpec, RoutesError, check_groups

log = logging.getLogger(__name__)


class Upstream:
    """One replica: its base URL, health, requests in flight and the models it serves (None until known)."""

    __slots__ = ("url", "host", "port", "group", "healthy", "in_flight", "failed_probes", "last_error",
                 "changed_at", "models", "model_entries", "models_fetched_at")

    def __init__(self, url: str, group: str):
        parts = urlsplit(url)
        self.url = url
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.group = group
        # Optimistic start: a replica that is down is found by the first request (which then moves on) or probe.
        self.healthy = True
        self.in_flight = 0
        self.failed_probes = 0
        self.last_error: str | None = None
        self.changed_at = time.time()
        self.models: frozenset[str] | None = None
        self.model_entries: list[dict] = []
        self.models_fetched_at: float | None = None

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def mark_down(self, reason: str) -> bool:
        """Take the replica out of rotation; True when it was in."""
        self.last_error = reason
        if not self.healthy:
            return False
        self.healthy = False
        self.changed_at = time.time()
        log.warning("upstream %s (group %s) marked unhealthy: %s", self.url, self.group, reason)
        return True

    def mark_up(self) -> bool:
        """Put the replica back; True when it was out."""
        self.failed_probes = 0
        if self.healthy:
            return False
        self.healthy = True
        self.changed_at = time.time()
        log.info("upstream %s (group %s) is healthy again", self.url, self.group)
        return True

    def snapshot(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "last_error": self.last_error,
            "changed_at": self.changed_at,
            "models": sorted(self.models) if self.models is not None else None,
        }


class ReplicaGroup:
    __slots__ = ("name", "weight", "upstreams", "cache")

    def __init__(self, name: str, weight: float, upstreams: tuple[Upstream, ...], cache: CacheSpec | None = None):
        self.name = name
        self.weight = weight
        self.upstreams = upstreams
        self.cache = cache

    def spec(self) -> GroupSpec:
        return GroupSpec(self.name, self.weight, tuple(u.url for u in self.upstreams), self.cache)


class RouteTable:
    """The current groups; updates swap the whole tuple, so a reader never sees half an update."""

    def __init__(self, specs: Iterable[GroupSpec], rng: random.Random | None = None):
        self._rng = rng or random.Random()
        self._groups: tuple[ReplicaGroup, ...] = ()
        self.replace(specs)

    @property
    def groups(self) -> tuple[ReplicaGroup, ...]:
        return self._groups

    def upstreams(self) -> list[Upstream]:
        return [upstream for group in self._groups for upstream in group.upstreams]

    def specs(self) -> tuple[GroupSpec, ...]:
        return tuple(group.spec() for group in self._groups)

    def replace(self, specs: Iterable[GroupSpec]) -> None:
        """Install new groups (validated as a whole), keeping the state of replicas whose URL stays."""
        specs = check_groups(specs)
        existing = {upstream.url: upstream for upstream in self.upstreams()}
        groups = []
        for spec in specs:
            members = []
            for url in spec.upstreams:
                upstream = existing.get(url)
                if upstream is None:
                    upstream = Upstream(url, spec.name)
                upstream.group = spec.name
                members.append(upstream)
            groups.append(ReplicaGroup(spec.name, spec.weight, tuple(members), spec.cache))
        self._groups = tuple(groups)

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Change the weights of named groups, leaving their replicas as they are."""
        known = {group.name for group in self._groups}
        unknown = sorted(set(weights) - known)
        if unknown:
            raise RoutesError(f"no such group(s): {', '.join(unknown)}")
        self.replace(dataclasses.replace(spec, weight=weights.get(spec.name, spec.weight)) for spec in self.specs())

    def choose_group(self) -> ReplicaGroup:
        """Draw a group by weight (only groups with weight above 0 take part)."""
        return self._draw([group for group in self._groups if group.weight > 0])

    def _draw(self, groups: list[ReplicaGroup]) -> ReplicaGroup:
        total = sum(group.weight for group in groups)
        point = self._rng.random() * total
        for group in groups:
            point -= group.weight
            if point < 0:
                return group
        return groups[-1]  # float rounding left `point` at exactly 0

    def group(self, name: str) -> ReplicaGroup | None:
        return next((group for group in self._groups if group.name == name), None)

    def pick(self, model: str, preferred: str, tried: Collection[Upstream] = (), *,
             pinned: bool = False) -> Upstream | None:
        """The replica for the next attempt: from group ``preferred`` if it has one, else another weighted group.
        ``pinned``: from group ``preferred`` only (whatever its weight), never another."""
        if pinned:
            group = self.group(preferred)
            eligible = [] if group is None else [
                u for u in group.upstreams if u.healthy and u not in tried and u.serves(model)]
            return self._least_loaded(eligible) if eligible else None
        eligible_by_group = []
        for group in self._groups:
            if group.weight <= 0 and group.name != preferred:
                continue
            eligible = [u for u in group.upstreams if u.healthy and u not in tried and u.serves(model)]
            if eligible:
                if group.name == preferred:
                    return self._least_loaded(eligible)
                if group.weight > 0:
                    eligible_by_group.append((group, eligible))
        if not eligible_by_group:
            return None
        chosen = self._draw([group for group, _ in eligible_by_group])
        return self._least_loaded(next(eligible for group, eligible in eligible_by_group if group is chosen))

    def _least_loaded(self, upstreams: list[Upstream]) -> Upstream:
        lowest = min(upstream.in_flight for upstream in upstreams)
        ties = [upstream for upstream in upstreams if upstream.in_flight == lowest]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    def known_models(self) -> frozenset[str] | None:
        """Models served by any replica whose model list is known; None when no list is known yet."""
        lists = [u.models for u in self.upstreams() if u.models is not None]
        if not lists:
            return None
        return frozenset().union(*lists)

    def snapshot(self) -> dict:
        return {
            "groups": [
                {"name": group.name, "weight": group.weight,
                 "upstreams": [upstream.snapshot() for upstream in group.upstreams],
                 **({"cache": group.cache.as_dict()} if group.cache is not None else {})}
                for group in self._groups
            ]
        }
