"""A Grafana dashboard's JSON model (schemaVersion 39) as the generator writes it: rows and panels laid out left to
right on the 24-column grid, every panel over the data source the board's `datasource` variable names.

Two kinds of panel: `Board.panel` (PromQL targets, Prometheus) and `Board.sql_panel` (one raw-SQL target of Grafana's
official ClickHouse plugin, `grafana-clickhouse-datasource`: `editorType` "sql", `rawSql`, `format` 0 = time series,
1 = table, and the `queryType` its editor shows for it).
"""
from __future__ import annotations

PROMETHEUS = {"type": "prometheus", "uid": "${datasource}"}
CLICKHOUSE = {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}
# A target saved by plugin 4.x: older ones (no pluginVersion) are migrated by the plugin's v3 path.
CLICKHOUSE_PLUGIN_VERSION = "4.0.0"
_LABELS = {"prometheus": "Prometheus", "grafana-clickhouse-datasource": "ClickHouse"}


class Board:
    def __init__(self, uid: str, title: str, tags: list[str], variables: list[dict], datasource: dict = PROMETHEUS):
        self.uid, self.title, self.tags, self.variables = uid, title, tags, variables
        self.datasource = datasource
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": len(self.panels) + 1,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def _add(self, kind: str, title: str, description: str, width: int, defaults: dict, options: dict,
             targets: list[dict], **extra) -> None:
        if self.x + width > 24:
            self.y += 8
            self.x = 0
        self.panels.append({
            "type": kind, "title": title, "description": description, "id": len(self.panels) + 1,
            "datasource": self.datasource, "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options, "targets": targets, **extra,
        })
        self.x += width

    def panel(self, title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
              width: int = 8, description: str = "", stack: bool = False, thresholds: list[float] | None = None) -> None:
        """A panel of PromQL targets: (expression, legend format)."""
        defaults = _defaults(kind, unit, stack)
        if thresholds:
            defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "green", "value": None}] + [
                {"color": "red", "value": t} for t in thresholds]}
            if kind == "timeseries":
                defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
        self._add(kind, title, description, width, defaults, _TIMESERIES_OPTIONS if kind == "timeseries" else {}, [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": self.datasource}
            for i, (expr, legend) in enumerate(targets)])

    def sql_panel(self, title: str, sql: str, *, unit: str = "percentunit", kind: str = "timeseries", width: int = 12,
                  description: str = "", stack: bool = False, display_name: str = "",
                  max_data_points: int = 200) -> None:
        """A panel of one ClickHouse SQL target. A time series panel reads the rows as a time series (`format` 0: the
        plugin turns a long result, a time column, one string column and values, into one series per string);
        a bar gauge reads a table (`format` 1) and shows every row. `max_data_points` caps the points, so Grafana's
        interval (`$__interval_s`) grows with the range."""
        defaults = _defaults(kind, unit, stack)
        if unit == "percentunit":
            defaults.update(min=0, max=1)
        if display_name:
            defaults["displayName"] = display_name
        table = kind != "timeseries"
        options = _TIMESERIES_OPTIONS if not table else {
            "orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
            "reduceOptions": {"values": True, "calcs": [], "fields": ""}}
        target = {"refId": "A", "datasource": self.datasource, "editorType": "sql", "format": 1 if table else 0,
                  "queryType": "table" if table else "timeseries", "pluginVersion": CLICKHOUSE_PLUGIN_VERSION,
                  "rawSql": sql}
        self._add(kind, title, description, width, defaults, options, [target], maxDataPoints=max_data_points)

    def json(self) -> dict:
        kind = self.datasource["type"]
        return {
            "uid": self.uid, "title": self.title, "tags": self.tags, "editable": True, "schemaVersion": 39,
            "version": 1, "refresh": "30s", "time": {"from": "now-6h", "to": "now"}, "timezone": "utc",
            "graphTooltip": 1, "panels": self.panels, "annotations": {"list": []},
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": kind,
                                     "label": _LABELS[kind], "current": {}}] + self.variables},
        }


_TIMESERIES_OPTIONS = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}


def _defaults(kind: str, unit: str, stack: bool) -> dict:
    defaults: dict = {"unit": unit}
    if kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 30 if stack else 0,
                              "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                              "spanNulls": False, "showPoints": "never"}
    return defaults
