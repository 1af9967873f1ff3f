"""Choosing the tree budget B: expected accepted tokens per second of step time.

A step with budget B costs t(B) (measured on this device: every candidate's captured step is
timed once when the session is built, then re-measured from the segments that run it, a moving
average over ``time_half_life`` steps; an autoregressive step's drift, e.g. as its context grows,
moves every tree's estimate by the same factor, so a tree last run hundreds of steps ago is not
compared at its old, shorter context's cost) and
accepts a(B) tokens per request on average.  The planner runs ``argmax_B a(B) / t(B)``; B = 0
(an autoregressive step) always accepts exactly 1, so it is the fallback that never loses.

a(B) is observed without running every budget: the first b pops of a best-first build are the
whole tree of budget b (same heap, same order), and the target's token at a node does not depend
on the other nodes (attention sees the ancestors only; with sampling, its draw is independent of
them), so a step at budget B also tells how many tokens a step at any b <= B would have accepted
-- exactly for greedy decoding, with the same draws for sampling: the accepted path's nodes with
index <= b (indices grow along a path).  The step accumulates these counterfactual lengths on the
device for every candidate b <= B.  Estimates are averages whose weight halves every
``half_life`` steps of generation, so they follow the text as it changes.

Running the chosen budget refreshes a(b) for every b below it; only larger budgets need
exploring, and one step at the largest refreshes all of them.  Exploring is what can make "auto"
slower than its best budget (with a useless drafter a B = 64 step costs ~5x an autoregressive
one for ~1 token), so it is bounded.  The planner explores one step per segment
(``segment_steps``): at the start (nothing is known; for a generation of known length, at the
largest budget whose step costs at most ``FIRST_LOOK_SHARE`` of its AR time), and then only once
the other steps since the last exploration took ``1 / share`` times as long as it did, so
exploring takes at most ``share`` of the time.  While autoregressive decoding looks best an exploration goes on, a step
at a time (``max_explore_steps`` at most), until no tree could still win given how few steps its
a(b) rests on (it measures no tree, so a good drafter written off by a few unlucky steps would
stay written off), at the largest budget still unclear (the larger ones are ruled out and a
smaller step costs less); otherwise it is one step.  While AR is the choice the next look waits
that bound times 1 - p (``PATIENCE_FLOOR`` at least), p the progress towards AR's rate the most
promising tree has surely made (:meth:`BudgetPlanner._patience`): a drafter that fell steadily
just short at a hard start looks again soon, a useless or lucky one waits the whole bound.  In a
generation of known length a near miss (p >= 0.2 when the look ended) brings the next look within
``NEAR_SPACING`` x (1 - p)^2 of the generation, however long the share bound's wait (a first look
at a hard start can cost more than the share of a short generation; :meth:`BudgetPlanner._wait`).  An
exploration that finds nothing better halves
``share`` (``max_backoff`` times at most), and any change of the choice restores it: a useless
drafter is looked at less often, a change of text is followed at once.  A tree that becomes the
choice on the strength of few request-steps (one lucky look) runs a step at a time until its a(b)
rests on ``PROBATION`` of them, so a wrong choice costs a step, not a whole segment; if it drops
below AR on that little evidence by less than its noise, it is rechecked once per look (a step or
two at the smallest budget, ``RECHECK_STEPS``): a look and a probation step can fall on the hard
start of a text.  A confirmed
tree whose estimate dips below AR's by less than its noise is measured on, a step at a time, until
the answer is clear or ``CONFIRM_STEPS`` have run (AR measures no tree: dropped on noise, it would
stay dropped until the next look, which the share bound may put after the end of the generation).
"""
from __future__ import annotations

AUTO_BUDGETS = (0, 4, 8, 16, 32, 64)
PROBATION = 4.0  # request-steps behind a(b) before a chosen tree runs whole segments
CONFIRM_STEPS = 4  # the most steps a dipped tree is measured on before AR takes over
RECHECK_STEPS = 2  # the same for a tree still on probation (once per scheduled look)
FIRST_LOOK_SHARE = 0.05  # with ``tokens``: the first look's step costs at most this share of the generation's AR time
NEAR = 0.8  # a look that ends with the patience at most this (p >= 0.2) was a near miss
NEAR_SPACING = 0.25  # with ``tokens``: after a near miss the next look comes within this x patience^2 of the generation
PATIENCE_FLOOR = 0.1  # the shortest wait for the next look, as a fraction of the share bound's


class FixedBudget:
    """One budget for the whole generation."""

    segment_steps = None  # the session's own segment length
    adaptive = False  # it reads no counterfactual accept lengths, and every rank knows its choice

    def __init__(self, budget: int):
        self.current = budget
        self.candidates = (budget,)

    def observe(self, budget: int, accepted: dict[int, tuple[float, float]], seconds_per_step: float | None,
                steps: int = 1) -> None:
        pass


class BudgetPlanner:
    """The ``tree_budget="auto"`` cost model and its bounded exploration (module docstring).

    Args:
        candidates: budgets with a captured step (0 = autoregressive, needs no draft).
        step_seconds: measured seconds per step of each candidate at this batch size (the
            session measures them once, before generation; nothing is re-measured here).
        share: exploring steps take at most this fraction of the time (before back-off).
        max_backoff: how many times explorations that find nothing may halve ``share``.
        max_explore_steps: the longest one exploration runs while its answer is unclear.
        z: how many standard errors a(b) may be off before an exploration counts as clear.
        half_life: steps of generation after which an accept observation weighs half.
        time_half_life: steps after which a step-time measurement weighs half (a segment of
            one step, as on the CPU, moves the estimate a little; one of eight, more).
        tokens: the generation's length, when known: its first look then costs at most
            ``FIRST_LOOK_SHARE`` of their autoregressive time (a short generation's first look at
            B = 64 would cost ~5 AR steps of, say, 64).

    ``current`` is the budget of the next segment and ``segment_steps`` its length (None: the
    session's ``sync_every``).
    """

    adaptive = True  # the session hands it the counterfactual accept lengths; rank 0's choice is everyone's

    def __init__(self, candidates, step_seconds: dict[int, float], *, share: float = 0.02, max_backoff: int = 1,
                 max_explore_steps: int = 16, z: float = 1.5, half_life: float = 16.0,
                 time_half_life: float = 16.0, tokens: int | None = None):
        self.candidates = tuple(sorted(set(candidates)))
        missing = [b for b in self.candidates if b not in step_seconds]
        if missing:
            raise ValueError(f"BudgetPlanner: no measured step time for budgets {missing}")
        self.seconds = {b: float(step_seconds[b]) for b in self.candidates}
        self.accept = {b: (1.0 if b == 0 else None) for b in self.candidates}
        self.weight = {b: 0.0 for b in self.candidates}  # request-steps behind accept[b], aged
        self.square = {b: None for b in self.candidates}  # the mean square of the accept lengths, aged alike
        self.share, self.max_backoff, self.max_explore_steps = share, max_backoff, max_explore_steps
        self.z, self.half_life, self.time_half_life = z, half_life, time_half_life
        self.largest = self.candidates[-1]
        self.tokens = tokens
        self.near = 1.0  # the patience when the last look ended (<= NEAR: a near miss; 1 without ``tokens``)
        self.best = self.candidates[0]
        self.backoff = 0
        self.clock = 0.0  # modelled seconds of generation so far (steps x t(budget))
        self.explored_at = self.explore_cost = 0.0  # when the last exploration ended, what it cost
        self.exploring = False
        self.rechecked = False  # a tree on probation was measured on after a dip since the last look
        self.history: list[dict] = []
        if self.largest > self.best:  # nothing is known of any tree yet
            self._start_exploring()
            if tokens is not None:
                # a short generation: a first look of at most FIRST_LOOK_SHARE of its AR time
                # (at least the smallest tree); its larger budgets come with the next looks
                fits = [b for b in self.candidates[1:]
                        if self.seconds[b] <= FIRST_LOOK_SHARE * tokens * self.seconds[0]]
                self.explore_budget = fits[-1] if fits else self.candidates[1]
        self._plan()

    def observe(self, budget: int, accepted: dict[int, tuple[float, float]], seconds_per_step: float | None,
                steps: int = 1) -> None:
        """One segment of ``steps`` steps ran at ``budget``: ``accepted[b] = (sum of counterfactual
        accept lengths, number of request-steps[, sum of their squares])`` for candidates b <=
        budget; ``seconds_per_step`` measured (None: not timed)."""
        age = 0.5 ** (steps / self.half_life)
        for b in self.candidates:
            self.weight[b] *= age
        for b, seen in accepted.items():
            total, count = seen[0], seen[1]
            if b in self.accept and b != 0 and count > 0:
                old, w = self.accept[b] or 0.0, self.weight[b]
                self.accept[b] = (old * w + total) / (w + count)
                # without squares, the noise _unclear assumes: drafts as variable as their mean
                squares = seen[2] if len(seen) > 2 else count * ((total / count) ** 2 + (total / count - 1) ** 2)
                self.square[b] = ((self.square[b] or 0.0) * w + squares) / (w + count)
                self.weight[b] = w + count
        if seconds_per_step is not None and budget in self.seconds:
            old, keep = self.seconds[budget], 0.5 ** (steps / self.time_half_life)
            self.seconds[budget] = keep * old + (1 - keep) * seconds_per_step
            if budget == 0:  # the context grew (or the machine got busier): trees drift alike
                for b in self.candidates:
                    if b:
                        self.seconds[b] *= self.seconds[0] / old
        self.clock += steps * self.seconds.get(budget, 0.0)
        exploring = self.exploring
        before, self.best = self.best, self.choose()
        if exploring:
            self.explore_steps += steps
            self.explore_cost += steps * self.seconds.get(budget, 0.0)
            unclear = self._unclear_budget()
            if self.explore_steps >= self.explore_limit or not unclear:
                self.exploring, self.explored_at = False, self.clock
                self.near = self._patience() if self.tokens is not None else 1.0
                if self.best == self.explore_from and not unclear:  # it found nothing: look less often
                    self.backoff = min(self.backoff + 1, self.max_backoff)
            elif self.looking and unclear < self.explore_budget:
                # a look goes on at the largest budget still unclear: the larger ones are ruled
                # out, and a smaller step costs less (a hard start can leave only B = 4 unclear)
                self.explore_budget = unclear
        if self.best != before:  # the text changed, or exploring paid off: look as often as allowed
            self.backoff = 0
            confirmed = self.weight[before] >= PROBATION
            if self.best == 0 and before != 0 and not self.exploring and (confirmed or not self.rechecked) \
                    and self._unclear():
                # a tree's estimate dipped below AR's by less than its noise: go on measuring (a
                # step at a time, as an exploration) until it is clear; AR measures no tree, so
                # abandoning it on noise would hold until the next look, which the share bound makes
                # late.  A confirmed tree is measured at its own budget (CONFIRM_STEPS at most); a
                # tree still on probation -- its estimate rests on a look and a step or two, e.g. at
                # the hard start of a text -- once per look, at the smallest budget (the cheapest
                # step; RECHECK_STEPS at most), so that a drafter right now and then, whose lucky
                # looks put trees on probation again and again, costs little
                self._start_exploring(before if confirmed else self.candidates[1], recheck=not confirmed)
        # an exploration of s seconds is followed by s / share seconds of other steps (share
        # halved per back-off), so exploring takes at most `share` of the time after the first
        if not self.exploring and self.best < self.largest and self.clock - self.explored_at >= self._wait():
            self._start_exploring()
        self._plan()
        self.history.append({"budget": budget, "steps": steps, "explore": exploring, "next": self.current,
                             "tokens_per_s": {b: self.rate(b) for b in self.candidates}})

    def rate(self, budget: int) -> float | None:
        """Expected accepted tokens per second per request at ``budget`` (None: not seen yet)."""
        a = self.accept[budget]
        return None if a is None else a / self.seconds[budget]

    def choose(self) -> int:
        """The budget with the most expected tokens per second among those seen."""
        known = [b for b in self.candidates if self.accept[b] is not None]
        return max(known, key=self.rate)

    def _wait(self) -> float:
        """Modelled seconds from the end of the last exploration to the next scheduled look: the
        share bound's (the look's cost / share, share halved per back-off) times the patience;
        after a near miss in a generation of known length (the look ended with a tree surely at
        least 1 - NEAR of the way from 1 token a step to AR's rate), at most NEAR_SPACING x
        patience^2 of the generation's AR time.  The share bound alone put the next look after the
        end of the trained pair's 256-token generations on a GPU (its first look, 6-16 steps long,
        costs more than 2 % of them): the look fell on the completion's hard start, where its trees
        reach 0.6-0.7 of AR's rate, and DDTree ran at 0.90x AR where a fixed B = 8 gave 1.87x
        (H100, run 227; 1.63x in run 228).  A useless or now-and-then drafter never makes a near
        miss (its a(b) less its noise stays below 1 + 0.2 (need - 1)), so its looks keep the share
        bound."""
        wait = self.explore_cost * 2 ** self.backoff / self.share * self._patience()
        if self.best == 0 and self.near <= NEAR:
            wait = min(wait, NEAR_SPACING * self.near ** 2 * self.tokens * self.seconds[0])
        return wait

    def _patience(self) -> float:
        """While autoregressive decoding is the choice, how long the next scheduled look waits, as
        a fraction of the share bound's wait: 1 - p (PATIENCE_FLOOR at least), p the progress
        towards AR's rate that the most promising tree has surely made, (a_low(b) - 1) / (need(b)
        - 1), need(b) = t(b) / t(0), a_low(b) its accept estimate less z standard errors (from
        the accept lengths' own spread).  A useless drafter (a ~ 1) waits the whole bound, as
        does one right now and then (its few lucky looks are a wide spread); one whose best tree
        fell just short, steadily (the trained pair's hard start: a(4) at 0.96 of its need),
        looks again several times sooner, when the text may have become easy.  While a tree is
        the choice, looks (at the larger budgets) wait the whole bound."""
        if self.best != 0:
            return 1.0
        p = 0.0
        for b in self.candidates:
            a, w, sq = self.accept[b], self.weight[b], self.square[b]
            need = self.seconds[b] / self.seconds[0]
            if b and a is not None and w > 0 and sq is not None and need > 1:
                low = a - self.z * (max(sq - a * a, 0.0) / w) ** 0.5
                p = max(p, min(1.0, (low - 1) / (need - 1)))
        return max(PATIENCE_FLOOR, 1 - p)

    def _unclear(self) -> bool:
        return self._unclear_budget() > 0

    def _unclear_budget(self) -> int:
        """The largest tree budget that could still beat autoregressive decoding, given how few
        steps its a(b) rests on (0: none).  Asked only while autoregressive decoding is best: it
        measures no tree, so a tree written off by a few unlucky steps stays written off until
        the next exploration (a tree chosen too eagerly is measured by running it).  To win, b
        must accept need = t(b) / t(0).  The drafts a step accepts (a - 1) vary about as much as
        their mean (near-geometric lengths: often none, sometimes many), so if b just won, a(b) -
        1 from w request-steps would rarely fall more than z standard errors, z (need - 1) /
        sqrt(w), below need - 1."""
        if self.best != 0:
            return 0
        for b in reversed(self.candidates):
            a, w = self.accept[b], self.weight[b]
            if b > 0 and a is not None and w > 0:
                need = self.seconds[b] / self.seconds[0]
                if a - 1 >= (need - 1) * (1 - self.z / w ** 0.5):
                    return b
        return 0

    def _start_exploring(self, budget: int | None = None, recheck: bool = False) -> None:
        """Explore at ``budget`` (default: the largest, which measures every a(b) at once);
        ``recheck``: a tree on probation dipped (at most once per scheduled look)."""
        self.exploring, self.explore_from = True, self.best
        if budget is None:  # a scheduled look: a tree it puts on probation may be rechecked once
            self.rechecked = False
        self.rechecked = self.rechecked or recheck
        self.explore_budget = self.largest if budget is None else budget
        self.looking = budget is None  # a look (the first, or scheduled), not a dipped tree's measuring
        # a dipped tree's measuring (budget given) is short: at a large budget each step costs
        # several AR steps, and a drafter that is right now and then dips often
        self.explore_limit = (self.max_explore_steps if budget is None else
                              RECHECK_STEPS if recheck else CONFIRM_STEPS)
        self.explore_steps, self.explore_cost = 0, 0.0

    def _plan(self) -> None:
        # one step at the largest budget measures a(b) of every budget; one step per segment, so
        # an exploration stops as soon as its answer is clear
        self.current = self.explore_budget if self.exploring else self.best
        # a tree chosen on few request-steps (one lucky look) runs a step at a time until its
        # a(b) rests on PROBATION of them: a wrong choice then costs a step, not a segment
        thin = self.best != 0 and self.weight[self.best] < PROBATION
        self.segment_steps = 1 if self.exploring or thin else None


__all__ = ["AUTO_BUDGETS", "BudgetPlanner", "FixedBudget"]
