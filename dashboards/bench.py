"""The web dashboard's server time per page over 10 million request rows, and the overview's transferred weight.

    python -m dashboards.bench [--rows 10000000] [--days 7] [--runs 15]

Rows are generated inside ClickHouse over the last `days` days (traces.seed) and the rollups built,
as for the summary benchmark; then a real platform process serves the pages to a logged-in session (Django's
login form, the session cookie) over HTTP. Printed: the median and p90 of each page's time to the last byte
(`runs` calls after one warm-up), and the bytes the overview costs a first visit, compressed as sent (HTML, JS,
CSS; `Accept-Encoding: gzip`).
"""
from __future__ import annotations

import gzip
import http.client
import re
import statistics
import urllib.parse

from benchkit.harness import PlatformProcess
from benchkit.timing import p90, timed
from traces.bench import rows_arguments, seed


class Browser:
    """A cookie jar over http.client: enough to log in and fetch pages."""

    def __init__(self, port: int):
        self.port = port
        self.cookies: dict[str, str] = {}

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        sent = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items()), **(headers or {})}
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        data = response.read()
        for name, value in response.getheaders():
            if name.lower() == "set-cookie":
                key, _, rest = value.partition("=")
                self.cookies[key.strip()] = rest.split(";", 1)[0]
        conn.close()
        return response.status, dict((k.lower(), v) for k, v in response.getheaders()), data

    def login(self, user: str, password: str) -> None:
        status, _, page = self.request("GET", "/accounts/login/")
        token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1).decode()
        body = urllib.parse.urlencode({"username": user, "password": password, "csrfmiddlewaretoken": token,
                                       "next": "/"}).encode()
        status, headers, _ = self.request("POST", "/accounts/login/", body, {
            "Content-Type": "application/x-www-form-urlencoded"})
        if status != 302 or "sessionid" not in self.cookies:
            raise SystemExit(f"login failed: {status}")


def _time(browser: Browser, path: str, runs: int) -> list[float]:
    """Milliseconds to the last byte of ``runs`` loads of the page, after a warm-up."""

    def load() -> None:
        status, _, body = browser.request("GET", path)
        if status != 200:
            raise SystemExit(f"{path}: {status} {body[:300]!r}")

    return [seconds * 1000 for seconds in timed(load, runs)[0]]


def _weight(browser: Browser, path: str) -> tuple[int, int]:
    """(compressed bytes, uncompressed bytes) of a page and the scripts and stylesheets it loads."""
    compressed = plain = 0
    status, headers, body = browser.request("GET", path, headers={"Accept-Encoding": "gzip"})
    html = gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body
    compressed += len(body)
    plain += len(html)
    assets = re.findall(rb'(?:src|href)="(/static/[^"]+\.(?:js|css))"', html)
    for asset in assets:
        status, headers, body = browser.request("GET", asset.decode(), headers={"Accept-Encoding": "gzip"})
        if status != 200:
            raise SystemExit(f"{asset!r}: {status}")
        compressed += len(body)
        plain += len(gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body)
    return compressed, plain


def main(argv=None) -> None:
    args = rows_arguments(argv)
    platform = PlatformProcess()
    platform.setup()
    login = platform.manage("dashboard_login", "--user", "bench", "--project", "bench", "--role", "viewer")
    password = re.search(r"password '([^']+)'", login).group(1)
    seed(platform.data_dir, "bench", args.rows, args.days)
    platform.start()
    figures = {}
    try:
        browser = Browser(platform.port)
        browser.login("bench", password)
        pages = {
            "overview_1h": "/?range=1h",
            "overview_24h": "/?range=24h",
            "overview_7d": "/?range=7d",
            "requests_1h": "/requests/",
            "requests_24h_by_e2e": "/requests/?range=24h&sort=e2e_ms&order=desc",
            "requests_1h_filtered": "/requests/?replica_group=canary&min_e2e=1000",
        }
        status, _, page = browser.request("GET", "/requests/")
        trace = re.search(rb'href="/traces/([0-9a-f]{32})', page)
        if trace is None:
            raise SystemExit("no request row in the explorer")
        pages["trace_detail"] = "/traces/" + trace.group(1).decode()
        for name, path in pages.items():
            timings = _time(browser, path, args.runs)
            figures[name] = (statistics.median(timings), p90(timings))
        compressed, plain = _weight(browser, "/")
    finally:
        platform.stop()
    print(f"BENCH dashboard_rows={args.rows} rows")
    for name, (median, high) in figures.items():
        print(f"BENCH dashboard_{name}_median_ms={median:.1f} ms")
        print(f"BENCH dashboard_{name}_p90_ms={high:.1f} ms")
    print(f"BENCH dashboard_overview_transfer_kb={compressed / 1024:.1f} KB")
    print(f"BENCH dashboard_overview_uncompressed_kb={plain / 1024:.1f} KB")


if __name__ == "__main__":
    main()
