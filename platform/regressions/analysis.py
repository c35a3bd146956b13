"""A replayed run's analysis: each result joined with the platform's decomposed row of its trace (waited for until
the row is complete), its output scored by the item's evaluators, both arms summarised and compared with the
baseline (the paired arm, the run given, or the last passing run of the same dataset and target): the verdict."""
from __future__ import annotations

import math
import time

from jobs.leases import SHUTTING_DOWN, Lease

from . import cache_sweep, queries
from . import gates as gates_module
from .evaluators import evaluators_for, score_output
from .models import Arm, RegressionRun, RunResult, RunState, Verdict
from .runner import SERVICE_NAME
from .service import cfg


class Interrupted(RuntimeError):
    """This worker is stopping: the run stays claimed where it is and resumes after the restart."""


def complete_row(row: dict | None) -> bool:
    """Whether a request row is the whole request: the run's client span is its outermost hop and the engine's
    figures are in."""
    return row is not None and row.get("service") == SERVICE_NAME and (
        row.get("engine_ttft_ms") is not None or row.get("queue_ms") is not None)


def wait_for_rows(store, run: RegressionRun, trace_ids: list[str], lease: Lease,
                  rows: dict[str, dict] | None = None) -> dict[str, dict]:
    """The rows of the run's traces, once each is complete: its outermost hop is the run's own client span and it
    has the engine's figures (the spans of one request come from three exporters and are decomposed as they
    arrive; the row is rebuilt when the rest comes). A target that sends no engine spans (an untraced URL) is
    recognised when, UNTRACED_GRACE_SECONDS into the wait, no row has engine figures. After ROW_WAIT_SECONDS,
    what there is."""
    started = time.monotonic()
    deadline = started + cfg("ROW_WAIT_SECONDS")
    rows = {t: rows[t] for t in trace_ids if t in rows} if rows else {}

    def engine_seen() -> bool:
        return any(row.get("engine_ttft_ms") is not None or row.get("queue_ms") is not None for row in rows.values())

    def complete(trace_id: str, untraced: bool) -> bool:
        row = rows.get(trace_id)
        if row is None or row.get("service") != SERVICE_NAME:
            return False
        return untraced or row.get("engine_ttft_ms") is not None or row.get("queue_ms") is not None

    while True:
        untraced = time.monotonic() - started >= cfg("UNTRACED_GRACE_SECONDS") and not engine_seen()
        missing = [t for t in trace_ids if not complete(t, untraced)]
        if missing:
            rows.update(queries.request_rows(store, run.project_id, missing))
            missing = [t for t in missing if not complete(t, untraced)]
        if not missing or time.monotonic() >= deadline:
            return rows
        lease.check()
        if SHUTTING_DOWN.is_set():
            raise Interrupted()
        time.sleep(0.25)


def _as_dict(result: RunResult, has_evaluators: bool) -> dict:
    return {"item_id": result.item_id, "repetition": result.repetition, "success": result.success,
            "metrics": result.metrics or {}, "prompt_bucket": result.prompt_bucket, "passed": result.passed,
            "scores": result.scores or {}, "has_evaluators": has_evaluators}


def last_passing_run(run: RegressionRun) -> RegressionRun | None:
    return (RegressionRun.objects.filter(
        project_id=run.project_id, dataset_version__dataset_id=run.dataset_version.dataset_id, target=run.target,
        state=RunState.DONE, verdict=Verdict.PASS, id__lt=run.id).order_by("-id").first())


def _note_similarities(store, run: RegressionRun, results: list[RunResult]) -> None:
    """A cache sweep's results get the similarity the gateway found for them (from the run's traces)."""
    passes = {cache_sweep.arm_of(t) for t in run.options["cache_sweep"]["thresholds"]}
    found = queries.cache_similarities(store, run.project_id, [
        r.trace_id for r in results if r.arm in passes and r.trace_id and r.success])
    for result in results:
        result.similarity = found.get(result.trace_id, result.similarity) if result.arm in passes else None


def _sweep_report(results: list[RunResult], sweep: dict) -> dict:
    def as_dict(result: RunResult) -> dict:
        return {"item_id": result.item_id, "success": result.success, "served_from": result.served_from,
                "passed": result.passed, "similarity": result.similarity, "error": result.error}

    baseline = [as_dict(r) for r in results if r.arm == Arm.CANDIDATE]
    passes = [(t, [as_dict(r) for r in results if r.arm == cache_sweep.arm_of(t)]) for t in sweep["thresholds"]]
    return cache_sweep.report(baseline, passes, sweep["max_false_hit_rate"])


def _arm_summary(results: list[dict]) -> dict:
    total = len(results)
    errors = sum(1 for r in results if not r["success"])
    passed = [r["passed"] for r in results if r["passed"] is not None]
    out = {"requests": total, "errors": errors, "error_rate": (100.0 * errors / total) if total else None,
           "pass_rate": (100.0 * sum(passed) / len(passed)) if passed else None, "evaluated": len(passed)}
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms"):
        values = [r["metrics"][metric] for r in results if r["success"] and r["metrics"].get(metric) is not None]
        out[metric] = gates_module._quantiles(values)
    return out


def analyse(store, run: RegressionRun, lease: Lease, rows: dict[str, dict] | None = None) -> dict:
    """Join every result with its decomposed row, score the outputs and compare with the baseline; the results are
    written, the run's fields to finish it with returned (verdict, comparison, summary, synthetic, baseline_run)."""
    timings: dict[str, float] = {}
    clock = time.monotonic()
    results = list(run.results.filter(warmup=False).order_by("id"))
    trace_ids = [r.trace_id for r in results if r.trace_id and r.success]
    rows = wait_for_rows(store, run, trace_ids, lease, rows)
    timings["rows_s"], clock = time.monotonic() - clock, time.monotonic()
    items = {item.item_id: item for item in run.dataset_version.items.all()}
    paired = run.baseline_target is not None
    baseline_run = None
    baseline_outputs: dict[tuple[str, int], str] = {}
    if paired:
        baseline_outputs = {(r.item_id, r.repetition): r.output for r in results
                            if r.arm == Arm.BASELINE and r.success}
    else:
        baseline_run = run.baseline_run or last_passing_run(run)
        if baseline_run is not None:
            baseline_outputs = {(r.item_id, r.repetition): r.output for r in baseline_run.results.filter(
                warmup=False, arm=Arm.CANDIDATE, success=True)}
    for result in results:
        row = rows.get(result.trace_id)
        if row is not None:
            result.prompt_bucket = row["prompt_bucket"] or ""
            result.row_found = row["service"] == SERVICE_NAME
            for key in queries.METRIC_COLUMNS:
                if row[key] is not None and not (isinstance(row[key], float) and math.isnan(row[key])):
                    result.metrics[key] = float(row[key])
        item = items.get(result.item_id)
        if item is None or not result.success:
            continue
        specs = evaluators_for(item.evaluators or [], item.expected, paired=paired or baseline_run is not None)
        reference = baseline_outputs.get((result.item_id, result.repetition)) if result.arm == Arm.CANDIDATE else None
        result.scores, result.passed = score_output(specs, result.output, expected=item.expected,
                                                    baseline_output=reference)
    sweep = run.options.get("cache_sweep")
    if sweep:
        _note_similarities(store, run, results)
    timings["scores_s"], clock = time.monotonic() - clock, time.monotonic()
    lease.check()
    RunResult.objects.bulk_update(results, ["row_found", "prompt_bucket", "metrics", "scores", "passed",
                                            "similarity"], batch_size=500)
    timings["write_s"], clock = time.monotonic() - clock, time.monotonic()
    has_evaluators = {item_id: bool(item.evaluators or item.expected is not None) for item_id, item in items.items()}
    candidate = [_as_dict(r, has_evaluators.get(r.item_id, False)) for r in results if r.arm == Arm.CANDIDATE]
    if paired:
        baseline = [_as_dict(r, has_evaluators.get(r.item_id, False)) for r in results if r.arm == Arm.BASELINE]
    elif baseline_run is not None:
        baseline = [_as_dict(r, has_evaluators.get(r.item_id, False))
                    for r in baseline_run.results.filter(warmup=False, arm=Arm.CANDIDATE)]
    else:
        baseline = None
    summary = dict(RegressionRun.objects.get(id=run.id).summary or {})
    summary["candidate"] = _arm_summary(candidate)
    summary["rows_found"] = sum(1 for r in results if r.row_found)  # with the run's client span as outermost hop
    if trace_ids and not any(complete_row(row) for row in rows.values()):
        summary["untraced_note"] = (
            "no engine spans were found in this project for the run's requests: its figures are the client's and "
            "the gateway's only (an untraced target, or one whose spans go to another project: the managed "
            "fleet's go to the project of its ingest key)")
    summary["rows_expected"] = len(trace_ids)
    if sweep:
        summary["cache_sweep"] = _sweep_report(results, sweep)
    synthetic = queries.simulated(store, run.project_id, trace_ids)
    if baseline is None:
        comparison = {"baseline": None, "gates": [], "metrics": [], "buckets": {}, "quality": [],
                      "note": "no baseline to compare with (no earlier passing run of this dataset and target): "
                              "this run's figures become the baseline once it passes"}
        error_rate = summary["candidate"]["error_rate"] or 0.0
        verdict = Verdict.FAIL if error_rate >= 50.0 else Verdict.PASS
        if verdict == Verdict.FAIL:
            comparison["gates"] = [{"metric": "error_rate", "verdict": "fail", "passed": False,
                                    "baseline": None, "candidate": error_rate,
                                    "reason": f"the candidate failed {error_rate:.0f}% of its requests"}]
    else:
        summary["baseline"] = _arm_summary(baseline)
        comparison = gates_module.compare(baseline, candidate, run.gates, paired=paired,
                                          seed=int(run.options.get("seed", 0)))
        comparison["baseline"] = ({"kind": "paired", "target": run.baseline_target} if paired
                                  else {"kind": "run", "run_id": baseline_run.id})
        verdict = comparison["verdict"]
    timings["compare_s"] = time.monotonic() - clock
    summary["analysis_timings"] = {k: round(v, 3) for k, v in timings.items()}
    if synthetic:
        summary["synthetic_note"] = ("outputs come from the engine simulator: their text is synthetic, so quality "
                                     "scores say nothing about a model; latencies are the simulator's model of "
                                     "vLLM on the configured GPU")
    return {"verdict": verdict, "comparison": comparison, "summary": summary, "synthetic": synthetic,
            "baseline_run": baseline_run}
