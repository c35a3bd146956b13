"""`manage.py tune --project P --group G [--workload traffic|dataset:NAME|synthetic:chat|rag|code] [--trials N]
[--objective goodput|goodput_per_gpu|pareto] [--space FILE] [--slo ttft_ms=300 ...] [--json OUT]`.

Creates a tuning study, which the platform's worker (Celery, queue `tuning`) executes; shows its progress
and prints the result: current and best config, goodput (requests/s, simulated), the robust re-scoring,
why the winner wins, and the confirmation on replicas (real vLLM for a group of real vLLM replicas).
Exit 0 done, 1 done but no config meets the SLOs, 3 error. `tune show ID` prints a study; `tune propose ID`
hands its winner to a rollout; `tune cancel ID` stops one. Ctrl-C while waiting cancels the study.
"""
import json
import sys
import time
from pathlib import Path

import yaml
from django.core.management.base import BaseCommand, CommandError

from tuning import service
from tuning.models import ACTIVE_STATES, Objective, StudyState, TuningStudy

EXIT_ERROR = 3


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
                     f"burstiness {wl['burstiness']:.2f}, prefix-cache hit {wl['prefix_hit_rate']:.0%}, "
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
    current, best = data["current"], data["best"]
    if current.get("goodput") is not None:
        lines.append(f"  current goodput {_fmt(current['goodput'])} req/s (simulated)")
    if best:
        lines.append(f"  best    goodput {_fmt(best['goodput'])} req/s (simulated; robust {_fmt(best['robust_score'])})"
                     + (f", gain ×{data['predicted_gain']:.2f}" if data["predicted_gain"] else ""))
        explanation = data.get("explanation") or {}
        for knob, change in (explanation.get("diff") or {}).items():
            lines.append(f"    {knob}: {change['current']} → {change['best']}")
        for reason in explanation.get("reasons") or []:
            lines.append(f"    why: {reason}")
        grid = data.get("grid_baseline") or {}
        if grid.get("best"):
            g = grid["best"]
            lines.append(f"  auto_tune.sh-style grid ({grid['points']} points of max_num_seqs × "
                         f"max_num_batched_tokens): best {_fmt(g['goodput'])} req/s at {g['max_num_seqs']} / "
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
        confirmed = confirmation.get("confirmed_goodput")
        if confirmed:
            lines.append(f"    confirmed goodput: {confirmed:.2f} req/s "
                         f"({100 * confirmation['confirmed_share']:.0f}% of the predicted)")
        else:
            lines.append("    confirmed goodput: not confirmed at any rate replayed")
    elif confirmation:
        lines.append(f"  confirmation: {confirmation.get('skipped') or confirmation.get('error')}")
    if study.proposal:
        lines.append(f"  proposed as a rollout of group {study.group}: {study.proposal['config_version']}")
    return lines


class Command(BaseCommand):
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

    def execute(self, *args, **options):
        try:
            return super().execute(*args, **options)
        except CommandError as exc:
            self.stderr.write(f"error: {exc}")
            sys.exit(EXIT_ERROR)

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
        from tenancy.models import Project

        if not o["project"] or not o["group"]:
            raise CommandError("give --project and --group")
        project = Project.objects.filter(name=o["project"]).first()
        if project is None:
            raise CommandError(f"no project named {o['project']!r}")
        space = None
        if o["space"]:
            try:
                space = yaml.safe_load(Path(o["space"]).read_text())
            except (OSError, yaml.YAMLError) as exc:
                raise CommandError(f"cannot read the space file {o['space']}: {exc}") from None
        slo = {}
        for text in o["slo"]:
            key, sep, value = text.partition("=")
            try:
                slo[key.strip()] = float(value)
            except ValueError:
                raise CommandError(f"--slo {text!r}: use NAME=MILLISECONDS, e.g. ttft_ms=300") from None
            if not sep:
                raise CommandError(f"--slo {text!r}: use NAME=MILLISECONDS")
        from django.conf import settings

        try:
            study = service.create_study(
                project, group=o["group"], workload=o["workload"], objective=o["objective"], space=space,
                trials=o["trials"], slo=slo or None, target=o["target"], seed=o["seed"],
                confirm=not o["no_confirm"], window_hours=o["window_hours"], created_by="cli",
                read_traces=not settings.EMBEDDED_MODE)
        except service.StudyError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"tuning study {study.id} queued ({study.trials} trials, objective {study.objective})")
        if o["no_wait"]:
            return None
        study = self._wait(study, o["start_timeout"])
        return self._report(study, o["json"])

    def _wait(self, study: TuningStudy, start_timeout: float) -> TuningStudy:
        started = time.monotonic()
        last = None
        try:
            while True:
                study.refresh_from_db()
                if study.state not in ACTIVE_STATES:
                    return study
                if study.state == StudyState.QUEUED and time.monotonic() - started > start_timeout:
                    service.cancel(study)
                    raise CommandError(f"no worker started study {study.id} within {start_timeout:g} s: is the "
                                       "platform (or a Celery worker on queue 'tuning') running?")
                line = f"[{study.state}] {study.phase}"
                if line != last:
                    self.stdout.write(line + (f"  best {study.best_score:.2f}" if study.best_score else ""))
                    last = line
                time.sleep(1.0)
        except KeyboardInterrupt:
            service.cancel(study)
            self.stderr.write(f"cancelled tuning study {study.id}")
            sys.exit(EXIT_ERROR)

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
