"""Adaptive speculation length: the choice (expected tokens per second from acceptance and step costs), and
losslessness while k switches between 0 and its maximum from step to step."""
import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.spec_decode import adaptive
from mtpserve.spec_decode.adaptive import AdaptiveK
from test_spec_decode import (GREEDY, assert_follows, exact_joint, fill_mtp_caches_with_noise,  # noqa: F401
                              prompts_for, trained1, trained3)
from tiny_models import random_checkpoint


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
    p.observe_step(1, 1, 1.2 * 1.8 / 2.2 * 0.99)                   # k=1 now 1% better than k=2: keep k=2
    assert p.choose(1) == 2


def test_each_draft_must_buy_the_premium():
    """k = 2 rated 2% above k = 1 (less than the premium per draft): k = 1, the fewer drafts, is chosen; rated
    10% above it, k = 2."""
    for gain, picked in ((1.02, 1), (1.10, 2)):
        p = policy_with([0.8, 0.5], {0: {1: 1.0}, 1: {1: 1.0}, 2: {1: 1.0}})
        p.timed[2][1].clear()
        p.observe_step(1, 2, 2.2 / (1.8 * gain))   # rate(2) = gain * rate(1)
        assert p.rate(1, 2) == pytest.approx(gain * p.rate(1, 1)) and p.choose(1) == picked


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
    p.observe_step(4, 3, 1.5)                   # the pair's ratio: median of 1.2 and 1.5
    assert p.seconds(4, 3) == pytest.approx(1.35)
    p.current = 3
    for _ in range(adaptive.TIMED_STEPS):
        p.observe_step(4, 3, 1.35)
    assert p.seconds(4, 2) == pytest.approx(1.0)


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


def cycling(k_max: int, hold: int = 1):
    """plan_drafts forcing k = 0, 1, ..., k_max, 0, ... step after step (the switches under test), each k for
    `hold` steps."""
    steps = iter(range(10**9))

    def plan(policy, scheduled):
        k = next(steps) // hold % (k_max + 1)
        for s in scheduled:
            s.num_next_drafts = k
        return k
    return plan


@pytest.mark.parametrize("tight", [False, True], ids=["plain", "chunked-preempted"])
def test_greedy_and_seeded_identical_while_k_switches(trained1, monkeypatch, tight):
    prompts = prompts_for()
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, seed=7 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    kw = dict(max_num_batched_tokens=8, num_kv_blocks=18, block_size=4) if tight else {}
    base = [o.outputs[0].token_ids for o in LLM(trained1, **kw).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    llm = LLM(trained1, speculative_config={"num_speculative_tokens": 3, "adaptive": True}, **kw)
    monkeypatch.setattr(adaptive, "plan_drafts", cycling(3))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base
    m = llm.get_metrics()
    assert 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"]
    assert sum(m["accepted_per_position"]) == m["num_accepted_tokens"]
    drafted = m["drafted_per_position"]   # (per-position acceptance divides by these: k varies)
    assert sum(drafted) == m["num_draft_tokens"] and drafted[0] == m["num_drafts"] > drafted[1] > drafted[2] > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("budget", [None, 8], ids=["whole-prompts", "chunked"])
def test_own_layers_chain_while_k_switches(trained3, monkeypatch, budget):
    """3 MTP layers, adaptive up to 3: the depths with a layer of their own chain it as fixed k does, and every
    step (prompt chunks, and steps drafting fewer depths) runs each own layer to keep its cache whole: with the
    MTP caches filled with noise first, drafts and acceptance are the same."""
    from collections import Counter
    prompts = prompts_for()
    runs = []
    for noise in (False, True):
        kw = {"max_num_batched_tokens": budget} if budget else {}
        llm = LLM(trained3, speculative_config={"num_speculative_tokens": 3, "adaptive": True}, **kw)
        runner = llm.engine.runner
        if noise:
            fill_mtp_caches_with_noise(llm)
        monkeypatch.setattr(adaptive, "plan_drafts", cycling(3))
        passes, forward = Counter(), runner.proposer.forward
        runner.proposer.forward = lambda what, *a, **kw: passes.update([what]) or forward(what, *a, **kw)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], llm.get_metrics()["accepted_per_position"]))
        assert passes["mtp0"] == passes["mtp1"] == passes["mtp2"] > 0   # every step, whatever k it drafts
    assert runs[0] == runs[1]


def test_decode_steps_run_the_chain_only_as_deep_as_they_draft(trained3, monkeypatch):
    """Adaptive up to 2 over 3 MTP layers (layer 1 chained): a decode step drafting one token runs layer 0 at
    the accepted index only and writes layer 1's KV alone (fed the main hidden states); drafting none, both
    only write KV; drafting two, layer 0's outputs everywhere feed layer 1. Greedy tokens stay those of no
    speculation."""
    llm = LLM(trained3, speculative_config={"num_speculative_tokens": 2, "adaptive": True})
    monkeypatch.setattr(adaptive, "plan_drafts", cycling(2, hold=2))
    calls, forward = [], llm.engine.runner.proposer.forward

    def recorded(what, rows, prev_hidden, output_index=None):
        decode = all(len(r.token_ids) <= 3 for r in rows)
        calls.append((what, decode, None if output_index is None else len(output_index), len(rows)))
        return forward(what, rows, prev_hidden, output_index=output_index)
    llm.engine.runner.proposer.forward = recorded
    outs = llm.generate(prompt_token_ids=prompts_for(), sampling_params=GREEDY, use_tqdm=False)
    plain = LLM(trained3).generate(prompt_token_ids=prompts_for(), sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    steps = [calls[i:i + 2] for i in range(0, len(calls), 2)]
    assert all([c[0] for c in step] == ["mtp0", "mtp1"] for step in steps)
    kinds = {(c0[2], c1[2]) for (c0, c1) in steps if c0[1] and c0[3] == len(prompts_for())}
    n = len(prompts_for())
    assert kinds == {(0, 0), (n, 0), (None, n)}   # drafting 0, 1, 2 in turn


def recording_drafts(llm) -> list:
    """(request id, next drafts) of every request in every step the engine runs from now on."""
    runner, log = llm.engine.runner, []
    execute = runner.execute

    def recorded(scheduled):
        results = execute(scheduled)
        log.extend((s.req.request_id, r.next_drafts) for s, r in zip(scheduled, results))
        return results
    runner.execute = recorded
    return log


def test_graph_mode_fused_steps_while_k_switches(tmp_path, monkeypatch):
    """Graph mode with adaptive k (up to 2, 3 MTP layers: layer 1 chained, its KV written also by steps
    drafting one token): a step that keeps the k of the step before runs the fused graph of that k (greedy and
    sampled; k = 0 too), the others the separate graphs and eager chained passes. Tokens are those of eager without
    speculation, and every step's drafts those of eager adaptive with the same choices of k (the graph
    engine's MTP caches filled with noise first: a slot read before it is written would change them)."""
    path = random_checkpoint(tmp_path, num_nextn_predict_layers=3)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.5, top_p=0.95, max_tokens=20, ignore_eos=True, seed=7)]
    prompts = prompts_for()[:4]
    spec = {"num_speculative_tokens": 2, "adaptive": True}
    graph = LLM(path, speculative_config=spec, enforce_eager=False, graph_batch_sizes=[4], max_model_len=64)
    eager, plain = LLM(path, speculative_config=spec), LLM(path)
    fill_mtp_caches_with_noise(graph)
    drafts = [recording_drafts(eager), recording_drafts(graph)]
    fused_query_lens, run_fused = [], graph.engine.runner.graphs.run_fused

    def recording_run_fused(what, rows, *args):
        fused_query_lens.append(len(rows[0].token_ids))
        return run_fused(what, rows, *args)
    graph.engine.runner.graphs.run_fused = recording_run_fused
    for each in ([params[0]] * 4, [params[0], params[1]] * 2):
        runs = []
        for llm in (plain, eager, graph):
            monkeypatch.setattr(adaptive, "plan_drafts", cycling(2, hold=3))
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=each, use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in outs])
        assert runs[0] == runs[1] == runs[2]
        counts = graph.engine.runner.pass_counts
        assert counts["fused_sampled" if each[1].seed else "fused"] > 0
    assert drafts[0] == drafts[1] and len(drafts[0]) > 50
    assert {what for what, _, q in graph.engine.runner.graphs.graphs if what.startswith("fused")} == {
        "fused", "fused_sampled"}
    assert set(fused_query_lens) == {1, 2, 3}   # k = 0 (plain decoding with the MTP KV passes) fused too


def test_adaptive_engine_picks_and_reports_k(trained1):
    llm = LLM(trained1, speculative_config={"num_speculative_tokens": 2, "adaptive": True})
    costs = llm.engine.adaptive.step_seconds
    assert set(costs) == {0, 1, 2} and all(costs[k] for k in costs)   # calibrated at start-up, every k
    assert all({1, 16, 64} <= set(costs[k]) for k in costs)            # ... at 1, 16 and max_num_seqs
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(trained1).generate(prompt_token_ids=prompts_for(), sampling_params=p,
                                                                    use_tqdm=False)]
    outs = llm.generate(prompt_token_ids=prompts_for(), sampling_params=p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base
    steps = llm.get_metrics()["draft_steps_by_k"]
    assert len(steps) == 3 and sum(steps) > 0


def test_sampling_lossless_while_k_switches(tmp_path_factory, monkeypatch):
    """Chi-square of the first two tokens against the model's exact distribution, k cycling 0..2."""
    path = random_checkpoint(tmp_path_factory.mktemp("v6a"), vocab_size=6, eos_token_id=None, bos_token_id=None)
    prompt, num = [1, 4, 2], 3000
    params = SamplingParams(temperature=1.3, top_p=0.95, max_tokens=2, ignore_eos=True)
    joint = exact_joint(path, prompt, params, 2)
    llm = LLM(path, speculative_config={"num_speculative_tokens": 2, "adaptive": True}, max_num_seqs=512,
              max_num_batched_tokens=4096, seed=11)
    monkeypatch.setattr(adaptive, "plan_drafts", cycling(2))
    outs = []
    for _ in range(6):   # several batches: each starts at a different k of the cycle
        outs += llm.generate(prompt_token_ids=[prompt] * (num // 6), sampling_params=params, use_tqdm=False)
    assert_follows(outs, joint)
    assert llm.get_metrics()["num_draft_tokens"] > 0
