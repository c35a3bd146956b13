"""Evaluators of a regression run's outputs. Each gives a score in [0, 1] and passed (a bool).

    {"type": "exact"}                                   output == expected (both stripped)
    {"type": "contains", "value": "Paris", "case_sensitive": false}
    {"type": "regex", "pattern": "^[0-9]+$"}            re.search, at most 500 characters of pattern
    {"type": "json"}                                    the output parses as JSON
    {"type": "json_schema", "schema": {...}}            parses and validates (jsonschema, Draft 2020-12)
    {"type": "similarity", "threshold": 0.8}            rapidfuzz's normalised Indel similarity to expected
    {"type": "consistency", "threshold": 1.0}           similarity to the baseline's output for the same item
                                                        (paired runs; greedy decoding should not change under a
                                                        lossless change such as speculative decoding)

An item with an expected output and no evaluators gets exact and similarity. Embedding similarity (a local
sentence-embedding model) is not built in: see docs/regressions.md ("Evaluators").
"""
from __future__ import annotations

import json
import re
from typing import Any

from rapidfuzz import fuzz

TYPES = ("exact", "contains", "regex", "json", "json_schema", "similarity", "consistency")
MAX_PATTERN = 500
MAX_EVALUATORS = 20
DEFAULT_THRESHOLD = {"similarity": 0.8, "consistency": 1.0}


class EvaluatorError(ValueError):
    pass


def check_evaluators(evaluators: Any) -> list[dict]:
    """The evaluator list checked (types, fields, compilable regexes and schemas); raises EvaluatorError."""
    if not isinstance(evaluators, list) or len(evaluators) > MAX_EVALUATORS:
        raise EvaluatorError(f"evaluators must be a list of at most {MAX_EVALUATORS} objects")
    out = []
    for index, spec in enumerate(evaluators):
        where = f"evaluators[{index}]"
        if not isinstance(spec, dict) or spec.get("type") not in TYPES:
            raise EvaluatorError(f"{where}.type must be one of {', '.join(TYPES)}")
        kind = spec["type"]
        allowed = {"type", "name"} | {
            "contains": {"value", "case_sensitive"}, "regex": {"pattern"}, "json_schema": {"schema"},
            "similarity": {"threshold"}, "consistency": {"threshold"},
        }.get(kind, set())
        extra = set(spec) - allowed
        if extra:
            raise EvaluatorError(f"{where}: unknown keys {', '.join(sorted(extra))} for {kind}")
        if "name" in spec and (not isinstance(spec["name"], str) or not 0 < len(spec["name"]) <= 64):
            raise EvaluatorError(f"{where}.name must be a string of 1-64 characters")
        if kind == "contains":
            if not isinstance(spec.get("value"), str) or not spec["value"]:
                raise EvaluatorError(f"{where}.value must be a non-empty string")
            if not isinstance(spec.get("case_sensitive", True), bool):
                raise EvaluatorError(f"{where}.case_sensitive must be true or false")
        elif kind == "regex":
            pattern = spec.get("pattern")
            if not isinstance(pattern, str) or not 0 < len(pattern) <= MAX_PATTERN:
                raise EvaluatorError(f"{where}.pattern must be a regular expression of 1-{MAX_PATTERN} characters")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise EvaluatorError(f"{where}.pattern does not compile: {exc}") from None
        elif kind == "json_schema":
            # jsonschema on first use (~90 ms to import): only datasets with this evaluator need it.
            import jsonschema

            if not isinstance(spec.get("schema"), dict):
                raise EvaluatorError(f"{where}.schema must be a JSON Schema object")
            try:
                jsonschema.Draft202012Validator.check_schema(spec["schema"])
            except jsonschema.exceptions.SchemaError as exc:
                raise EvaluatorError(f"{where}.schema is not a valid JSON Schema: {exc.message}") from None
        elif kind in DEFAULT_THRESHOLD:
            threshold = spec.get("threshold", DEFAULT_THRESHOLD[kind])
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
                raise EvaluatorError(f"{where}.threshold must be a number between 0 and 1")
        out.append(dict(spec))
    # Two evaluators of one type without names are told apart by a number (contains, contains-2, ...); names
    # given twice are an error.
    given = [spec["name"] for spec in out if spec.get("name")]
    if len(set(given)) != len(given):
        raise EvaluatorError("two evaluators have the same name")
    taken = set(given)
    for spec in out:
        if not spec.get("name"):
            base, n = spec["type"], 1
            name = base
            while name in taken:
                n += 1
                name = f"{base}-{n}"
            if n > 1:
                spec["name"] = name
            taken.add(name)
    return out


def name_of(spec: dict) -> str:
    return spec.get("name") or spec["type"]


def needs_expected(spec: dict) -> bool:
    return spec["type"] in ("exact", "similarity")


def similarity(a: str, b: str) -> float:
    """Normalised Indel similarity in [0, 1] (rapidfuzz's ratio / 100)."""
    return fuzz.ratio(a, b) / 100.0


def evaluate(spec: dict, output: str, *, expected: str | None, baseline_output: str | None) -> dict | None:
    """{"score", "passed"[, "detail"]} for one output; None when the evaluator cannot apply (no expected output,
    no baseline output)."""
    kind = spec["type"]
    if kind == "exact":
        if expected is None:
            return None
        ok = output.strip() == expected.strip()
        return {"score": 1.0 if ok else 0.0, "passed": ok}
    if kind == "contains":
        value = spec["value"]
        ok = value in output if spec.get("case_sensitive", True) else value.lower() in output.lower()
        return {"score": 1.0 if ok else 0.0, "passed": ok}
    if kind == "regex":
        ok = re.search(spec["pattern"], output) is not None
        return {"score": 1.0 if ok else 0.0, "passed": ok}
    if kind in ("json", "json_schema"):
        try:
            document = json.loads(output)
        except ValueError as exc:
            return {"score": 0.0, "passed": False, "detail": f"not JSON: {exc}"[:200]}
        if kind == "json":
            return {"score": 1.0, "passed": True}
        from jsonschema import Draft202012Validator  # on first use, as in check_evaluators

        errors = sorted(Draft202012Validator(spec["schema"]).iter_errors(document), key=lambda e: list(e.path))
        if errors:
            return {"score": 0.0, "passed": False, "detail": errors[0].message[:200]}
        return {"score": 1.0, "passed": True}
    reference = expected if kind == "similarity" else baseline_output
    if reference is None:
        return None
    score = similarity(output.strip(), reference.strip())
    return {"score": round(score, 6), "passed": score >= spec.get("threshold", DEFAULT_THRESHOLD[kind])}


def evaluators_for(item_evaluators: list[dict], expected: str | None, *, paired: bool) -> list[dict]:
    """The evaluators applied to an item: its own, else exact + similarity when it has an expected output; in a
    paired run, consistency with the baseline's output too (unless the item names one)."""
    specs = list(item_evaluators) or ([{"type": "exact"}, {"type": "similarity"}] if expected is not None else [])
    if paired and not any(spec["type"] == "consistency" for spec in specs):
        specs.append({"type": "consistency"})
    return specs


def score_output(specs: list[dict], output: str, *, expected: str | None, baseline_output: str | None
                 ) -> tuple[dict, bool | None]:
    """Scores of every evaluator that applies, and whether the item passed (None: none applied). Consistency
    is scored but left out of `passed` (it compares the arms, not the item with its expectation)."""
    scores: dict[str, dict] = {}
    verdicts = []
    for spec in specs:
        result = evaluate(spec, output, expected=expected, baseline_output=baseline_output)
        if result is None:
            continue
        scores[name_of(spec)] = result
        if spec["type"] != "consistency":
            verdicts.append(result["passed"])
    return scores, (all(verdicts) if verdicts else None)
