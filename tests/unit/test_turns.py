"""`Turns` (tokenloom/core/turns.py): ties among equally good choices rotate instead of always going to the first."""
from __future__ import annotations

from tokenloom.core.turns import Turns


def test_take_goes_to_the_next_key_after_the_last_one_and_wraps_around():
    turns: Turns[int] = Turns()
    assert [turns.take([2, 0, 1]) for _ in range(4)] == [0, 1, 2, 0]


def test_take_skips_keys_that_are_not_tied_this_time():
    turns: Turns[int] = Turns()
    assert turns.take([0, 1, 2]) == 0
    assert turns.take([0, 2]) == 2  # 1 is busier now: the next tied key after 0
    assert turns.take([1]) == 1  # a single candidate is taken, and remembered
    assert turns.take([0, 1, 2]) == 2


def test_least_picks_the_lowest_score_and_rotates_only_among_its_ties():
    turns: Turns[str] = Turns()
    loads = {"a": 1, "b": 0, "c": 0}
    assert [turns.least(list(loads), loads.__getitem__, str) for _ in range(3)] == ["b", "c", "b"]
