"""`manage.py export_prometheus_rules [--project P] [--out FILE]`: the SLOs as Prometheus rules over vLLM's histograms."""
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from tenancy.models import Project

from slo import prometheus
from slo.models import SLO


class Command(BaseCommand):
    help = ("Write Prometheus recording and alerting rules (multi-window burn rates, as Sloth/Pyrra) for the SLOs, "
            "over vLLM's own metrics, and alerts on the platform's own ingest (lag to queryable rows, a stalled "
            "backlog, shedding). Check them with `promtool check rules FILE`.")

    def add_arguments(self, parser):
        parser.add_argument("--project", action="append", default=[], help="only this project (repeatable)")
        parser.add_argument("--out", default="-", help="output file (default: standard output)")
        parser.add_argument("--selector", default=None,
                            help='label matchers added to every vLLM series, e.g. job="vllm",namespace="prod"')
        parser.add_argument("--tpot-histogram", default="request_time_per_output_token",
                            choices=sorted(prometheus.TPOT_HISTOGRAMS),
                            help="TPOT SLIs: vLLM's per-request histogram (default) or the per-token inter_token_latency")
        parser.add_argument("--platform-selector", default=None,
                            help='label matchers for the platform\'s own series in its alerts (ingest lag, stalled '
                                 'backlog, shedding), e.g. job="observatory"')
        parser.add_argument("--no-platform-rules", action="store_true",
                            help="leave out the platform's own ingest alerts (only the SLOs' rules)")
        parser.add_argument("--skip-unexportable", action="store_true",
                            help="write the SLOs that can be expressed and only warn about the others "
                                 "(default: refuse and write nothing)")

    def handle(self, *args, project, out, selector, tpot_histogram, skip_unexportable, platform_selector,
               no_platform_rules, **options):
        slos = SLO.objects.select_related("project").order_by("project__name", "name")
        if project:
            missing = sorted(set(project) - set(Project.objects.filter(name__in=project).values_list("name", flat=True)))
            if missing:
                raise CommandError(f"no project named {', '.join(missing)}")
            slos = slos.filter(project__name__in=project)
        try:
            result = prometheus.export(list(slos), selector=selector, tpot_histogram=tpot_histogram,
                                       platform=not no_platform_rules, platform_selector=platform_selector)
        except prometheus.ExportError as exc:
            raise CommandError(str(exc)) from None
        for warning in result.warnings:
            self.stderr.write(f"warning: {warning}")
        if result.skipped:
            if not skip_unexportable:
                raise CommandError("these SLOs cannot be expressed over vLLM's metrics (nothing written; "
                                   "--skip-unexportable writes the others):\n  " + "\n  ".join(result.skipped))
            for reason in result.skipped:
                self.stderr.write(f"skipped: {reason}")
        text = result.to_yaml()
        if out == "-":
            self.stdout.write(text, ending="")
        else:
            Path(out).write_text(text)
            self.stderr.write(f"wrote {len(result.document['groups'])} rule groups to {out}")
