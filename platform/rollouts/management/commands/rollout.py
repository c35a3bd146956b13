"""`manage.py rollout start --project P --group G --config FILE|--from-study ID [--plan FILE] [--wait]` prints the
new rollout's id (alone on its line); the platform's worker (Celery, queue `rollouts`, advanced by the beat) runs
it. `rollout show ID [--json]`, `rollout list --project P`, and the controls `rollout pause|resume|approve|promote|
abort|retry ID` (the command runs as an admin of the machine: its actor in the audit is `cli:<user>`).

Exit status of `start --wait` and `show`: 0 promoted (or still running for show), 1 rolled back / failed /
aborted, 2 paused, 3 error.
"""
import getpass
import json
import sys
import time
from pathlib import Path

import yaml
from django.core.management.base import CommandError
from jobs.commands import JobCommand
from tenancy.models import Project

from rollouts import controls, service
from rollouts.models import ACTIVE_STATES, Rollout, RolloutState
from rollouts.transitions import Conflict

CONTROLS = ("pause", "resume", "approve", "promote", "abort", "retry")


def _load(path: str, what: str):
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CommandError(f"cannot read the {what} file {path}: {exc}") from None


def report_lines(rollout: Rollout) -> list[str]:
    data = service.summary(rollout, detail=True)
    lines = [f"rollout {rollout.id}: group {rollout.group} → config {rollout.config_version} — {rollout.state}"
             + (f" (step {rollout.step + 1}/{len(data['steps'])}: {data['step_kind']})" if data["step_kind"] else "")]
    if data["changes"]:
        lines.append("  changes: " + ", ".join(f"{k} {a} → {b}" for k, (a, b) in data["changes"].items()))
    for step in data["steps"]:
        desc = step["kind"] + (f" {step['weight']:g}% for {step['interval_seconds']:g} s" if step["kind"] == "canary"
                               else f" on {step['dataset']}" if step["kind"] == "gate" else "")
        lines.append(f"  [{step['status']:>11}] {step['index'] + 1}. {desc}")
    if rollout.reason:
        lines.append(f"  reason: {rollout.reason}")
    for t in data["transitions"][-8:]:
        lines.append(f"  {t['at'][11:19]} {t['actor']}: {t['action']} ({t['from'] or '-'} → {t['to']}) {t['reason']}")
    return lines


def exit_code(state: str) -> int:
    if state in (RolloutState.ROLLED_BACK, RolloutState.FAILED, RolloutState.ABORTED):
        return 1
    if state == RolloutState.PAUSED:
        return 2
    return 0


class Command(JobCommand):
    help = "Roll a new engine config out to a replica group: gate, canary steps, promotion or rollback (docs/rollouts.md)."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=("start", "show", "list", *CONTROLS))
        parser.add_argument("rollout_id", nargs="?", type=int)
        parser.add_argument("--project", default=None)
        parser.add_argument("--group", default=None)
        parser.add_argument("--config", default=None, help="the new engine config (YAML/JSON file of vLLM knobs)")
        parser.add_argument("--from-study", type=int, default=None, help="take the config a tuning study proposes")
        parser.add_argument("--plan", default=None, help="plan file (steps, analysis); default: docs/rollouts.md")
        parser.add_argument("--reason", default="", help="why (pause, abort): kept in the audit")
        parser.add_argument("--wait", action="store_true", help="follow the rollout until it ends or pauses")
        parser.add_argument("--json", action="store_true", help="show: the API's JSON document")

    def handle(self, *args, action, rollout_id, **o):
        actor = f"cli:{getpass.getuser()}"
        if action == "start":
            return self._start(actor, o)
        if action == "list":
            rollouts = Rollout.objects.select_related("project")
            if o["project"]:
                project = Project.objects.filter(name=o["project"]).first()
                if project is None:
                    raise CommandError(f"no project named {o['project']!r}")
                rollouts = rollouts.filter(project=project)
            for r in rollouts.order_by("-id")[:50]:
                self.stdout.write(f"{r.id:>5}  {r.project.name:<16} {r.group:<20} {r.state:<12} step {r.step + 1}  "
                                  f"{r.config_version}  {r.reason[:80]}")
            return None
        if rollout_id is None:
            raise CommandError(f"rollout {action} needs a rollout id")
        rollout = Rollout.objects.select_related("project").filter(id=rollout_id).first()
        if rollout is None:
            raise CommandError(f"no rollout {rollout_id}")
        if action == "show":
            return self._show(rollout, o["json"])
        actions = {"pause": lambda: controls.manual_pause(rollout, actor, o["reason"]),
                   "resume": lambda: controls.resume(rollout, actor),
                   "approve": lambda: controls.approve(rollout, actor),
                   "promote": lambda: controls.promote_now(rollout, actor),
                   "abort": lambda: controls.abort(rollout, actor, o["reason"]),
                   "retry": lambda: controls.retry(rollout, actor)}
        try:
            updated = actions[action]()
        except (service.RolloutError, Conflict) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"rollout {updated.id}: {updated.state} — {updated.reason}")
        return None

    def _start(self, actor: str, o: dict):
        if not o["project"] or not o["group"]:
            raise CommandError("give --project and --group")
        if (o["config"] is None) == (o["from_study"] is None):
            raise CommandError("give --config FILE or --from-study ID, one of them")
        project = Project.objects.filter(name=o["project"]).first()
        if project is None:
            raise CommandError(f"no project named {o['project']!r}")
        config = _load(o["config"], "config") if o["config"] else None
        plan = _load(o["plan"], "plan") if o["plan"] else None
        try:
            rollout = service.create_rollout(project, group=o["group"], config=config, from_study=o["from_study"],
                                             plan=plan, created_by=actor, source="cli")
        except service.RolloutError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(str(rollout.id))
        if not o["wait"]:
            return None
        seen = 0
        while True:
            rollout.refresh_from_db()
            transitions = list(rollout.transitions.all())
            for t in transitions[seen:]:
                self.stderr.write(f"{t.at:%H:%M:%S} {t.actor}: {t.action} → {t.to_state}. {t.reason}")
            seen = len(transitions)
            if rollout.state not in ACTIVE_STATES or rollout.state == RolloutState.PAUSED:
                break
            time.sleep(1.0)
        sys.exit(exit_code(rollout.state))

    def _show(self, rollout: Rollout, as_json: bool):
        if as_json:
            self.stdout.write(json.dumps(service.summary(rollout, detail=True), indent=2, default=str))
        else:
            for line in report_lines(rollout):
                self.stdout.write(line)
        sys.exit(exit_code(rollout.state))
