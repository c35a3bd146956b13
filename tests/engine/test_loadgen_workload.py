"""Request contents: ShareGPT-like lengths, fixed/uniform lengths, JSONL datasets, chat/completions shapes."""
from __future__ import annotations

import json
import statistics

import pytest

from engine.loadgen import LengthRange, WorkloadFileError
from engine.loadgen.spec import LoadSpec
from engine.loadgen.workload import SHAREGPT_MAX_TOTAL, Workload
from engine.tokens import count_tokens, token_ids


def test_sharegpt_lengths_match_the_documented_statistics():
    workload = Workload(seed=0)
    pairs = [workload.lengths(i) for i in range(5000)]
    prompts = [p for p, _ in pairs]
    outputs = [o for _, o in pairs]
    assert all(4 <= p <= 1024 and o >= 4 and p + o <= SHAREGPT_MAX_TOTAL for p, o in pairs)
    # Means of vLLM's ShareGPT_V3 run (230 / 203 tokens per request); medians as fitted (170 / 129 before the filter).
    assert statistics.fmean(prompts) == pytest.approx(230, rel=0.06)
    assert statistics.fmean(outputs) == pytest.approx(203, rel=0.06)
    assert statistics.median(prompts) == pytest.approx(154, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(127, rel=0.1)
    # Right-skewed: the mean is well above the median.
    assert statistics.fmean(prompts) > 1.3 * statistics.median(prompts)


def test_contents_are_deterministic_per_seed_and_index():
    a, b, c = Workload(seed=1), Workload(seed=1), Workload(seed=2)
    assert a.content(5) == b.content(5)
    assert a.content(5) != c.content(5)
    assert a.content(5).prompt != a.content(6).prompt


def test_synthetic_prompts_have_exactly_the_asked_length():
    workload = Workload(input_len=LengthRange(100, 100), output_len=LengthRange(7, 7), seed=3)
    for index in range(20):
        content = workload.content(index)
        assert count_tokens(content.prompt) == content.input_tokens == 100
        assert content.max_tokens == 7
    sharegpt = Workload(seed=3)
    for index in range(20):
        content = sharegpt.content(index)
        assert count_tokens(content.prompt) == content.input_tokens


def test_a_shared_prefix_starts_every_synthetic_prompt_and_keeps_the_lengths():
    shared = 64
    contents = [Workload(seed=seed, shared_prefix_len=shared).content(index) for seed in (1, 2) for index in range(40)]
    plain = [Workload(seed=seed).content(index) for seed in (1, 2) for index in range(40)]
    assert [c.input_tokens for c in contents] == [c.input_tokens for c in plain]  # lengths as drawn
    longer = [c for c in contents if c.input_tokens > shared]
    assert len(longer) > 20
    first = token_ids(longer[0].prompt)[:shared]
    for content in contents:
        ids = token_ids(content.prompt)
        assert len(ids) == count_tokens(content.prompt) == content.input_tokens
        assert ids[:shared] == first[:len(ids[:shared])]  # the same text across seeds and requests
    # After the prefix, each request's own text.
    assert len({tuple(token_ids(c.prompt)[shared:]) for c in longer}) == len(longer)
    assert LoadSpec(shared_prefix_len=-1).problems() and LoadSpec(shared_prefix_len=10**6).problems()


def test_uniform_lengths_cover_the_range():
    workload = Workload(input_len=LengthRange(10, 20), output_len=LengthRange(1, 3), seed=0)
    pairs = [workload.lengths(i) for i in range(600)]
    assert {p for p, _ in pairs} == set(range(10, 21))
    assert {o for _, o in pairs} == {1, 2, 3}


def test_length_range_parsing():
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse("10:20") == LengthRange(10, 20)
    assert str(LengthRange(10, 20)) == "10:20" and str(LengthRange(5, 5)) == "5"
    for bad in ("", "a", "1:2:3", "5:", ":5", "1.5"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "Tell me a story.", "output_tokens": 12}),
        json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
                    "max_tokens": 3}),
        json.dumps({"prompt": "No output length given."}),
    ]) + "\n")
    workload = Workload(str(path), output_len=LengthRange(9, 9))
    first, second, third, wrapped = (workload.content(i) for i in range(4))
    assert (first.prompt, first.max_tokens, first.input_tokens) == ("Tell me a story.", 12, 5)
    assert second.messages[1] == {"role": "user", "content": "Hi!"} and second.max_tokens == 3
    assert second.input_tokens == count_tokens("Be brief.") + count_tokens("Hi!")
    assert third.max_tokens == 9
    assert wrapped == first
    # Shaped for each endpoint.
    assert first.for_endpoint("chat").messages == ({"role": "user", "content": "Tell me a story."},)
    as_text = second.for_endpoint("completions")
    assert as_text.messages is None and as_text.prompt == "system: Be brief.\n\nuser: Hi!"
    assert as_text.input_tokens == count_tokens(as_text.prompt)


@pytest.mark.parametrize("line,message", [
    ({"output_tokens": 3}, "needs 'prompt'"),
    ({"prompt": ""}, "non-empty string"),
    ({"prompt": "x", "output_tokens": "3"}, "whole number"),
    ({"prompt": "x", "max_tokens": 0}, "whole number >= 1"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "", "content": "x"}]}, "non-empty string 'role'"),
])
def test_bad_dataset_lines_are_refused(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "good"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(WorkloadFileError, match=":2: .*" + message):
        Workload(str(path))


def test_empty_or_unreadable_dataset(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n# nothing\n")
    with pytest.raises(WorkloadFileError, match="no entries"):
        Workload(str(empty))
    with pytest.raises(WorkloadFileError, match="cannot read"):
        Workload(str(tmp_path / "missing.jsonl"))
