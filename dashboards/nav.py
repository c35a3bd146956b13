"""The dashboard's main navigation: one entry per page. A new page adds its entry here and its route in urls.py."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str      # the URL name (dashboards/urls.py)
    label: str
    section: str   # the `section` a page's template sets, to mark the current entry


PAGES = (
    Entry("overview", "Overview", "overview"),
    Entry("requests", "Requests", "requests"),
    Entry("slos", "SLOs", "slos"),
    Entry("alerts", "Alerts", "alerts"),
    Entry("channels", "Channels", "channels"),
    Entry("engine", "Engine", "engine"),
    Entry("regressions", "Regressions", "regressions"),
    Entry("tuning", "Tuning", "tuning"),
    Entry("rollouts", "Rollouts", "rollouts"),
    Entry("loops", "Loops", "loops"),
)
