"""`manage.py slo apply FILE [--dry-run] [--prune]` and `manage.py slo list` on the metadata DB (pytest-django `db`)."""
from __future__ import annotations

import io
import textwrap

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from slo.models import SLO
from tenancy.models import Project

FILE = textwrap.dedent("""\
    project: alpha
    slos:
      - name: chat-ttft
        description: First token of the chat service
        sli: ttft_ms
        threshold_ms: 500
        objective: 99%
        period: 30d
        filters: {service: chat-app, model: [m-8b, m-70b]}
      - name: errors
        sli: error_ratio
        objective: 99.9%
        period: 28d
        no_data: alert
        repeat_interval: 1h
        labels: {team: inference}
      - name: batch-e2e
        sli: e2e_ms
        threshold_ms: 30000
        objective: 0.9
        tiers:
          - {name: page-6h, severity: page, long_window: 6h, short_window: 30m, factor: 6}
          - {name: ticket-3d, severity: ticket, long_window: 3d, short_window: 6h, factor: 1}
    ---
    project: beta
    slos:
      - name: queue
        sli: queue_ms
        threshold_ms: 200
        objective: 99.5%
        enabled: false
""")


@pytest.fixture
def projects(db):
    return Project.objects.create(name="alpha"), Project.objects.create(name="beta")


def run(*args) -> str:
    out = io.StringIO()
    call_command("slo", *args, stdout=out)
    return out.getvalue()


def write(tmp_path, text: str) -> str:
    path = tmp_path / "slos.yaml"
    path.write_text(text)
    return str(path)


def test_apply_creates_every_slo_of_every_document(projects, tmp_path):
    output = run("apply", write(tmp_path, FILE))
    assert "+ alpha/chat-ttft  (ttft_ms ≤ 500 ms, objective 99%, 30d)" in output
    assert "+ beta/queue  (queue_ms ≤ 200 ms, objective 99.5%, 30d)" in output
    assert output.strip().endswith("4 created, 0 updated, 0 deleted, 0 unchanged")
    slo = SLO.objects.get(project__name="alpha", name="chat-ttft")
    assert (slo.sli, slo.threshold_ms, slo.objective, slo.period_days) == ("ttft_ms", 500.0, 0.99, 30)
    assert slo.filters == {"model": ["m-70b", "m-8b"], "service": ["chat-app"]}
    assert slo.tiers == [] and [t.name for t in slo.burn_tiers] == ["page-1h", "page-6h", "ticket-1d", "ticket-3d"]
    errors = SLO.objects.get(name="errors")
    assert (errors.period_days, errors.no_data, errors.repeat_interval_seconds, errors.labels) == (
        28, "alert", 3600, {"team": "inference"})
    assert [t.name for t in SLO.objects.get(name="batch-e2e").burn_tiers] == ["page-6h", "ticket-3d"]
    assert SLO.objects.get(name="queue").enabled is False


def test_apply_again_is_unchanged_and_changes_show_as_a_diff(projects, tmp_path):
    run("apply", write(tmp_path, FILE))
    assert run("apply", write(tmp_path, FILE)).strip().endswith("0 created, 0 updated, 0 deleted, 4 unchanged")
    changed = FILE.replace("threshold_ms: 500", "threshold_ms: 400").replace("objective: 99.9%", "objective: 99.95%")
    output = run("apply", write(tmp_path, changed))
    assert "~ alpha/chat-ttft\n    threshold_ms: 500.0 → 400.0" in output
    assert "~ alpha/errors\n    objective: 99.9% → 99.95%" in output
    assert "= alpha/batch-e2e" in output
    assert output.strip().endswith("0 created, 2 updated, 0 deleted, 2 unchanged")
    assert SLO.objects.get(name="chat-ttft").threshold_ms == 400.0


def test_dry_run_writes_nothing(projects, tmp_path):
    output = run("apply", "--dry-run", write(tmp_path, FILE))
    assert "dry run: 4 created, 0 updated, 0 deleted, 0 unchanged (nothing written)" in output
    assert SLO.objects.count() == 0


def test_prune_deletes_what_the_file_no_longer_defines_and_only_in_its_projects(projects, tmp_path):
    run("apply", write(tmp_path, FILE))
    head = FILE.split("---")[0]
    smaller = head[: head.index("  - name: batch-e2e")]
    output = run("apply", write(tmp_path, smaller))
    assert "? alpha/batch-e2e  (not in the file; kept — --prune deletes it)" in output
    assert SLO.objects.filter(name="batch-e2e").exists()
    output = run("apply", "--prune", write(tmp_path, smaller))
    assert "- alpha/batch-e2e" in output
    assert not SLO.objects.filter(name="batch-e2e").exists()
    assert SLO.objects.filter(project__name="beta", name="queue").exists()  # beta is not in this file


def test_an_invalid_file_changes_nothing_and_lists_every_problem(projects, tmp_path):
    bad = FILE.replace("objective: 0.9", "objective: 90%").replace(
        "{name: page-6h, severity: page, long_window: 6h, short_window: 30m, factor: 6}",
        "{name: page-1h, severity: page, long_window: 1h, short_window: 5m, factor: 14.4}").replace(
        "threshold_ms: 200", "threshold_ms: -3").replace("project: beta", "project: gamma")
    with pytest.raises(CommandError) as info:
        run("apply", write(tmp_path, bad))
    message = str(info.value)
    assert "the file was not applied" in message
    assert "no project named 'gamma'" in message
    assert "alpha/batch-e2e" in message and "tier page-1h (14.4× over 1h" in message and "Drop this tier" in message
    assert "gamma/queue: threshold_ms: sli queue_ms needs a latency threshold" in message
    assert SLO.objects.count() == 0


@pytest.mark.parametrize(("text", "message"), [
    ("slos: [", "not valid YAML"),
    ("", "no SLO document"),
    ("- a\n- b\n", "a document is a mapping with `project` and `slos`"),
    ("project: alpha\n", "`slos:` must be a list"),
    ("slos: []\n", "`project: NAME` is required"),
    ("project: alpha\nslo: []\n", "unknown top-level key(s) slo"),
    ("project: alpha\nslos:\n  - {name: a, sli: error_ratio, objective: 99%}\n  - {name: a, sli: error_ratio, objective: 98%}\n",
     "the name 'a' appears twice"),
])
def test_file_level_errors(projects, tmp_path, text, message):
    with pytest.raises(CommandError, match=None) as info:
        run("apply", write(tmp_path, text))
    assert message in str(info.value)


def test_project_override_and_list(projects, tmp_path):
    text = "slos:\n  - {name: errors, sli: error_ratio, objective: 99%}\n"
    run("apply", "--project", "beta", write(tmp_path, text))
    assert SLO.objects.get().project.name == "beta"
    listing = run("list")
    assert "beta/errors\terror_ratio\t99%/30d\tenabled\tpending\tbudget=n/a" in listing


def test_missing_file(projects):
    with pytest.raises(CommandError, match="cannot read /nonexistent.yaml"):
        run("apply", "/nonexistent.yaml")
