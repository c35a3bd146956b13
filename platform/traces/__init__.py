"""Trace ingestion app: joins the LLM spans of one trace into per-request latency records."""
