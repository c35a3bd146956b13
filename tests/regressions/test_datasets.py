"""Datasets: the three import formats, bad files (every bad line reported, nothing imported), versions, and the
evaluators."""
from __future__ import annotations

import json

import pytest
from regressions import evaluators
from regressions.datasets import MAX_ITEM_BYTES, DatasetError, parse_file, resolve_version, write_version
from regressions.models import Dataset, DatasetItem
from tenancy.models import Project

pytestmark = pytest.mark.django_db


def jsonl(*rows) -> bytes:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode()


@pytest.fixture
def project():
    return Project.objects.create(name="golden")


def test_openai_chat_format():
    items = parse_file(jsonl(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "Paris"}], "max_tokens": 8},
        {"id": "q2", "messages": [{"role": "user", "content": "2+2?"}], "ideal": ["4"],
         "evaluators": [{"type": "regex", "pattern": "^4$"}], "tags": ["math"]},
        "",
    ), "openai")
    first, second = items
    assert first["id"] == "item-1" and first["expected"] == "Paris" and len(first["messages"]) == 2
    assert first["params"] == {"max_tokens": 8}
    assert second["id"] == "q2" and second["expected"] == "4" and second["tags"] == ["math"]


def test_vllm_custom_format():
    items = parse_file(jsonl({"prompt": "Once upon a time", "output_tokens": 32},
                             {"prompt": "Hello", "completion": "world"}), "vllm")
    assert items[0]["prompt"] == "Once upon a time" and items[0]["params"] == {"max_tokens": 32}
    assert items[1]["expected"] == "world"


def test_sharegpt_format():
    data = json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me a joke"},
                                      {"from": "gpt", "value": "Why did the GPU cross the road"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "You are terse."},
                                      {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                                      {"from": "human", "value": "ignored"}]},
    ]).encode()
    a, b = parse_file(data, "sharegpt")
    assert a["messages"] == [{"role": "user", "content": "Tell me a joke"}]
    assert a["expected"].startswith("Why") and a["params"]["max_tokens"] > 1
    assert [m["role"] for m in b["messages"]] == ["system", "user"] and b["expected"] == "Hello."


def test_malformed_lines_are_reported_with_their_numbers_and_nothing_is_imported(project):
    data = jsonl(
        {"prompt": "ok"},
        "{not json",
        {"messages": []},
        {"prompt": "x", "params": {"max_tokens": "ten"}},
        {"prompt": "x", "surprise": 1},
        {"prompt": "x", "evaluators": [{"type": "regex", "pattern": "("}]},
        {"id": "item-1", "prompt": "duplicate id"},
        {"prompt": "y" * (MAX_ITEM_BYTES + 10)},
    )
    with pytest.raises(DatasetError) as caught:
        parse_file(data, "openai")
    problems = caught.value.problems
    lines = [int(p.split(":")[0].split()[1]) for p in problems]
    assert lines == [2, 3, 4, 5, 6, 7, 8], problems
    assert "not JSON" in problems[0] and "messages must be a non-empty list" in problems[1]
    assert "params.max_tokens has the wrong type" in problems[2] and "unknown keys surprise" in problems[3]
    assert "does not compile" in problems[4] and "repeats line 1" in problems[5] and "limit is" in problems[6]
    assert not Dataset.objects.exists()


def test_bad_utf8_and_wrong_shapes():
    with pytest.raises(DatasetError, match="line 2: not valid UTF-8"):
        parse_file(b'{"prompt": "a"}\n{"prompt": "\xff"}\n', "openai")
    with pytest.raises(DatasetError, match="JSON array"):
        parse_file(b'{"conversations": []}', "sharegpt")
    with pytest.raises(DatasetError, match="entry 1: needs a human turn"):
        parse_file(b'[{"conversations": [{"from": "gpt", "value": "x"}]}]', "sharegpt")
    with pytest.raises(DatasetError, match="no items"):
        parse_file(b"\n\n", "vllm")
    with pytest.raises(DatasetError, match="unknown format"):
        parse_file(b"", "csv")


def test_versions_upsert_delete_replace_and_pin(project):
    v1 = write_version(project, "qa", parse_file(jsonl({"id": "a", "prompt": "A"}, {"id": "b", "prompt": "B"}),
                                                 "vllm"), source="test")
    v2 = write_version(project, "qa", parse_file(jsonl({"id": "b", "prompt": "B2"}, {"id": "c", "prompt": "C"}),
                                                 "vllm"), source="test", delete=["a"])
    assert (v1.number, v1.item_count, v2.number, v2.item_count) == (1, 2, 2, 2)
    assert {i.item_id: i.prompt for i in v2.items.all()} == {"b": "B2", "c": "C"}
    assert {i.item_id: i.prompt for i in v1.items.all()} == {"a": "A", "b": "B"}  # v1 unchanged
    v3 = write_version(project, "qa", parse_file(jsonl({"id": "z", "prompt": "Z"}), "vllm"), source="t", replace=True)
    assert [i.item_id for i in v3.items.all()] == ["z"]
    assert resolve_version(project, "qa").number == 3 and resolve_version(project, "qa", 1) == v1
    with pytest.raises(LookupError, match="has no version 9 \\(versions: 1, 2, 3\\)"):
        resolve_version(project, "qa", 9)
    with pytest.raises(LookupError, match="no dataset named 'nope'"):
        resolve_version(project, "nope")
    v4 = write_version(project, "qa", [], source="t", delete=["q"])  # an id not there: nothing to delete
    assert v4.item_count == 1
    with pytest.raises(DatasetError, match="dataset name"):
        write_version(project, "Bad Name", [{"id": "a", "prompt": "A"}], source="t")
    assert DatasetItem.objects.filter(version__dataset__name="qa").count() == 6


@pytest.mark.parametrize("spec, output, expected, baseline, score, passed", [
    ({"type": "exact"}, " Paris\n", "Paris", None, 1.0, True),
    ({"type": "exact"}, "paris", "Paris", None, 0.0, False),
    ({"type": "contains", "value": "PARIS", "case_sensitive": False}, "It is Paris.", None, None, 1.0, True),
    ({"type": "contains", "value": "PARIS"}, "It is Paris.", None, None, 0.0, False),
    ({"type": "regex", "pattern": r"^\d+$"}, "42", None, None, 1.0, True),
    ({"type": "json"}, '{"a": 1}', None, None, 1.0, True),
    ({"type": "json"}, "{a: 1}", None, None, 0.0, False),
    ({"type": "json_schema", "schema": {"type": "object", "required": ["a"]}}, '{"b": 1}', None, None, 0.0, False),
    ({"type": "json_schema", "schema": {"type": "object", "required": ["a"]}}, '{"a": 1}', None, None, 1.0, True),
    ({"type": "similarity", "threshold": 0.8}, "the cat sat", "the cat sat.", None, 0.9565, True),
    ({"type": "consistency"}, "same", None, "same", 1.0, True),
    ({"type": "consistency"}, "same", None, "sane", 0.75, False),
])
def test_evaluators(spec, output, expected, baseline, score, passed):
    result = evaluators.evaluate(evaluators.check_evaluators([spec])[0], output, expected=expected,
                                 baseline_output=baseline)
    assert result["score"] == pytest.approx(score, abs=1e-3) and result["passed"] is passed


def test_evaluators_of_one_type_are_numbered():
    specs = evaluators.check_evaluators([{"type": "contains", "value": "a"}, {"type": "contains", "value": "b"}])
    assert [evaluators.name_of(s) for s in specs] == ["contains", "contains-2"]


def test_evaluators_that_cannot_apply_and_defaults():
    assert evaluators.evaluate({"type": "exact"}, "x", expected=None, baseline_output=None) is None
    specs = evaluators.evaluators_for([], "Paris", paired=True)
    assert [s["type"] for s in specs] == ["exact", "similarity", "consistency"]
    scores, passed = evaluators.score_output(specs, "Paris", expected="Paris", baseline_output="Lyon")
    assert passed is True and scores["consistency"]["passed"] is False  # consistency is not part of `passed`
    for bad, message in (([{"type": "bleu"}], "type must be one of"),
                         ([{"type": "json_schema", "schema": {"type": 5}}], "not a valid JSON Schema"),
                         ([{"type": "similarity", "threshold": 2}], "threshold must be a number"),
                         ([{"type": "exact", "name": "e"}, {"type": "contains", "value": "x", "name": "e"}],
                          "same name")):
        with pytest.raises(evaluators.EvaluatorError, match=message):
            evaluators.check_evaluators(bad)
