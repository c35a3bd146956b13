"""Logging filters installed by settings.LOGGING."""
from __future__ import annotations

import logging


class SheddedExports(logging.Filter):
    """Drops django.request's ERROR line for each export refused with 503 under backpressure: that is the
    platform doing its job, counted in observatory_ingest_backpressure_refusals_total and summarised by
    the ingest service in one warning every 30 s, not one error per export."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = getattr(record, "request", None)
        return not (getattr(record, "status_code", None) == 503 and request is not None
                    and getattr(request, "path", "") == "/v1/traces")
