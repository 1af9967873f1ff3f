"""``tree_budget="auto"`` (models/generation/budget.py) in simulation: the planner is fed
synthetic segments, no model runs and no clock is read.

Step times are the H200's (2p2b, issue 44: AR 0.564 ms, B = 4 / 16 / 64 at 3.6 / 4.4 / 5.2x AR;
8 and 32 in between) and a faster tree step (B = 16 at 2.6x AR, issue 44's target).  Each step
accepts 1 + (a(B) - 1) x drafts, x ~ Exp(1) drawn once per request-step and shared by every b
(so the counterfactual lengths grow with b, as a real step's do) -- as noisy as the near-geometric
accept lengths of a real drafter: often ~none, sometimes many.  Simulated tokens per second over
a 2,000-token generation of "auto" are compared with autoregressive decoding and the best fixed
budget, each simulated the same way.  These are simulations, not GPU measurements.
"""
import random
import statistics
import types

import pytest

from torch_kdtree.models.generation import AUTO_BUDGETS, BudgetPlanner, FixedBudget, GenerationSession

AR_SECONDS = 0.564e-3
H200 = {0: 1.0, 4: 3.6, 8: 4.0, 16: 4.4, 32: 4.8, 64: 5.2}  # step time / AR step time
FAST = {0: 1.0, 4: 2.0, 8: 2.2, 16: 2.6, 32: 3.2, 64: 4.2}
RANDOM = {4: 1.02, 8: 1.03, 16: 1.04, 32: 1.05, 64: 1.05}  # a(B): random drafter weights
GOOD = {4: 2.9, 8: 3.6, 16: 4.3, 32: 4.7, 64: 5.0}  # a(B) rising to 4-5
STRONG = {4: 4.2, 8: 5.6, 16: 7.5, 32: 8.5, 64: 9.0}  # ~95 % oracle
# k2_slice on an H100 (RESULTS.md run 193: AR, B = 16 and 32 measured; 4, 8 and 64 estimated)
K2_H100 = {0: 1.0, 4: 2.8, 8: 3.1, 16: 3.53, 32: 4.48, 64: 6.2}
SEEDS = range(12)


def simulate(policy, times, accept, *, tokens=2000, R=1, sync_every=8, seed=0, draw=None):
    """Tokens per AR-step time of one generation: segments as GenerationSession.run cuts them on
    CUDA (``segment_steps``, at most ``sync_every``); ``accept(tokens so far)`` gives a(B), and a
    request-step accepts 1 + (a(B) - 1) x, x = ``draw(rng)`` (default Exp(1))."""
    rng = random.Random(seed)
    draw = draw or (lambda rng: rng.expovariate(1.0))
    made = clock = 0.0
    while made < tokens:
        budget, a = policy.current, accept(made)
        steps = min(policy.segment_steps or sync_every, sync_every)
        sums = {b: [0.0, 0, 0.0] for b in times if 0 < b <= budget}
        for _ in range(steps):
            for _ in range(R):
                x = draw(rng)
                for b in sums:
                    sums[b][0] += 1 + (a[b] - 1) * x
                    sums[b][1] += 1
                    sums[b][2] += (1 + (a[b] - 1) * x) ** 2
                made += (1 + (a[budget] - 1) * x if budget else 1) / R
            clock += times[budget]
        policy.observe(budget, {b: tuple(v) for b, v in sums.items()}, times[budget] * AR_SECONDS, steps)
    return made / clock


def auto(times):
    return BudgetPlanner(AUTO_BUDGETS, {b: t * AR_SECONDS for b, t in times.items()})


def mean_rate(make_policy, times, accept, **kw):
    return statistics.mean(simulate(make_policy(), times, accept, seed=s, **kw) for s in SEEDS)


def steady(a):
    return lambda made: a


def switching(first, second, at=1000):
    return lambda made: first if made < at else second


@pytest.mark.parametrize("times", [H200, FAST], ids=["h200", "fast_tree"])
@pytest.mark.parametrize("R", [1, 4])
def test_useless_drafter_costs_less_than_3_percent_of_autoregressive(times, R):
    for seed in SEEDS:
        planner = auto(times)
        rate = simulate(planner, times, steady(RANDOM), R=R, seed=seed)
        assert rate >= 0.97, (seed, rate)  # AR makes 1 token per AR-step time
        explored = sum(h["steps"] * times[h["budget"]] for h in planner.history if h["explore"])
        first = sum(h["steps"] * times[h["budget"]] for h in planner.history[: 16] if h["explore"])
        assert explored - first <= planner.share * 2000 / rate  # the share bound, after the first look


@pytest.mark.parametrize("times,accept", [(H200, GOOD), (H200, STRONG), (FAST, GOOD), (FAST, STRONG)],
                         ids=["h200_good", "h200_strong", "fast_good", "fast_strong"])
@pytest.mark.parametrize("R", [1, 4])
def test_good_drafter_gets_the_best_fixed_budgets_rate(times, accept, R):
    fixed = {b: mean_rate(lambda b=b: FixedBudget(b), times, steady(accept), R=R) for b in times}
    best = max(fixed, key=fixed.get)
    rate = mean_rate(lambda: auto(times), times, steady(accept), R=R)
    assert rate >= 0.95 * fixed[best], (rate, fixed)
    planner = auto(times)
    simulate(planner, times, steady(accept), R=4)
    used = {}
    for h in planner.history:
        used[h["budget"]] = used.get(h["budget"], 0) + h["steps"] * times[h["budget"]]
    top = max(used, key=used.get)
    assert fixed[top] >= 0.97 * fixed[best], (top, best, fixed)  # most of the time at a best-rate budget


@pytest.mark.parametrize("times,good", [(H200, STRONG), (FAST, GOOD)], ids=["h200_strong", "fast_good"])
@pytest.mark.parametrize("R", [1, 4])
def test_follows_good_text_then_random_text(times, good, R):
    """1,000 tokens the drafter predicts well, then 1,000 it does not."""
    best_good = max(good.get(b, 1.0) / t for b, t in times.items())
    ideal = 2000 / (1000 / best_good + 1000)  # the best budget of each half, switched at once
    accept = switching(good, RANDOM)
    rate = mean_rate(lambda: auto(times), times, accept, R=R)
    fixed = max(mean_rate(lambda b=b: FixedBudget(b), times, accept, R=R) for b in times)
    assert rate >= 0.92 * ideal and rate >= 1.05 * fixed, (rate, ideal, fixed)
    planner = auto(times)
    simulate(planner, times, accept, R=R)
    tail = planner.history[-len(planner.history) // 3:]  # well inside the random half
    ar = sum(h["steps"] for h in tail if h["budget"] == 0) / sum(h["steps"] for h in tail)
    assert ar >= 0.9, ar


def test_finds_the_drafter_when_random_text_turns_good():
    """The other way round it takes an exploration (bounded, so not at once), but it comes."""
    accept = switching(RANDOM, STRONG)
    rate = mean_rate(lambda: auto(H200), H200, accept, R=4)
    ideal = 2000 / (1000 + 1000 * H200[32] / STRONG[32])  # AR, then B = 32
    assert rate >= 0.9 * ideal and rate >= 1.15, (rate, ideal)  # AR: 1.0


def test_exploration_waits_for_its_share_of_the_time_and_backs_off():
    planner = BudgetPlanner((0, 64), {0: 1.0, 64: 5.0}, share=0.05, max_backoff=2)
    looks = []
    while len(looks) < 4:
        if planner.current == 64:
            looks.append(planner.clock)
            planner.observe(64, {64: (4.0, 4.0)}, 5.0, 1)  # 4 requests, nothing extra: clear at once
        else:
            planner.observe(0, {}, 1.0, 8)
    # one step of 5 s, each finding nothing: then 5 / 0.05 = 100 s of other steps, doubled per
    # back-off (at most twice)
    assert looks == [0.0, 205.0, 610.0, 1015.0] and planner.backoff == 2
    planner.observe(0, {}, 1.0, 8)
    while planner.current != 64:
        planner.observe(0, {}, 1.0, 8)
    planner.observe(64, {64: (40.0, 4.0)}, 5.0, 1)  # the text changed: a(64) = 10
    assert (planner.current, planner.segment_steps, planner.backoff) == (64, None, 0)


def test_an_unclear_first_look_goes_on_while_no_tree_is_ruled_out():
    planner = BudgetPlanner((0, 16), {0: 1.0, 16: 4.0})  # 16 wins with a(16) >= 4
    planner.observe(16, {16: (1.0, 1.0)}, 4.0, 1)  # one step, nothing extra accepted: no proof yet
    assert (planner.current, planner.segment_steps) == (16, 1)
    planner.observe(16, {16: (1.0, 1.0)}, 4.0, 1)
    planner.observe(16, {16: (1.0, 1.0)}, 4.0, 1)  # three steps: 0 < 3 (1 - 1.5 / sqrt(3)) drafts
    assert (planner.current, planner.segment_steps) == (0, None)


class _Policy:
    def __init__(self, plan):
        self.plan, self.seen = list(plan), []
        self.current, self.segment_steps = self.plan.pop(0)

    def observe(self, budget, accepted, seconds_per_step, steps):
        self.seen.append((budget, steps))
        if self.plan:
            self.current, self.segment_steps = self.plan.pop(0)


@pytest.mark.parametrize("device,expected", [("cuda", [(64, 1), (4, 8), (4, 3)]), ("cpu", [(64, 1)] + [(4, 1)] * 11)])
def test_session_run_honours_segment_steps(device, expected):
    """GenerationSession.run cuts segments of ``policy.segment_steps`` steps, at most sync_every
    (1 on the CPU), and never more than can still be needed."""
    left = [12]

    def step(budget):
        left[0] -= 1

    fake = types.SimpleNamespace(device=types.SimpleNamespace(type=device), sync_every=8, max_new=64, _timing=None,
                                 tp=None, remaining=lambda: left[0], step=step, _timed_seconds=lambda: 1.0,
                                 take_counterfactuals=lambda: {})
    policy = _Policy([(64, 1)] + [(4, None)] * 20)
    run = GenerationSession.run(fake, policy)
    assert policy.seen == expected
    assert run["budgets"] == [64] + [4] * 11


def simulate_drifting(policy, times, accept, *, tokens=2000, growth=1.5, noise=0.25, flush_every=16, seed=0):
    """Like :func:`simulate` on the CPU (a segment is one step): every step's cost grows with
    the context (x ``1 + growth`` by the end, as a small model's attention on the CPU does), each
    measurement is off by a log-normal factor (``noise``) and every ``flush_every``-th
    autoregressive step also pays the drafter's deferred context append (x2).  Returns tokens per
    AR-step time at the start."""
    rng = random.Random(seed)
    made = clock = 0.0
    ar_steps = 0
    while made < tokens:
        budget, a = policy.current, accept(made)
        x = rng.expovariate(1.0)
        sums = {b: [1 + (a[b] - 1) * x, 1, (1 + (a[b] - 1) * x) ** 2] for b in times if 0 < b <= budget}
        made += 1 + (a[budget] - 1) * x if budget else 1
        cost = times[budget] * (1 + growth * made / tokens)
        if budget == 0:
            ar_steps += 1
            cost *= 2 if ar_steps % flush_every == 0 else 1
        clock += cost
        policy.observe(budget, {b: tuple(v) for b, v in sums.items()}, cost * rng.lognormvariate(0, noise), 1)
    return made / clock


def test_noisy_one_step_segments_and_a_growing_context_do_not_tempt_it_into_trees():
    """The CPU's case: one-step segments whose times scatter, and an autoregressive step that
    gets slower as the context grows while the trees' estimates date from their last run.  A
    useless drafter must still cost at most 3 % (an early planner, whose time estimate moved
    half-way to each one-step measurement and left the trees' estimates where they were, ran
    trees whenever an AR step's measurement came out high: 0.87-0.94x on the CPU)."""
    ar = statistics.mean(simulate_drifting(FixedBudget(0), H200, steady(RANDOM), seed=s) for s in SEEDS)
    rates = []
    for seed in SEEDS:
        planner = auto(H200)
        rates.append(simulate_drifting(planner, H200, steady(RANDOM), seed=seed))
        trees = sum(h["steps"] for h in planner.history if h["budget"])
        assert trees <= 12, (seed, trees)  # the first look and a few more, no runs of trees
    assert statistics.mean(rates) >= 0.97 * ar, (statistics.mean(rates), ar)


def test_a_tree_chosen_on_one_lucky_look_runs_a_step_at_a_time_until_it_is_confirmed():
    """One request, a useless drafter whose first look happened to accept 10 tokens: the tree is
    the choice (10 / 4 > 1 / 1) but rests on one request-step, so it runs single steps (a GPU
    segment would be 8 of them) until PROBATION request-steps back it: two ordinary steps make AR
    the choice, a step at a time, not a segment at once; its estimate then rests on so few steps
    that one short recheck (at most RECHECK_STEPS) runs before AR takes over."""
    from torch_kdtree.models.generation.budget import PROBATION, RECHECK_STEPS

    planner = BudgetPlanner((0, 16), {0: 1.0, 16: 4.0})
    planner.observe(16, {16: (10.0, 1.0)}, 4.0, 1)  # the first look: a(16) = 10 on one request-step
    assert (planner.current, planner.segment_steps) == (16, 1)
    planner.observe(16, {16: (1.0, 1.0)}, 4.0, 1)  # a(16) ~ 5.4: still the choice, still on probation
    assert (planner.current, planner.segment_steps) == (16, 1)
    planner.observe(16, {16: (1.0, 1.0)}, 4.0, 1)  # ~3.9 < 4: AR is the choice, after single steps only
    # ... but ~3.9 on three request-steps is within the noise of 4: one short recheck (an
    # exploration at the smallest tree budget, here 16), then AR
    assert (planner.best, planner.current, planner.segment_steps, planner.exploring) == (0, 16, 1, True)
    steps = 0
    while planner.exploring:
        planner.observe(16, {16: (1.0, 1.0)}, 4.0, 1)
        steps += 1
    assert planner.current == 0 and steps <= RECHECK_STEPS
    # a drafter that keeps delivering is confirmed and gets whole segments
    planner = BudgetPlanner((0, 16), {0: 1.0, 16: 4.0})
    steps = 0
    while planner.segment_steps == 1:
        planner.observe(16, {16: (10.0, 1.0)}, 4.0, 1)
        steps += 1
    assert planner.current == 16 and planner.weight[16] >= PROBATION and steps == 5  # ages 0.5 ** (1 / 16) a step


def test_a_good_drafter_whose_look_falls_on_a_hard_start_is_rechecked_and_kept():
    """The trained pair on the CPU (2026-12-06): the first look and the probation step fell on the
    start of a completion, which the drafter finds hard, and put B = 8 just below AR (2.07 tokens a
    step against the 2.16 it needs); the share bound then scheduled the next look after ~230 AR
    steps, so a 64-token generation ran autoregressively at 0.85-0.95x where B = 8 gives 1.3-1.4x.
    Now a tree dropped on that little evidence is rechecked once, at the smallest budget, and a
    drafter that is good after the start is back within RECHECK_STEPS; a useless one is not
    rechecked (its estimate is clear at once)."""
    from torch_kdtree.models.generation.budget import RECHECK_STEPS

    times = {0: 11.55, 4: 24.27, 8: 24.92}  # ms, measured there
    planner = BudgetPlanner((0, 4, 8), times)
    assert planner.current == 8  # the first look at the largest budget
    planner.observe(8, {4: (4.6, 2.0), 8: (5.2, 2.0)}, 24.9, 1)  # two requests: a(8) = 2.6 > 2.16
    assert (planner.best, planner.current, planner.segment_steps) == (8, 8, 1)  # on probation
    planner.observe(8, {4: (2.6, 2.0), 8: (2.8, 2.0)}, 24.9, 1)  # a hard step: a(8) ~ 2.0 < 2.16
    assert planner.best == 0 and planner.exploring and planner.current == 4
    steps = 0
    while planner.exploring:
        planner.observe(4, {4: (6.4, 2.0)}, 24.3, 1)  # the completion's loop: 3.2 a step at B = 4
        steps += 1
    assert planner.best == 4 and planner.current == 4 and steps <= RECHECK_STEPS
    # a useless drafter: its first look goes on until no tree could win (an unclear first look),
    # no tree is ever the choice, so nothing is on probation and nothing is rechecked
    planner = BudgetPlanner((0, 4, 8), times)
    while planner.exploring:
        planner.observe(8, {4: (2.1, 2.0), 8: (2.1, 2.0)}, 24.9, 1)
        assert planner.best == 0 and not planner.rechecked
    assert planner.current == 0 and len(planner.history) <= 4


def test_a_steady_drafter_just_short_at_a_hard_start_is_looked_at_again_soon():
    """The trained pair on the CPU at 256 tokens (session 48: "auto" 1.12x AR where a fixed B = 4
    gave 2.15x): the first look and its recheck fall on a completion's hard start, where every
    tree accepts steadily just short of its need; then the text turns easy.  The share bound
    alone waited ~200 AR steps for the next look.  The wait now shrinks with how close the best
    tree surely came (its accept lengths' own spread: steady here) and the look goes on at the
    largest budget still unclear, so "auto" gets >= 0.8 of the best fixed budget's rate (the
    planner before: 0.71) -- while the useless and the now-and-then drafters above keep theirs."""
    cpu = {0: 1.0, 4: 1.9, 8: 2.2, 16: 2.5, 32: 3.1, 64: 4.5}  # step / AR step, as measured there
    hard = {4: 1.75, 8: 1.85, 16: 1.9, 32: 1.95, 64: 2.0}
    easy = {4: 4.2, 8: 5.2, 16: 5.8, 32: 6.0, 64: 6.1}
    accept = switching(hard, easy, at=24)

    def steady_draw(rng):
        return rng.uniform(0.5, 1.5)

    for R in (1, 2):
        kw = dict(tokens=256, R=R, draw=steady_draw)
        fixed = max(mean_rate(lambda b=b: FixedBudget(b), cpu, accept, **kw) for b in cpu)
        rate = mean_rate(lambda: auto(cpu), cpu, accept, **kw)
        assert rate >= 0.8 * fixed, (R, rate, fixed)


@pytest.mark.parametrize("times", [H200, K2_H100], ids=["h200", "k2_h100"])
def test_a_short_generations_first_look_costs_a_share_of_it(times):
    """Told the generation's length (generate passes max_new_tokens), the first look runs at the
    largest budget whose step costs at most FIRST_LOOK_SHARE of the generation's AR time (the
    smallest tree if none does): at 64 tokens a first look at B = 64 cost a useless drafter 11-14 %
    (0.865-0.888x in simulation), now ~6-7 %; at 2,000 tokens the first look is at the largest, as
    before."""
    from torch_kdtree.models.generation.budget import FIRST_LOOK_SHARE

    def planner(tokens):
        return BudgetPlanner(AUTO_BUDGETS, {b: t * AR_SECONDS for b, t in times.items()}, tokens=tokens)

    first = planner(64).current
    fits = [b for b in AUTO_BUDGETS[1:] if times[b] <= FIRST_LOOK_SHARE * 64]
    assert first == (fits[-1] if fits else 4) and planner(2000).current == 64 and planner(None).current == 64
    rate = mean_rate(lambda: planner(64), times, steady(RANDOM), tokens=64, R=2)
    assert rate >= 0.92, rate


def test_a_confirmed_tree_that_dips_below_ar_by_noise_is_measured_before_it_is_dropped():
    """A tree confirmed over many steps whose estimate one bad segment pushes just below AR's is
    measured on (single steps at that tree, an exploration) until the answer is clear, instead of
    being dropped for AR until the next share-bounded look; a tree that falls far below AR is
    dropped at once, and so is one still on probation (the lucky-look test above).  The measuring
    lasts CONFIRM_STEPS steps at most: a drafter right now and then dips often, each step at a
    large budget costing several AR steps."""
    from torch_kdtree.models.generation.budget import CONFIRM_STEPS

    def confirmed():
        # share 1e-3: no scheduled look in this test (its wait >= the first look's 4 / share x PATIENCE_FLOOR)
        planner = BudgetPlanner((0, 16), {0: 1.0, 16: 4.0}, share=1e-3)
        for _ in range(30):
            planner.observe(16, {16: (5.0, 1.0)}, 4.0, 1)  # a(16) = 5 > 4: the choice, confirmed
        assert planner.current == 16 and planner.segment_steps is None
        return planner

    planner = confirmed()
    planner.observe(16, {16: (1.0 * 8, 8.0)}, 4.0, 8)  # a bad segment: the estimate ~3.4 < 4
    assert planner.best == 0 and planner.rate(16) < planner.rate(0)
    assert (planner.current, planner.segment_steps, planner.exploring) == (16, 1, True)
    steps = 0
    while planner.exploring:  # the text is still good: the tree is back
        planner.observe(16, {16: (8.0, 1.0)}, 4.0, 1)
        steps += 1
    assert planner.best == planner.current == 16 and steps <= CONFIRM_STEPS
    # a collapse far below the need is clear at once: AR
    planner = confirmed()
    planner.observe(16, {16: (1.0 * 16, 16.0)}, 4.0, 16)
    assert planner.best == 0 and planner.current == 0 and not planner.exploring
    # and the share bound holds: the dip's measuring is one exploration of at most max_explore_steps
    planner = confirmed()
    planner.observe(16, {16: (1.0 * 8, 8.0)}, 4.0, 8)
    steps = 0
    while planner.exploring:
        planner.observe(16, {16: (1.0, 1.0)}, 4.0, 1)  # the drafter really went useless
        steps += 1
    assert planner.current == 0 and 1 <= steps <= CONFIRM_STEPS


@pytest.mark.parametrize("times", [H200, FAST, K2_H100], ids=["h200", "fast_tree", "k2_h100"])
@pytest.mark.parametrize("q", [0.01, 0.05])
@pytest.mark.parametrize("R", [1, 4])
def test_a_drafter_right_now_and_then_costs_under_3_percent_in_every_seed(times, q, R):
    """Rare whole-block hits (a(b) = 1.07 / 1.35, below every tree's need) make lucky looks and
    dips: the probation, the dips' short measuring and the share bound keep every one of 40
    seeds within 3 % of AR (worst at this head: 0.9705, h200 q 0.05 R 4; 0.9715 before session 48)."""
    block = steady({b: 8.0 for b in times if b})  # a hit accepts the whole block at every budget
    worst = min(simulate(auto(times), times, block, R=R, seed=s, draw=lambda rng: float(rng.random() < q))
                for s in range(40))
    assert worst >= 0.97, worst


# the trained default pair at batch 2 on an H100 (runs 227-228, 256 tokens): these times give a fixed
# B = 8 the 47 steps and 1.91x AR the GPU showed when replayed on the pair's own accept lengths
PAIR_H100 = {0: 1.0, 4: 2.7, 8: 2.85, 16: 3.1, 32: 3.4, 64: 3.9}


@pytest.mark.parametrize("slower", [1.0, 1.2, 1.5, 2.0])
def test_a_near_miss_at_a_short_generations_hard_start_is_looked_at_again_within_it(slower):
    """The trained pair's completions start hard (a(b) ~2-2.6 for ~20 tokens, at 0.6-0.7 of AR's
    rate) and then turn easy (5-7 tokens a step).  With trees only a little dearer than
    PAIR_H100 (measured or real: ``slower``) the first look ended on the hard start, and the share
    bound's next look came after the end of the 256 tokens: "auto" ran at ~0.95x AR in the worst
    seed where a fixed budget gave 1.1-1.8x (on the H100, runs 227 and 228: 0.90x, then
    1.63x).  A near miss now brings the next look within the generation: every seed reaches 0.9
    of the best fixed budget's rate.  Useless and now-and-then drafters make no near miss (next
    test), so their looks keep the share bound."""
    times = {b: 1 + (t - 1) * slower for b, t in PAIR_H100.items()}
    hard = {4: 2.0, 8: 2.2, 16: 2.3, 32: 2.5, 64: 2.6}
    easy = {4: 4.5, 8: 6.5, 16: 7.0, 32: 7.2, 64: 7.3}
    kw = dict(tokens=256, R=2, draw=lambda rng: rng.uniform(0.5, 1.5))
    accept = switching(hard, easy, at=20)
    fixed = max(mean_rate(lambda b=b: FixedBudget(b), times, accept, **kw) for b in AUTO_BUDGETS[1:])

    def planner():
        return BudgetPlanner(AUTO_BUDGETS, {b: t * AR_SECONDS for b, t in times.items()}, tokens=256)

    worst = min(simulate(planner(), times, accept, seed=s, **kw) for s in SEEDS)
    assert worst >= 0.9 * fixed, (worst, fixed)


@pytest.mark.parametrize("times", [H200, K2_H100], ids=["h200", "k2_h100"])
@pytest.mark.parametrize("R", [1, 4])
def test_useless_and_now_and_then_drafters_make_no_near_miss(times, R):
    """In a generation of known length (as generate runs it) neither a useless drafter nor one
    right now and then ends a look as a near miss, so the next look keeps the share bound's wait."""
    from torch_kdtree.models.generation.budget import NEAR

    class Watched(BudgetPlanner):
        def _wait(self):
            self.nearest = min(getattr(self, "nearest", 1.0), self.near)
            return super()._wait()

    block = steady({b: 8.0 for b in times if b})
    drafters = [(steady(RANDOM), None), (block, lambda rng: float(rng.random() < 0.05))]
    for accept, draw in drafters:
        for seed in range(10):
            planner = Watched(AUTO_BUDGETS, {b: t * AR_SECONDS for b, t in times.items()}, tokens=2000)
            rate = simulate(planner, times, accept, tokens=2000, R=R, seed=seed, draw=draw)
            assert planner.nearest > NEAR and rate >= 0.95, (seed, planner.nearest, rate)


@pytest.mark.parametrize("adaptive", [False, True])
def test_session_run_reads_counterfactuals_and_broadcasts_only_for_an_adaptive_policy(adaptive):
    """A fixed budget (FixedBudget.adaptive is False) is handed no counterfactual accept lengths --
    two device reads a look saved -- and under tensor parallelism its choice is not broadcast (every
    rank knows it); the planner gets them every look, rank 0's choice and segment in one broadcast."""
    left, reads, broadcasts = [10], [], []

    def step(budget):
        left[0] -= 1

    def broadcast(obj):
        broadcasts.append(obj)
        return obj

    fake = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), sync_every=4, max_new=64, _timing=None,
                                 tp=types.SimpleNamespace(broadcast_object=broadcast), remaining=lambda: left[0],
                                 step=step, _timed_seconds=lambda: 1.0,
                                 take_counterfactuals=lambda: reads.append(1) or {4: (4.0, 2.0)})
    policy = BudgetPlanner((0, 4), {0: 1.0, 4: 2.0}) if adaptive else FixedBudget(4)
    seen, observe = [], policy.observe
    policy.observe = lambda budget, accepted, *rest: seen.append(accepted) or observe(budget, accepted, *rest)
    run = GenerationSession.run(fake, policy)
    looks = len(seen)  # FixedBudget: 4 + 4 + 2 steps; the planner explores a step at a time
    assert len(run["budgets"]) == 10 and (looks >= 3 if adaptive else looks == 3)
    assert len(reads) == (looks if adaptive else 0) and len(broadcasts) == (looks if adaptive else 0)
    assert all(a == ({4: (4.0, 2.0)} if adaptive else {}) for a in seen)
    assert all(isinstance(b, tuple) and len(b) == 2 for b in broadcasts)
