"""The search of a tuning study: Optuna ask-and-tell over the space, scored by SLO goodput in the simulator.

Single-objective studies (``goodput``, ``goodput_per_gpu``) use TPE with constraints;
``pareto`` (goodput against p99 TTFT at the workload's peak rate) uses NSGA-II. A point
vLLM would refuse (``space.check``: the config's own validation and the simulator's memory
plan) is told to Optuna as infeasible (constraint value 1) without simulating, and does not
count against the trial budget, so no trial is spent on it. Trials left RUNNING by a worker
that died (Optuna's heartbeat does not cover ask-and-tell) are failed and their points
enqueued again by ``recover``.

After the search (``settle``) the best candidates (and the current config) are scored again over
the selection seeds (other arrival orders and length draws); the selection score is median − MAD,
as vLLM's ``tune_speculative_k`` ranks; among candidates within 2% of the best selection score the
one closest to the current config (fewest changed knobs) wins. A figure on the seeds a config was
chosen on carries the luck of its choice, so the winner, the current config and the auto_tune.sh-style
grid's best are then scored on fresh seeds, the same for all three: the figures a study reports
(``FIGURES`` says what each is). A winner that does not beat the current config there by more than the goodput
search's precision is not proposed (``no_gain``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import statistics as stats_lib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import optuna

from engine.config import EngineConfig
from engine.sim.profiles import HardwareProfile

from .goodput import Goodput, Measure, Slo, goodput, measure
from .space import Space, check, distance
from .workload import Workload

log = logging.getLogger(__name__)
optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes")

OBJECTIVES = ("goodput", "goodput_per_gpu", "pareto")
NEAR_EQUAL = 0.02
MAX_INVALID_PER_TRIAL = 50


@dataclasses.dataclass
class Problem:
    current: EngineConfig
    space: Space
    workload: Workload
    slo: Slo
    objective: str = "goodput"
    seed: int = 0
    count: int = 400  # simulated requests per rate
    precision: float = 0.03  # relative width the goodput search stops at
    hardware: HardwareProfile | None = None  # the group's calibrated engine model (None: the published constants)

    def score(self, result: Goodput, config: EngineConfig) -> float:
        if self.objective == "goodput_per_gpu":
            return result.goodput / config.tensor_parallel_size
        return result.goodput

    def reference_rate(self) -> float:
        return max(self.workload.peak_rate, 0.01)


def _constraints(trial: optuna.trial.FrozenTrial) -> tuple[float]:
    return (float(trial.user_attrs.get("constraint", 0.0)),)


def sampler(objective: str, seed: int) -> optuna.samplers.BaseSampler:
    with warnings.catch_warnings():  # constraints_func and multivariate are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if objective == "pareto":
            return optuna.samplers.NSGAIISampler(seed=seed, constraints_func=_constraints, population_size=20)
        return optuna.samplers.TPESampler(seed=seed, constraints_func=_constraints, multivariate=True,
                                          n_startup_trials=10)


def directions(objective: str) -> list[str]:
    return ["maximize", "minimize"] if objective == "pareto" else ["maximize"]


def evaluate(problem: Problem, point: dict[str, Any], start: float | None = None) -> dict[str, Any]:
    """Check and score one point: {"valid": False, "problems"} or the config, goodput and its measures."""
    config, problems = check(problem.space, problem.current, point)
    if config is None:
        return {"valid": False, "problems": problems}
    result = goodput(config, problem.workload, problem.slo, seed=problem.seed, count=problem.count,
                     hardware=problem.hardware,
                     precision=problem.precision, start=start)
    out = {"valid": True, "config": config.to_dict(), "goodput": result.goodput,
           "score": problem.score(result, config), "best_attainment": result.best_attainment,
           "at": result.at.to_dict() if result.at else None, "evaluations": result.evaluations}
    if problem.objective == "pareto":
        peak = measure(config, problem.workload, problem.slo, problem.reference_rate(), count=problem.count,
                       hardware=problem.hardware,
                       seed=problem.seed)
        out["ttft_p99_at_peak"] = peak.ttft_p99 if math.isfinite(peak.ttft_p99) else 1e9
    return out


def recover(study: optuna.Study, trial_ids: set[int] | None = None) -> int:
    """Fail trials a dead worker left RUNNING (all, or those with these storage ids) and enqueue their points
    again; returns how many."""
    storage = study._storage
    count = 0
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if trial_ids is not None and trial._trial_id not in trial_ids:
            continue
        storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
        if trial.params:
            study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number}, skip_if_exists=False)
        count += 1
    return count


def valid_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.user_attrs.get("valid")]


def seed_start(problem: Problem, study: optuna.Study) -> None:
    """First the points nearest vLLM's defaults and the current config: TPE starts from what runs today."""
    if study.get_trials(deepcopy=False):
        return
    seen = []
    for config in (EngineConfig(model=problem.current.model, gpu_type=problem.current.gpu_type,
                                tensor_parallel_size=problem.current.tensor_parallel_size), problem.current):
        point = problem.space.nearest(config)
        if point and point not in seen:
            seen.append(point)
            study.enqueue_trial(point, user_attrs={"seeded_from": "vLLM defaults" if len(seen) == 1 else
                                                   "current config"})


@dataclasses.dataclass
class Outcome:
    """One valid trial run to its end (``result`` None when stopped first) and the refused points asked before."""

    result: dict[str, Any] | None
    invalid: int
    trial_number: int | None = None


def run_one(problem: Problem, study: optuna.Study, *, best: float | None = None, max_invalid: int = 1000,
            on_start: Callable[[optuna.trial.Trial], bool | None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Outcome:
    """Ask until a point vLLM would accept comes (refused ones are told as infeasible at once, not simulated),
    score it and tell it. ``on_start`` sees the valid trial before it is simulated (a worker's lease); when it
    returns False another worker holds the trial, and this one asks again."""
    invalid = 0
    while True:
        if should_stop and should_stop():
            return Outcome(None, invalid)
        if invalid > max_invalid:
            raise RuntimeError(f"{invalid} points in a row were configurations vLLM refuses: narrow the space to "
                               "values that fit together")
        trial = study.ask()
        point = problem.space.suggest(trial)
        config, problems = check(problem.space, problem.current, point)
        if config is None:
            if _told(study, trial, {"valid": False, "constraint": 1.0, "problems": problems[:3]},
                     [0.0, 1e9] if problem.objective == "pareto" else [0.0]):
                invalid += 1
            continue
        if on_start and on_start(trial) is False:
            continue  # another worker holds this trial (it took the same enqueued point): it will tell it
        result = evaluate(problem, point, start=best)
        attrs = {"valid": True, "constraint": 0.0}
        attrs.update({key: result[key] for key in ("config", "goodput", "score", "best_attainment", "at",
                                                   "evaluations", "ttft_p99_at_peak") if key in result})
        values = [result["score"], result["ttft_p99_at_peak"]] if problem.objective == "pareto" else \
            [result["score"]]
        if not _told(study, trial, attrs, values):
            continue
        return Outcome(result, invalid, trial.number)


def _told(study: optuna.Study, trial: optuna.trial.Trial, attrs: dict[str, Any], values: list[float]) -> bool:
    """Record and tell a trial; False when another worker finished it first. Two workers can both take the same
    enqueued trial where the storage cannot lock its row (SQLite ignores SELECT ... FOR UPDATE): the first tell
    wins, and the other worker's duplicate is dropped rather than failing the study."""
    try:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        study.tell(trial, values)
    except optuna.exceptions.UpdateFinishedTrialError:
        log.info("trial %s was finished by another worker; dropping this worker's duplicate", trial.number)
        return False
    return True


def search(problem: Problem, study: optuna.Study, budget: int, *,
           progress: Callable[[int, int, float | None], None] | None = None,
           should_stop: Callable[[], bool] | None = None) -> None:
    """Ask and tell until ``budget`` valid trials are complete (resuming where the study is, and counting those
    other workers tell the same study meanwhile), in this thread."""
    seed_start(problem, study)
    invalid = sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("valid") is False)
    done = len(valid_trials(study))
    best = max((t.user_attrs["score"] for t in valid_trials(study)), default=None)
    while done < budget:
        outcome = run_one(problem, study, best=best, should_stop=should_stop,
                          max_invalid=MAX_INVALID_PER_TRIAL * budget)
        invalid += outcome.invalid
        if outcome.result is None:
            return
        # Other workers may be telling trials to the same study: count them all.
        done = max(done + 1, len(valid_trials(study)))
        score = outcome.result["score"]
        best = score if best is None else max(best, score)
        if progress:
            progress(done, invalid, best)


# Selection seeds are the search's seed + 1000·k; fresh seeds lie halfway between them, so no count of either
# makes the two sets (or the search's seed) meet.
SEED_STRIDE = 1000
FRESH_OFFSET = 500

FIGURES = {
    "goodput": "median goodput over {fresh} fresh seeds: arrival orders and length draws that neither the search nor "
               "the choice of the winner used",
    "robust": "median − MAD (median absolute deviation) of the goodputs over the same fresh seeds: a lower figure "
              "that most seeds reach",
    "search": "the goodput on the search's seed, where the trial was scored: the best of many trials there, so it "
              "leans upward",
    "selection": "median − MAD over the {selection} selection seeds, on which the winner was chosen among the best "
                 "candidates",
}


def selection_seeds(problem: Problem, count: int) -> list[int]:
    """The seeds the best candidates are re-scored on to choose the winner."""
    return [problem.seed + SEED_STRIDE * k for k in range(1, count + 1)]


def fresh_seeds(problem: Problem, count: int) -> list[int]:
    """Seeds neither the search nor the selection used: the figures a study reports are scored on them."""
    return [problem.seed + SEED_STRIDE * k + FRESH_OFFSET for k in range(1, count + 1)]


def figures(fresh: int, selection: int) -> dict[str, str]:
    """What each reported figure is, in words (the API's ``figures``; the CLI and the page say the same)."""
    return {k: v.format(fresh=fresh, selection=selection) for k, v in FIGURES.items()}


def _median_mad(values: list[float]) -> tuple[float, float]:
    median = stats_lib.median(values)
    return median, stats_lib.median(abs(v - median) for v in values)


def over_seeds(problem: Problem, seeds: list[int], entry: dict[str, Any]) -> dict[str, Any]:
    """One config ({"config", "goodput"?}: the goodput warm-starts each search) scored on each seed, with the
    statistics of its goodputs (req/s) and of its scores (the objective's unit): median, MAD, median − MAD."""
    config = EngineConfig.from_dict(entry["config"])
    goodputs, scores = [], []
    for seed in seeds:
        result = goodput(config, problem.workload, problem.slo, seed=seed, count=problem.count,
                         hardware=problem.hardware,
                         precision=problem.precision, start=entry.get("goodput") or None)
        goodputs.append(result.goodput)
        scores.append(problem.score(result, config))
    median, mad = _median_mad(goodputs)
    score, score_mad = _median_mad(scores)
    return {"seeds": list(seeds), "seed_goodputs": [round(g, 4) for g in goodputs],
            "seed_scores": [round(s, 4) for s in scores], "goodput": median, "mad": mad,
            "robust_goodput": median - mad, "score": score, "robust_score": score - score_mad}


def rescore_one(problem: Problem, seeds: list[int], candidate: dict[str, Any]) -> dict[str, Any]:
    """A candidate ({"config", "score", "goodput"}) on the selection seeds: its selection score (median − MAD) and
    its distance from the current config."""
    scored = over_seeds(problem, seeds, candidate)
    return {**candidate, "seed_scores": scored["seed_scores"], "median": scored["score"],
            "mad": scored["score"] - scored["robust_score"], "robust_score": scored["robust_score"],
            "distance": distance(EngineConfig.from_dict(candidate["config"]), problem.current)}


def robust(problem: Problem, candidates: list[dict[str, Any]], seeds: int = 5) -> list[dict[str, Any]]:
    """Re-score each candidate ({"config", "score"}) over ``seeds`` selection seeds: median, MAD and median − MAD."""
    return [rescore_one(problem, selection_seeds(problem, seeds), c) for c in candidates]


def choose(rescored: list[dict[str, Any]]) -> dict[str, Any]:
    """The highest robust score, or among those within 2% of it the one closest to the current config."""
    top = max(c["robust_score"] for c in rescored)
    near = [c for c in rescored if c["robust_score"] >= top * (1 - NEAR_EQUAL)]
    return min(near, key=lambda c: (c["distance"], -c["robust_score"]))


def _key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def settle(problem: Problem, candidates: list[dict[str, Any]], current: dict[str, Any], *, seeds: int,
           grid: dict[str, Any] | None = None,
           pool_map: Callable[..., Iterable[dict[str, Any]]] = map) -> dict[str, Any]:
    """After the search: the best ``candidates`` ({"trial", "config", "score", "goodput", "params"}, their search
    figures) and the ``current`` config ({"config", "score", "goodput"}) re-scored over ``seeds`` selection seeds;
    the winner (``choose``; the current config when nothing beats its selection score); then the winner, the
    current config and ``grid``'s best (``grid_baseline``) scored on ``seeds`` fresh seeds, the same for all three:
    the reported figures, with ``no_gain`` (why not to propose it) when the winner does not beat the current config
    there. ``pool_map`` spreads the re-scoring (a process pool's ``map``)."""
    selection, fresh = selection_seeds(problem, seeds), fresh_seeds(problem, seeds)
    entries = candidates + [{"trial": None, "config": current["config"], "score": current["score"],
                             "goodput": current["goodput"], "params": {}, "is_current": True}]
    rescored = list(pool_map(functools.partial(rescore_one, problem, selection), entries))
    current_r = next(c for c in rescored if c.get("is_current"))
    winner = choose([c for c in rescored if not c.get("is_current")] or [current_r])
    if winner["robust_score"] <= current_r["robust_score"]:
        winner = current_r
    grid_best = (grid or {}).get("best")
    to_score = {"best": winner, "current": current_r}
    if grid_best:
        to_score["grid"] = {"config": grid_best["config"], "goodput": grid_best["search_goodput"]}
    unique = {_key(e["config"]): e for e in to_score.values()}
    scored = dict(zip(unique, pool_map(functools.partial(over_seeds, problem, fresh), list(unique.values()))))
    on_fresh = {name: scored[_key(e["config"])] for name, e in to_score.items()}
    best = {"config": winner["config"], **_figures(on_fresh["best"]), "search_goodput": winner["goodput"],
            "search_score": winner["score"], "selection_score": winner["robust_score"], "trial": winner.get("trial"),
            "is_current": bool(winner.get("is_current"))}
    now = on_fresh["current"]
    out = {"candidates": [{k: v for k, v in c.items() if k != "config"} | {"config": c["config"]} for c in rescored],
           "best": best, "current_fresh": _figures(now), "current_robust_score": current_r["robust_score"],
           # Like with like: both on the same fresh seeds, with the same statistic; none when the current config
           # meets the SLOs at no rate (the two goodputs say it).
           "predicted_gain": best["score"] / now["score"] if now["score"] > 0 else None,
           "seeds": {"search": [problem.seed], "selection": selection, "fresh": fresh},
           "figures": figures(len(fresh), len(selection))}
    unit = "req/s per GPU" if problem.objective == "goodput_per_gpu" else "req/s"
    if not best["is_current"]:
        reason = no_gain(best["score"], now["score"], problem.precision, unit)
        if reason:
            out["no_gain"] = reason  # the study says so, and does not propose the winner
    if grid is not None:
        if grid_best:
            grid_best.update(_figures(on_fresh["grid"]))
        out["grid_baseline"] = grid_against(grid, best["score"], max(c["score"] for c in candidates), unit,
                                            problem.precision)
    return out


def _figures(scored: dict[str, Any]) -> dict[str, Any]:
    return {k: scored[k] for k in ("goodput", "robust_goodput", "score", "robust_score", "mad", "seed_goodputs")}


def explain(problem: Problem, current: EngineConfig, winner: EngineConfig, rate: float) -> dict[str, Any]:
    """Both configs at one rate (the current config's goodput): where the time goes and why it differs."""
    if rate <= 0:
        rate = problem.workload.rate or 1.0
    a = measure(current, problem.workload, problem.slo, rate, count=problem.count, seed=problem.seed,
                hardware=problem.hardware)
    b = measure(winner, problem.workload, problem.slo, rate, count=problem.count, seed=problem.seed,
                hardware=problem.hardware)
    changes = []
    for label, key in (("queue", "mean_queue_ms"), ("prefill", "mean_prefill_ms"), ("decode", "mean_decode_ms")):
        before, after = getattr(a, key), getattr(b, key)
        changes.append({"component": label, "current_ms": round(before, 2), "best_ms": round(after, 2),
                        "change_ms": round(after - before, 2)})
    reasons = []
    biggest = min(changes, key=lambda c: c["change_ms"])
    if biggest["change_ms"] < 0:
        reasons.append(f"mean {biggest['component']} time falls {-biggest['change_ms']:.1f} ms "
                       f"({biggest['current_ms']:.1f} → {biggest['best_ms']:.1f} ms) at {rate:.2f} req/s")
    if a.preemptions != b.preemptions:
        reasons.append(f"preemptions {a.preemptions} → {b.preemptions}")
    if abs(a.mean_kv_usage - b.mean_kv_usage) > 0.02:
        reasons.append(f"mean KV-cache usage {a.mean_kv_usage:.0%} → {b.mean_kv_usage:.0%}")
    if b.spec_acceptance is not None or a.spec_acceptance is not None:
        fmt = lambda v: "off" if v is None else f"{v:.0%} accepted"  # noqa: E731
        reasons.append(f"speculative decoding {fmt(a.spec_acceptance)} → {fmt(b.spec_acceptance)}")
    reasons.append(f"SLO attainment at {rate:.2f} req/s {a.attainment:.1%} → {b.attainment:.1%}")
    limits = slo_limits(problem.slo, a, b)
    if limits:
        reasons.append(limit_sentence(problem.slo, limits, rate))
    return {"rate": round(rate, 4), "current": a.to_dict(), "best": b.to_dict(), "components": changes,
            "reasons": reasons, "limits": limits, "quantile": quantile_label(problem.slo.target),
            "diff": {k: {"current": v[1], "best": v[0]} for k, v in winner.diff(current).items()}}


SLO_LABELS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "e2e"}


def quantile_label(target: float) -> str:
    """The percentile a target share reads as: 0.95 → p95, 0.999 → p99.9."""
    return f"p{round(target * 100, 3):g}"


def slo_limits(slo: Slo, current: Measure, best: Measure) -> list[dict[str, Any]]:
    """Each SLO threshold against both configs' value at the target share (the 95th percentile for 95%), the
    nearest to its threshold in the current config first: the first is what limits the current config's
    goodput (``binding``); the others say how much room each leaves."""
    rows = []
    for metric, threshold in slo.thresholds.items():
        now, then = current.at_target.get(metric), best.at_target.get(metric)
        if metric not in current.at_target or (not _finite(now) and not current.over.get(metric)):
            continue  # no request it applies to (a TPOT threshold when every answer is one token)
        rows.append({"slo": metric, "threshold_ms": threshold,
                     "current_ms": round(now, 2) if _finite(now) else None,
                     "best_ms": round(then, 2) if _finite(then) else None,
                     "current_over": round(current.over.get(metric, 0.0), 4),
                     "best_over": round(best.over.get(metric, 0.0), 4)})
    # Unmet (None) sorts first: nothing is nearer its threshold than a share of requests that never finished.
    rows.sort(key=lambda row: -math.inf if row["current_ms"] is None else -row["current_ms"] / row["threshold_ms"])
    for index, row in enumerate(rows):
        row["binding"] = index == 0
    return rows


def idle_misses(problem: Problem, config: EngineConfig) -> tuple[float, list[str]]:
    """For SLOs no config meets: ``config`` nearly idle (1/256 of the workload's rate, where the goodput search
    gives up) and each threshold its value at the target share still misses, e.g. "p95 TTFT 228.7 ms against 1
    ms": what no batching can buy back."""
    rate = max((problem.workload.rate or 1.0) / 256, 0.005)
    m = measure(config, problem.workload, problem.slo, rate, count=min(problem.count, 200), seed=problem.seed,
                hardware=problem.hardware)
    q = quantile_label(problem.slo.target)
    return rate, [f"{q} {_name(row['slo'])} {_ms(row['current_ms'])} against "
                  f"{row['threshold_ms']:g} ms" for row in slo_limits(problem.slo, m, m)
                  if row["current_ms"] is None or row["current_ms"] > row["threshold_ms"]]


def _name(metric: str) -> str:
    return SLO_LABELS.get(metric, metric)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _ms(value: float | None) -> str:
    return "not reached (too many requests unfinished)" if value is None else f"{value:.1f} ms"


def limit_sentence(slo: Slo, limits: list[dict[str, Any]], rate: float) -> str:
    """``slo_limits``' rows in words: the binding SLO with both configs' value, then the others' room."""
    q = quantile_label(slo.target)
    first = limits[0]
    name = _name(first["slo"])
    text = (f"{name} limits the current config's goodput: at {rate:.2f} req/s its {q} {name} is "
            f"{_ms(first['current_ms'])} against {first['threshold_ms']:g} ms, and {_ms(first['best_ms'])} "
            f"with the winner")
    rest = [f"{_name(row['slo'])} {_ms(row['current_ms'])} of {row['threshold_ms']:g} ms"
            for row in limits[1:]]
    return text + (f" (the current config's other {q}s: " + ", ".join(rest) + ")" if rest else "")


def importances(study: optuna.Study) -> dict[str, float]:
    """Optuna's PED-ANOVA importances of the knobs over the valid trials ({} when too few or all equal).
    (fANOVA, Optuna's default evaluator, needs scikit-learn; PED-ANOVA needs nothing more and is fast.)"""
    trials = valid_trials(study)
    if len(trials) < 4 or len({t.values[0] for t in trials}) < 2:
        return {}
    try:
        values = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(),
            target=lambda t: -t.values[0])  # PED-ANOVA explains low values: the negated score
    except (RuntimeError, ValueError, ZeroDivisionError) as exc:
        log.info("importances not computed: %s", exc)
        return {}
    return {k: round(float(v), 4) for k, v in values.items() if v == v}


def pareto(study: optuna.Study, problem: Problem) -> list[dict[str, Any]]:
    """Non-dominated valid trials: goodput up, p99 TTFT at peak down (p99 TTFT from the goodput rate when
    the study is single-objective)."""
    points = []
    for t in valid_trials(study):
        ttft = t.user_attrs.get("ttft_p99_at_peak")
        if ttft is None:
            ttft = (t.user_attrs.get("at") or {}).get("ttft_p99")
        if ttft is None:
            continue
        points.append({"trial": t.number, "goodput": t.user_attrs["goodput"], "score": t.user_attrs["score"],
                       "ttft_p99_ms": ttft, "params": t.params})
    front = [p for p in points if not any(
        (q["score"] >= p["score"] and q["ttft_p99_ms"] <= p["ttft_p99_ms"]) and
        (q["score"] > p["score"] or q["ttft_p99_ms"] < p["ttft_p99_ms"]) for q in points)]
    return sorted(front, key=lambda p: -p["score"])


def grid_baseline(problem: Problem, budget: int) -> dict[str, Any]:
    """The same budget spent as vLLM's auto_tune.sh spends it: a grid of max_num_seqs × max_num_batched_tokens
    (speculative decoding and the other knobs left as they are); its best valid point on the search's seed
    (``search_goodput``, ``search_score``: a one-seed maximum, which ``settle`` scores again on fresh seeds)."""
    seqs = [16, 32, 64, 128, 256, 512, 1024]
    tokens = [512, 1024, 2048, 4096, 8192, 16384]
    grid = [(s, t) for s in seqs for t in tokens if t >= s]
    step = max(1, math.ceil(len(grid) / max(budget, 1)))
    chosen = grid[::step][:budget]
    best = None
    evaluated = 0
    space = Space({"max_num_seqs": seqs, "max_num_batched_tokens": tokens})
    for s, t in chosen:
        config, problems = check(space, problem.current, {"max_num_seqs": s, "max_num_batched_tokens": t})
        if config is None:
            continue
        evaluated += 1
        result = goodput(config, problem.workload, problem.slo, seed=problem.seed, count=problem.count,
                     hardware=problem.hardware,
                         precision=problem.precision, start=best["search_goodput"] if best else None)
        score = problem.score(result, config)
        if best is None or score > best["search_score"]:
            best = {"max_num_seqs": s, "max_num_batched_tokens": t, "config": config.to_dict(),
                    "search_goodput": result.goodput, "search_score": score}
    if best is not None:
        point = {"max_num_seqs": best["max_num_seqs"], "max_num_batched_tokens": best["max_num_batched_tokens"]}
        best["outside_space"] = problem.space.outside(problem.current, point)
    return {"points": evaluated, "best": best}


def beats(score: float, than: float, precision: float) -> bool:
    """Whether ``score`` is better than ``than`` by more than the goodput search's relative ``precision`` (the width
    it stops at): a smaller difference is one the search cannot tell from none."""
    return score > than * (1.0 + precision)


def no_gain(winner: float, current: float, precision: float, unit: str = "req/s") -> str | None:
    """Why a winner (not the current config) is not to be proposed: its score on the fresh seeds does not beat the
    current config's there (``beats``); None when it does. It was chosen on the selection seeds, so it can."""
    if beats(winner, current, precision):
        return None
    figures = f"{winner:.2f} against {current:.2f} {unit}"
    if winner < current:
        return (f"on the fresh seeds the winner scores below the current config ({figures}): it was chosen on the "
                "selection seeds, where it scored higher")
    return (f"on the fresh seeds the winner does not beat the current config by more than the goodput search's "
            f"precision ({precision:.0%}): {figures}")


def grid_against(grid: dict[str, Any], winner_score: float, search_best: float | None = None,
                 unit: str = "req/s", precision: float = 0.0) -> dict[str, Any]:
    """The auto_tune.sh-style grid's best, with a verdict against the study's winner: their ``score`` on the same
    fresh seeds (better only by more than the goodput search's ``precision``). Where the grid does better: whether
    its point lies outside the study's search space (widen it), inside but beyond what the trials found on the
    search's seed (``search_best`` against the grid's ``search_score``: more trials), or as good there as a trial
    the selection ranked below the winner."""
    best = grid.get("best")
    if not best:
        return grid
    search_best = search_best or 0.0
    than = f"better than this study's winner ({winner_score:.2f} {unit} on the same fresh seeds)"
    if not beats(best["score"], winner_score, precision):
        grid["verdict"] = f"no better than this study's winner ({winner_score:.2f} {unit} on the same fresh seeds)"
    elif best.get("outside_space"):
        grid["verdict"] = (f"{than}, at a point outside the study's search space: {'; '.join(best['outside_space'])}"
                           ". Widen the space to search there")
    elif beats(best.get("search_score", best["score"]), search_best, precision):
        grid["verdict"] = f"{than}, at a point inside the study's search space that its trials did not find: more " \
                          "trials may"
    else:
        grid["verdict"] = (f"{than}; the trials found as good on the search's seed ({search_best:.2f} {unit}), but "
                           "the winner was chosen over the selection seeds, where it scored higher")
    return grid
