"""Adaptive speculation length in the engine: losslessness while k switches between 0 and its maximum from
step to step, the MTP passes a step runs for the k it drafts, graph mode, the calibration, and the k reported.
(The policy itself: test_adaptive_policy.py.)"""
import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.spec_decode import adaptive
from test_spec_decode import (GREEDY, assert_follows, exact_joint, fill_mtp_caches_with_noise,  # noqa: F401
                              prompts_for, run, trained1, trained3)
from tiny_models import random_checkpoint


def forcing(ks: list[int], hold: int = 1):
    """AdaptiveK.choose_for forcing the k of `ks` in turn, round and round, step after step (the switches under test),
    each k for `hold` steps."""
    steps = iter(range(10**9))

    def choose_for(policy, scheduled):
        return ks[next(steps) // hold % len(ks)]
    return choose_for


def cycling(k_max: int, hold: int = 1):
    """k = 0, 1, ..., k_max, 0, ..."""
    return forcing(list(range(k_max + 1)), hold)


@pytest.mark.parametrize("tight", [False, True], ids=["plain", "chunked-preempted"])
def test_greedy_and_seeded_identical_while_k_switches(trained1, monkeypatch, tight):
    prompts = prompts_for()
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, seed=7 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    kw = dict(max_num_batched_tokens=8, num_kv_blocks=18, block_size=4) if tight else {}
    base = [o.outputs[0].token_ids for o in LLM(trained1, enforce_eager=True, **kw).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    llm = LLM(trained1, speculative_config={"num_speculative_tokens": 3, "adaptive": True}, enforce_eager=True,
              **kw)
    monkeypatch.setattr(adaptive.AdaptiveK, "choose_for", cycling(3))
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
    step (prompt chunks, and steps drafting fewer depths or none) runs each own layer to keep its cache whole:
    with the MTP caches filled with noise first, drafts and acceptance are the same."""
    from collections import Counter
    prompts = prompts_for()
    runs = []
    for noise in (False, True):
        kw = {"max_num_batched_tokens": budget} if budget else {}
        llm = LLM(trained3, speculative_config={"num_speculative_tokens": 3, "adaptive": True}, enforce_eager=True,
                  **kw)
        runner = llm.engine.runner
        if noise:
            fill_mtp_caches_with_noise(llm)
        monkeypatch.setattr(adaptive.AdaptiveK, "choose_for", forcing([0, 1, 2, 3, 0, 0, 3, 2, 0, 1]))
        passes, forward = Counter(), runner.proposer.forward
        runner.proposer.forward = lambda what, *a, **kw: passes.update([str(what)]) or forward(what, *a, **kw)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], llm.get_metrics()["accepted_per_position"]))
        assert passes["mtp0"] == passes["mtp1"] == passes["mtp2"] > 0   # every own layer, every step
    assert runs[0] == runs[1]
    assert runs[0][0] == run(trained3, None, prompts, **({"max_num_batched_tokens": budget} if budget else {}))[0]


def test_decode_steps_run_the_whole_chain_whatever_they_draft(trained3, monkeypatch):
    """Adaptive up to 2 over 3 MTP layers (layer 1 chained): every decode step feeds layer 0's outputs everywhere
    to layer 1, as a step drafting two does, so layer 1's KV is the same whatever k wrote it; drafting one or
    none, layer 1 writes its KV only. Greedy tokens stay those of no speculation. (The separate path:
    fused_graph_step false; the fused decode step follows the same plan, test_graph_mode_fused_steps_...)"""
    llm = LLM(trained3, speculative_config={"num_speculative_tokens": 2, "adaptive": True, "fused_graph_step": False},
              enforce_eager=True)
    monkeypatch.setattr(adaptive.AdaptiveK, "choose_for", cycling(2, hold=2))
    runner = llm.engine.runner
    steps, forward, execute = [], runner.proposer.forward, runner.execute

    def recorded(what, rows, prev_hidden, output_index=None):
        steps[-1][1].append((str(what), None if output_index is None else len(output_index)))
        return forward(what, rows, prev_hidden, output_index=output_index)

    def executed(scheduled):
        decode = all(s.samples and s.num_new_tokens == 1 for s in scheduled) and len(scheduled) == n
        steps.append((scheduled[0].num_next_drafts if decode else None, []))
        return execute(scheduled)
    runner.proposer.forward, runner.execute = recorded, executed
    n = len(prompts_for())
    outs = llm.generate(prompt_token_ids=prompts_for(), sampling_params=GREEDY, use_tqdm=False)
    plain = LLM(trained3, enforce_eager=True).generate(prompt_token_ids=prompts_for(), sampling_params=GREEDY,
                                                       use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    kinds = {k: {tuple(calls) for drafted, calls in steps if drafted == k} for k in (0, 1, 2)}
    assert kinds == {0: {(("mtp0", None), ("mtp1", 0))}, 1: {(("mtp0", None), ("mtp1", 0))},
                     2: {(("mtp0", None), ("mtp1", n))}}


@pytest.mark.parametrize("tight", [False, True], ids=["plain", "chunked-preempted"])
def test_steps_drafting_nothing_write_the_mtp_kv(trained1, monkeypatch, tight):
    """A step drafting none still writes its positions' MTP KV (KV only): with the MTP cache filled with noise
    first, every draft is the same, the tokens are those of no speculation, and no KV block leaks."""
    kw = dict(max_num_batched_tokens=8, num_kv_blocks=18, block_size=4) if tight else {}
    spec = {"num_speculative_tokens": 3, "adaptive": True}
    runs = []
    for noise in (True, False):
        llm = LLM(trained1, speculative_config=spec, enforce_eager=True, **kw)
        if noise:
            fill_mtp_caches_with_noise(llm)
        monkeypatch.setattr(adaptive.AdaptiveK, "choose_for", forcing([0, 0, 0, 1, 0, 0, 3, 2]))
        drafts = recording_drafts(llm)
        outs = llm.generate(prompt_token_ids=prompts_for(), sampling_params=GREEDY, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], drafts))
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert runs[0] == runs[1] and any(d for _, d in runs[0][1])
    assert runs[0][0] == run(trained1, None, prompts_for(), **kw)[0]


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
    drafting one token or none): a step that keeps the k of the step before runs the fused graph of that k
    (greedy and sampled; k = 0 too); a step changing k runs apart (its graphs built by the compiler thread when
    first needed, eager until then; chained passes eager). Tokens
    are those of eager without speculation, and every step's drafts those of eager adaptive with the same choices
    of k (the graph engine's MTP caches filled with noise first: a slot read before it is written would change
    them)."""
    path = random_checkpoint(tmp_path, num_nextn_predict_layers=3, num_hidden_layers=2)   # (9 graphs to build)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.5, top_p=0.95, max_tokens=20, ignore_eos=True, seed=7)]
    prompts = prompts_for()[:4]
    spec = {"num_speculative_tokens": 2, "adaptive": True}
    few = dict(max_num_seqs=4)
    graph = LLM(path, speculative_config=spec, enforce_eager=False, graph_batch_sizes=[4], max_model_len=64, **few)
    eager, plain = LLM(path, speculative_config=spec, enforce_eager=True, **few), LLM(path, enforce_eager=True)
    fill_mtp_caches_with_noise(graph)
    drafts = [recording_drafts(eager), recording_drafts(graph)]
    fused_ks, fused_step = [], graph.engine.runner._fused_step   # (k verified, k drafted next)

    def recording_fused_step(what, scheduled):
        fused_ks.append((len(scheduled[0].draft_token_ids), scheduled[0].num_next_drafts))
        return fused_step(what, scheduled)
    graph.engine.runner._fused_step = recording_fused_step
    for each in ([params[0]] * 4, [params[0], params[1]] * 2):
        runs = []
        for llm in (plain, eager, graph):
            monkeypatch.setattr(adaptive.AdaptiveK, "choose_for", cycling(2, hold=3))
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=each, use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in outs])
        assert runs[0] == runs[1] == runs[2]
        counts = graph.engine.runner.pass_counts
        assert counts["fused_sampled" if each[1].seed else "fused"] > 0
    assert drafts[0] == drafts[1] and len(drafts[0]) > 50
    assert {str(which) for which, _, q in graph.engine.runner.graphs.graphs if which.kind == "fused"} == {
        "fused", "fused_sampled"}
    assert set(fused_ks) == {(0, 0), (1, 1), (2, 2)}   # k = 0 (plain decoding with the MTP KV passes) fused too


def test_calibration_times_every_k_at_each_size(trained1):
    """LLM calibrates at start-up (LLMEngine.calibrate): a step cost for every k at 1, 4, 16 and 64; an engine
    built alone is uncalibrated and drafts the maximum k until it is."""
    from mtpserve.engine.engine import LLMEngine
    spec = {"num_speculative_tokens": 2, "adaptive": True}
    table = LLM(trained1, speculative_config=spec, enforce_eager=True).engine.policy.table
    assert set(table) == {0, 1, 2} and all(set(table[k]) == {1, 4, 16, 64} for k in table)
    assert all(s > 0 for k in table for s in table[k].values())
    bare = LLMEngine.from_kwargs(trained1, spec, enforce_eager=True)
    assert bare.policy.table == {} and bare.policy.choose(4) == 2


def test_calibration_times_batches_one_step_takes_at_the_largest_k(trained1):
    """With a token budget of 8, a step verifies at most 2 requests at k = 3 (4 tokens each): the calibration
    times batch sizes 1 and 2 only, every k at both (a batch of 4 would be cut into steps of 2 at k = 3)."""
    llm = LLM(trained1, speculative_config={"num_speculative_tokens": 3, "adaptive": True}, max_num_batched_tokens=8,
              enforce_eager=True)
    table = llm.engine.policy.table
    assert set(table) == {0, 1, 2, 3} and all(set(table[k]) == {1, 2} for k in table)


def test_adaptive_engine_picks_and_reports_k(trained1):
    llm = LLM(trained1, speculative_config={"num_speculative_tokens": 2, "adaptive": True}, enforce_eager=True)
    costs = llm.engine.policy.table
    assert set(costs) == {0, 1, 2} and all(costs[k] for k in costs)   # calibrated at start-up, every k
    assert all({1, 4, 16, 64} <= set(costs[k]) for k in costs)         # ... at 1, 4, 16 and max_num_seqs
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(trained1, enforce_eager=True).generate(
        prompt_token_ids=prompts_for(), sampling_params=p, use_tqdm=False)]
    outs = llm.generate(prompt_token_ids=prompts_for(), sampling_params=p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base
    steps = llm.get_metrics()["draft_steps_by_k"]
    assert len(steps) == 3 and sum(steps) > 0


def test_mtp_adapts_by_default_and_adaptive_false_keeps_k(trained1):
    """num_speculative_tokens is the most an MTP step drafts (adaptive unless told otherwise); "adaptive": false
    drafts exactly k every step; n-gram drafts are never adapted."""
    from mtpserve.config import SpeculativeConfig
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).adaptive is True
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "adaptive": False}).adaptive is False
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).adaptive is False
    with pytest.raises(ValueError, match="speculative_config.adaptive"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "adaptive": "no"})
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fixed = LLM(trained1, speculative_config={"num_speculative_tokens": 2, "adaptive": False}, enforce_eager=True)
    outs = fixed.generate(prompt_token_ids=prompts_for(), sampling_params=p, use_tqdm=False)
    m = fixed.get_metrics()
    assert not fixed.engine.policy.adapts and "draft_steps_by_k" not in m
    assert m["num_draft_tokens"] == 2 * m["num_drafts"] > 0
    default = LLM(trained1, speculative_config={"num_speculative_tokens": 2}, enforce_eager=True)
    assert default.engine.policy.adapts and default.engine.policy.max_k == 2
    again = default.generate(prompt_token_ids=prompts_for(), sampling_params=p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert sum(default.get_metrics()["draft_steps_by_k"]) > 0


def test_sampling_lossless_while_k_switches(tmp_path_factory, monkeypatch):
    """Chi-square of the first two tokens against the model's exact distribution, k cycling 0..2."""
    path = random_checkpoint(tmp_path_factory.mktemp("v6a"), vocab_size=6, eos_token_id=None, bos_token_id=None)
    prompt, num = [1, 4, 2], 3000
    params = SamplingParams(temperature=1.3, top_p=0.95, max_tokens=2, ignore_eos=True)
    joint = exact_joint(path, prompt, params, 2)
    llm = LLM(path, speculative_config={"num_speculative_tokens": 2, "adaptive": True}, max_num_seqs=512,
              max_num_batched_tokens=4096, seed=11, enforce_eager=True)
    monkeypatch.setattr(adaptive.AdaptiveK, "choose_for", cycling(2))
    outs = []
    for _ in range(6):   # several batches: each starts at a different k of the cycle
        outs += llm.generate(prompt_token_ids=[prompt] * (num // 6), sampling_params=params, use_tqdm=False)
    assert_follows(outs, joint)
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_adaptive_k_compiled_in_the_background_times_its_graphs_once_built(tmp_path, monkeypatch):
    """compile_in_background with adaptive k: the start-up calibration times eager steps and queues their graphs
    (the compiler thread starts after it and builds the fused steps' first); once the thread has built them, the
    engine's idle work times the same steps as graphs, leaving the counters a server reports as they were. Greedy
    tokens equal no speculation's before, during and after."""
    import threading
    from mtpserve.executor.compile_process import CompileProcess
    from mtpserve.runner.graphs import GraphRunner
    from mtpserve.spec_decode import calibration
    path = random_checkpoint(tmp_path, num_nextn_predict_layers=1, num_hidden_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = prompts_for()[:1]
    want = [o.outputs[0].token_ids for o in LLM(path, enforce_eager=True).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    start_building, build = threading.Event(), GraphRunner._build   # (a warm inductor cache builds in seconds)
    built, compiled, compile_cold = [], [], CompileProcess.__call__
    monkeypatch.setattr(GraphRunner, "_build",
                        lambda runner, *key: start_building.wait() and (built.append(key) or build(runner, *key)))
    monkeypatch.setattr(CompileProcess, "__call__",
                        lambda process, key: compiled.append(key) or compile_cold(process, key))
    after_timing, calibrate = [], calibration.calibrate   # (the compiler thread, started only after the timing)

    def timing(engine, policy):
        calibrate(engine, policy)
        after_timing.append((engine.runner.graphs._compiler, len(engine.runner.graphs._queued)))
    monkeypatch.setattr(calibration, "calibrate", timing)
    llm = LLM(path, speculative_config={"num_speculative_tokens": 1}, enforce_eager=False, graph_batch_sizes=[1],
              max_num_seqs=1, max_model_len=64, compile_in_background=True)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    queued = {(str(which), q) for which, _, q in graphs._queued}
    assert engine.graphs_timed == 0 and queued >= {("fused", 1), ("fused", 2)}
    assert after_timing[0][0] is None and after_timing[0][1] >= 2 and graphs._compiler is not None
    table = engine.policy.table
    monkeypatch.setattr(adaptive.AdaptiveK, "choose_for", forcing([1]))   # (drafts to count, whatever the timing)
    start_building.set()
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)] == want
    runs, run_fused = [], graphs.run_fused
    graphs.run_fused = lambda *a, **kw: runs.append(1) or run_fused(*a, **kw)
    before = llm.get_metrics()
    # every graph queued built, then the steps timed again, as graphs (LLM.generate's idle does the latter once
    # nothing compiles); they count in no metric
    engine.wait_for_graphs()
    assert not graphs.compiling() and {(str(which), q) for which, _, q in graphs.graphs} >= queued
    # the timing's graphs compiled in compile_order (runner/background.py): fused steps, then the passes apart
    # (each is loaded once compiled and once a step reached its batch size: that order depends on timing)
    fused_first = [which.kind == "fused" for which, _, _ in compiled[:after_timing[0][1]]]
    assert fused_first[0] and not fused_first[-1] and fused_first == sorted(fused_first, reverse=True)
    assert llm.get_metrics() == before and before["num_drafts"] > 0
    assert engine.graphs_timed == len(graphs.graphs) >= 2 and engine.policy.table is not table
    assert set(engine.policy.table) == {0, 1} and len(runs) > 8
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    timed = engine.policy.table
    engine.idle()   # nothing new built: no timing again
    assert engine.policy.table is timed
    engine.shutdown()
