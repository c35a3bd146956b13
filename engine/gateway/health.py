"""Active health checks of the replicas (``GET /health``) and the cache of the models they serve (``GET /v1/models``).

Every ``health_interval_s`` each replica is probed: a 200 puts it (back) in rotation; a
refused connection takes it out at once, other failures after ``unhealthy_after`` probes
in a row (a replica busy enough to miss one probe is not dead). A request that finds no
replica in rotation for its model has the ones out of rotation probed at once (``recheck``),
so a restarted replica serves as soon as it answers rather than at the next round. Model
lists are fetched from healthy replicas at most every ``models_cache_ttl_s``, one fetch at
a time however many requests ask.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

import aiohttp
import orjson
from prometheus_client import Counter

from engine.gateway.routing import RouteTable, Upstream
from engine.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

_MAX_MODELS_BODY = 4 * 1024 * 1024
# At most one recheck round per this many seconds (or per ``health_interval_s`` if shorter): in a real
# outage a flood of requests costs each dead replica a few probes a second, not one per request.
RECHECK_MIN_GAP_S = 0.5


def describe_failure(exc: BaseException) -> str:
    """A short, log-friendly reason for a failed upstream call."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


class UpstreamMonitor:
    def __init__(self, table: RouteTable, settings: GatewaySettings, rechecks: Counter | None = None):
        self.table = table
        self.settings = settings
        self.rechecks = rechecks  # recheck rounds by outcome ("back" or "down"), when metrics are kept
        self.session: aiohttp.ClientSession | None = None
        self._wake = asyncio.Event()
        self._models_fetch: asyncio.Future | None = None
        self._recheck: asyncio.Future | None = None
        self._recheck_started = 0.0

    def wake(self) -> None:
        """Probe now rather than at the next interval (after a route change)."""
        self._wake.set()

    async def run(self) -> None:
        """Probe and refresh forever; one bad round never stops the loop."""
        while True:
            try:
                await self.probe_all()
                await self.refresh_models(self.settings.models_cache_ttl_s)
            except Exception:
                log.exception("health check round failed")
            try:
                async with asyncio.timeout(self.settings.health_interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(upstream) for upstream in self.table.upstreams()))

    async def recheck(self, model: str, exclude: Collection[Upstream] = ()) -> bool:
        """A request found no replica in rotation for ``model``: probe the ones out of rotation now.

        Returns whether one of them is back. Rounds are shared: a request arriving while one runs
        waits for it, and one arriving within ``RECHECK_MIN_GAP_S`` of the last round reads its outcome.
        ``exclude``: replicas this request has just failed on (not worth a probe).
        """
        down = [u for u in self.table.upstreams() if not u.healthy and u.serves(model) and u not in exclude]
        if not down:
            return False
        now = asyncio.get_running_loop().time()
        gap = min(RECHECK_MIN_GAP_S, self.settings.health_interval_s)
        if self._recheck is None or (self._recheck.done() and now - self._recheck_started >= gap):
            self._recheck_started = now
            log.info("no replica in rotation serves '%s': probing %d out of rotation now", model[:100], len(down))
            self._recheck = asyncio.ensure_future(self._recheck_round(down))
        try:
            # Shielded: a request that gives up must not cancel the round other requests are waiting on.
            await asyncio.shield(self._recheck)
        except Exception:  # a cancelled request's CancelledError is not an Exception: it goes on up
            log.exception("recheck of replicas out of rotation failed")
            return False
        return any(u.healthy for u in down)

    async def _recheck_round(self, down: list[Upstream]) -> None:
        answered = await asyncio.gather(*(self.probe(u) for u in down))
        if self.rechecks is not None:
            self.rechecks.labels("back" if any(answered) else "down").inc()

    async def probe(self, upstream: Upstream) -> bool:
        """One ``/health`` probe; updates the replica's health and returns whether it answered 200."""
        refused = False
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
            async with self.session.get(upstream.url + "/health", timeout=timeout, allow_redirects=False) as resp:
                await resp.content.read(65536)
                healthy = resp.status == 200
                reason = f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            healthy = False
            refused = isinstance(exc, aiohttp.ClientConnectorError)
            reason = f"/health: {describe_failure(exc)}"
        if healthy:
            upstream.mark_up()
        else:
            upstream.failed_probes += 1
            if refused or upstream.failed_probes >= self.settings.unhealthy_after:
                upstream.mark_down(reason)
            else:
                upstream.last_error = reason
        return healthy

    async def refresh_models(self, max_age_s: float) -> None:
        """Fetch the model lists older than ``max_age_s`` from healthy replicas; joins a fetch already running."""
        if self._models_fetch is None or self._models_fetch.done():
            now = asyncio.get_running_loop().time()
            stale = [
                upstream for upstream in self.table.upstreams()
                if upstream.healthy and (upstream.models_fetched_at is None
                                         or now - upstream.models_fetched_at >= max_age_s)
            ]
            if not stale:
                return
            self._models_fetch = asyncio.ensure_future(
                asyncio.gather(*(self._fetch_models(upstream) for upstream in stale))
            )
        # Shielded: a request that gives up must not cancel the fetch other requests are waiting on.
        await asyncio.shield(self._models_fetch)

    async def _fetch_models(self, upstream: Upstream) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_s)
            async with self.session.get(upstream.url + "/v1/models", timeout=timeout, allow_redirects=False) as resp:
                body = await resp.content.read(_MAX_MODELS_BODY + 1)
                if resp.status != 200 or len(body) > _MAX_MODELS_BODY:
                    log.debug("models of %s: status %s, %d bytes", upstream.url, resp.status, len(body))
                    return
            document = orjson.loads(body)
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            log.debug("models of %s: %s", upstream.url, describe_failure(exc))
            return
        entries = document.get("data") if isinstance(document, dict) else None
        if not isinstance(entries, list):
            return
        entries = [entry for entry in entries if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
        upstream.model_entries = entries
        upstream.models = frozenset(entry["id"] for entry in entries)
        upstream.models_fetched_at = asyncio.get_running_loop().time()

    def models_document(self) -> dict | None:
        """``/v1/models`` merged over replicas (first entry per id wins); None when no list is known."""
        merged: dict[str, dict] = {}
        known = False
        # Healthy replicas first, so their entries win over stale ones.
        for upstream in sorted(self.table.upstreams(), key=lambda u: not u.healthy):
            if upstream.models is None:
                continue
            known = True
            for entry in upstream.model_entries:
                merged.setdefault(entry["id"], entry)
        if not known:
            return None
        return {"object": "list", "data": list(merged.values())}
