"""Adaptive speculation length, the policy: expected tokens per second from the acceptance measured per
position and the step costs measured per k and batch size, the probes, and the prices of the k not in use."""
import pytest

from mtpserve.spec_decode import adaptive
from mtpserve.spec_decode.adaptive import AdaptiveK


def policy_with(acceptance: list[float], seconds: dict) -> AdaptiveK:
    p = AdaptiveK(len(acceptance), reached=[1e6] * len(acceptance), accepted=[a * 1e6 for a in acceptance])
    for k, by_batch in seconds.items():
        for batch, s in by_batch.items():
            p.observe_step(batch, k, s)
    return p


def test_choice_maximises_expected_tokens_per_second():
    p = policy_with([0.8, 0.5, 0.2], {0: {1: 1.0, 16: 2.0}, 1: {1: 1.1, 16: 4.0}, 2: {1: 1.2, 16: 5.0},
                                      3: {1: 1.3, 16: 6.0}})
    assert p.expected_tokens(0) == 1 and p.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.4)
    rates = {k: p.expected_tokens(k) / s for k, s in enumerate([1.0, 1.1, 1.2, 1.3])}
    assert p.choose(1) == max(rates, key=rates.get) == 2          # cheap drafts at batch 1: speculate
    p.current = None
    assert p.choose(16) == 0                                       # verification costs too much at 16: plain decode
    assert p.seconds(8, 1) == pytest.approx(1.1 + (4.0 - 1.1) * 7 / 15)   # interpolated between measured sizes
    p.current = 2
    p.timed[1][1].clear()
    p.observe_step(1, 1, 1.2 * 1.8 / 2.2 / 1.01)   # k=1 now 1% better (no premium at batch 1): keep k=2
    assert p.choose(1) == 2


@pytest.mark.parametrize("batch,gain,premium,picked", [(16, 1.03, 0.05, 1), (16, 1.10, 0.05, 2), (1, 1.03, 0.05, 2),
                                                       (16, 1.03, 0.0, 2)])
def test_each_draft_must_buy_the_premium(batch, gain, premium, picked):
    """At batch 16, k = 2 rated 3% above k = 1 (less than the premium per draft): k = 1, the fewer drafts, is
    chosen; rated 10% above it, k = 2. At batch 1 (no spread of progress to pay for) the better rate wins, and
    so it does with no premium (behind a server)."""
    p = policy_with([0.8, 0.5], {0: {batch: 1.0}, 1: {batch: 1.0}, 2: {batch: 1.0}})
    p.draft_premium = premium
    p.timed[2][batch].clear()
    p.observe_step(batch, 2, 2.2 / (1.8 * gain))   # rate(2) = gain * rate(1)
    assert p.rate(batch, 2) == pytest.approx(gain * p.rate(batch, 1)) and p.choose(batch) == picked


def test_the_first_draft_pays_no_premium():
    """At batch 64, k = 1 rated 3% above k = 0: the first draft is worth it (k = 2, 3% above k = 1, is not)."""
    p = policy_with([0.5, 0.2], {0: {64: 1.0}, 1: {64: 1.5 / 1.03}, 2: {64: 1.6 / 1.03 ** 2}})
    assert p.rate(64, 1) == pytest.approx(1.03 * p.rate(64, 0)) and p.rate(64, 2) == pytest.approx(1.03 * p.rate(64, 1))
    assert p.choose(64) == 1


def test_a_slower_machine_does_not_make_the_other_k_look_cheap():
    """Calibrated at one speed (k = 1 the best), then the machine slows down twice: the k in use is timed at the
    new speed, the other k is not. Priced by the ratio measured side by side, it stays behind; priced by its
    old absolute cost, it would look cheap and be picked."""
    p = policy_with([0.8, 0.625], {0: {4: 0.9}, 1: {4: 1.0}, 2: {4: 1.5}})
    p.relate_costs(min_steps=1)
    assert p.choose(4) == 1
    for _ in range(adaptive.TIMED_STEPS):
        p.observe_step(4, 1, 2.0)
    assert p.seconds(4, 2) == pytest.approx(3.0) and p.seconds(4, 0) == pytest.approx(1.8)
    assert p.choose(4) == 1
    stale = p.expected_tokens(2) / adaptive.at_batch(p.timed[2], 4)   # (priced by its old absolute cost)
    assert stale > p.expected_tokens(1) / p.seconds(4, 1)


def test_a_probe_prices_the_pair_both_ways():
    """A probe of k = 3 while k = 2 is in use updates the one ratio of the pair, which k = 2 is then priced by once
    k = 3 is in use (two ratios, one per side, disagreed, and the engine switched between the two every step)."""
    p = policy_with([0.8, 0.7, 0.6], {2: {4: 1.0}, 3: {4: 1.2}})
    p.relate_costs(min_steps=1)
    p.current = 2
    p.observe_step(4, 2, 1.0)
    p.observe_step(4, 3, 1.5)                   # the pair's ratio: median of 1.2 and 1.5
    assert p.seconds(4, 3) == pytest.approx(1.35)
    p.current = 3
    for _ in range(adaptive.TIMED_STEPS):
        p.observe_step(4, 3, 1.35)
    assert p.seconds(4, 2) == pytest.approx(1.0)


def test_a_probe_is_priced_against_the_steps_just_before_it():
    """Calibrated fast (k = 1 1.0 at batch 1, k = 3 1.3), then served three times slower: the k = 3 probe (3.9) is
    priced against the in-use steps just before it (3.0), a ratio of 1.3, not against k = 1's times at batch 1
    from the calibration (a ratio of 3.9, which priced k = 3 out at a server's batch 1)."""
    p = policy_with([0.8, 0.8, 0.8], {1: {1: 1.0}, 3: {1: 1.3}})
    for _ in range(6):
        p.observe_step(1, 1, 1.0)
    p.relate_costs(min_steps=1)
    p.current = 1
    p.observe_step(16, 1, 8.0)
    for _ in range(4):
        p.observe_step(1, 1, 3.0)
    p.observe_step(1, 3, 3.9)
    assert list(p.relative[(1, 3)][1]) == [pytest.approx(1.3), pytest.approx(1.3)]
    p.observe_step(16, 3, 20.0)   # the in-use step at batch 16 was five steps ago: no ratio
    assert 5 not in p.relative[(1, 3)]


def test_a_pair_two_apart_is_priced_through_its_neighbours():
    """Calibrated k = 1 : 2 : 3 at 1.0 : 1.2 : 1.4; then probes find k = 2 and 3 dearer under load (ratios 1.5 and
    1.3). k = 3 is priced against k = 1 through them (1.95), not by the calibration's 1.4, which the probes,
    always one k away, never refresh: the same prices whichever k is in use."""
    p = policy_with([0.8, 0.8, 0.8], {1: {4: 1.0}, 2: {4: 1.2}, 3: {4: 1.4}})
    p.relate_costs(min_steps=1)
    p.relative[(1, 2)][3] = [1.5]
    p.relative[(2, 3)][3] = [1.3]
    p.current = 1
    assert p.seconds(4, 3) == pytest.approx(1.0 * 1.5 * 1.3)
    p.current = 3
    for _ in range(adaptive.TIMED_STEPS):
        p.observe_step(4, 3, 1.95)
    assert p.seconds(4, 1) == pytest.approx(1.0) and p.seconds(4, 2) == pytest.approx(1.5)


def test_ratios_between_measured_sizes_are_interpolated():
    """Ratios measured at batch 16 (1.5) and 64 (1.9): at 32, between them, k = 3 is priced at 1.7x k = 1, not at
    the nearest size's 1.5x (which made k = 3 look better there); at 128, past them, at 64's."""
    p = policy_with([0.8, 0.75, 0.9], {1: {16: 1.0, 64: 1.0}, 3: {16: 1.5, 64: 1.9}})
    p.relate_costs(min_steps=1)
    p.current = 1
    p.observe_step(32, 1, 2.0)
    assert p.seconds(32, 3) == pytest.approx(2.0 * 1.7) and p.seconds(128, 3) == pytest.approx(p.seconds(128, 1) * 1.9)
    assert adaptive.ratio_at({5: [1.5], 7: [1.9]}, 16) == 1.5


def test_expected_tokens_stop_at_max_tokens():
    """A request with r tokens left gets at most r from a step, so drafts past r - 1 add nothing: with every
    request one token from its end plain decoding is chosen, even where drafts are cheap and accepted."""
    p = policy_with([0.9, 0.9, 0.9], {0: {4: 1.0}, 1: {4: 1.01}, 2: {4: 1.02}, 3: {4: 1.03}})
    assert p.expected_tokens(3, room=2) == pytest.approx(1.9) and p.expected_tokens(3, room=9) == pytest.approx(3.439)
    assert p.choose(4) == 3
    p.current = None
    assert p.choose(4, rooms=[1, 1, 1, 1]) == 0
    p.current = None
    assert p.choose(4, rooms=[2, 2, 2, 2]) == 1


def test_costs_beyond_the_measured_sizes_follow_the_widest_span():
    """Timed at batch 1, 15 and 16 (16 a little faster than 15: noise), a batch of 32 is priced on the line
    through 1 and 16, not on the falling line through 15 and 16, which priced a big k cheap at high load."""
    p = policy_with([0.8], {1: {1: 1.0, 15: 2.6, 16: 2.5}})
    assert p.seconds(32, 1) == pytest.approx(1.0 + 1.5 * 31 / 15)
    assert p.seconds(8, 1) == pytest.approx(1.0 + 1.6 * 7 / 14)


def test_costs_are_medians_so_one_slow_step_does_not_decide():
    p = policy_with([0.8], {0: {1: 1.0}, 1: {1: 1.1}})
    p.observe_step(1, 1, 50.0)   # a step that also paid a one-off cost (first run of a shape, a page fault)
    p.observe_step(1, 1, 1.1)
    assert p.seconds(1, 1) == pytest.approx(1.1) and p.choose(1) == 1


def test_probes_find_that_speculation_pays_after_a_bad_start():
    """The acceptance estimate starts (wrongly) low, so plain decoding looks best; k = 0 verifies no drafts, so
    only the periodic probes of other k can show that drafts are accepted 90% of the time here."""
    cost = {0: 1.0, 1: 1.15, 2: 1.3}
    p = AdaptiveK(2)
    for k, c in cost.items():
        p.observe_step(4, k, c)
    for _ in range(40):            # an unlucky start: 40 verifications, nothing accepted
        p.observe_verification(2, 0)
    assert p.choose(4) == 0
    picked, draw = [], iter(range(10**9))
    for step in range(600):
        k = p.choose(4)
        picked.append(k)
        for _request in range(4):
            if k:                  # each draft accepted with probability 0.9 (a fixed pattern)
                accepted = next((i for i in range(k) if next(draw) % 10 == 0), k)
                p.observe_verification(k, accepted)
        p.observe_step(4, k, cost[k])
    late = picked[-100:]
    assert max(set(late), key=late.count) == 2
    assert all(p.choices[k] > 0 for k in cost)


def test_probes_time_the_k_they_try():
    """A probe drafts another k for two steps: the second verifies that k's drafts and drafts as many, the
    steady step costs are timed on (as the engine's observe does), so a k priced wrongly at start-up is
    re-timed and then picked."""
    p = AdaptiveK(2, reached=[1e6] * 2, accepted=[0.9e6] * 2)
    true_cost = {0: 1.0, 1: 1.1, 2: 1.2}
    for k, c in true_cost.items():
        p.observe_step(1, k, c)
    for _ in range(3):
        p.observe_step(1, 2, 5.0)   # a noisy start-up calibration
    previous = None
    for _ in range(600):
        k = p.choose(1)
        if k == previous:           # a steady step: verified k drafts and drafted k
            p.observe_step(1, k, true_cost[k])
        previous = k
    assert p.seconds(1, 2) == pytest.approx(1.2) and p.current == 2


def test_probes_try_the_neighbouring_k():
    """With k = 2 best of 0..3, the probes draft 3 and 1 in turn, never 0 (its one token per step is known)."""
    p = policy_with([0.8, 0.6, 0.1], {0: {1: 1.0}, 1: {1: 1.1}, 2: {1: 1.2}, 3: {1: 1.3}})
    picked = [p.choose(1) for _ in range(4 * adaptive.PROBE_EVERY)]
    assert p.current == 2 and set(picked) == {1, 2, 3} and picked.count(1) == picked.count(3) > 0
    assert "k = 2 at batch 1" in adaptive.describe(p, 1)


def test_acceptance_counts_only_positions_reached():
    p = AdaptiveK(3)
    assert p.acceptance() == [adaptive.PRIOR_ACCEPTANCE] * 3
    for _ in range(200):
        p.observe_verification(3, 1)   # position 0 accepted, 1 rejected, 2 never reached
    c = p.acceptance()
    assert c[0] > 0.95 and c[1] < 0.05 and p.reached[2] == 0 and c[2] == pytest.approx(c[1])


def test_a_deeper_position_starts_from_the_one_before():
    """k = 2 in use, every draft accepted: position 3, never drafted, is priced at position 2's acceptance
    (not a fixed guess below it), so k = 3, 15% dearer than k = 2 for 1 + 3 tokens instead of 1 + 2, is picked;
    once drafted, its own count takes over."""
    p = policy_with([1.0, 1.0, 0.0], {2: {1: 1.0}, 3: {1: 1.15}})
    p.reached[2] = p.accepted[2] = 0.0   # position 3 never reached
    assert p.acceptance()[2] == pytest.approx(1.0) and p.choose(1) == 3
    for _ in range(50):
        p.observe_verification(3, 2)   # the third draft always rejected
    p.current = None
    assert p.acceptance()[2] < 0.1 and p.choose(1) == 2


def test_a_step_is_timed_only_after_a_steady_step_of_the_same_k():
    """The first steady step after a switch of k (or of batch size) runs slower than the ones after it: only
    steps whose step before was steady at the same k and batch size are timed."""
    p = AdaptiveK(2)
    steps = [(None, 1, 9.0),             # a switch step: not steady
             (1, 1, 5.0), (1, 1, 1.0),   # the first steady k = 1 step after it, then a timed one
             (1, 2, 7.0), (1, 2, 2.0),   # k changed: again
             (4, 2, 6.0), (4, 2, 2.5),   # the batch size changed: again
             (None, 2, 8.0), (4, 2, 9.5), (4, 2, 3.5)]
    for steady, k, seconds in steps:
        adaptive.observe(p, steady, [], k, seconds)
    assert p.step_seconds == {1: {1: 1.0}, 2: {1: 2.0, 4: 3.0}}
