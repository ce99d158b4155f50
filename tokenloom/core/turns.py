"""Ties broken in turn: among equally good choices, the next one after the last choice.

The data-parallel front end and the router both pick "the least loaded" replica or worker. When they
are idle every candidate scores the same, and a plain `min` returns the first one each time: every
sequential request went to replica 0 while the others sat idle. `Turns` takes the tied candidates in
the order of their keys (replica ranks, worker URLs), starting after the key it took last, so ties
rotate and each candidate gets its share.
"""
from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

Key = TypeVar("Key", int, str)
Item = TypeVar("Item")
# What candidates are compared by: a load score, or a tuple of them (compared in order).
Score = float | tuple[float, ...]


class Turns(Generic[Key]):
    """Remembers the last key taken; `take` picks the first tied key after it (wrapping around)."""

    def __init__(self) -> None:
        self.last: Key | None = None

    def take(self, tied: Sequence[Key]) -> Key:
        """One of `tied` (not empty): the smallest key greater than the last one taken, else the smallest."""
        ordered = sorted(tied)
        last = self.last
        chosen = next((k for k in ordered if last is not None and k > last), ordered[0])
        self.last = chosen
        return chosen

    def least(self, items: Sequence[Item], score: Callable[[Item], Score], key: Callable[[Item], Key]) -> Item:
        """The item of lowest `score`; among several with that score, the next in turn by `key`."""
        scores = [score(item) for item in items]
        low = min(scores)
        tied = {key(item): item for item, s in zip(items, scores) if s == low}
        return tied[self.take(list(tied))]
