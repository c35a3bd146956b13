"""The confirmation of a study's winner on replicas: a paired regression run of the winner against the current
config, both started for the run on the group's own backend (``target_config``/``baseline_config``: real-time
simulated replicas, or real `vllm serve` processes replayed in turn for a group of real vLLM replicas), on items
with the workload's lengths at the winner's predicted goodput (capped by ``CONFIRM_MAX_RATE``); SLO attainment is
measured per arm from the decomposed rows. Where the winner misses the SLOs there, it alone is replayed at lower
rates (``CONFIRM_RATE_STEPS``) until it meets them: the confirmed goodput is the highest rate at which it did."""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

from jobs import leases
from regressions.datasets import clean_items, write_version
from regressions.models import Arm, RegressionRun, RunState
from regressions.service import RunError, create_run
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.tokens import synthetic_text

from . import search as S
from .goodput import measure
from .models import Objective, TuningStudy
from .service import STUDIES, cfg, group_backend

log = logging.getLogger(__name__)


def _update(study: TuningStudy, **fields) -> None:
    leases.leased_update(study, STUDIES.what, **fields)


def local_tokenizer(model: str):
    """The model's own tokenizer when it is a local directory with a tokenizer.json (a tiny model, a mounted
    checkpoint), else None."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # a file it cannot read: fall back to the estimate
        log.warning("cannot read the tokenizer of %s; prompts are sized by the estimate", model, exc_info=True)
        return None


def prompt_text(tokens: int, rng, tokenizer=None) -> str:
    """Synthetic text of about ``tokens`` prompt tokens: by the platform's estimate, or, given the model's own
    tokenizer (a real vLLM counts with it), shrunk until that tokenizer counts no more than asked (a prompt
    longer than planned would push prompt + output past max_model_len and vLLM would refuse it)."""
    words = tokens
    text = synthetic_text(words, rng)
    if tokenizer is None:
        return text
    for _ in range(8):
        counted = len(tokenizer.encode(text, add_special_tokens=False).ids)
        if counted <= tokens or words <= 1:
            break
        words = max(1, min(words - 1, int(words * tokens / counted)))
        text = synthetic_text(words, rng)
    return text


def confirmation_rates(predicted: float) -> list[float]:
    """The rates the confirmation replays the winner at, in turn, until it meets the SLOs: ``CONFIRM_RATE_STEPS``
    times its predicted goodput (by default 1, 0.8, 0.6), each capped at ``CONFIRM_MAX_RATE``; a rate no lower
    than the one before is dropped."""
    rates: list[float] = []
    for factor in cfg("CONFIRM_RATE_STEPS"):
        rate = round(min(max(predicted * factor, 0.1), cfg("CONFIRM_MAX_RATE")), 4)
        if not rates or rate < rates[-1]:
            rates.append(rate)
    return rates


def confirm(study: TuningStudy, problem: S.Problem, result: dict, lease: leases.Lease) -> bool:
    """Replay winner and current as a paired regression run and measure both: on real-time simulated replicas, or
    on real `vllm serve` processes when the study's group runs real vLLM. Where the winner misses the SLOs at its
    predicted goodput, it alone is replayed again at the lower rates of ``confirmation_rates`` until it meets them
    (or none is left): the confirmed goodput is the highest rate at which it did. Each finished step is kept in
    the result, so a resumed study goes on with the next one. False when it stopped before its end (the lease
    lost, a cancel asked, the worker stopping)."""
    best = result.get("best") or {}
    if best.get("is_current"):
        result["confirmation"] = {"skipped": "the current config is the best found: nothing to confirm"}
        return True
    rates = confirmation_rates(best["goodput"])
    confirmation = result.setdefault("confirmation", {})
    steps = confirmation.setdefault("steps", [])
    while True:
        run_id = TuningStudy.objects.filter(id=study.id).values_list("confirmation_run_id", flat=True).first()
        if run_id is None or (steps and steps[-1]["run_id"] == run_id):  # this step's run is not started yet
            if steps and (steps[-1]["attainment"] is None or steps[-1]["met"] or len(steps) >= len(rates)):
                break
            run_id = _start_confirmation_run(study, problem, result, best, rates[len(steps)], paired=not steps)
            if run_id is None:
                break
        while True:
            run = RegressionRun.objects.get(id=run_id)
            if run.state in (RunState.DONE, RunState.ERROR, RunState.CANCELLED):
                break
            if lease.stop_now():
                return False
            time.sleep(1.0)
        figures = confirmation_figures(run, problem, run.options["rate"])
        if not steps:  # the paired run's figures are the confirmation's own
            confirmation.update(figures)
        attainment = figures["best"]
        steps.append({"run_id": run.id, "rate": figures["rate"], "state": run.state, "attainment": attainment,
                      "predicted_attainment": figures["predicted_attainment"].get("best"),
                      "requests": figures["measured"]["best"]["requests"],
                      "met": attainment is not None and attainment >= problem.slo.target})
        _update(study, result=result, phase=f"confirming on replicas: {len(steps)} of at most {len(rates)} rates")
    confirmation.update(confirmation_outcome(steps, best["goodput"], cap=cfg("CONFIRM_MAX_RATE"),
                                             target=problem.slo.target, backend=confirmation.get("backend")))
    if study.objective != Objective.PARETO and confirmation.get("best") is not None:
        result["confirmed_goodput"] = confirmation["confirmed_goodput"]
    return True


def confirmation_outcome(steps: list[dict], predicted: float, *, cap: float, target: float,
                         backend: str | None = None) -> dict:
    """What the replays (``steps``, in turn) confirmed of the winner's ``predicted`` goodput (simulated):
    ``confirmed_goodput``, the highest rate at which it met the SLOs; when the prediction lies above ``cap`` (the
    most the host replays), ``capped``: the attainment at the cap, and that no rate above it was tested (the
    confirmed goodput is then a lower bound, and ``confirmed_share`` is none: a share of a rate the host could not
    reach says nothing of the winner); and ``statement``, the same in words."""
    where = "on real vLLM" if backend == "vllm" else "on real-time simulated replicas"
    met = [step for step in steps if step["met"]]
    top = max(met, key=lambda step: step["rate"]) if met else None
    missed = [step for step in steps if not step["met"] and (top is None or step["rate"] > top["rate"])]
    capped = predicted > cap
    at_cap = next((step for step in steps if step["rate"] >= cap - 1e-9), None)
    out: dict[str, Any] = {"confirmed_goodput": top["rate"] if top else None, "confirmed_share": None,
                           "cap": cap, "capped": None}

    def share(step: dict) -> str:
        return "no share measured" if step["attainment"] is None else f"{step['attainment']:.1%} of requests"

    if capped:
        out["capped"] = {"rate": cap, "predicted_goodput": predicted, "tested_above_cap": False,
                         "attainment": at_cap["attainment"] if at_cap else None,
                         "met": bool(at_cap and at_cap["met"])}
    elif top and predicted > 0:
        out["confirmed_share"] = round(top["rate"] / predicted, 4)  # a replay rate over the predicted goodput
    untested = (f"; above {cap:.2f} req/s, the most this host replays (TUNING_CONFIRM_MAX_RATE), nothing was "
                f"tested: the predicted {predicted:.2f} req/s (simulated) is neither confirmed nor refuted")
    if capped and top is not None and top is at_cap:
        out["statement"] = (f"at {cap:.2f} req/s, the replay limit, {share(top)} met the SLOs {where} (target "
                            f"{target:.1%}): the winner's goodput is at least that" + untested)
        return out
    if top is not None:
        text = f"confirmed goodput {top['rate']:.2f} req/s {where}: {share(top)} met the SLOs there (target {target:.1%})"
    else:
        rates = ", ".join(f"{step['rate']:.2f}" for step in steps) or "none"
        text = f"not confirmed {where}: the winner met the SLOs (target {target:.1%}) at none of the rates replayed " \
               f"({rates} req/s)"
    if missed and top is not None:
        text += "; it missed them at " + ", ".join(f"{step['rate']:.2f} req/s ({share(step)})" for step in missed)
    elif steps and top is None:
        text += ": " + ", ".join(f"{share(step)} at {step['rate']:.2f}" for step in steps)
    out["statement"] = text + (untested if capped else f"; predicted goodput {predicted:.2f} req/s (simulated)")
    return out


def _start_confirmation_run(study: TuningStudy, problem: S.Problem, result: dict, best: dict, rate: float,
                            paired: bool) -> int | None:
    """The confirmation's next regression run: the winner against the current config (paired) at the first rate,
    the winner alone at the lower ones. None (and the reason in the result) when it cannot start."""
    name = f"tuning-study-{study.id}"
    if paired:
        rng = random.Random(study.seed)
        items = []
        tokenizer = local_tokenizer(problem.current.model)
        max_len = problem.current.resolved().max_model_len
        for index in range(cfg("CONFIRM_ITEMS")):
            prompt, output = problem.workload.samples[rng.randrange(len(problem.workload.samples))]
            if max_len is not None and prompt + output > max_len:  # as the simulation fits them (Workload.requests)
                prompt = max(1, min(prompt, max_len - output))
                output = max(1, min(output, max_len - prompt))
            items.append({"id": f"w{index + 1}", "prompt": prompt_text(max(1, min(prompt, 8000)), rng, tokenizer),
                          "params": {"max_tokens": max(1, output), "ignore_eos": True, "temperature": 0}})
        items = clean_items((f"item {i + 1}", item, item["id"]) for i, item in enumerate(items))
        write_version(study.project, name, items, source="tuning", replace=True, created_by=study.created_by,
                      note=f"lengths of tuning study {study.id}'s workload")
    backend = group_backend(study.group)
    real = backend["backend"] == "vllm"
    options = {"rate": rate, "arrival": "poisson", "seed": study.seed, "burstiness": problem.workload.burstiness}
    if paired:
        options["arms"] = "in_turn" if real else "together"  # two real vLLM servers on this host's cores would
        # slow each other
    try:
        # On the group's own backend: real `vllm serve` processes for a group of real vLLM replicas.
        run = create_run(study.project, dataset=name, target_config=best["config"],
                         baseline_config=study.current_config if paired else None,
                         created_by=study.created_by or "tuning", options=options,
                         config_backend=backend if real else None)
    except RunError as exc:
        what = "the confirmation run" if paired else f"the confirmation's replay at {rate:g} req/s"
        result["confirmation"]["error"] = f"{what} could not start: {exc}"
        return None
    _update(study, confirmation_run=run, result=result)
    return run.id


def confirmation_figures(run, problem: S.Problem, rate: float) -> dict:
    """Measured SLO attainment per arm of the confirmation run, beside the simulator's prediction at that rate."""
    limits = problem.slo.thresholds
    arms: dict[str, dict] = {}
    replayed = 0
    for arm, label in ((Arm.CANDIDATE, "best"), (Arm.BASELINE, "current")):
        results = list(run.results.filter(arm=arm, warmup=False))
        replayed = max(replayed, len(results))
        results = results[int(len(results) * 0.1):]  # as in the simulation: the first 10% warm the engine up
        good = 0
        for r in results:
            m = r.metrics or {}
            ok = r.success and all(m.get(k) is not None and m[k] <= v for k, v in limits.items()
                                   if not (k == "tpot_ms" and (r.completion_tokens or 0) <= 1))
            good += ok
        arms[label] = {"requests": len(results), "attainment": good / len(results) if results else None}
    predicted = {}
    # As many requests as were replayed: beyond its goodput a short replay queues less than a long one, so a
    # prediction of the study's length would not be the same experiment.
    count = replayed or cfg("CONFIRM_ITEMS")
    for label, config in (("best", run.target.get("config")), ("current", (run.baseline_target or {}).get("config"))):
        if config:
            m = measure(EngineConfig.from_dict(config), problem.workload, problem.slo, rate, count=count,
                        seed=problem.seed, hardware=problem.hardware)
            predicted[label] = m.attainment
    real = (run.target or {}).get("backend") == "vllm"
    out = {"run_id": run.id, "state": run.state, "verdict": run.verdict, "rate": round(rate, 4), "requests": count,
           "target": problem.slo.target, "measured": arms, "predicted_attainment": predicted,
           "backend": "vllm" if real else "simulator", "note": (
               "replayed on real vLLM: a `vllm serve` per config, started for the run with the launcher's command; "
               "the current config's replay, then the winner's (in turn: two servers would split this host's cores)"
               if real else "replayed on real-time simulated replicas (this host has no GPU): the engine simulator "
               "in real time, with HTTP, tokenisation and tracing on the path")}
    best = arms.get("best", {}).get("attainment")
    out["best"] = best
    if "best" in predicted and best is not None:
        out["gap_best"] = round(predicted["best"] - best, 4)
    current = arms.get("current", {}).get("attainment")
    if "current" in predicted and current is not None:
        out["gap_current"] = round(predicted["current"] - current, 4)
    return out
