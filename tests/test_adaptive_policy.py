"""Adaptive speculation length, the policy: expected tokens per second from the acceptance measured per
position and a table of step costs by k and batch size."""
import pytest

from mtpserve.spec_decode import adaptive
from mtpserve.spec_decode.adaptive import AdaptiveK


def policy_with(acceptance: list[float], table: dict) -> AdaptiveK:
    return AdaptiveK(len(acceptance), table=table, reached=[1e6] * len(acceptance),
                     accepted=[a * 1e6 for a in acceptance])


def best_fixed_k(acceptance: list[float], table: dict, batch: int) -> int:
    """The k a sweep of fixed k would find best (closed form: expected tokens over the table's cost)."""
    def tokens(k):
        total, reach = 1.0, 1.0
        for c in acceptance[:k]:
            reach *= c
            total += reach
        return total
    return max(table, key=lambda k: tokens(k) / table[k][batch])


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_choice_is_the_best_fixed_k_on_a_synthetic_table(batch):
    """A table shaped like this machine's (drafts cheap at batch 1, dear at 64): the policy picks what a sweep of
    fixed k would, and the choice moves from k = 3 at batch 1 to plain decoding at 64."""
    table = {0: {1: 1.0, 4: 1.2, 16: 2.0, 64: 5.0}, 1: {1: 1.1, 4: 1.4, 16: 2.8, 64: 9.5},
             2: {1: 1.2, 4: 1.6, 16: 3.6, 64: 13.0}, 3: {1: 1.3, 4: 1.8, 16: 4.4, 64: 17.0}}
    acceptance = [0.8, 0.6, 0.5]
    p = policy_with(acceptance, table)
    assert p.choose(batch) == best_fixed_k(acceptance, table, batch)
    assert [best_fixed_k(acceptance, table, b) for b in (1, 4, 16, 64)] == [3, 2, 1, 0]


def test_costs_between_and_beyond_the_sizes_timed_are_linear():
    p = policy_with([0.8], {0: {1: 1.0, 16: 2.5, 64: 4.9}, 1: {1: 1.1, 15: 4.0, 16: 3.9}})
    assert p.seconds(8, 0) == pytest.approx(1.0 + 1.5 * 7 / 15)
    assert p.seconds(32, 1) == pytest.approx(1.1 + (3.9 - 1.1) * 31 / 15)   # (the widest span, not 15-16's slope)


def test_the_k_in_use_is_kept_unless_another_is_clearly_better():
    p = policy_with([0.8], {0: {1: 1.0}, 1: {1: 1.8 / 1.01}})   # k = 1 rated 1% above k = 0
    p.current = 0
    assert p.choose(1) == 0
    p.table[1][1] = 1.8 / 1.05                                  # 5% above: switch
    assert p.choose(1) == 1


def test_a_bigger_k_never_looks_cheaper():
    p = policy_with([0.9, 0.9], {0: {1: 1.0}, 1: {1: 2.0}, 2: {1: 1.5}})   # (noise: k = 2 timed below k = 1)
    rates = p.rates(1)
    assert rates[2] == pytest.approx(p.expected_tokens()[2] / 2.0) == pytest.approx((1 + 0.9 + 0.81) / 2.0)


def test_expected_tokens_stop_at_max_tokens():
    """A request with r tokens left gets at most r from a step: drafts past r - 1 add nothing."""
    p = policy_with([1.0, 1.0, 1.0], {k: {1: 1.0 + 0.01 * k} for k in range(4)})
    assert p.expected_tokens() == pytest.approx([1, 2, 3, 4])
    assert p.rates(1, rooms=[2, 4]) == pytest.approx([1, 2 / 1.01, 2.5 / 1.02, 3 / 1.03])   # (the mean over rooms)
    assert p.choose(1, rooms=[2]) == 1   # (k = 1 gives the two tokens it may take, cheaper than 2 or 3)
    p.current = None
    assert p.choose(1) == 3


def test_exploration_recovers_from_a_bad_start():
    """The acceptance starts (wrongly) low, so plain decoding looks best and k = 0 verifies nothing; every
    EXPLORE_EVERY-th step drafts one more, its drafts are all accepted, and the policy moves up to k = 2."""
    p = AdaptiveK(2, table={0: {1: 1.0}, 1: {1: 1.2}, 2: {1: 1.4}}, reached=[20.0, 20.0], accepted=[1.0, 1.0])
    chosen = []
    for _ in range(12 * adaptive.EXPLORE_EVERY):
        k = p.choose(1)
        chosen.append(k)
        if k:
            p.observe_verification(k, k)
    assert chosen[0] == 0 and chosen[adaptive.EXPLORE_EVERY - 1] == 1
    assert chosen[-adaptive.EXPLORE_EVERY + 1:].count(2) == adaptive.EXPLORE_EVERY - 1


def test_uncalibrated_drafts_the_most():
    p = AdaptiveK(3)
    assert p.choose(8) == 3


def test_acceptance_counts_only_positions_reached():
    p = AdaptiveK(3)
    p.observe_verification(3, 1)   # position 1 accepted, 2 rejected, 3 never reached
    assert p.reached == [1, 1, 0] and p.accepted == [1, 0, 0]


def test_a_deeper_position_starts_from_the_one_before():
    """Position 3, never drafted, is priced at position 2's acceptance, not at the prior."""
    p = AdaptiveK(3)
    for _ in range(200):
        p.observe_verification(2, 2)
    c = p.acceptance()
    assert c[0] > 0.98 and c[1] > 0.98 and c[2] == pytest.approx(c[1])


def test_only_steady_steps_are_timed():
    """A step is timed when every request verifies k drafts and drafts k (the table's shape)."""
    from mtpserve.request import Request
    from mtpserve.sampling_params import SamplingParams
    from mtpserve.step import ScheduledRequest
    req = Request("a", None, [1, 2, 3, 4, 5, 6], SamplingParams(), max_tokens=8)
    step = [ScheduledRequest(req, 5, 1, [7, 8]) for _ in range(3)]
    assert AdaptiveK(2).plan(step).steady_batch == 3
    assert AdaptiveK(2, forced=1).plan(step).steady_batch is None
    assert adaptive.FixedK(2).plan(step).steady_batch is None   # (nothing times it)
    step[0] = ScheduledRequest(req, 1, 5, [7, 8])                # a prompt chunk and its drafts
    assert AdaptiveK(2).plan(step).steady_batch is None
