"""Forms that go through the API's own input layer: the same declared types (pydantic) and the same checks give the
same messages, shown next to the field they concern."""
from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

_ADAPTERS: dict[Any, TypeAdapter] = {}


def validate(schema: Any, data: dict, fields: set[str]) -> tuple[Any, dict[str, list[str]]]:
    """(the parsed object, {}) or (None, {field: [messages]}); a message about no form field goes under ''."""
    adapter = _ADAPTERS.get(schema)
    if adapter is None:
        adapter = _ADAPTERS[schema] = TypeAdapter(schema)
    try:
        return adapter.validate_python(data), {}
    except ValidationError as exc:
        errors: dict[str, list[str]] = {}
        for error in exc.errors(include_url=False):
            location = [str(part) for part in error.get("loc", ())]
            field = next((part for part in reversed(location) if part in fields), "")
            message = error.get("msg", "invalid")
            if message.startswith("Value error, "):
                message = message[len("Value error, "):]
            bucket = errors.setdefault(field, [])
            if message not in bucket:
                bucket.append(message)
        # A field of several accepted forms (a number or a text such as '99%') fails once per form: keep what the
        # specific forms say over pydantic's generic "Input should be a valid number".
        for field, messages in errors.items():
            specific = [m for m in messages if not m.startswith("Input should be")]
            if specific:
                errors[field] = specific
        return None, errors


def refusal_errors(refusal: Exception, fields: set[str]) -> dict[str, list[str]]:
    """A service's refusal (RunError, StudyError, RolloutError: its `problems`, about its `field`) as the form's
    errors: under that field when the form has it, else under ''."""
    return {refusal.field if refusal.field in fields else "": refusal.problems}


def problems_by_field(problems: list[str], fields: set[str]) -> dict[str, list[str]]:
    """'field: message' problems (the definition checks') by form field; the others under ''."""
    errors: dict[str, list[str]] = {}
    for text in problems:
        head, sep, reason = text.partition(": ")
        name = head.split(".")[0].split("[")[0] if sep else ""
        field = name if name in fields else ""
        errors.setdefault(field, []).append(reason if field else text)
    return errors


def form_number(text: str, *, whole: bool = False):
    """A number typed into a form, for the API's types: None when left empty; an int when `whole` and the text is
    one, else a float; text that is no number goes on as it is, for the type's own check to name."""
    text = (text or "").strip()
    if not text:
        return None
    if whole:
        try:
            return int(text)
        except ValueError:
            pass
    try:
        return float(text)
    except ValueError:
        return text
