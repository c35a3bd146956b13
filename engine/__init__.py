"""The platform's managed engine: vLLM config and launcher, gateway, simulator replicas, load generator.

Nothing here imports Django or the platform; the platform drives it through
``manage.py engine`` / ``manage.py loadgen`` and reads what it emits (OTLP spans,
Prometheus metrics) like any other source.
"""
