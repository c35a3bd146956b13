"""The SLO YAML format (docs/slo.md): read a file, plan the changes against the database, apply them at once.

    project: alpha            # one project per document; several documents (---) per file
    slos:
      - name: chat-ttft
        sli: ttft_ms
        threshold_ms: 500
        objective: 99%
        ...
"""
from __future__ import annotations

import dataclasses

import yaml
from django.db import transaction
from django.utils import timezone
from tenancy.models import Project

from . import definitions
from .models import SLO

MAX_SLOS_PER_DOCUMENT = 1000


class FileError(ValueError):
    """The file cannot be applied; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclasses.dataclass
class ProjectPlan:
    project: Project
    create: list[dict] = dataclasses.field(default_factory=list)
    update: list[tuple[SLO, dict, dict]] = dataclasses.field(default_factory=list)  # (slo, fields, changes)
    unchanged: list[SLO] = dataclasses.field(default_factory=list)
    delete: list[SLO] = dataclasses.field(default_factory=list)  # with --prune
    not_in_file: list[SLO] = dataclasses.field(default_factory=list)  # without --prune

    @property
    def has_changes(self) -> bool:
        return bool(self.create or self.update or self.delete)


def parse(text: str, *, source: str = "file", project_override: str | None = None) -> list[tuple[str, list]]:
    """(project name, [SLO definition]) per YAML document."""
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise FileError([f"{source}: not valid YAML: {exc}"]) from None
    if not documents:
        raise FileError([f"{source}: no SLO document (expected `project:` and `slos:`)"])
    out = []
    problems = []
    for i, document in enumerate(documents):
        where = f"{source}, document {i + 1}" if len(documents) > 1 else source
        if not isinstance(document, dict):
            problems.append(f"{where}: a document is a mapping with `project` and `slos`")
            continue
        unknown = sorted(set(map(str, document)) - {"project", "slos"})
        if unknown:
            problems.append(f"{where}: unknown top-level key(s) {', '.join(unknown)}; a document has `project` and `slos`")
        project = project_override or document.get("project")
        if not isinstance(project, str) or not project:
            problems.append(f"{where}: `project: NAME` is required (or pass --project)")
            continue
        slos = document.get("slos")
        if not isinstance(slos, list):
            problems.append(f"{where}: `slos:` must be a list of SLO definitions")
            continue
        if len(slos) > MAX_SLOS_PER_DOCUMENT:
            problems.append(f"{where}: at most {MAX_SLOS_PER_DOCUMENT} SLOs per document")
            continue
        out.append((project, slos))
    if problems:
        raise FileError(problems)
    return out


def plan(text: str, *, source: str = "file", prune: bool = False, project_override: str | None = None) -> list[ProjectPlan]:
    """Validate everything and compare with the database; nothing is written. FileError lists every problem."""
    documents = parse(text, source=source, project_override=project_override)
    problems: list[str] = []
    plans: dict[str, ProjectPlan] = {}
    seen: dict[str, set[str]] = {}
    for project_name, items in documents:
        project = Project.objects.filter(name=project_name).first()
        if project is None:
            problems.append(f"{source}: no project named {project_name!r} (projects are created with "
                            "`manage.py create_ingest_key --project NAME`)")
            current = ProjectPlan(Project(name=project_name))  # still validate its SLOs, to report everything
            existing = {}
        else:
            current = plans.setdefault(project_name, ProjectPlan(project))
            existing = {s.name: s for s in SLO.objects.filter(project=project)}
        names = seen.setdefault(project_name, set())
        for index, item in enumerate(items):
            label = item.get("name") if isinstance(item, dict) else None
            where = f"{source}: {project_name}/{label}" if isinstance(label, str) else f"{source}: {project_name} slos[{index}]"
            try:
                fields = definitions.validate(item, where=where)
            except definitions.DefinitionError as exc:
                problems.extend(f"{where}: {p}" for p in exc.problems)
                continue
            if fields["name"] in names:
                problems.append(f"{where}: the name {fields['name']!r} appears twice for project {project_name}")
                continue
            names.add(fields["name"])
            slo = existing.get(fields["name"])
            if slo is None:
                current.create.append(fields)
                continue
            changed = definitions.changes(slo, fields)
            if changed:
                current.update.append((slo, fields, changed))
            else:
                current.unchanged.append(slo)
    for project_name, current in plans.items():
        for slo in SLO.objects.filter(project=current.project).exclude(name__in=seen[project_name]).order_by("name"):
            (current.delete if prune else current.not_in_file).append(slo)
    if problems:
        raise FileError(problems)
    return list(plans.values())


@transaction.atomic
def apply(plans: list[ProjectPlan]) -> None:
    """Write a plan: all of it or nothing."""
    now = timezone.now()
    for current in plans:
        for slo in current.delete:
            slo.delete()
        for slo, _fields, changed in current.update:
            for key, (_, new) in changed.items():
                setattr(slo, key, new)
            slo.updated_at = now
            slo.save(update_fields=[*changed, "updated_at"])
        for fields in current.create:
            SLO.objects.create(project=current.project, created_at=now, updated_at=now, **fields)


def describe_plan(plans: list[ProjectPlan]) -> list[str]:
    """Diff-like lines: + created, ~ changed (field: old → new), - deleted, = unchanged, ? only in the database."""
    lines = []
    for current in plans:
        project = current.project.name
        for fields in current.create:
            lines.append(f"+ {project}/{fields['name']}  ({_summary(fields)})")
        for slo, _fields, changed in current.update:
            lines.append(f"~ {project}/{slo.name}")
            for key, (old, new) in changed.items():
                lines.append(f"    {key}: {_show(key, old)} → {_show(key, new)}")
        for slo in current.delete:
            lines.append(f"- {project}/{slo.name}")
        for slo in current.unchanged:
            lines.append(f"= {project}/{slo.name}")
        for slo in current.not_in_file:
            lines.append(f"? {project}/{slo.name}  (not in the file; kept — --prune deletes it)")
    return lines


def _summary(fields: dict) -> str:
    sli = fields["sli"]
    if fields.get("threshold_ms") is not None:
        sli = f"{sli} ≤ {fields['threshold_ms']:g} ms"
    elif fields.get("threshold") is not None:
        sli = f"{sli} ≤ {fields['threshold']:.4g} (|error| of each check)"
    return f"{sli}, objective {definitions.format_objective(fields['objective'])}, {fields['period_days']}d"


def _show(key: str, value) -> str:
    if key == "objective":
        return definitions.format_objective(value)
    if key == "tiers" and not value:
        return "default"
    return repr(value)
