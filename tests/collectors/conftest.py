"""Fixtures for the collector tests; the span shapes themselves live in collectors_samples.py."""
import collectors_samples
import pytest


@pytest.fixture
def make_span():
    """build_span(name, *, kind, attributes, resource, events=[(name, ms after start)], ...) -> SpanView."""
    return collectors_samples.build_span


@pytest.fixture
def payloads():
    """The attribute dicts and span builders of collectors_samples, for tests that vary them."""
    return collectors_samples
