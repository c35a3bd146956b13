"""Silence matchers as Alertmanager reads them: `=`, `!=`, `=~`, `!~` on alert labels."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

OPERATORS = ("=", "!=", "=~", "!~")
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_MATCHERS = 32
MAX_VALUE_LENGTH = 1024


class MatcherError(ValueError):
    """A matcher that cannot be used; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Matcher:
    name: str
    op: str
    value: str

    def matches(self, labels: Mapping[str, str]) -> bool:
        # Alertmanager: a label the alert does not carry reads as the empty string, and regexes are
        # anchored at both ends.
        actual = str(labels.get(self.name, ""))
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        found = re.fullmatch(self.value, actual) is not None
        return found if self.op == "=~" else not found

    def to_dict(self) -> dict:
        return {"name": self.name, "op": self.op, "value": self.value}


def parse_matcher(item, where: str = "matcher") -> Matcher:
    """One matcher from `{"name", "op", "value"}` (or Alertmanager's `{"name", "value", "isRegex", "isEqual"}`)
    or from the text form `name=value`, `name!=value`, `name=~regex`, `name!~regex`."""
    if isinstance(item, str):
        match = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*", item, flags=re.S)
        if not match:
            raise MatcherError(f"{where}: {item!r} is not of the form name=value, name!=value, name=~re or name!~re")
        name, op, value = match.groups()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
    elif isinstance(item, Mapping):
        unknown = set(item) - {"name", "op", "value", "isRegex", "isEqual"}
        if unknown:
            raise MatcherError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        name, value = item.get("name"), item.get("value")
        if "op" in item:
            op = item["op"]
        else:
            regex, equal = item.get("isRegex", False), item.get("isEqual", True)
            if not isinstance(regex, bool) or not isinstance(equal, bool):
                raise MatcherError(f"{where}: isRegex and isEqual must be booleans")
            op = {(False, True): "=", (False, False): "!=", (True, True): "=~", (True, False): "!~"}[(regex, equal)]
    else:
        raise MatcherError(f"{where} must be an object {{name, op, value}} or a string like severity=\"page\"")
    if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name):
        raise MatcherError(f"{where}: name must be a label name ([A-Za-z_][A-Za-z0-9_]*)")
    if op not in OPERATORS:
        raise MatcherError(f"{where}: op must be one of {', '.join(OPERATORS)}")
    if not isinstance(value, str):
        raise MatcherError(f"{where}: value must be a string")
    if len(value) > MAX_VALUE_LENGTH:
        raise MatcherError(f"{where}: value is longer than {MAX_VALUE_LENGTH} characters")
    if op in ("=~", "!~"):
        try:
            re.compile(value)
        except re.error as exc:
            raise MatcherError(f"{where}: invalid regular expression {value!r}: {exc}") from None
    return Matcher(name, op, value)


def parse_matchers(items) -> list[Matcher]:
    """A silence's matchers: a non-empty list, at least one of which cannot match the empty string, so a
    silence never mutes everything by accident (Alertmanager's rule)."""
    if not isinstance(items, list) or not items:
        raise MatcherError("matchers must be a non-empty list")
    if len(items) > MAX_MATCHERS:
        raise MatcherError(f"at most {MAX_MATCHERS} matchers")
    matchers = [parse_matcher(item, f"matchers[{i}]") for i, item in enumerate(items)]
    if all(m.matches({}) for m in matchers):
        raise MatcherError("at least one matcher must not match the empty label value (it would silence every alert)")
    return matchers


def matches_all(matchers: Iterable[Matcher], labels: Mapping[str, str]) -> bool:
    return all(m.matches(labels) for m in matchers)
