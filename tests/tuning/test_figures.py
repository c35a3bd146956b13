"""The figures a tuning study reports: the winner's goodput on fresh seeds (neither the search's nor those it was
chosen on), the current config and the auto_tune.sh-style grid's best on the same seeds, the robust figure beside
them on those seeds too, no ratio when the current config meets the SLOs at no rate, no proposal of a winner that
does not beat the current config on the fresh seeds, and a confirmation capped at the replay limit saying what it
confirmed and what it could not."""
from __future__ import annotations

import datetime as dt
import html
import re
import statistics
import types

import pytest
from django.template.loader import render_to_string
from tenancy.models import Project
from tuning import goodput as G
from tuning import search as S
from tuning import service
from tuning.confirmation import confirmation_outcome
from tuning.management.commands.tune import report_lines
from tuning.models import TuningStudy
from tuning.space import parse_space
from tuning.workload import synthetic

from engine.config import EngineConfig

pytestmark = pytest.mark.mode_independent  # no database, no broker

CURRENT = EngineConfig(max_num_seqs=64)
LUCKY, STEADY = 128, 256  # max_num_seqs of two candidates: the first only looks best on the selection seeds
SLO = G.Slo({"ttft_ms": 300, "tpot_ms": 30}, 0.95)


def _problem() -> S.Problem:
    space = parse_space({"max_num_seqs": [64, LUCKY, STEADY]}, CURRENT)
    return S.Problem(CURRENT, space, synthetic("chat"), SLO, seed=7, count=150)


def _candidates(problem: S.Problem) -> list[dict]:
    out = []
    for trial, (seqs, search) in enumerate(((LUCKY, 25.0), (STEADY, 24.0))):
        config = problem.space.config(CURRENT, {"max_num_seqs": seqs}).to_dict()
        out.append({"trial": trial, "config": config, "score": search, "goodput": search,
                    "params": {"max_num_seqs": seqs}})
    return out


def _fake_goodput(monkeypatch, problem: S.Problem, current_goodput: float = 10.0) -> list[tuple]:
    """Goodput by (config, seed), recording each call. The lucky candidate scores 30 on the selection seeds and
    18/20/22 on the fresh ones; the steady one 24 and 23; the current config ``current_goodput`` (its fresh seeds
    -1, 0, +2 around it); a grid point (a token budget set) seqs × tokens / 10⁶ on the search's seed and 15 on the
    others."""
    selection = S.selection_seeds(problem, 3)
    fresh = S.fresh_seeds(problem, 3)
    calls = []

    def value(config: EngineConfig, seed: int) -> float:
        if config.max_num_batched_tokens is not None:
            return config.max_num_seqs * config.max_num_batched_tokens / 1e6 if seed == problem.seed else 15.0
        if config.max_num_seqs == LUCKY:
            return 30.0 if seed in selection else (18.0, 20.0, 22.0)[fresh.index(seed)] if seed in fresh else 25.0
        if config.max_num_seqs == STEADY:
            return 24.0 if seed in selection or seed == problem.seed else 23.0
        if not current_goodput:
            return 0.0
        return current_goodput + ((-1.0, 0.0, 2.0)[fresh.index(seed)] if seed in fresh else 0.0)

    def fake(config, workload, slo, *, seed=0, count=600, precision=0.02, start=None, stop_early=True, hardware=None):
        calls.append((config.max_num_seqs, config.max_num_batched_tokens, seed))
        result = value(config, seed)
        return G.Goodput(result, 1.0 if result else 0.4, None, 1)

    monkeypatch.setattr(S, "goodput", fake)
    return calls


def _settle(problem: S.Problem, current_goodput: float = 10.0) -> dict:
    current = {"config": CURRENT.to_dict(), "score": current_goodput, "goodput": current_goodput}
    return S.settle(problem, _candidates(problem), current, seeds=3, grid=S.grid_baseline(problem, 6))


def test_the_winners_goodput_is_scored_on_seeds_it_was_not_chosen_on(monkeypatch):
    """The lucky candidate wins on the selection seeds (30 against 24), and is then reported at its median over
    fresh seeds (20), with the search's figure (25) and median − MAD (18) on those same seeds beside it."""
    problem = _problem()
    _fake_goodput(monkeypatch, problem)
    out = _settle(problem)
    seeds = out["seeds"]
    assert seeds["search"] == [7] and seeds["selection"] == [1007, 2007, 3007]
    assert len(seeds["fresh"]) >= len(seeds["selection"]) and len(set(seeds["fresh"])) == len(seeds["fresh"])
    assert not set(seeds["fresh"]) & (set(seeds["search"]) | set(seeds["selection"])), seeds
    best = out["best"]
    assert best["config"]["max_num_seqs"] == LUCKY and best["selection_score"] == 30.0
    assert best["goodput"] == 20.0 and best["search_goodput"] == 25.0
    assert best["robust_goodput"] == 18.0 <= best["goodput"] and best["seed_goodputs"] == [18.0, 20.0, 22.0]
    assert out["figures"]["goodput"].startswith("median goodput over 3 fresh seeds")
    assert out["figures"]["robust"].startswith("median − MAD") and "same fresh seeds" in out["figures"]["robust"]


def test_current_winner_and_grid_are_scored_on_the_same_fresh_seeds(monkeypatch):
    problem = _problem()
    calls = _fake_goodput(monkeypatch, problem)
    out = _settle(problem)
    fresh = out["seeds"]["fresh"]
    grid = out["grid_baseline"]["best"]
    on_fresh: dict[tuple, list[int]] = {}
    for seqs, tokens, seed in calls:
        if seed in fresh:
            on_fresh.setdefault((seqs, tokens), []).append(seed)
    # Exactly three configs on the fresh seeds, each on all of them: the winner, the current config, the grid's best.
    assert on_fresh == {(LUCKY, None): fresh, (64, None): fresh,
                        (grid["max_num_seqs"], grid["max_num_batched_tokens"]): fresh}, on_fresh
    # Chosen on the search's seed (its one-seed maximum), reported on the fresh seeds.
    searched = [seqs * tokens / 1e6 for seqs, tokens, seed in calls if tokens is not None and seed == problem.seed]
    assert grid["search_goodput"] == pytest.approx(max(searched)) and grid["goodput"] == 15.0
    assert out["current_fresh"]["goodput"] == 10.0 and out["current_fresh"]["robust_goodput"] == 9.0
    assert out["predicted_gain"] == pytest.approx(20.0 / 10.0)  # like with like: both medians on the fresh seeds
    assert "no better than this study's winner (20.00 req/s on the same fresh seeds)" == out["grid_baseline"]["verdict"]


def _study(result: dict) -> TuningStudy:
    """A finished study in memory (nothing read from or written to a database), for the CLI's and the page's text."""
    return TuningStudy(id=41, project=Project(name="p"), group="base", objective="goodput", state="done",
                       current_config=CURRENT.to_dict(), workload={}, slo=SLO.to_dict(), space={}, trials=2,
                       trials_done=2, seed=7, result=result, created_at=dt.datetime(2026, 11, 28, tzinfo=dt.timezone.utc))


def test_no_ratio_when_the_current_config_meets_the_slos_at_no_rate(monkeypatch):
    """Code completion with vLLM's defaults meets its SLOs at no rate: the study reports both goodputs (0 and the
    winner's), not an infinite or missing-denominator ratio, in the API, the CLI and on the page."""
    problem = _problem()
    _fake_goodput(monkeypatch, problem, current_goodput=0.0)
    out = _settle(problem, current_goodput=0.0)
    assert out["predicted_gain"] is None and out["current_fresh"]["goodput"] == 0.0 and out["best"]["goodput"] == 20.0
    study = _study({"current": {"config": CURRENT.to_dict(), "goodput": 0.0, "score": 0.0}, **out})
    text = "\n".join(report_lines(study))
    assert "current goodput 0.00 req/s" in text and "best    goodput 20.00 req/s" in text, text
    assert "no ratio: the current config meets the SLOs at no rate (0.00 req/s), the winner at 20.00 req/s" in text
    assert not re.search(r"×\s*[0-9i]", text) and "inf" not in text, text  # no "×2.1", no "×inf"
    page = render_to_string("dashboards/partials/tuning_progress.html", {"study": service.summary(study, detail=True)})
    assert "the current config meets the SLOs at no rate" in page and not re.search(r"×\s*[0-9i]", page), page
    assert "20.00" in page and "median goodput over 3 fresh seeds" in page


def test_with_a_current_goodput_the_ratio_is_of_figures_on_the_same_seeds(monkeypatch):
    problem = _problem()
    _fake_goodput(monkeypatch, problem)
    out = _settle(problem)
    study = _study({"current": {"config": CURRENT.to_dict(), "goodput": 10.0, "score": 10.0}, **out})
    lines = report_lines(study)
    assert "  current goodput 10.00 req/s (robust 9.00, search 10.00)" in lines, lines
    assert "  best    goodput 20.00 req/s (robust 18.00, search 25.00)" in lines, lines
    assert "  gain ×2.00 in goodput (best over current, both on the same fresh seeds)" in lines, lines


def _page(study: TuningStudy) -> str:
    """The study's page as an operator sees it (no request, no database)."""
    viewer = types.SimpleNamespace(can=lambda role: True, projects=["p"], project="p", role="operator",
                                   identity=types.SimpleNamespace(username="ops"))
    return render_to_string("dashboards/tuning_study.html", {"study": service.summary(study, detail=True),
                                                              "viewer": viewer, "active": False})


@pytest.mark.parametrize("current_goodput, words", [
    (20.0, "on the fresh seeds the winner does not beat the current config by more than the goodput search's "
           "precision (3%): 20.00 against 20.00 req/s"),
    (23.0, "on the fresh seeds the winner scores below the current config (20.00 against 23.00 req/s): it was "
           "chosen on the selection seeds, where it scored higher"),
])
def test_a_winner_that_does_not_beat_the_current_config_on_the_fresh_seeds_is_not_proposed(
        monkeypatch, current_goodput, words):
    """The lucky candidate wins on the selection seeds (30 against the current config's 20 or 23) but scores 20 on
    the fresh seeds, no better than the current config there: the study says so (the result, tune show, the page,
    without its Propose button), and propose refuses it with that reason."""
    problem = _problem()
    _fake_goodput(monkeypatch, problem, current_goodput=current_goodput)
    out = _settle(problem, current_goodput=current_goodput)
    assert out["best"]["config"]["max_num_seqs"] == LUCKY and not out["best"]["is_current"]
    assert out["best"]["goodput"] == 20.0 and out["current_fresh"]["goodput"] == current_goodput
    assert out["no_gain"] == words
    study = _study({"current": {"config": CURRENT.to_dict(), "goodput": current_goodput, "score": current_goodput},
                    **out})
    with pytest.raises(service.StudyError) as refused:
        service.propose(study, by="ops")
    assert str(refused.value) == f"{words}: nothing to propose" and refused.value.field == "best"
    assert f"  nothing to propose: {words}" in report_lines(study)
    page = _page(study)
    assert f"{words.capitalize()}: nothing to propose." in html.unescape(page), page
    assert 'data-testid="no-gain"' in page and 'data-testid="propose"' not in page, page


def test_a_winner_that_beats_the_current_config_on_the_fresh_seeds_is_offered(monkeypatch):
    problem = _problem()
    _fake_goodput(monkeypatch, problem, current_goodput=10.0)
    out = _settle(problem)
    assert "no_gain" not in out and out["best"]["goodput"] == 20.0
    study = _study({"current": {"config": CURRENT.to_dict(), "goodput": 10.0, "score": 10.0}, **out})
    page = _page(study)
    assert 'data-testid="propose"' in page and 'data-testid="no-gain"' not in page
    assert not [line for line in report_lines(study) if "nothing to propose" in line]


# ---------------------------------------------------------------------------------------------- confirmation
def _step(rate: float, attainment: float, met: bool, run_id: int = 5) -> dict:
    return {"run_id": run_id, "rate": rate, "state": "done", "attainment": attainment,
            "predicted_attainment": 1.0, "requests": 180, "met": met}


def test_a_confirmation_capped_at_the_replay_limit_says_what_it_confirmed_and_what_it_could_not():
    """Predicted 87.24 req/s, replayed at the 20 req/s cap and met there: the confirmation is the attainment at
    20 req/s, and says nothing above it was tested; no share of the prediction (20/87 = 23% would read as a
    failure)."""
    out = confirmation_outcome([_step(20.0, 1.0, True)], 87.24, cap=20.0, target=0.95, backend="simulator")
    assert out["capped"] == {"rate": 20.0, "predicted_goodput": 87.24, "tested_above_cap": False,
                             "attainment": 1.0, "met": True}
    assert out["confirmed_goodput"] == 20.0 and out["confirmed_share"] is None
    statement = out["statement"]
    assert statement.startswith("at 20.00 req/s, the replay limit, 100.0% of requests met the SLOs on real-time "
                                "simulated replicas (target 95.0%)"), statement
    assert "above 20.00 req/s, the most this host replays (TUNING_CONFIRM_MAX_RATE), nothing was tested" in statement
    assert "the predicted 87.24 req/s (simulated) is neither confirmed nor refuted" in statement
    assert "23%" not in statement and "of the predicted)" not in statement
    # Missed at the cap, met below it: what was confirmed, what was missed, and that above the cap is untested.
    out = confirmation_outcome([_step(20.0, 0.6, False), _step(18.0, 0.97, True, 6)], 30.0, cap=20.0, target=0.95)
    assert out["capped"]["attainment"] == 0.6 and out["capped"]["met"] is False and out["confirmed_goodput"] == 18.0
    assert out["statement"].startswith("confirmed goodput 18.00 req/s on real-time simulated replicas: 97.0% of "
                                       "requests met the SLOs there (target 95.0%); it missed them at 20.00 req/s "
                                       "(60.0% of requests); above 20.00 req/s"), out["statement"]
    # The CLI and the page print the statement.
    confirmation = {"run_id": 5, "state": "done", "rate": 20.0, "backend": "simulator", "note": "replayed on replicas",
                    "measured": {"best": {"requests": 180, "attainment": 1.0},
                                 "current": {"requests": 180, "attainment": 0.3}},
                    "predicted_attainment": {"best": 1.0, "current": 0.2}, "steps": [_step(20.0, 1.0, True)],
                    **confirmation_outcome([_step(20.0, 1.0, True)], 87.24, cap=20.0, target=0.95)}
    study = _study({"current": {"config": CURRENT.to_dict(), "goodput": 40.0}, "confirmation": confirmation,
                    "confirmed_goodput": 20.0})
    text = "\n".join(report_lines(study))
    assert "at 20.00 req/s, the replay limit, 100.0% of requests met the SLOs" in text and "nothing was tested" in text
    assert "% of the predicted" not in text, text
    page = render_to_string("dashboards/partials/tuning_confirmation.html", {"c": confirmation})
    assert "At 20.00 req/s, the replay limit, 100.0% of requests met the SLOs" in page and "nothing was tested" in page


def test_an_uncapped_confirmation_gives_the_confirmed_and_the_predicted_goodput():
    out = confirmation_outcome([_step(8.41, 0.533, False), _step(6.73, 1.0, True, 6)], 8.41, cap=20.0, target=0.9,
                               backend="vllm")
    assert out["capped"] is None and out["confirmed_goodput"] == 6.73 and out["confirmed_share"] == 0.8002
    assert out["statement"] == ("confirmed goodput 6.73 req/s on real vLLM: 100.0% of requests met the SLOs there "
                                "(target 90.0%); it missed them at 8.41 req/s (53.3% of requests); predicted goodput "
                                "8.41 req/s (simulated)")
    out = confirmation_outcome([_step(8.41, 0.2, False), _step(6.73, 0.5, False, 6)], 8.41, cap=20.0, target=0.9)
    assert out["confirmed_goodput"] is None and out["statement"].startswith(
        "not confirmed on real-time simulated replicas: the winner met the SLOs (target 90.0%) at none of the rates "
        "replayed (8.41, 6.73 req/s): 20.0% of requests at 8.41, 50.0% of requests at 6.73")


# ---------------------------------------------------------------------------------------------- in the simulator
def test_in_the_simulator_the_reported_figures_are_each_configs_goodput_on_the_fresh_seeds():
    """Unfaked, small: each reported figure is the median of the goodput searches on the fresh seeds, and the
    robust figure never stands above it."""
    current = EngineConfig()
    space = parse_space({"max_num_seqs": [16, 64, 256]}, current)
    problem = S.Problem(current, space, synthetic("chat"), SLO, count=120)
    candidates = []
    for seqs in (64, 256):
        result = S.evaluate(problem, {"max_num_seqs": seqs})
        candidates.append({"trial": seqs, "config": result["config"], "score": result["score"],
                           "goodput": result["goodput"], "params": {"max_num_seqs": seqs}})
    now = G.goodput(current, problem.workload, SLO, seed=problem.seed, count=problem.count, precision=problem.precision)
    out = S.settle(problem, candidates, {"config": current.to_dict(), "score": now.goodput, "goodput": now.goodput},
                   seeds=2)
    fresh = out["seeds"]["fresh"]
    assert len(fresh) == 2 and not set(fresh) & {problem.seed, *out["seeds"]["selection"]}
    for figures, config, start in ((out["best"], out["best"]["config"], out["best"]["search_goodput"]),
                                   (out["current_fresh"], current.to_dict(), now.goodput)):
        each = [G.goodput(EngineConfig.from_dict(config), problem.workload, SLO, seed=seed, count=problem.count,
                          precision=problem.precision, start=start).goodput for seed in fresh]
        assert figures["seed_goodputs"] == [round(g, 4) for g in each]
        assert figures["goodput"] == pytest.approx(statistics.median(each))
        assert figures["robust_goodput"] <= figures["goodput"]
    assert out["predicted_gain"] == pytest.approx(out["best"]["score"] / out["current_fresh"]["score"])
