"""Normalisers that turn spans of each LLM instrumentation convention into canonical LLM-call records.

Nothing here imports Django: the platform calls `normalise_span` on every decoded span.
"""
