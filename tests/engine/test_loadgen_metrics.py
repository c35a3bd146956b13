"""The summary: vLLM's statistics and names, goodput counting exactly the requests that meet every SLO."""
from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace import TracerProvider
from test_loadgen_fake_server import FakeOpenAI

from engine.loadgen import LoadSpec, RequestRecord, Summary, parse_goodput, run_load_sync, summarize
from engine.loadgen.metrics import percentile


def _ok(index, ttft, tpot, e2e, tokens=10, itl=(), prompt=5):
    return RequestRecord(index=index, scheduled_ms=0.0, sent_ms=float(index), success=True, ttft_ms=ttft,
                         tpot_ms=tpot, e2e_ms=e2e, completion_tokens=tokens, prompt_tokens=prompt, itl_ms=list(itl))


def _failed(index, error_type="500"):
    return RequestRecord(index=index, scheduled_ms=0.0, sent_ms=float(index), success=False, e2e_ms=3.0,
                         status=500, error="boom", error_type=error_type)


def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0


def test_summary_statistics_and_names():
    records = [
        _ok(0, 10.0, 2.0, 30.0, itl=(1.0, 3.0)),
        _ok(1, 20.0, 4.0, 60.0, itl=(5.0,)),
        _ok(2, 30.0, None, 40.0, tokens=1),
        _failed(3),
    ]
    summary = summarize(records, 2.0, percentiles=(50, 99.9))
    data = summary.to_dict()
    assert data["completed"] == 3 and data["failed"] == 1
    assert data["total_input_tokens"] == 15 and data["total_output_tokens"] == 21
    assert data["request_throughput"] == 1.5
    assert data["output_throughput"] == 10.5 and data["total_token_throughput"] == 18.0
    assert data["request_goodput"] is None
    assert data["mean_ttft_ms"] == 20.0 and data["median_ttft_ms"] == 20.0
    assert data["std_ttft_ms"] == pytest.approx((200 / 3) ** 0.5)  # population std, as numpy
    assert data["p50_ttft_ms"] == 20.0 and data["p99.9_ttft_ms"] == pytest.approx(29.98)
    assert data["mean_tpot_ms"] == 3.0 and data["count_tpot"] == 2  # one-token outputs have no TPOT
    assert data["mean_itl_ms"] == 3.0 and data["count_itl"] == 3  # all gaps pooled
    assert data["median_e2el_ms"] == 40.0
    assert data["errors"] == {"500": 1}
    assert Summary.from_dict(json.loads(json.dumps(data))) == summary


def test_empty_metrics_are_null_not_zero():
    summary = summarize([_failed(0), _failed(1, "TimeoutError")], 1.0)
    data = summary.to_dict()
    assert data["completed"] == 0 and data["request_throughput"] == 0.0
    assert data["mean_ttft_ms"] is None and data["p99_e2el_ms"] is None and data["count_e2el"] == 0
    assert data["errors"] == {"500": 1, "TimeoutError": 1}


def test_goodput_counts_exactly_the_requests_meeting_every_slo():
    records = [
        _ok(0, 100.0, 20.0, 500.0),   # meets all
        _ok(1, 201.0, 20.0, 500.0),   # TTFT over
        _ok(2, 100.0, 30.5, 500.0),   # TPOT over
        _ok(3, 100.0, 20.0, 1001.0),  # E2EL over
        _ok(4, 200.0, 30.0, 1000.0),  # exactly at every limit: good (<=)
        _ok(5, 50.0, None, 90.0, tokens=1),  # one token: TPOT counts as 0, as in vLLM
        _failed(6),
    ]
    slos = parse_goodput(["ttft:200", "tpot:30", "e2el:1000"])
    summary = summarize(records, 2.0, goodput=slos)
    assert summary.request_goodput == 3 / 2.0
    assert summarize(records, 2.0, goodput={"ttft": 200}).request_goodput == 5 / 2.0
    assert summarize(records, 2.0, goodput={"e2el": 1000}).request_goodput == 5 / 2.0
    assert summarize(records, 1.0, goodput={"tpot": 30}).request_goodput == 5.0
    assert summary.to_dict()["goodput_slos"] == {"ttft": 200.0, "tpot": 30.0, "e2el": 1000.0}


def test_goodput_parsing():
    assert parse_goodput("ttft:300 tpot:50") == {"ttft": 300.0, "tpot": 50.0}
    for bad in (["ttft"], ["latency:5"], ["ttft:-1"], ["ttft:abc"], ["ttft:1", "ttft:2"], ["e2el:inf"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_goodput_of_a_live_run(tmp_path):
    dataset = tmp_path / "d.jsonl"
    # Short answers take ~30 ms, long ones >= 410 ms: an e2el SLO of 250 ms separates them by far.
    lengths = [2, 40, 2, 2, 40, 2]
    dataset.write_text("".join(json.dumps({"prompt": f"q{i}", "output_tokens": n}) + "\n"
                               for i, n in enumerate(lengths)))
    with FakeOpenAI(ttft=0.02, itl=0.01) as server:
        result = run_load_sync(
            LoadSpec(base_url=server.base_url, model="fake-model", arrival="constant", rate=float("inf"),
                     num_requests=6, dataset=str(dataset), goodput={"e2el": 250.0, "ttft": 1000.0}),
            tracer_provider=TracerProvider(),
        )
    good = [r.index for r in result.records if r.e2e_ms <= 250.0 and r.ttft_ms <= 1000.0]
    assert result.summary.request_goodput == pytest.approx(len(good) / result.duration)
    assert good == [0, 2, 3, 5]
