"""Draft lengths chosen by what a pass of more rows costs: `best_length`, `DraftStats` and the proposer that
uses them, and the backend's measured `pass_costs`. A length never changes an answer (the identity tests in
test_verified_decoding run these proposers too); here: that rows are paid for only where acceptance covers
them, and that the rates follow what the model accepts."""
from __future__ import annotations

import math
import random

from simllm_ros.model.draft_proposer import DRAFT_MARGIN, DraftProposer, DraftStats, best_length
from simllm_ros.model.load_checks import MAX_PASS_ROWS

from core_fixtures import LOSSLESS, shared_engine

FREE_ROWS = [0.0] + [1.0] * 12  # a padded 16-bit pass: a few more rows cost (almost) nothing
FOUR_BIT = [0.0, 1.0, 1.10, 1.20, 1.28, 1.50, 1.72, 1.86, 2.01, 2.2, 2.4, 2.6, 2.8]  # measured shape, 4 bits


def _value(rate, costs, d):
    return sum(rate ** j for j in range(d + 1)) / costs[1 + d]


def test_best_length_is_the_length_with_most_tokens_per_cost():
    rng = random.Random(3)
    for _ in range(300):
        rate = rng.random()
        steps = [rng.random() * 0.4 for _ in range(12)]
        costs = [0.0, 1.0]
        for s in steps[:-1]:
            costs.append(costs[-1] + s)
        available = rng.randrange(0, 12)
        d = best_length(rate, costs, available)
        best = max(_value(rate, costs, k) for k in range(available + 1))
        assert 0 <= d <= available
        if best <= _value(rate, costs, 0) * (1 + DRAFT_MARGIN):  # not worth the estimates' error: no draft
            assert d == 0, (rate, costs, available, d)
            continue
        assert math.isclose(_value(rate, costs, d), best, rel_tol=1e-9), (rate, costs, available, d)
        # the shortest of the best: a shorter length that is as good would have been taken
        assert all(_value(rate, costs, k) < best * (1 + 1e-9) for k in range(d)) or d == 0


def _value_in(rate, costs, d, rows):
    return (rows - 1 + sum(rate ** j for j in range(d + 1))) / costs[rows + d]


def test_in_a_batched_pass_the_length_is_the_one_with_most_tokens_per_cost_of_the_whole_pass():
    """A pass that decodes `rows` answers' tokens: a draft row slows all of them, so its value is the pass's tokens
    per cost; rows=1 is the single answer's rule."""
    rng = random.Random(5)
    for _ in range(300):
        rate = rng.random() ** 0.3  # mostly high: the drafts that could pay in a batch
        costs = [0.0, 1.0]
        for _ in range(15):
            costs.append(costs[-1] + rng.random() * 1.1)
        available, rows = rng.randrange(0, 12), rng.randrange(1, 8)
        assert best_length(rate, costs, available, 1) == best_length(rate, costs, available)
        d = best_length(rate, costs, available, rows)
        top = min(available, len(costs) - 1 - rows)
        best = max(_value_in(rate, costs, k, rows) for k in range(top + 1))
        assert 0 <= d <= top
        if best <= _value_in(rate, costs, 0, rows) * (1 + DRAFT_MARGIN):
            assert d == 0, (rate, costs, available, rows, d)
        else:
            assert math.isclose(_value_in(rate, costs, d, rows), best, rel_tol=1e-9), (rate, costs, rows, d)
    assert best_length(0.9, FOUR_BIT, 8, rows=len(FOUR_BIT)) == 0, "no cost known for more rows: no draft"


def test_a_draft_that_pays_alone_does_not_pay_in_a_compute_bound_batch():
    """At 4 bits a second row costs 10% of a one-row pass (memory-bound), but in a pass of four answers' rows a
    fifth costs 17% of it: a draft accepted half the time pays alone and not there. Where rows cost in proportion
    (compute-bound), not even a draft the model always follows gains enough to be checked."""
    assert best_length(0.5, FOUR_BIT, 8) >= 1
    assert best_length(0.5, FOUR_BIT, 8, rows=4) == 0
    assert best_length(0.99, FOUR_BIT, 8, rows=4) >= 1, "an answer the model keeps following still pays"
    linear = [0.0] + [float(m) for m in range(1, 16)]
    assert best_length(1.0, linear, 8, rows=4) == 0


def test_rows_are_paid_for_only_where_acceptance_covers_them():
    assert best_length(0.0, FREE_ROWS, 8) == 0, "a draft that is never accepted is never worth a row"
    assert best_length(0.1, FREE_ROWS, 8) >= 1, "a free row is worth any chance"
    assert best_length(0.1, FOUR_BIT, 8) == 0, "at 4 bits a second row costs 10%: a 10% guess does not pay"
    assert best_length(0.5, FOUR_BIT, 8) in (1, 2, 3)
    assert best_length(0.99, FOUR_BIT, 11) == 11, "an answer the model keeps following: check all of it"
    assert best_length(0.99, FOUR_BIT, 3) == 3, "never longer than what is there"


def test_rates_follow_what_the_model_accepts():
    st = DraftStats()
    start = st.rate("suffix")
    for _ in range(40):
        st.record("suffix", 4, 0)  # the first token rejected: one checked, none accepted
    low = st.rate("suffix")
    assert low < 0.1 < start
    for _ in range(400):
        st.record("suffix", 4, 4)
    assert st.rate("suffix") > 0.9
    assert st.rate("answer") == DraftStats.PRIOR["answer"], "kinds are counted apart"


def test_a_guess_that_does_not_pay_is_left_out_but_still_tried_now_and_then():
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11]
    st = DraftStats()
    for _ in range(60):
        st.record("guess", 1, 0)
    p = DraftProposer(prompt=prompt, max_tokens=8, costs=FOUR_BIT, stats=st)
    # [.., 9, 7]: only the last token (7) matches somewhere: a one-token guess
    drafts = [p.propose([1, 7], 8) for _ in range(DraftStats.EXPLORE_EVERY * 2)]
    assert sum(1 for d in drafts if d) == 2 and all(len(d) <= 1 for d in drafts)
    # Without costs (the adaptive length) the guess is always made, as before.
    assert DraftProposer(prompt=prompt, max_tokens=8).propose([1, 7], 8) in ([8], [10])


def test_the_stored_answer_of_the_same_prompt_is_checked_whole():
    answer, other = list(range(100, 120)), list(range(200, 220))
    costs = FOUR_BIT + [FOUR_BIT[-1] + 0.2 * i for i in range(1, 30)]
    st = DraftStats()
    p = DraftProposer(repeat=answer, answers=[other, answer], max_tokens=32, costs=costs, stats=st)
    assert p.answers == [answer, other], "the repeat first, and once"
    first = p.propose([], 32)
    assert first == answer[:len(first)] and len(first) >= 8, "from the prior alone: a long draft"
    p.feedback(len(first), len(first))
    assert st.rate("repeat") > DraftStats.PRIOR["repeat"]
    assert p.propose(first, 32) == answer[len(first):], "once it was kept: the rest in one pass"
    # A similar request's answer is a kind of its own: its rate does not shorten the repeat's drafts.
    for _ in range(50):
        st.record("answer", 20, 0)
    q = DraftProposer(answers=[other], max_tokens=32, costs=costs, stats=st)
    assert q.propose([], 32) in ([], other[:1])
    assert DraftProposer(repeat=answer, max_tokens=32, costs=costs, stats=st).propose([], 32) == answer


def test_the_backend_measures_its_pass_costs_at_load():
    costs = shared_engine(**LOSSLESS).backend.pass_costs
    assert costs is not None and len(costs) == MAX_PASS_ROWS + 1
    assert costs[0] == 0.0 and costs[1] == 1.0
    assert all(b >= a for a, b in zip(costs[1:], costs[2:])), "more rows never cost less"
    assert all(math.isfinite(c) for c in costs)


def test_a_pause_of_the_machine_does_not_become_the_pass_costs():
    """The costs timed at load are kept for every later load: a pause while one size is timed (another process,
    here a sleep of 0.4 s in one of the 2-row passes) must not price a second row at tens of passes, or drafts stay off."""
    import time

    runner = shared_engine(**LOSSLESS).backend.runner
    forward, twos = runner.forward, []

    def slow_once(ids, *a, **k):
        if len(ids) == 2:
            twos.append(True)
            if len(twos) == 2:  # the later round's
                time.sleep(0.4)
        return forward(ids, *a, **k)

    runner.forward = slow_once
    try:
        costs = runner.pass_costs(4)
    finally:
        del runner.forward
    assert len(twos) >= 2, "the pause happened"
    assert costs[2] < 3.0, costs  # a pass of one row takes milliseconds: the paused pass would be > 10x


def test_pass_costs_learn_from_the_passes_timed_here():
    """A prior timed at load (here: a second row nearly free) gives way to what this process's passes take
    (a second row at 1.3x one): a guess accepted 20% of the time then no longer pays."""
    from simllm_ros.model.pass_costs import PassCosts

    costs = PassCosts([0.0, 1.0, 1.01, 1.02, 1.03])
    assert best_length(0.2, costs, 3) >= 1
    for _ in range(PassCosts.TRUST):
        costs.observe(1, 0.010)
        costs.observe(2, 0.013)
    assert math.isclose(costs[2], 1.3, rel_tol=1e-6)
    assert costs[3] >= costs[2] and costs[4] >= costs[3], "never cheaper for more rows"
    assert best_length(0.2, costs, 3) == 0
    costs.observe(0, 1.0)
    costs.observe(9, 1.0)  # outside the table: ignored
    costs.observe(2, float("nan"))
    assert math.isclose(costs[2], 1.3, rel_tol=1e-6) and len(costs) == 5
