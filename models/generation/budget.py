"""Choosing the tree budget B: expected accepted tokens per second of step time.

A step with budget B costs t(B) (measured on this device: every candidate's captured step is
timed once when the session is built, then re-measured from the segments that run it) and
accepts a(B) tokens per request on average.  The planner picks ``argmax_B a(B) / t(B)``.

a(B) is observed without running every budget: the first b pops of a best-first build are the
whole tree of budget b (same heap, same order), and the target's token at a node does not depend
on the other nodes, so a step at budget B also tells exactly how many tokens a step at any
b <= B would have accepted: the accepted path's nodes with index <= b (indices grow along a
path).  The step accumulates these counterfactual lengths on the device for every candidate
b <= B; B = 0 (an autoregressive step) always accepts exactly 1.  Larger budgets are only seen
when one runs, so the planner explores with the largest candidate in the first segment and
every ``explore_every`` segments after that.  Estimates are exponential moving averages over
segments (weight ``decay`` on the past), so the choice follows the text as it changes.
"""
from __future__ import annotations

AUTO_BUDGETS = (0, 4, 8, 16, 32, 64)


class FixedBudget:
    """One budget for the whole generation."""

    def __init__(self, budget: int):
        self.current = budget
        self.candidates = (budget,)

    def observe(self, budget: int, accepted: dict[int, tuple[float, float]], seconds_per_step: float | None) -> None:
        pass


class BudgetPlanner:
    """The ``tree_budget="auto"`` cost model (module docstring).

    Args:
        candidates: budgets with a captured step (0 = autoregressive, needs no draft).
        step_seconds: measured seconds per step of each candidate at this batch size.
        explore_every: every this many segments, run the largest candidate to refresh a(B) for all.
        decay: weight of the old estimate in each moving-average update.
    """

    def __init__(self, candidates, step_seconds: dict[int, float], *, explore_every: int = 8, decay: float = 0.5):
        self.candidates = tuple(sorted(set(candidates)))
        missing = [b for b in self.candidates if b not in step_seconds]
        if missing:
            raise ValueError(f"BudgetPlanner: no measured step time for budgets {missing}")
        self.seconds = {b: float(step_seconds[b]) for b in self.candidates}
        self.accept = {b: (1.0 if b == 0 else None) for b in self.candidates}
        self.explore_every, self.decay = explore_every, decay
        self.segments = 0
        self.current = self.candidates[-1]
        self.history: list[dict] = []

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe(self, budget: int, accepted: dict[int, tuple[float, float]], seconds_per_step: float | None) -> None:
        """One segment ran at ``budget``: ``accepted[b] = (sum of counterfactual accept lengths,
        number of request-steps)`` for candidates b <= budget; ``seconds_per_step`` measured."""
        for b, (total, count) in accepted.items():
            if b in self.accept and b != 0 and count > 0:
                self.accept[b] = self._mix(self.accept[b], total / count)
        if seconds_per_step is not None and budget in self.seconds:
            self.seconds[budget] = self._mix(self.seconds[budget], seconds_per_step)
        self.segments += 1
        self.current = self.choose()
        self.history.append({"budget": budget, "next": self.current,
                             "tokens_per_s": {b: self.rate(b) for b in self.candidates}})

    def rate(self, budget: int) -> float | None:
        """Expected accepted tokens per second per request at ``budget`` (None: not seen yet)."""
        a = self.accept[budget]
        return None if a is None else a / self.seconds[budget]

    def choose(self) -> int:
        if self.segments % self.explore_every == 0:
            return self.candidates[-1]
        known = [b for b in self.candidates if self.accept[b] is not None]
        return max(known, key=self.rate)


__all__ = ["AUTO_BUDGETS", "BudgetPlanner", "FixedBudget"]
