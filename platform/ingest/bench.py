"""End-to-end ingest throughput: OTLP/HTTP protobuf batches of ~1,000 spans → durable → queryable, one platform process.

    python -m ingest.bench [--batches 300] [--senders 2] [--preload-traces 0]

Also measures, on the same payloads in the same run, the raw parse rate: protobuf
decoding plus turning every span's fields and attributes into Python values, which
any Python receiver must do at least; the platform process's peak resident
memory (VmHWM) over the run; and the CPU time (user + system, all threads) the platform
process spent per span from the first export to the last trace being queryable.

With `--preload-traces N` the store already holds N traces (3N spans, N request rows, spread
over the last day) before the first export, as a store that has been ingesting for a while does:
a lookup by trace id costs more the more is stored, which an empty store does not show. The run
starts once the platform has read those traces back into its trace filter (the one-time work of
a restart on a full store, ~5 s for 10 million spans here).
"""
from __future__ import annotations

import argparse
import datetime as dt
import http.client
import os
import random
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from benchkit.harness import PlatformProcess
from benchkit.payloads import chain_batch
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families
from traces.seed import platform_store, seed_spans


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def raw_parse(payload: bytes) -> int:
    request = ExportTraceServiceRequest.FromString(payload)
    n = 0
    for rs in request.resource_spans:
        {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                (s.trace_id, s.span_id, s.parent_span_id, s.name, s.kind, s.start_time_unix_nano,
                 s.end_time_unix_nano, s.status.code, {kv.key: _value(kv.value) for kv in s.attributes})
                n += 1
    return n


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--cpu-detail", action="store_true",
                        help="also print the platform's CPU per span by thread name (Python threads are 'python')")
    parser.add_argument("--hops", type=int, choices=(2, 3, 5), default=3,
                        help="spans per trace: 3 (client → gateway → engine), 5 (two more gateways in front) or 2 "
                             "(gateway → engine, no client: every row a loose end looked up for a join)")
    parser.add_argument("--preload-traces", type=int, default=0,
                        help="traces (3 spans and a request row each) stored before the run")
    args = parser.parse_args(argv)

    rng = random.Random(7)
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    payloads = [chain_batch(1000 // args.hops, rng, hops=args.hops) for _ in range(args.batches)]
    spans_total = sum(args.hops * len(ids) for _, ids in payloads)
    traces_total = sum(len(ids) for _, ids in payloads)

    started = time.perf_counter()
    parsed = sum(raw_parse(p) for p, _ in payloads)
    parse_rate = parsed / (time.perf_counter() - started)

    platform = PlatformProcess()
    key, token = platform.setup()
    if args.preload_traces:
        preload(platform.data_dir, "bench", args.preload_traces)
    platform.start()
    _wait_for_trace_filter(platform)
    try:
        local = threading.local()

        def send(payload: bytes) -> int:
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = http.client.HTTPConnection("127.0.0.1", platform.port, timeout=120)
            conn.request("POST", "/v1/traces", body=payload,
                         headers={"Content-Type": "application/x-protobuf", "Authorization": f"Bearer {key}"})
            response = conn.getresponse()
            response.read()
            return response.status

        cpu_before = _cpu_seconds(platform.proc.pid)
        threads_before = _thread_cpu(platform.proc.pid) if args.cpu_detail else {}
        started = time.perf_counter()
        with ThreadPoolExecutor(args.senders) as pool:
            statuses = list(pool.map(send, [p for p, _ in payloads]))
        acked = time.perf_counter() - started
        if any(s != 200 for s in statuses):
            raise SystemExit(f"non-200 answers: {sorted(set(statuses))}")
        # Durable in ClickHouse: the spool is drained. Then decomposed: /readyz says no trace waits.
        # Both are read from /readyz, which costs the platform next to nothing; the summary API (a
        # ClickHouse query, which would compete with the decomposition for the embedded engine) is
        # asked only once everything should be there, and again until it shows every trace.
        durable = None
        while True:
            _, ready = platform.get("/readyz")
            if durable is None and ready.get("spool_pending_bytes") == 0:
                durable = time.perf_counter() - started
            if durable is not None and ready.get("decomposition_pending") == 0:
                decomposed = time.perf_counter() - started
                break
            time.sleep(0.02)
        while True:
            _, summary = platform.get("/api/v1/latency/summary?group_by=&since=" + since, token)
            if "groups" not in summary:
                raise SystemExit(f"summary failed: {summary}")
            count = sum(g["count"] for g in summary["groups"])
            if count >= traces_total:
                break
            time.sleep(0.1)
        queryable = time.perf_counter() - started
        cpu_after = _cpu_seconds(platform.proc.pid)
        threads_after = _thread_cpu(platform.proc.pid) if args.cpu_detail else {}
        peak_rss_kib = _peak_rss_kib(platform.proc.pid)
        sources = _decompose_sources(platform)
    finally:
        platform.stop()

    e2e_rate = spans_total / queryable
    print(f"BENCH ingest_spans_total={spans_total} spans")
    if args.preload_traces:
        print(f"BENCH ingest_preloaded_spans={3 * args.preload_traces} spans")
    print(f"BENCH ingest_ack_spans_per_s={spans_total / acked:.0f} spans/s")
    print(f"BENCH ingest_durable_spans_per_s={spans_total / durable:.0f} spans/s")
    print(f"BENCH ingest_decomposed_spans_per_s={spans_total / decomposed:.0f} spans/s")
    print(f"BENCH ingest_spans_per_s={e2e_rate:.0f} spans/s")
    print(f"BENCH ingest_parse_spans_per_s={parse_rate:.0f} spans/s")
    print(f"BENCH ingest_ratio={e2e_rate / parse_rate:.2f} ratio")
    if peak_rss_kib is not None:
        print(f"BENCH ingest_peak_rss_mib={peak_rss_kib / 1024:.0f} MiB")
    # How the traces were decomposed: from memory with no lookup (new to the store), from memory after a
    # span-count lookup, or read back from ClickHouse (e.g. when the decomposition fell so far behind that
    # traces left its memory). Counts, not rates.
    for source, count in sorted(sources.items()):
        print(f"BENCH ingest_decomposed_from_{source}={count:.0f} traces")
    if cpu_before is not None and cpu_after is not None:
        print(f"BENCH ingest_cpu_us_per_span={(cpu_after - cpu_before) * 1e6 / spans_total:.1f} us/span")
    if args.cpu_detail:
        by_name: dict[str, float] = {}
        for tid, (name, seconds) in threads_after.items():
            by_name[name] = by_name.get(name, 0.0) + seconds - threads_before.get(tid, (name, 0.0))[1]
        for name, seconds in sorted(by_name.items(), key=lambda item: -item[1]):
            if seconds > 0:
                print(f"  cpu {name:16s} {seconds * 1e6 / spans_total:6.1f} us/span")


def _decompose_sources(platform: PlatformProcess) -> dict[str, float]:
    """observatory_decompose_traces_by_source_total of the platform, by source."""
    with urllib.request.urlopen(platform.url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    return {sample.labels["source"]: sample.value
            for family in text_string_to_metric_families(text) if family.name == "observatory_decompose_traces_by_source"
            for sample in family.samples if sample.name.endswith("_total")}


def _wait_for_trace_filter(platform: PlatformProcess, timeout: float = 600) -> None:
    """Until the decomposition's trace filter has read back the traces stored before the start
    (traces/trace_filter.py): a one-time cost of starting on a full store, not of ingesting."""
    deadline = time.monotonic() + timeout
    while platform.get("/readyz")[1].get("trace_filter") == "loading":
        if time.monotonic() > deadline:
            raise SystemExit("the trace filter did not load")
        time.sleep(0.1)


def preload(data_dir: str, project_name: str, traces: int) -> None:
    """Store `traces` synthetic traces in the platform's (not yet running) store, in this process."""
    started = time.perf_counter()
    with platform_store(data_dir, project_name) as (store, project_id):
        end = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
        seed_spans(store, project_id, traces=traces, start=end - dt.timedelta(days=1), end=end)
        store.command(f"OPTIMIZE TABLE {store.table('spans')}")  # merged, as a store ingesting for a while is
    print(f"preloaded {traces} traces ({3 * traces} spans) in {time.perf_counter() - started:.1f}s", file=sys.stderr)


def _thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{thread id: (thread name, CPU seconds so far)} of a process, Linux only (ended threads are lost)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) the platform process has used so far, Linux only."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_kib(pid: int) -> int | None:
    """The platform process's resident-set high-water mark (VmHWM), Linux only."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


if __name__ == "__main__":
    main()
