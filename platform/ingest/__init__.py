"""OTLP trace receivers (HTTP and gRPC), validation, the durable spool and the ClickHouse writer."""
