"""The scheduler's account of the workers' encoder cache: which images' rows they hold, who still reads them,
and how many rows a step may encode.

An image's rows are computed by the worker in the step whose tokens first reach its placeholders and kept,
keyed by content hash, until no request needs them and the room is wanted: so a prefill split over several
chunks encodes its image once, and a later request with the same image (a retry, n > 1 after a preemption,
another user) reuses it. Entries nobody references stay cached in least-recently-used order; evicting one
tells the workers to drop it (`take_frees`, sent in the next step). The workers compute whatever a step
needs and they lack, so this account only budgets and evicts; it never decides correctness.

Per step, at most `step_budget` rows are encoded (the step's token budget, or one whole image if that is
larger): a chunk that would reach an image beyond that stops before the image's first placeholder.

A capacity of 0 turns reuse off: every image's rows are freed at the start of the step after the one that
encoded them, so each request (and each prefill chunk that reaches an image) encodes it again; sequences in
the same step that show the same image still share that step's one encoding. It is the baseline the encoder
cache is measured against (`tokenloom bench vlm`).
"""
from __future__ import annotations

from collections import OrderedDict

from tokenloom.core.multimodal import ImageInput


class EncoderCacheManager:
    def __init__(self, capacity: int, step_budget: int):
        """`capacity`: rows held at once (--max-encoder-cache); `step_budget`: rows encoded per step."""
        self.capacity = capacity
        self.step_budget = step_budget
        self.entries: OrderedDict[str, int] = OrderedDict()  # content hash -> rows, least recently used first
        self.readers: dict[str, set[str]] = {}  # content hash -> keys of the sequences yet to read it
        self.used = 0
        self.pending_frees: list[str] = []
        self.step_rows = 0  # rows this step encodes
        self.step_hashes: list[str] = []  # capacity 0: the images this step encodes, freed when the next begins

    @property
    def reuses(self) -> bool:
        return self.capacity > 0

    def begin_step(self) -> None:
        self.step_rows = 0
        self.pending_frees.extend(self.step_hashes)
        self.step_hashes = []

    def fit_chunk(self, key: str, images: list[ImageInput], start: int, n: int) -> int:
        """How many of the `n` tokens from `start` this sequence may compute this step: all of them, or fewer
        so the chunk stops before an image this step cannot encode, or before an `attend_whole` image whose
        remaining placeholders it cannot hold all of (0: wait for a step with room). Images the chunk reaches
        are held for `key` until `release_past` or `release`."""
        for image in images:
            if not image.overlaps(start, start + n):
                continue
            if image.attend_whole and start + n < image.end:  # never part of an image's remaining placeholders
                return max(image.offset - start, 0)
            h = image.content_hash
            if not self.reuses:
                if h not in self.step_hashes:
                    self.step_hashes.append(h)
                continue
            if h in self.entries:
                self.entries.move_to_end(h)
            elif self._room_for(image.length):
                self._insert(h, image.length)
            else:
                return max(image.offset - start, 0)
            self.readers.setdefault(h, set()).add(key)
        return n

    def release_past(self, key: str, images: list[ImageInput], num_computed: int) -> None:
        """Drop `key`'s hold on the images whose placeholders it has computed."""
        for image in images:
            if image.end <= num_computed:
                self._drop_reader(image.content_hash, key)

    def release(self, key: str, images: list[ImageInput]) -> None:
        """Drop every hold of a sequence that finished or was preempted."""
        for image in images:
            self._drop_reader(image.content_hash, key)

    def take_frees(self) -> list[str]:
        frees, self.pending_frees = self.pending_frees, []
        return frees

    def _room_for(self, rows: int) -> bool:
        if self.step_rows and self.step_rows + rows > self.step_budget:
            return False
        evictable = sum(r for h, r in self.entries.items() if not self.readers.get(h))
        return self.capacity - self.used + evictable >= rows

    def _insert(self, h: str, rows: int) -> None:
        for old in [old for old in self.entries if not self.readers.get(old)]:
            if self.capacity - self.used >= rows:
                break
            self.used -= self.entries.pop(old)
            self.readers.pop(old, None)
            self.pending_frees.append(old)
        self.entries[h] = rows
        self.used += rows
        self.step_rows += rows

    def _drop_reader(self, h: str, key: str) -> None:
        readers = self.readers.get(h)
        if readers is not None:
            readers.discard(key)


def run_over_whole_images(images: list[ImageInput], start: int, n: int, limit: int) -> int:
    """A chunk of `n` tokens from `start` that would end inside an `attend_whole` image's placeholders runs on
    to the image's end when `limit` (the tokens left and the step's budget) allows: the cap on long prefills
    gives way to an image that must be prefilled in one chunk."""
    for image in images:
        if image.attend_whole and image.offset < start + n < image.end <= start + limit:
            n = image.end - start
    return n
