"""What a pass of m rows costs relative to one row, as this process's passes measure it.

Draft lengths are chosen by it (draft_proposer.best_length): a verified draft pays for its rows whether the
model accepts them or not, so a cost that is too low makes drafts that are rarely accepted slower than none.
A cost timed once at load (LlamaRunner.pass_costs) is a prior only: it was timed at another thread count or on a
busier moment of a shared machine, and a row's share of a pass changes with the thread count (at 2 threads the
fixed part of a pass, dispatches and Python, weighs more). So every decode pass the engine runs is timed too,
per row count, and the ratio to one row's time replaces the prior as passes of both sizes accumulate.
The costs never change a token, only how many a pass checks.
"""
from __future__ import annotations

import threading
from typing import Sequence


class PassCosts:
    """costs[m] for m = 0..len-1 ([0] is 0): the prior from load, then the learnt ratio of passes timed here.
    Never decreasing in m (noise must not make a longer draft look cheaper). Shared by an engine's requests."""

    ALPHA = 0.1  # weight of a new pass in the running time of its row count: about the last twenty count
    TRUST = 8  # passes of a row count (and of one row) before the measured ratio alone is used

    def __init__(self, prior: Sequence[float]):
        self.prior = prior  # as given (the engine makes a new one when the backend's changes)
        self._prior = [float(c) for c in prior]
        self._lock = threading.Lock()
        self._time = [0.0] * len(self._prior)  # running mean seconds of a pass of m rows
        self._seen = [0] * len(self._prior)

    def __len__(self) -> int:
        return len(self._prior)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode pass of `rows` rows (a token and its draft, or several requests' rows) took `seconds`."""
        if rows < 1 or rows >= len(self._prior) or not seconds > 0:
            return
        with self._lock:
            n = self._seen[rows]
            self._time[rows] = seconds if n == 0 else self._time[rows] + self.ALPHA * (seconds - self._time[rows])
            self._seen[rows] = n + 1

    def _ratio(self, m: int) -> float:
        """Row count m's cost: the measured ratio to one row, blended with the prior until both are trusted."""
        prior = self._prior[m]
        if m <= 1 or not self._seen[1] or not self._seen[m]:
            return prior
        measured = self._time[m] / self._time[1]
        trust = min(self._seen[m], self._seen[1], self.TRUST) / self.TRUST
        return prior + trust * (measured - prior)

    def __getitem__(self, m: int) -> float:
        if m < 0:
            m += len(self._prior)
        with self._lock:
            cost = 0.0
            for i in range(min(m, len(self._prior) - 1) + 1):
                cost = max(cost, self._ratio(i))
            return cost

    def snapshot(self) -> list[float]:
        """Every cost now (for the log and tests)."""
        return [self[m] for m in range(len(self._prior))]
