"""The replay plan of a regression run: warm-ups, repetitions, paired arms together or in turn, and a resumed
plan's offsets."""
from __future__ import annotations

import pytest
from regressions import runner

pytestmark = pytest.mark.mode_independent  # no database, no broker: CI runs it once (tests/conftest.py)

ITEMS = [{"id": f"i{n}", "prompt": "Hello"} for n in range(3)]


def test_together_sends_both_arms_of_an_item_at_one_moment_alternating_their_order():
    slots = runner.plan(ITEMS, {"rate": 2.0, "seed": 1, "warmup": 1}, paired=True)
    assert len(slots) == 2 * (1 + 3)
    assert [s.arm for s in slots[:4]] == ["candidate", "baseline", "baseline", "candidate"]
    assert {s.phase for s in slots} == {0}
    for first, second in zip(slots[::2], slots[1::2]):
        assert (first.item, first.offset) == (second.item, second.offset)
    assert [s.warmup for s in slots[::2]] == [True, False, False, False]


def test_in_turn_replays_the_whole_baseline_then_the_candidate_with_the_same_arrivals():
    slots = runner.plan(ITEMS, {"rate": 2.0, "seed": 1, "warmup": 1, "repetitions": 2, "arms": "in_turn"},
                        paired=True)
    baseline, candidate = slots[:7], slots[7:]
    assert {(s.arm, s.phase) for s in baseline} == {("baseline", 0)}
    assert {(s.arm, s.phase) for s in candidate} == {("candidate", 1)}
    assert [(s.item["id"], s.repetition, s.warmup, s.offset) for s in baseline] == \
           [(s.item["id"], s.repetition, s.warmup, s.offset) for s in candidate]
    assert baseline[0].warmup and not any(s.warmup for s in baseline[1:])  # each arm warms its own target
    assert [s.seq for s in slots] == list(range(14))
    # Not paired, the option changes nothing.
    assert runner.plan(ITEMS, {"rate": 2.0, "arms": "in_turn"}, paired=False) == \
           runner.plan(ITEMS, {"rate": 2.0}, paired=False)


def test_a_resumed_plan_starts_each_phase_at_its_first_unsent_request():
    slots = runner.plan(ITEMS, {"rate": 1.0, "seed": 3, "arms": "in_turn"}, paired=True)
    left = runner.rebase(slots[2:])  # two baseline requests were sent before the restart
    assert left[0].offset == 0.0 and left[0].phase == 0
    assert (left[1].arm, left[1].phase, left[1].offset) == ("candidate", 1, 0.0)  # then the whole candidate arm
    assert [s.offset for s in left[1:]] == pytest.approx([s.offset - slots[3].offset for s in slots[3:]])


def test_a_cache_sweep_adds_a_pass_per_threshold_each_item_once_in_order():
    slots = runner.plan(ITEMS, {"rate": 2.0, "seed": 1, "warmup": 1, "repetitions": 2,
                                "cache_sweep": {"thresholds": [0.8, 0.95], "max_false_hit_rate": 1.0}}, paired=False)
    replay, sweep = slots[:7], slots[7:]
    assert {(s.arm, s.phase, s.in_order) for s in replay} == {("candidate", 0, False)}
    assert [(s.arm, s.phase, s.item["id"], s.repetition, s.warmup, s.offset, s.in_order) for s in sweep] == [
        (arm, phase, f"i{n}", 0, False, 0.0, True) for arm, phase in (("t0.8", 1), ("t0.95", 2)) for n in range(3)]
    assert [s.seq for s in slots] == list(range(len(slots)))
