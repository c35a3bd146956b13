"""The benchmarks' synthetic stored traces (traces.seed.seed_spans) are what they claim to be:
client → gateway → engine chains, each trace with its request row, inside the time range asked for."""
import datetime as dt

from traces import ch_migrate
from traces.seed import seed_spans


def test_seed_spans_stores_linked_three_span_traces_with_their_request_rows(make_store):
    store = make_store()
    ch_migrate.apply(store, log=lambda *_: None)
    end = dt.datetime(2026, 11, 20, 12, tzinfo=dt.timezone.utc)
    start = end - dt.timedelta(hours=1)
    seed_spans(store, 7, traces=10, start=start, end=end)

    spans = store.query(
        f"SELECT trace_id, span_id, parent_span_id, service_name, toUnixTimestamp64Nano(start_time), "
        f"toUnixTimestamp64Nano(end_time) FROM {store.table('spans')} WHERE project_id = {{project_id:UInt32}}",
        project_id=7,
    )
    assert len(spans) == 30
    by_trace: dict[str, dict[str, tuple]] = {}
    for trace_id, span_id, parent, service, start_ns, end_ns in spans:
        by_trace.setdefault(trace_id, {})[service] = (span_id, parent, start_ns, end_ns)
    assert len(by_trace) == 10
    for chain in by_trace.values():
        client, gateway, engine = chain["chat-app"], chain["llm-gateway"], chain["vllm"]
        assert client[1] == "" and gateway[1] == client[0] and engine[1] == gateway[0]
        # each hop inside the one above it, and the whole trace inside [start, end + 1 s)
        assert client[2] < gateway[2] < engine[2] < engine[3] < gateway[3] < client[3]
        assert start.timestamp() * 1e9 <= client[2] and client[3] < end.timestamp() * 1e9 + 1e9

    requests = store.query(
        f"SELECT trace_id FROM {store.table('llm_requests')} WHERE project_id = {{project_id:UInt32}}", project_id=7
    )
    assert sorted(r[0] for r in requests) == sorted(by_trace)
    # nothing written under another project
    assert store.query(f"SELECT count() FROM {store.table('spans')} WHERE project_id = {{project_id:UInt32}}",
                       project_id=8) == [(0,)]
