"""The fast-decoder tests compare results in a shared helper module; pytest rewrites its asserts too, so that a
failure there shows the values compared, as in a test module."""
import pytest

pytest.register_assert_rewrite("otlp_fast_checks")
