"""Arrival processes: Poisson statistics, exact constant and burst schedules, trace replay, and on-time sending."""
from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest
from opentelemetry.sdk.trace import TracerProvider
from test_loadgen_fake_server import FakeOpenAI

from engine.loadgen import LengthRange, LoadSpec, plan_requests, run_load_sync
from engine.loadgen.arrivals import (
    TraceError,
    bounded,
    burst_offsets,
    constant_offsets,
    load_trace,
    on_off_offsets,
    poisson_offsets,
)


def _gaps(offsets):
    return [b - a for a, b in itertools.pairwise(offsets)]


def test_poisson_has_the_right_mean_and_dispersion():
    rate, n = 50.0, 20_000
    offsets = list(itertools.islice(poisson_offsets(rate, seed=7), n))
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = _gaps(offsets)
    mean = statistics.fmean(gaps)
    # Exponential gaps: standard error of the mean is (1/rate)/sqrt(n); allow 5 of them.
    assert abs(mean - 1 / rate) <= 5 * (1 / rate) / math.sqrt(len(gaps))
    # Coefficient of variation 1 (exponential); its standard error is about 1/sqrt(n).
    assert abs(statistics.pstdev(gaps) / mean - 1.0) <= 5 / math.sqrt(len(gaps))
    # Counts per one-second window: Poisson, so variance/mean ≈ 1 (std error sqrt(2/(k-1))).
    windows = [0] * int(offsets[-1])
    for offset in offsets:
        if int(offset) < len(windows):
            windows[int(offset)] += 1
    dispersion = statistics.pvariance(windows) / statistics.fmean(windows)
    assert abs(dispersion - 1.0) <= 5 * math.sqrt(2 / (len(windows) - 1))
    assert abs(statistics.fmean(windows) - rate) <= 5 * math.sqrt(rate / len(windows))


def test_poisson_is_seeded():
    first = list(itertools.islice(poisson_offsets(5.0, seed=1), 50))
    assert first == list(itertools.islice(poisson_offsets(5.0, seed=1), 50))
    assert first != list(itertools.islice(poisson_offsets(5.0, seed=2), 50))


def test_burstiness_is_the_gamma_shape():
    gaps = _gaps(list(itertools.islice(poisson_offsets(10.0, seed=3, burstiness=0.25), 20_000)))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)
    # Gamma with shape k has coefficient of variation 1/sqrt(k) = 2.
    assert statistics.pstdev(gaps) / mean == pytest.approx(2.0, rel=0.08)


def test_infinite_rate_sends_everything_at_once():
    assert list(bounded(poisson_offsets(math.inf), count=4)) == [0.0] * 4
    assert list(bounded(constant_offsets(math.inf), count=3)) == [0.0] * 3


def test_constant_schedule_is_exact():
    offsets = list(bounded(constant_offsets(8.0), count=1000))
    assert offsets == [i / 8.0 for i in range(1000)]
    assert list(bounded(constant_offsets(10.0), duration=1.0)) == [i / 10.0 for i in range(10)]


def test_burst_schedules_are_exact():
    assert list(bounded(burst_offsets(3, 0.5), count=8)) == [0, 0, 0, 0.5, 0.5, 0.5, 1.0, 1.0]
    assert list(bounded(burst_offsets(4, 2.0), duration=5.0)) == [0.0] * 4 + [2.0] * 4 + [4.0] * 4
    # On/off: 4 req/s for 1 s, then 2 s off.
    assert list(bounded(on_off_offsets(4.0, 1.0, 2.0), count=10)) == [
        0.0, 0.25, 0.5, 0.75, 3.0, 3.25, 3.5, 3.75, 6.0, 6.25,
    ]
    # on * rate an exact whole number: the window holds exactly that many.
    assert list(bounded(on_off_offsets(5.0, 1.0, 0.0), count=6)) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_count_and_duration_bound_together():
    assert list(bounded(constant_offsets(10.0), count=3, duration=10.0)) == [0.0, 0.1, 0.2]
    assert len(list(bounded(constant_offsets(10.0), count=100, duration=0.5))) == 5
    with pytest.raises(ValueError):
        next(bounded(constant_offsets(1.0)))


def _write(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_trace_offsets_timestamps_and_contents(tmp_path):
    entries = load_trace(_write(tmp_path / "t.jsonl", [
        {"offset": 1.5, "prompt": "later"},
        "# a comment",
        "",
        {"offset": 0.5, "input_tokens": 30, "output_tokens": 5},
        {"offset_ms": 500, "messages": [{"role": "user", "content": "same time, file order"}]},
    ]))
    assert [e.offset for e in entries] == [0.0, 0.0, 1.0]
    assert [e.line for e in entries] == [4, 5, 1]
    assert entries[0].input_tokens == 30 and entries[0].output_tokens == 5
    assert entries[1].messages == ({"role": "user", "content": "same time, file order"},)
    assert entries[2].prompt == "later"
    stamped = load_trace(_write(tmp_path / "s.jsonl", [
        {"timestamp": "2025-01-01T00:00:02Z"},
        {"timestamp": "2025-01-01T00:00:00.250+00:00"},
    ]))
    assert [e.offset for e in stamped] == [0.0, 1.75]
    unix = load_trace(_write(tmp_path / "u.jsonl", [{"timestamp_ms": 1_700_000_000_500}, {"timestamp_ms": 1_700_000_000_000}]))
    assert [e.offset for e in unix] == [0.0, 0.5]


@pytest.mark.parametrize("lines,message", [
    ([{"prompt": "no time"}], ":1: no time field"),
    ([{"offset": 0}, "{broken"], ":2: not valid JSON"),
    ([{"offset": -1}], "must be >= 0"),
    ([{"offset": True}], "finite number"),
    ([{"offset": 0}, {"timestamp": 5}], "mixes offsets and timestamps"),
    ([{"offset": 0, "output_tokens": 0}], "'output_tokens' must be a whole number >= 1"),
    ([{"offset": 0, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}], "not both"),
    ([{"offset": 0, "messages": [{"role": "user"}]}], "string 'content'"),
    (["[1, 2]"], "must be a JSON object"),
    (["# only a comment"], "no entries"),
])
def test_bad_traces_are_refused_with_the_line(tmp_path, lines, message):
    with pytest.raises(TraceError, match=message.replace("(", r"\(")):
        load_trace(_write(tmp_path / "bad.jsonl", lines))


def test_replay_plan_follows_the_file(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [
        {"offset": 0.0, "prompt": "alpha"},
        {"offset": 0.1, "input_tokens": 12, "output_tokens": 3},
        {"offset": 0.3},
    ])
    spec = LoadSpec(arrival="replay", trace=trace, replay_speed=2.0, output_len=LengthRange(4, 4), seed=5)
    plan = plan_requests(spec)
    planned = list(plan)
    assert [p.offset for p in planned] == [0.0, 0.05, 0.15]
    assert planned[0].content.prompt == "alpha" and planned[0].content.max_tokens == 4
    assert planned[1].content.input_tokens == 12 and planned[1].content.max_tokens == 3
    assert planned[2].content.max_tokens == 4  # the workload fills what the line leaves out
    limited = plan_requests(LoadSpec(arrival="replay", trace=trace, num_requests=2))
    assert len(limited) == 2
    assert len(plan_requests(LoadSpec(arrival="replay", trace=trace, duration=0.2))) == 2


def test_requests_are_sent_on_schedule(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [
        {"offset": 0.0, "prompt": "first"},
        {"offset": 0.12, "prompt": "second"},
        {"offset": 0.05, "prompt": "third in time"},
    ])
    with FakeOpenAI(ttft=0.005, itl=0.002) as server:
        replayed = run_load_sync(LoadSpec(base_url=server.base_url, model="fake-model", arrival="replay", trace=trace,
                                          output_len=LengthRange(2, 2)), tracer_provider=TracerProvider())
        assert [r.body["prompt"] for r in server.received] == ["first", "third in time", "second"]
        paced = run_load_sync(LoadSpec(base_url=server.base_url, model="fake-model", arrival="constant", rate=25.0,
                                       num_requests=8, input_len=LengthRange(8, 8), output_len=LengthRange(2, 2)),
                              tracer_provider=TracerProvider())
        bursts = run_load_sync(LoadSpec(base_url=server.base_url, model="fake-model", arrival="burst", burst_size=3,
                                        burst_interval=0.1, num_requests=6, input_len=LengthRange(8, 8),
                                        output_len=LengthRange(2, 2)), tracer_provider=TracerProvider())
    assert [r.scheduled_ms for r in replayed.records] == [0.0, 50.0, 120.0]
    assert [r.scheduled_ms for r in paced.records] == [i * 40.0 for i in range(8)]
    assert [r.scheduled_ms for r in bursts.records] == [0.0] * 3 + [100.0] * 3
    lateness = []
    for record in replayed.records + paced.records + bursts.records:
        assert record.success
        assert record.sent_ms >= record.scheduled_ms  # never early
        lateness.append(record.sent_ms - record.scheduled_ms)
    # Late only by event-loop jitter (a stall of the shared machine may delay a few).
    assert statistics.median(lateness) <= 5.0
