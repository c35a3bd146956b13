"""Burn-rate maths of the SRE Workbook's multi-window, multi-burn-rate alerts: pure functions, no Django, no ClickHouse.

Definitions (request-based SLOs; see docs/slo.md):
- error budget      = 1 − objective (the share of requests allowed to be bad)
- burn rate (window) = (bad / total) / (1 − objective); 1.0 spends the budget exactly over the period
- a tier burns when the burn rates of both its long and its short window are at or above its factor
- budget remaining  = 1 − (bad / total over the period) / (1 − objective): 1.0 untouched, 0.0 spent,
  negative when overspent; None without any request in the period
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Iterable, Mapping

SEVERITIES = ("page", "ticket")
NO_DATA_POLICIES = ("ok", "keep", "alert")
STATES = ("ok", "burning", "no_data", "low_traffic")
# Floating point: (144/10000)/(1 − 0.999) is 14.399999999999986; a burn within this relative distance
# of the factor counts as reaching it, so "exactly 14.4×" fires as the definition says.
_RELATIVE_TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True)
class BurnTier:
    name: str
    severity: str  # "page" | "ticket"
    long_window: dt.timedelta
    short_window: dt.timedelta
    factor: float

    def budget_share(self, period: dt.timedelta) -> float:
        """The share of the period's error budget this tier spends over its long window when it just fires."""
        return self.factor * (self.long_window / period)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "severity": self.severity,
            "long_window": window_label(self.long_window),
            "short_window": window_label(self.short_window),
            "factor": self.factor,
        }


DEFAULT_TIERS: tuple[BurnTier, ...] = (
    BurnTier("page-1h", "page", dt.timedelta(hours=1), dt.timedelta(minutes=5), 14.4),
    BurnTier("page-6h", "page", dt.timedelta(hours=6), dt.timedelta(minutes=30), 6.0),
    BurnTier("ticket-1d", "ticket", dt.timedelta(days=1), dt.timedelta(hours=2), 3.0),
    BurnTier("ticket-3d", "ticket", dt.timedelta(days=3), dt.timedelta(hours=6), 1.0),
)


@dataclasses.dataclass(frozen=True)
class WindowCounts:
    total: int
    bad: int


@dataclasses.dataclass
class TierResult:
    tier: BurnTier
    long_burn: float | None
    short_burn: float | None
    burning: bool  # both windows at or above the factor and the traffic guard passed
    suppressed: bool  # burning, but a faster tier of the same SLO fires
    reason: str

    def as_dict(self) -> dict:
        return {
            **self.tier.as_dict(),
            "long_burn": self.long_burn,
            "short_burn": self.short_burn,
            "burning": self.burning,
            "suppressed": self.suppressed,
            "reason": self.reason,
        }


@dataclasses.dataclass
class Evaluation:
    slo_id: int
    at: dt.datetime
    state: str  # "ok" | "burning" | "no_data" | "low_traffic"
    tiers: list[TierResult]
    firing: TierResult | None  # the fastest burning, unsuppressed tier (or what the no-data policy says)
    burn_rates: dict[str, float | None]  # window label ("5m", "1h", ...) -> burn rate
    budget_remaining: float | None  # over the SLO period, 1.0 = untouched
    counts: dict[str, WindowCounts]

    def as_dict(self) -> dict:
        return {
            "at": self.at.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z"),
            "state": self.state,
            "firing": self.firing.as_dict() if self.firing else None,
            "burn_rates": dict(self.burn_rates),
            "budget_remaining": self.budget_remaining,
            "counts": {label: {"total": c.total, "bad": c.bad} for label, c in self.counts.items()},
            "tiers": [t.as_dict() for t in self.tiers],
        }


# -- windows -----------------------------------------------------------------------------------------
_WINDOW = re.compile(r"^\s*(\d+)\s*([mhd])\s*$")
_UNITS = {"m": 60, "h": 3600, "d": 86400}


def parse_window(text: str) -> dt.timedelta:
    """'5m', '1h', '3d' → timedelta. Raises ValueError with a readable message."""
    if not isinstance(text, str):
        raise ValueError(f"a window is written like 5m, 1h or 3d, not {text!r}")
    match = _WINDOW.match(text)
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"a window is written like 5m, 1h or 3d (a positive whole number of minutes, hours or days), "
                         f"not {text!r}")
    return dt.timedelta(seconds=int(match.group(1)) * _UNITS[match.group(2)])


def window_label(window: dt.timedelta) -> str:
    """The shortest exact label: 5m, 90m, 1h, 6h, 1d, 30d."""
    seconds = int(window.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    raise ValueError(f"window {window} is not a whole number of minutes")


# -- maths -------------------------------------------------------------------------------------------
def error_budget(objective: float) -> float:
    # round() removes the binary noise of 1 − 0.999 (0.0010000000000000009) without changing any real budget.
    return round(1.0 - objective, 12)


def burn_rate(counts: WindowCounts | None, objective: float) -> float | None:
    """(bad / total) / (1 − objective); None when the window holds no request."""
    if counts is None or counts.total <= 0:
        return None
    return (counts.bad / counts.total) / error_budget(objective)


def budget_remaining(counts: WindowCounts | None, objective: float) -> float | None:
    rate = burn_rate(counts, objective)
    return None if rate is None else 1.0 - rate


def reaches(burn: float | None, factor: float) -> bool:
    return burn is not None and burn >= factor * (1.0 - _RELATIVE_TOLERANCE)


def can_fire(tier: BurnTier, objective: float) -> bool:
    """A tier can fire only if factor × (1 − objective) ≤ 1: the bad share of requests cannot exceed 100%."""
    return tier.factor * error_budget(objective) <= 1.0 + _RELATIVE_TOLERANCE


def tier_order(tier: BurnTier) -> tuple:
    """Faster first: pages before tickets, then shorter long windows, then higher factors."""
    return (SEVERITIES.index(tier.severity) if tier.severity in SEVERITIES else len(SEVERITIES),
            tier.long_window, -tier.factor)


def windows_of(tiers: Iterable[BurnTier], period: dt.timedelta) -> list[dt.timedelta]:
    """Every window an SLO needs: the tiers' long and short windows and the period, shortest first."""
    found = {period}
    for tier in tiers:
        found.add(tier.long_window)
        found.add(tier.short_window)
    return sorted(found)


def evaluate(*, slo_id: int, at: dt.datetime, objective: float, period: dt.timedelta, tiers: Iterable[BurnTier],
             counts: Mapping[str, WindowCounts], min_requests: int = 0, min_bad: int = 0,
             no_data: str = "ok", previous_firing: str | None = None, events: str = "requests") -> Evaluation:
    """Decide the SLO's state from the request counts of each window (keyed by window_label).

    - A tier burns when both windows reach its factor, its long window holds at least `min_requests`
      requests and at least `min_bad` bad ones (the traffic guard; a blocked tier reports why).
    - Faster tiers suppress slower ones: the first burning tier in tier_order() is `firing`, every
      later burning tier is marked suppressed.
    - No data = no request in the fastest tier's long window. The policy decides what fires:
      "ok" nothing; "keep" the tier that fired at the previous evaluation (`previous_firing`, by
      name) keeps firing; "alert" a tier named "no_data" (severity ticket, the fastest tier's
      windows) fires.
    `events` names what is counted in the reasons: requests, or an engine model's live checks.
    """
    if no_data not in NO_DATA_POLICIES:
        raise ValueError(f"no_data must be one of {', '.join(NO_DATA_POLICIES)}")
    ordered = sorted(tiers, key=tier_order)
    if not ordered:
        raise ValueError("an SLO needs at least one burn-rate tier")
    empty = WindowCounts(0, 0)

    def counts_for(window: dt.timedelta) -> WindowCounts:
        return counts.get(window_label(window), empty)

    results: list[TierResult] = []
    firing: TierResult | None = None
    guarded = False
    for tier in ordered:
        long_counts, short_counts = counts_for(tier.long_window), counts_for(tier.short_window)
        long_burn, short_burn = burn_rate(long_counts, objective), burn_rate(short_counts, objective)
        over = reaches(long_burn, tier.factor) and reaches(short_burn, tier.factor)
        burning, suppressed = False, False
        long_label, short_label = window_label(tier.long_window), window_label(tier.short_window)
        if long_burn is None:
            reason = f"no {events} in {long_label}"
        elif not over:
            reason = (f"burn {_fmt(long_burn)} over {long_label}, {_fmt(short_burn)} over {short_label}: "
                      f"not both at or above {tier.factor:g}")
        elif long_counts.total < min_requests:
            guarded = True
            reason = f"low traffic: {long_counts.total} {events} in {long_label} < min_requests {min_requests}"
        elif long_counts.bad < min_bad:
            guarded = True
            reason = f"low traffic: {long_counts.bad} bad {events} in {long_label} < min_bad {min_bad}"
        else:
            burning = True
            if firing is not None:
                suppressed = True
                reason = f"burning, suppressed by the faster tier {firing.tier.name}"
            else:
                reason = (f"burn {_fmt(long_burn)} over {long_label} and {_fmt(short_burn)} over {short_label} "
                          f"reach {tier.factor:g}")
        result = TierResult(tier, long_burn, short_burn, burning, suppressed, reason)
        if burning and firing is None:
            firing = result
        results.append(result)

    fastest = ordered[0]
    no_data_now = counts_for(fastest.long_window).total == 0
    if no_data_now:
        state = "no_data"
        firing = _no_data_firing(no_data, ordered, previous_firing, events)
    elif firing is not None:
        state = "burning"
    elif guarded:
        state = "low_traffic"
    else:
        state = "ok"

    windows = windows_of(ordered, period)
    burn_rates = {window_label(w): burn_rate(counts_for(w), objective) for w in windows}
    return Evaluation(
        slo_id=slo_id,
        at=at,
        state=state,
        tiers=results,
        firing=firing,
        burn_rates=burn_rates,
        budget_remaining=budget_remaining(counts_for(period), objective),
        counts={window_label(w): counts_for(w) for w in windows},
    )


def _no_data_firing(policy: str, ordered: list[BurnTier], previous_firing: str | None,
                    events: str = "requests") -> TierResult | None:
    if policy == "ok":
        return None
    if policy == "keep":
        tier = next((t for t in ordered if t.name == previous_firing), None)
        if tier is None:
            return None
        return TierResult(tier, None, None, True, False, "no data: keeping the previous state (no_data: keep)")
    fastest = ordered[0]
    tier = BurnTier("no_data", "ticket", fastest.long_window, fastest.short_window, 0.0)
    return TierResult(tier, None, None, True, False,
                      f"no data: no {events} in {window_label(fastest.long_window)} (no_data: alert)")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}×"
