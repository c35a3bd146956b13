"""The load generator: drives an OpenAI-compatible endpoint and measures latency exactly as vLLM's benchmark does.

Arrivals (Poisson, constant, bursts, trace replay), request contents (ShareGPT-like
lengths, fixed/uniform, JSONL datasets), a streaming client measuring TTFT, ITL, TPOT and
end-to-end latency, vLLM's summary and goodput, and one OTel CLIENT span per request whose
``traceparent`` makes the gateway and engine spans its descendants.

    from engine.loadgen import LoadSpec, run_load_sync
    result = run_load_sync(LoadSpec(num_requests=100, rate=5))
    print(result.summary.to_dict()["median_ttft_ms"])

Command line: ``python -m engine.loadgen --help``.
"""
from engine.loadgen.cli import main
from engine.loadgen.client import RequestRecord
from engine.loadgen.metrics import MetricStats, Summary, summarize
from engine.loadgen.report import ProgressBar, format_summary
from engine.loadgen.runner import LoadError, LoadResult, load_result, plan_requests, run_load, run_load_sync
from engine.loadgen.spec import LengthRange, LoadSpec, SpecError, parse_goodput
from engine.loadgen.workload import WorkloadFileError

__all__ = [
    "LengthRange",
    "LoadError",
    "LoadResult",
    "LoadSpec",
    "MetricStats",
    "ProgressBar",
    "RequestRecord",
    "SpecError",
    "Summary",
    "WorkloadFileError",
    "format_summary",
    "load_result",
    "main",
    "parse_goodput",
    "plan_requests",
    "run_load",
    "run_load_sync",
    "summarize",
]
