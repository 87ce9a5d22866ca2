"""Prefix caching (engine/kv_cache.py): outputs identical with the cache on and off (MTP fixed and adaptive,
whole and chunked prompts, eviction and preemption, n > 1), hits that reuse the main and the MTP KV of
whole blocks and recompute nothing else, a block whose following tokens differ never hit, no block leaked,
salts kept apart, and the reset."""
import pytest
import torch

from mtpserve import LLM, SamplingParams
from test_spec_decode import fill_mtp_caches_with_noise, trained1  # noqa: F401
from tiny_models import random_checkpoint

SYSTEM = [(5 * i) % 40 + 3 for i in range(20)]   # a shared 20-token prefix (five blocks of 4)
QUESTIONS = [[7, 8, 9], [7, 8, 11, 12], [30, 31], [7, 8, 9, 10, 14, 15]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)


def prompts():
    return [SYSTEM + q for q in QUESTIONS]


def outputs(llm, prompt_ids, params):
    return [[c.token_ids for c in o.outputs] for o in
            llm.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False)]


def assert_no_leak(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(list(bm.free_blocks) + list(bm.evictable)) == list(range(bm.num_blocks))


@pytest.mark.parametrize("spec, kw", [
    ({"num_speculative_tokens": 1, "adaptive": False}, {}),
    ({"num_speculative_tokens": 3, "adaptive": True}, dict(max_num_batched_tokens=8)),
    ({"num_speculative_tokens": 2, "adaptive": False}, dict(num_kv_blocks=14, max_num_batched_tokens=8)),
    (None, {}),
], ids=["mtp-k1", "adaptive-k3-chunked", "mtp-k2-evicted-preempted", "no-spec"])
def test_outputs_identical_with_the_cache_on_and_off(trained1, spec, kw):
    """Each prompt set runs twice on one engine (the second time its prefixes are cached, the system prompt from
    the first request on), greedy and seeded, n = 1 and 4: the tokens are those of an engine without the cache,
    and the MTP acceptance per position on the cached prompts is the same as on the uncached ones."""
    kw = dict(block_size=4, enforce_eager=True, **kw)
    on, off = LLM(trained1, speculative_config=spec, **kw), LLM(trained1, speculative_config=spec,
                                                                 enable_prefix_caching=False, **kw)
    four = SamplingParams(temperature=0.8, seed=5, n=4, max_tokens=8, ignore_eos=True)
    for params in (GREEDY, SEEDED, four):
        want = outputs(off, prompts(), params)
        assert outputs(off, prompts(), params) == want
        assert outputs(on, prompts(), params) == want   # (the system prompt hits after the first request)
        before = on.get_metrics()["prefix_cache_hits"]
        assert outputs(on, prompts(), params) == want
        assert on.get_metrics()["prefix_cache_hits"] - before >= len(SYSTEM) * len(QUESTIONS) // 2
    if spec is not None and not spec["adaptive"] and "num_kv_blocks" not in kw:
        m_on, m_off = on.get_metrics(), off.get_metrics()
        assert m_on["accepted_per_position"] == m_off["accepted_per_position"]
    assert off.get_metrics()["prefix_cache_hits"] == 0
    if "num_kv_blocks" in kw:   # (the budget is tight: requests were preempted and blocks evicted)
        assert on.engine.get_stats()["num_preemptions"] > 0
    assert_no_leak(on)
    assert_no_leak(off)


def test_a_hit_computes_only_the_tokens_past_it(tmp_path):
    """Three MTP layers (k = 3: layers chained, a block's MTP KV depends on the 3 tokens after it): a repeated
    prompt starts at the last cached block whose following tokens are in the prompt; every block before it is
    reused whole, main and MTP KV: the drafts are those of the first run, and with the cached MTP KV filled with
    noise they change (the hit reads it; nothing recomputes it). (Random weights: a trained tiny model's drafts
    hardly attend.)"""
    spec = {"num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(random_checkpoint(tmp_path, num_nextn_predict_layers=3), speculative_config=spec, block_size=4,
              enforce_eager=True)
    runner, log = llm.engine.runner, []
    execute = runner.execute

    def recorded(scheduled):
        results = execute(scheduled)
        log.append(([s.start for s in scheduled], [r.next_drafts for r in results]))
        return results
    runner.execute = recorded
    prompt = SYSTEM + QUESTIONS[0]   # 23 tokens
    first = outputs(llm, [prompt], GREEDY)
    first_log, log[:] = list(log), []
    assert outputs(llm, [prompt], GREEDY) == first
    assert log[0][0] == [20]   # blocks 0..4 hit (block 4, 16..19, with tokens 20..22 after it); 3 tokens left
    assert llm.engine.block_manager.num_hits == 20
    assert [d for _, d in log] == [d for _, d in first_log]
    fill_mtp_caches_with_noise(llm)
    log[:] = []
    assert outputs(llm, [prompt], GREEDY) == first   # (lossless anyway)
    assert [d for _, d in log] != [d for _, d in first_log]


def test_a_block_whose_following_tokens_differ_is_not_hit(trained1):
    """One MTP layer: block 1 (tokens 4..7) of A = SYSTEM[:8] + [9, ...] holds MTP KV at position 7 computed with
    9 after it. B = SYSTEM[:8] + [10, ...] hits block 0 only; A's block 1, its MTP KV then filled with noise,
    changes nothing of B's: tokens and acceptance per position are an uncached engine's."""
    spec = {"num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(trained1, speculative_config=spec, block_size=4, enforce_eager=True)
    a, b = SYSTEM[:8] + [9, 12, 13], SYSTEM[:8] + [10, 12, 13]
    outputs(llm, [a], GREEDY)
    bm = llm.engine.block_manager
    block1 = bm.cached[bm._hash(bm._hash(None, a, 0, None), a, 1, None)]
    for cache in llm.engine.runner.mtp_caches:
        cache[block1] = torch.randn(cache[block1].shape) * 3
    hits, before = bm.num_hits, llm.get_metrics()["accepted_per_position"]
    got = outputs(llm, [b], GREEDY)
    assert bm.num_hits - hits == 4
    fresh = LLM(trained1, speculative_config=spec, block_size=4, enable_prefix_caching=False, enforce_eager=True)
    assert got == outputs(fresh, [b], GREEDY)
    after = [x - y for x, y in zip(llm.get_metrics()["accepted_per_position"], before)]
    assert after == fresh.get_metrics()["accepted_per_position"]


def test_salts_share_nothing_and_reset_empties_the_cache(trained1):
    llm = LLM(trained1, speculative_config={"num_speculative_tokens": 1}, block_size=4, enforce_eager=True)
    bm = llm.engine.block_manager

    def hits(salt):
        before = bm.num_hits
        llm.generate(prompt_token_ids=[SYSTEM], use_tqdm=False,
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=2, cache_salt=salt))
        return bm.num_hits - before
    assert hits("tenant-a") == 0 and hits("tenant-a") == 16 and hits("tenant-b") == 0 and hits(None) == 0
    assert hits(None) == 16
    llm.reset_prefix_cache()
    assert not bm.cached and hits("tenant-a") == 0
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_n_children_compute_the_prompt_once(trained1):
    """n = 4: one child computes the prompt; the others wait a step and hit its blocks."""
    llm = LLM(trained1, block_size=4, enforce_eager=True)
    computed, execute = [], llm.engine.runner.execute
    llm.engine.runner.execute = lambda scheduled: computed.extend(
        s.num_new_tokens for s in scheduled if s.start <= len(SYSTEM)) or execute(scheduled)
    out = llm.generate(prompt_token_ids=[SYSTEM + [7]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=6))
    assert len(out[0].outputs) == 4
    assert computed == [21, 1, 1, 1]   # the prompt once; the others hit its 5 blocks and compute its last token
    assert_no_leak(llm)


def test_graph_mode_hits_give_eager_tokens(tmp_path):
    """Graph mode (one batch size, no MTP graph of its own beyond the fused step): prompts repeated over a
    shared prefix hit the cache and their decode steps run as graphs; tokens are those of eager without the
    cache."""
    path = random_checkpoint(tmp_path, num_nextn_predict_layers=1, num_hidden_layers=2)
    spec = {"num_speculative_tokens": 1, "adaptive": False}
    graph = LLM(path, speculative_config=spec, enforce_eager=False, graph_batch_sizes=[4], max_model_len=64,
                block_size=4)
    eager = LLM(path, speculative_config=spec, enable_prefix_caching=False, block_size=4, enforce_eager=True)
    for _ in range(2):
        assert outputs(graph, prompts(), GREEDY) == outputs(eager, prompts(), GREEDY)
    assert graph.get_metrics()["prefix_cache_hits"] > 0 and graph.engine.runner.pass_counts["fused"] > 0
    # requests that read logits (logprobs, processors) take the separate path, its graphs too: same logprobs
    scored = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                            repetition_penalty=1.3)
    fused = graph.engine.runner.pass_counts["fused"]
    ours, theirs = (llm.generate(prompt_token_ids=prompts(), sampling_params=scored, use_tqdm=False)
                    for llm in (graph, eager))
    assert graph.engine.runner.pass_counts["fused"] == fused
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 and list(x) == list(y)
                   for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids))
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 and list(x) == list(y)
                   for x, y, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:]))
    assert_no_leak(graph)
