"""The web dashboard's server time per page over 10 million request rows, and the overview's transferred weight.

    python -m observatory.bench.dashboard [--rows 10000000] [--days 7] [--runs 15]

Rows are generated inside ClickHouse over the last `days` days (observatory.bench.seed) and the rollups built,
as for the summary benchmark; then a real platform process serves the pages to a logged-in session (Django's
login form, the session cookie) over HTTP. Printed: the median and p90 of each page's time to the last byte
(`runs` calls after one warm-up), and the bytes the overview costs a first visit, compressed as sent (HTML, JS,
CSS; `Accept-Encoding: gzip`).
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import re
import statistics
import time
import urllib.parse

from .harness import PlatformProcess
from .summary import seed


class Browser:
    """A cookie jar over http.client: enough to log in and fetch pages."""

    def __init__(self, port: int):
        self.port = port
        self.cookies: dict[str, str] = {}

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        sent = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items()), **(headers or {})}
        started = time.perf_counter()
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - started
        for name, value in response.getheaders():
            if name.lower() == "set-cookie":
                key, _, rest = value.partition("=")
                self.cookies[key.strip()] = rest.split(";", 1)[0]
        conn.close()
        return response.status, dict((k.lower(), v) for k, v in response.getheaders()), data, elapsed

    def login(self, user: str, password: str) -> None:
        status, _, page, _ = self.request("GET", "/accounts/login/")
        token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1).decode()
        body = urllib.parse.urlencode({"username": user, "password": password, "csrfmiddlewaretoken": token,
                                       "next": "/"}).encode()
        status, headers, _, _ = self.request("POST", "/accounts/login/", body, {
            "Content-Type": "application/x-www-form-urlencoded"})
        if status != 302 or "sessionid" not in self.cookies:
            raise SystemExit(f"login failed: {status}")


def _time(browser: Browser, path: str, runs: int) -> list[float]:
    timings = []
    for i in range(runs + 1):
        status, _, body, elapsed = browser.request("GET", path)
        if status != 200:
            raise SystemExit(f"{path}: {status} {body[:300]!r}")
        if i:
            timings.append(elapsed * 1000)
    return timings


def _weight(browser: Browser, path: str) -> tuple[int, int]:
    """(compressed bytes, uncompressed bytes) of a page and the scripts and stylesheets it loads."""
    compressed = plain = 0
    status, headers, body, _ = browser.request("GET", path, headers={"Accept-Encoding": "gzip"})
    html = gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body
    compressed += len(body)
    plain += len(html)
    assets = re.findall(rb'(?:src|href)="(/static/[^"]+\.(?:js|css))"', html)
    for asset in assets:
        status, headers, body, _ = browser.request("GET", asset.decode(), headers={"Accept-Encoding": "gzip"})
        if status != 200:
            raise SystemExit(f"{asset!r}: {status}")
        compressed += len(body)
        plain += len(gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body)
    return compressed, plain


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)

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
        status, _, page, _ = browser.request("GET", "/requests/")
        trace = re.search(rb'href="/traces/([0-9a-f]{32})', page)
        if trace is None:
            raise SystemExit("no request row in the explorer")
        pages["trace_detail"] = "/traces/" + trace.group(1).decode()
        for name, path in pages.items():
            timings = _time(browser, path, args.runs)
            figures[name] = (statistics.median(timings), sorted(timings)[max(0, int(len(timings) * 0.9) - 1)])
        compressed, plain = _weight(browser, "/")
    finally:
        platform.stop()
    print(f"BENCH dashboard_rows={args.rows} rows")
    for name, (median, p90) in figures.items():
        print(f"BENCH dashboard_{name}_median_ms={median:.1f} ms")
        print(f"BENCH dashboard_{name}_p90_ms={p90:.1f} ms")
    print(f"BENCH dashboard_overview_transfer_kb={compressed / 1024:.1f} KB")
    print(f"BENCH dashboard_overview_uncompressed_kb={plain / 1024:.1f} KB")


if __name__ == "__main__":
    main()
