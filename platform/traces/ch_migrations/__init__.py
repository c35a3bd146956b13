"""Numbered ClickHouse migrations (NNNN_name.py), each with `forwards(ctx)` and `backwards(ctx)` returning DDL."""
