"""A/A traffic pages nobody: the same healthy service for six hours (and six before them) — random arrivals, every
1000th request slow (the rate a 99.9% objective allows), two 20-second stalls in the busy hours (every request slow:
the 5-minute window burns ~50×, the hour ~5×), a quiet night at 2 requests a minute with two slow requests 40 s apart
(both windows of the 1 h tier over 14.4×, but 2 bad requests < min_bad) — evaluated as the platform evaluates now
(every 5 s, windows ending on the evaluation's second, no page pending period) and as it did before (once a minute
on the closed minute, a page pending for 50 s). Neither pages.

The window counts are brute force over the generated requests, which is what the evaluation's queries count
(tests/slo/slo_window_check.py checks them against brute force for windows ending on any second); burn.evaluate
decides and the real lifecycle pages through a real channel."""
from __future__ import annotations

import bisect
import datetime as dt
import random

from alerts import lifecycle
from alerts.models import AlertTransition
from notify.models import Channel, Delivery
from slo import burn, services
from tenancy.models import Project

UTC = dt.timezone.utc
START = (dt.datetime.now(UTC) - dt.timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
HOURS = 6  # evaluated; the traffic starts six hours earlier, so the page tiers' windows are full from the start


def aa_traffic(seed: int = 42) -> list[tuple[float, bool]]:
    """(start time as epoch seconds, bad) of every request, in order: Poisson arrivals at 30 a minute, 2 from the
    third hour on."""
    rng = random.Random(seed)
    begin = (START - dt.timedelta(hours=6)).timestamp()
    quiet_from = (START + dt.timedelta(hours=3)).timestamp()
    end = (START + dt.timedelta(hours=HOURS)).timestamp()
    stalls = [(START + dt.timedelta(minutes=m)).timestamp() for m in (37, 151)]
    requests, t = [], begin
    while t < end:
        per_minute = 30 if t < quiet_from else 2
        t += rng.expovariate(per_minute / 60)
        stalled = any(s <= t < s + 20 for s in stalls)
        requests.append((t, stalled or len(requests) % 1000 == 999))
    night_pair = (START + dt.timedelta(hours=4, minutes=10)).timestamp()
    requests += [(night_pair, True), (night_pair + 40, True)]
    return sorted(requests)


class Counter:
    """Requests and bad requests in [at − window, at), from prefix sums."""

    def __init__(self, requests: list[tuple[float, bool]]):
        self.times = [t for t, _ in requests]
        self.bad = [0]
        for _, bad in requests:
            self.bad.append(self.bad[-1] + bad)

    def counts(self, at: dt.datetime, windows: list[dt.timedelta]) -> dict[str, burn.WindowCounts]:
        end = bisect.bisect_left(self.times, at.timestamp())
        out = {}
        for window in windows:
            begin = bisect.bisect_left(self.times, (at - window).timestamp())
            out[burn.window_label(window)] = burn.WindowCounts(end - begin, self.bad[end] - self.bad[begin])
        return out


def play(slo, counter: Counter, ticks: list[dt.datetime]) -> list[burn.Evaluation]:
    windows = burn.windows_of(slo.burn_tiers, slo.period)
    evaluations = []
    for at in ticks:
        evaluation = burn.evaluate(slo_id=slo.id, at=at, objective=slo.objective, period=slo.period,
                                   tiers=slo.burn_tiers, counts=counter.counts(at, windows),
                                   min_requests=slo.min_requests, min_bad=slo.min_bad, no_data=slo.no_data)
        lifecycle.apply_evaluation(slo, evaluation)
        evaluations.append(evaluation)
    return evaluations


def pages(settings, counter: Counter, name: str, first: dt.datetime, step: dt.timedelta, pending: float):
    """Play the six hours at `step` from `first` with a page pending period of `pending` seconds on a new SLO; returns
    (its page transitions to firing, its evaluations)."""
    project = Project.objects.create(name=name)
    Channel.objects.create(project=project, name="pager", kind="webhook", url="http://127.0.0.1:9/hook")
    slo = services.create(project.id, {"name": "ttft", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99.9%"})
    settings.ALERTS = {**settings.ALERTS, "PAGE_FOR_SECONDS": pending}
    ticks = [first + i * step for i in range(int(dt.timedelta(hours=HOURS) / step))]
    evaluations = play(slo, counter, ticks)
    fired = AlertTransition.objects.filter(alert__slo=slo, alert__severity="page", to_state="firing")
    return [(t.at, t.reason) for t in fired], evaluations


def test_aa_traffic_pages_nobody_now_as_before(db, store, settings):
    counter = Counter(aa_traffic())
    interval, pending = settings.SLO["EVALUATE_INTERVAL_SECONDS"], settings.ALERTS["PAGE_FOR_SECONDS"]
    assert (interval, pending) == (5, 0), "the defaults"
    now, evaluations = pages(settings, counter, "now", START + dt.timedelta(seconds=2), dt.timedelta(seconds=interval),
                             pending)
    before, _ = pages(settings, counter, "before", START, dt.timedelta(minutes=1), 50.0)
    assert now == [] and before == []
    assert not Delivery.objects.filter(severity="page").exists()
    # what the traffic put to the test: the stalls push the 5-minute window over the page factor (the hour holds it
    # back); the night's pair pushes both, and the traffic guard holds it back
    fast = [t for e in evaluations for t in e.tiers if t.tier.name == "page-1h"]
    assert max(t.short_burn or 0 for t in fast) >= 14.4
    assert any(t.reason == "low traffic: 2 bad requests in 1h < min_bad 3" for t in fast)
