"""The command line: argument errors (exit 2, clear message), a full run with --json, and the JSON round trip."""
from __future__ import annotations

import io
import json

import pytest
from test_loadgen_fake_server import FakeOpenAI, free_port

from engine.loadgen import LoadResult, ProgressBar, load_result, main, summarize
from engine.loadgen.client import RequestRecord


@pytest.mark.parametrize("argv,message", [
    (["--num-requests", "3", "--rate", "-1"], "--rate must be > 0"),
    (["--num-requests", "3", "--rate", "abc"], "'abc' is not a number"),
    (["--rate", "2"], "needs --num-requests and/or --duration"),
    (["--rate", "inf", "--duration", "5"], "give --num-requests"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--num-requests", "3", "--duration", "0"], "--duration must be"),
    (["--num-requests", "3", "--arrival", "burst"], "needs either --burst-size and --burst-interval"),
    (["--num-requests", "3", "--arrival", "burst", "--burst-size", "0", "--burst-interval", "1"],
     "--burst-size must be >= 1"),
    (["--num-requests", "3", "--arrival", "burst", "--burst-size", "2", "--burst-on", "1"], "needs either"),
    (["--arrival", "replay"], "needs --trace"),
    (["--arrival", "replay", "--trace", "/nonexistent/t.jsonl"], "no file"),
    (["--arrival", "sometimes", "--num-requests", "1"], "invalid choice"),
    (["--endpoint", "embeddings", "--num-requests", "1"], "invalid choice"),
    (["--num-requests", "3", "--input-len", "5:2"], "upper bound 2 is below the lower bound 5"),
    (["--num-requests", "3", "--output-len", "0"], "--output-len must be >= 1"),
    (["--num-requests", "3", "--input-len", "x"], "expected whole numbers"),
    (["--num-requests", "3", "--goodput", "ttft:100", "speed:3"], "KEY:MILLISECONDS"),
    (["--num-requests", "3", "--no-stream", "--goodput", "ttft:100"], "need streaming"),
    (["--num-requests", "3", "--dataset", "/nonexistent.jsonl"], "existing JSONL file"),
    (["--num-requests", "3", "--base-url", "ftp://x/v1"], "--base-url must be an http(s) URL"),
    (["--num-requests", "3", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--num-requests", "3", "--percentiles", "50,100"], "strictly between 0 and 100"),
    (["--num-requests", "3", "--otlp-header", "novalue"], "expected KEY=VALUE"),
    (["--num-requests", "3", "--extra-body", "[1]"], "must be a JSON object"),
    (["--num-requests", "3", "--extra-body", '{"stream": false, "top_k": 5}'], "--extra-body cannot set stream"),
    (["--num-requests", "3", "--timeout", "nan"], "not a finite number"),
])
def test_argument_errors_exit_2_with_a_clear_message(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--goodput" in capsys.readouterr().out


def test_bad_dataset_content_exits_2(tmp_path, capsys):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    assert main(["--num-requests", "1", "--model", "m", "--dataset", str(dataset), "--quiet"]) == 2
    assert f"{dataset}:2: each line needs 'prompt'" in capsys.readouterr().err


def test_unreachable_model_list_exits_1(capsys):
    assert main(["--base-url", f"http://127.0.0.1:{free_port()}/v1", "--num-requests", "1", "--quiet"]) == 1
    assert "cannot list models" in capsys.readouterr().err


def test_full_run_prints_the_table_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    out = tmp_path / "result.json"
    with FakeOpenAI(ttft=0.01, itl=0.002) as server:
        code = main([
            "--base-url", server.base_url, "--endpoint", "chat", "--arrival", "constant", "--rate", "50",
            "--num-requests", "5", "--input-len", "10:20", "--output-len", "4", "--seed", "3",
            "--goodput", "ttft:500", "e2el:1000", "--percentiles", "50,90,99", "--json", str(out), "--quiet",
            "--extra-body", '{"top_p": 0.9}', "--api-key", "sk-test",
        ])
        assert all(r.body["model"] == "fake-model" for r in server.received)  # found at /v1/models
        assert all(r.body["top_p"] == 0.9 for r in server.received)
        assert all(r.headers["Authorization"] == "Bearer sk-test" for r in server.received)
    assert code == 0
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out
    assert "Successful requests:" in captured.out and "Median TTFT (ms):" in captured.out
    assert "Request goodput (req/s):" in captured.out
    assert captured.err == ""  # --quiet: no progress bar
    data = json.loads(out.read_text())
    assert data["format"] == "llm-loadgen/1"
    assert data["model"] == "fake-model"
    assert data["config"]["endpoint"] == "chat" and data["config"]["input_len"] == "10:20"
    assert data["config"]["api_key"] is None and data["config"]["api_key_set"] is True  # never the secret
    assert "sk-test" not in out.read_text()
    assert data["summary"]["completed"] == 5 and data["summary"]["request_goodput"] > 0
    assert len(data["requests"]) == 5
    assert all(len(r["trace_id"]) == 32 and r["success"] for r in data["requests"])
    # Round trip: reading the file back gives the same result, and the summary recomputes from the requests.
    result = load_result(str(out))
    again = result.to_dict()
    data["config"]["api_key_set"] = False  # the secret is not in the file, so a re-read result has none
    assert again == data
    recomputed = summarize(result.records, result.duration, goodput=result.spec.goodput,
                           percentiles=result.spec.percentiles)
    assert recomputed == result.summary


def test_spans_are_exported_to_the_given_otlp_endpoint(capsys):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    with FakeOpenAI(ttft=0.005, itl=0.001) as server:
        code = main([
            "--base-url", server.base_url, "--model", "fake-model", "--arrival", "constant", "--rate", "inf",
            "--num-requests", "3", "--output-len", "2", "--input-len", "4", "--quiet",
            "--otlp-endpoint", server.base_url + "/traces", "--otlp-protocol", "http/protobuf",
            "--otlp-header", "authorization=Bearer ingest-key",
        ])
        exports = list(server.otlp_exports)  # flushed before main returned
    assert code == 0 and exports
    for headers, _ in exports:
        assert {k.lower(): v for k, v in headers.items()}["authorization"] == "Bearer ingest-key"
    spans, services = [], set()
    for _, body in exports:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            attrs = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
            services.add(attrs.get("service.name"))
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
    assert services == {"llm-loadgen"}
    assert len(spans) == 3 and all(span.name == "text_completion fake-model" for span in spans)
    assert all(span.kind == 3 for span in spans)  # SPAN_KIND_CLIENT


def test_json_round_trip_of_a_result_object(tmp_path):
    from engine.loadgen import LoadSpec

    records = [RequestRecord(index=0, scheduled_ms=0.0, sent_ms=0.1, success=True, e2e_ms=5.0, ttft_ms=1.0,
                             tpot_ms=1.0, itl_ms=[1.0, 1.0], completion_tokens=5, prompt_tokens=3)]
    spec = LoadSpec(rate=float("inf"), num_requests=1, goodput={"e2el": 10.0})
    result = LoadResult(spec=spec, model="m", started_at=1.7e9, duration=0.01, records=records,
                        summary=summarize(records, 0.01, goodput=spec.goodput))
    path = tmp_path / "r.json"
    result.write_json(str(path))
    back = load_result(str(path))
    assert back.to_dict() == result.to_dict()
    assert back.spec.rate == float("inf") and back.records == records
    path.write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a load generator result"):
        load_result(str(path))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_draws_only_on_a_terminal():
    record = RequestRecord(index=0, scheduled_ms=0.0, success=True)
    piped = io.StringIO()
    bar = ProgressBar(piped)
    bar.start(2)
    bar.advance(record)
    bar.close()
    assert piped.getvalue() == ""
    terminal = _Terminal()
    bar = ProgressBar(terminal)
    bar.start(2)
    bar.advance(record)
    bar.advance(RequestRecord(index=1, scheduled_ms=0.0, success=False))
    bar.close()
    text = terminal.getvalue()
    assert "\r" in text and "2/2 requests, 1 ok, 1 failed" in text and "100.0%" in text and text.endswith("\n")
