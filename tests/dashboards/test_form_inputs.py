"""The dashboard's form helpers: a number typed into a form goes to the API's types as the number it is (or as the
text, for the type's own message), a service's refusal lands under the form field it names, and a role below the
one an action needs is refused with the sentence that names both."""
from __future__ import annotations

import math

import pytest
from slo.api import NewSlo
from tenancy.keys import ApiIdentity

from dashboards.access import Refused, Viewer
from dashboards.inputs import form_number, refusal_errors, validate
from dashboards.slo_views import FIELDS, _form_data, _initial

pytestmark = pytest.mark.mode_independent  # no database, no broker


@pytest.mark.parametrize("text, whole, expected", [
    ("", False, None), ("  ", True, None), (None, False, None),
    (" 7 ", True, 7), ("7", False, 7.0), ("2.5", True, 2.5), ("1e3", True, 1000.0),
    ("fast", True, "fast"), ("fast", False, "fast"),
])
def test_form_number(text, whole, expected):
    value = form_number(text, whole=whole)
    assert value == expected and type(value) is type(expected)


def test_a_rate_of_inf_is_a_float_the_service_takes_as_all_at_once():
    assert math.isinf(form_number("inf", whole=True)) and math.isinf(form_number("INF"))


class _Refusal(ValueError):
    def __init__(self, field, problems):
        super().__init__("; ".join(problems))
        self.field, self.problems = field, problems


def test_a_refusal_goes_under_its_field_when_the_form_has_it():
    assert refusal_errors(_Refusal("group", ["no such group"]), {"group", "config"}) == {"group": ["no such group"]}
    assert refusal_errors(_Refusal("slo", ["too strict"]), {"group"}) == {"": ["too strict"]}
    assert refusal_errors(_Refusal(None, ["busy"]), {"group"}) == {"": ["busy"]}


def test_require_refuses_a_lower_role_with_the_sentence():
    viewer = Viewer(ApiIdentity(1, "ann", "admin", {5: "viewer"}, {"alpha": 5}), 5, "alpha", "viewer")
    viewer.require("viewer", "reading")
    with pytest.raises(Refused, match=r"^starting a run needs the operator role in project alpha$"):
        viewer.require("operator", "starting a run")
    with pytest.raises(Refused, match=r"^channels need the admin role in project alpha$"):
        viewer.require("admin", "channels", verb="need")


def test_the_slo_form_carries_include_cached_both_ways():
    """The SLO form's checkbox: ticked posts include_cached true, unticked false (a replacement takes the form's
    fields whole, so an edit through the form keeps or clears it as shown), and editing starts from the SLO's."""
    post = {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": "500", "objective": "99%", "enabled": "on"}
    assert _form_data({**post, "include_cached": "on"})["include_cached"] is True
    assert _form_data(post)["include_cached"] is False
    body = {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 500.0, "objective_percent": "99%", "filters": {},
            "include_cached": True}
    assert _initial(body)["include_cached"] is True and _initial(None)["include_cached"] is False


def test_the_slo_form_sends_each_sli_its_own_threshold_and_names_the_filters_it_refuses():
    """engine_model_error reads the ratio field and a latency SLI the milliseconds one (the form shows both); a filter
    other than the replica group is refused by the API's own type, with a message naming it."""
    post = {"name": "chat-model", "sli": "engine_model_error", "threshold": "0.2", "threshold_ms": "500",
            "objective": "99%", "replica_group": "chat", "service": "chat-app", "enabled": "on"}
    data = _form_data(post)
    assert data["threshold"] == 0.2 and "threshold_ms" not in data
    parsed, errors = validate(NewSlo, data, FIELDS)
    assert parsed is None and errors == {"": [
        "engine_model_error counts live checks of a replica group's engine model, which only replica_group selects; "
        "remove service"]}
    parsed, errors = validate(NewSlo, _form_data({k: v for k, v in post.items() if k != "service"}), FIELDS)
    assert errors == {} and parsed.definition()["threshold"] == 0.2
    latency = _form_data({**post, "sli": "ttft_ms"})
    assert latency["threshold_ms"] == 500.0 and "threshold" not in latency
