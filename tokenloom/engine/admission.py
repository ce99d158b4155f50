"""Engine work the server admitted but has not handed to the engine yet (the admission decision itself is
entrypoints/openai/admission.py).

Admission counts the engine's open requests plus these reservations, so requests admitted together cannot
all slip through on one snapshot of the load; each `generate()` given a reservation takes its share over once
it is registered, and `release()` drops whatever is left when the HTTP response ends.
"""
from __future__ import annotations


class ReservedWork:
    """The sum of all open reservations of one engine."""

    def __init__(self) -> None:
        self.seqs = 0
        self.work = 0.0  # decode-equivalent tokens (see LoadEstimator)


class Reservation:
    """One HTTP request's admitted share of `ledger`."""

    def __init__(self, ledger: ReservedWork, seqs: int, work: float) -> None:
        self.ledger, self.seqs, self.work = ledger, seqs, work
        ledger.seqs += seqs
        ledger.work += work

    def take(self, seqs: int, work: float) -> None:
        seqs, work = min(seqs, self.seqs), min(work, self.work)
        self.seqs -= seqs
        self.work -= work
        self.ledger.seqs -= seqs
        self.ledger.work -= work
        if self.ledger.seqs == 0:  # no float residue may make an idle engine look busy to admission
            self.ledger.work = 0.0
        if self.seqs == 0 and self.work > 0:  # all taken over: the estimate's excess goes too
            self.take(0, self.work)

    def release(self) -> None:
        self.take(self.seqs, self.work)
