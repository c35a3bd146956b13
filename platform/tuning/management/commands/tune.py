"""`manage.py tune --project P --group G [--workload traffic|dataset:NAME|synthetic:chat|rag|code] [--trials N]
[--objective goodput|goodput_per_gpu|pareto] [--space FILE] [--slo ttft_ms=300 ...] [--json OUT]`.

Creates a tuning study, which the platform's worker (Celery, queue `tuning`) executes; shows its progress
and prints the result: current and best config, goodput (requests/s, simulated: on fresh seeds, beside the
search's figure and the robust one), the re-scoring that chose the winner, why the winner wins, and the
confirmation on replicas (real vLLM for a group of real vLLM replicas).
Exit 0 done, 1 done but no config meets the SLOs, 3 error. `tune show ID` prints a study; `tune propose ID`
hands its winner to a rollout; `tune cancel ID` stops one. Ctrl-C while waiting cancels the study.
"""
import json
import sys
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError
from jobs.commands import EXIT_ERROR, JobCommand, project_named, read_yaml

from tuning import service
from tuning.models import Objective, StudyState, TuningStudy


def _fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def report_lines(study: TuningStudy) -> list[str]:
    data = service.summary(study, detail=True)
    wl = data["workload"]
    lines = [f"tuning study {study.id}: group {study.group}, objective {study.objective} — {study.state}"
             + (f" ({study.phase})" if study.phase and study.state not in (StudyState.DONE,) else "")]
    if data["error"]:
        lines.append(f"error: {data['error']}")
    if "rate" in wl:
        lines.append(f"  workload {wl['source']}: {wl['rate']:.2f} req/s mean, peak {wl['peak_rate']:.2f}, "
                     f"burstiness {wl['burstiness']:.2f}, prefix-cache hit {wl['prefix_hit_rate']:.0%}"
                     + (f" ({wl['prefix_hit_basis']})" if wl.get("prefix_hit_basis") else "") + ", "
                     f"prompt p50 {wl['prompt_tokens'].get('p50', 0):.0f} / output p50 "
                     f"{wl['output_tokens'].get('p50', 0):.0f} tokens")
        for note in wl.get("notes") or []:
            lines.append(f"    note: {note}")
    slo = data["slo"]
    lines.append("  SLO: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo["thresholds"].items())
                 + f" for {slo['target']:.1%} of requests ({slo.get('source') or 'given'})")
    lines.append(f"  trials {data['trials']}/{data['trials_budget']} (configs vLLM would refuse, not simulated: "
                 f"{data['invalid_trials']}; retried after a crash: {data['retried_trials']})")
    if data["message"]:
        lines.append(f"  {data['message']}")
    best = data["best"]
    lines.extend(goodput_lines(data))
    if data["no_gain"]:
        lines.append(f"  nothing to propose: {data['no_gain']}")
    if best:
        explanation = data.get("explanation") or {}
        for knob, change in (explanation.get("diff") or {}).items():
            lines.append(f"    {knob}: {change['current']} → {change['best']}")
        for reason in explanation.get("reasons") or []:
            lines.append(f"    why: {reason}")
        grid = data.get("grid_baseline") or {}
        if grid.get("best"):
            g = grid["best"]
            fresh = f" on the same fresh seeds ({_fmt(g.get('search_goodput'))} on the search's seed)" \
                if g.get("search_goodput") is not None else ""
            lines.append(f"  auto_tune.sh-style grid ({grid['points']} points of max_num_seqs × "
                         f"max_num_batched_tokens): best {_fmt(g['goodput'])} req/s{fresh} at {g['max_num_seqs']} / "
                         f"{g['max_num_batched_tokens']}" + (f": {grid['verdict']}" if grid.get("verdict") else ""))
        if data.get("importances"):
            lines.append("  importances: " + ", ".join(f"{k} {v:.2f}" for k, v in data["importances"].items()))
    confirmation = data.get("confirmation") or {}
    if confirmation.get("measured"):
        m, p = confirmation["measured"], confirmation.get("predicted_attainment", {})
        where = "real vLLM" if confirmation.get("backend") == "vllm" else "real-time simulated replicas"
        lines.append(f"  confirmation (regression run {confirmation['run_id']}, {confirmation['rate']:.2f} req/s on "
                     f"{where}):")
        for arm in ("current", "best"):
            measured = m.get(arm, {}).get("attainment")
            lines.append(f"    {arm:<7} attainment measured {_fmt(None if measured is None else 100 * measured, 1)}%"
                         f", predicted {_fmt(None if p.get(arm) is None else 100 * p[arm], 1)}%")
        for step in (confirmation.get("steps") or [])[1:]:
            measured, predicted = step.get("attainment"), step.get("predicted_attainment")
            lines.append(f"    best alone at {step['rate']:.2f} req/s (regression run {step['run_id']}): attainment "
                         f"measured {_fmt(None if measured is None else 100 * measured, 1)}%, predicted "
                         f"{_fmt(None if predicted is None else 100 * predicted, 1)}%")
        if confirmation.get("statement"):
            lines.append(f"    {confirmation['statement']}")
    elif confirmation:
        lines.append(f"  confirmation: {confirmation.get('skipped') or confirmation.get('error')}")
    if study.proposal:
        lines.append(f"  proposed as a rollout of group {study.group}: {study.proposal['config_version']}")
    return lines


def goodput_lines(data: dict) -> list[str]:
    """Both configs' goodput on the same seeds, the search's figure beside it, the robust figure with its definition,
    and their ratio only when the current config meets the SLOs at some rate."""
    current, best = data["current"], data["best"]
    fresh = (data.get("seeds") or {}).get("fresh")
    if not fresh:  # still searching, or no config meets the SLOs: the search's figures only
        rows = [("current", current)] if current.get("goodput") is not None else []
        return [f"  {label:<7} goodput {_fmt(row['goodput'])} req/s (simulated, on the search's seed)"
                for label, row in rows + ([("best", best)] if best else [])]
    lines = [f"  goodput (simulated): the median over {len(fresh)} fresh seeds, none of them used by the search or to "
             "choose the winner; robust: median − MAD over the same seeds; search: on the search's seed"]
    rows = [("current", current)] + ([("best", best)] if best else [])
    for label, row in rows:
        lines.append(f"  {label:<7} goodput {_fmt(row['goodput'])} req/s (robust {_fmt(row.get('robust_goodput'))}, "
                     f"search {_fmt(row.get('search_goodput'))})")
    if best and data.get("predicted_gain"):
        per = " per GPU" if data.get("objective") == Objective.GOODPUT_PER_GPU else ""
        lines.append(f"  gain ×{data['predicted_gain']:.2f} in goodput{per} (best over current, both on the same "
                     "fresh seeds)")
    elif best and not best.get("is_current"):
        lines.append(f"  no ratio: the current config meets the SLOs at no rate ({_fmt(current['goodput'])} req/s), "
                     f"the winner at {_fmt(best['goodput'])} req/s")
    return lines


class StudyProgress:
    """The progress line of a study being waited for, "[state] phase" with the best score so far; a new line when
    the state or the phase changes, not the best score alone."""

    def __init__(self):
        self.line: str | None = None
        self.text = ""

    def __call__(self, study: TuningStudy) -> str:
        line = f"[{study.state}] {study.phase}"
        if line != self.line:
            self.line = line
            self.text = line + (f"  best {study.best_score:.2f}" if study.best_score else "")
        return self.text


class Command(JobCommand):
    help = "Auto-tune a replica group's vLLM knobs for SLO goodput (docs/tuning.md)."

    def add_arguments(self, parser):
        parser.add_argument("action", nargs="?", default="run", choices=("run", "show", "propose", "cancel"))
        parser.add_argument("study_id", nargs="?", type=int)
        parser.add_argument("--project", default=None)
        parser.add_argument("--group", default=None)
        parser.add_argument("--workload", default="traffic",
                            help="traffic (default: the group's recent requests), dataset:NAME, synthetic:chat|rag|code")
        parser.add_argument("--window-hours", type=float, default=24.0, help="traffic window (default 24 h)")
        parser.add_argument("--objective", choices=Objective.values, default="goodput")
        parser.add_argument("--trials", type=int, default=60)
        parser.add_argument("--space", default=None, help="search space file (YAML/JSON); default: docs/tuning.md")
        parser.add_argument("--slo", action="append", default=[],
                            help="an SLO threshold, e.g. ttft_ms=300 (default: the project's SLOs)")
        parser.add_argument("--target", type=float, default=None, help="share of requests that must meet them")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--no-confirm", action="store_true", help="skip the replay on real-time replicas")
        parser.add_argument("--json", default=None, help="write the result as JSON to this file")
        parser.add_argument("--no-wait", action="store_true")
        parser.add_argument("--start-timeout", type=float, default=90.0)

    def handle(self, *args, action, study_id, **o):
        if action != "run":
            if study_id is None:
                raise CommandError(f"tune {action} needs a study id")
            study = TuningStudy.objects.filter(id=study_id).first()
            if study is None:
                raise CommandError(f"no tuning study {study_id}")
            if action == "propose":
                try:
                    proposal = service.propose(study, by="cli")
                except service.StudyError as exc:
                    raise CommandError(str(exc)) from None
                self.stdout.write(json.dumps(proposal, indent=2))
                return None
            if action == "cancel":
                self.stdout.write("cancel asked" if service.cancel(study) else f"study {study.id} already ended")
                return None
            return self._report(study, o["json"])
        if not o["project"] or not o["group"]:
            raise CommandError("give --project and --group")
        project = project_named(o["project"])
        space = read_yaml(o["space"], "space") if o["space"] else None
        slo = {}
        for text in o["slo"]:
            key, sep, value = text.partition("=")
            try:
                slo[key.strip()] = float(value)
            except ValueError:
                raise CommandError(f"--slo {text!r}: use NAME=MILLISECONDS, e.g. ttft_ms=300") from None
            if not sep:
                raise CommandError(f"--slo {text!r}: use NAME=MILLISECONDS")
        try:
            study = service.create_study(
                project, group=o["group"], workload=o["workload"], objective=o["objective"], space=space,
                trials=o["trials"], slo=slo or None, target=o["target"], seed=o["seed"],
                confirm=not o["no_confirm"], window_hours=o["window_hours"], created_by="cli",
                read_traces=not settings.EMBEDDED_MODE)
        except service.StudyError as exc:
            raise CommandError(str(exc)) from None
        study = self.follow(study, service.STUDIES,
                            f"tuning study {study.id} queued ({study.trials} trials, objective {study.objective})",
                            no_wait=o["no_wait"], start_timeout=o["start_timeout"],
                            not_started=f"no worker started study {study.id} within {o['start_timeout']:g} s: is the "
                                        "platform (or a Celery worker on queue 'tuning') running?",
                            progress=StudyProgress(), interval=1.0)
        return None if study is None else self._report(study, o["json"])

    def _report(self, study: TuningStudy, json_path: str | None):
        for line in report_lines(study):
            self.stdout.write(line)
        if json_path:
            data = service.summary(study, detail=True)
            Path(json_path).write_text(json.dumps(data, indent=2, default=str))
        if study.state == StudyState.DONE:
            if (study.result or {}).get("infeasible"):
                sys.exit(1)
            return None
        sys.exit(EXIT_ERROR)
