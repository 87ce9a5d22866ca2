"""N-gram (prompt lookup) drafting through the same verify path as MTP: lossless, and it needs no MTP layers."""
import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.config import SpeculativeConfig
from mtpserve.spec_decode.ngram import find_continuation
from tiny_models import random_checkpoint, trained_checkpoint
from test_spec_decode import check_metrics, run


def test_find_continuation_takes_the_longest_suffix_and_its_latest_match():
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 6, 7, 3, 5, 6, 7]
    assert find_continuation(tokens, 2, 3, 1) == [8, 9]      # "5 6 7" matches at 0 only
    assert find_continuation(tokens, 2, 2, 1) == [3, 5]      # "6 7": the latest match (at 5)
    assert find_continuation(tokens, 4, 3, 1) == [8, 9, 6, 7]
    assert find_continuation([1, 2, 3, 1], 2, 3, 1) == [2, 3]
    assert find_continuation([1, 2, 3, 1], 3, 3, 1) == [2, 3, 1]   # the continuation may run into the suffix
    assert find_continuation([1, 2, 3, 1], 4, 3, 1) is None        # not k tokens after any match
    assert find_continuation([1, 2, 3, 4], 1, 3, 1) is None        # nothing repeats
    assert find_continuation([1, 2, 1, 2], 1, 4, 2) == [1]
    assert find_continuation([1, 2, 3, 1], 1, 3, 2) is None        # only a 1-token match; min_n is 2
    assert find_continuation([3, 1, 2, 9, 1, 2, 8, 1, 2], 1, 2, 1) == [8]   # the latest of equal matches
    assert find_continuation([7], 1, 3, 1) is None


@pytest.mark.parametrize("bad, field", [
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "draft_vocab_size": 8}, "draft_vocab_size"),
    ({"method": "eagle"}, "method"),
    ({"method": "mtp", "prompt_lookup_max": 3}, "prompt_lookup_max: only for method 'ngram'"),
    ({"method": "ngram", "prompt_lookup_min": 5}, "prompt_lookup_min = 5: must be at most prompt_lookup_max = 4"),
])
def test_bad_ngram_config(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(bad)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("ng"), num_mtp_layers=1)


def repeating_prompts():
    """Counting patterns (what the trained checkpoint continues) long enough to wrap around, so the context
    repeats and lookups find matches."""
    return [[2 + (i * s) % 46 for i in range(n)] for s, n in [(1, 50), (3, 20), (1, 7), (2, 60)]]


@pytest.mark.parametrize("k, scorer", [(1, "mqa"), (3, "mqa"), (2, "batch_expansion")])
def test_greedy_identical_to_no_speculation(trained, k, scorer):
    prompts = repeating_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base, _ = run(trained, None, prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": k, "scorer": scorer}
    out, m = run(trained, spec, prompts, params, max_num_batched_tokens=32)
    assert out == base
    check_metrics(m, k)
    assert m["num_drafts"] > 10 and m["acceptance_rate"] > 0.5   # the patterns repeat: drafts are right


def test_greedy_identical_with_chunked_prefill_and_preemption(trained):
    prompts = repeating_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base, _ = run(trained, None, prompts, params)
    engine = LLM(trained, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                 max_num_batched_tokens=16, num_kv_blocks=40, block_size=4, enforce_eager=True).engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, p, params)
    preempted, out = 0, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = o.outputs[0].token_ids
        preempted = max(preempted, sum(r.num_preemptions for r in engine.requests.values()))
    assert preempted > 0
    assert [out[str(i)] for i in range(len(prompts))] == base
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_works_without_mtp_layers(tmp_path):
    path = random_checkpoint(tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="MTP layers"):
        LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False},
            enforce_eager=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(10, 40)) * 2, [9, 9, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base, _ = run(path, None, prompts, params)
    out, m = run(path, {"method": "ngram", "num_speculative_tokens": 2}, prompts, params)
    assert out == base
    check_metrics(m, 2)
    assert m["num_drafts"] > 0
    llm = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, enforce_eager=True)
    assert not llm.engine.runner.mtp_caches   # no MTP cache is allocated


def test_graph_mode(trained):
    prompts = repeating_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base, _ = run(trained, None, prompts, params)
    llm = LLM(trained, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, enforce_eager=False,
              graph_batch_sizes=[1])
    # steps with drafts verify 3 tokens, steps without a match decode 1: both have a graph
    assert {key[2] for key in llm.engine.runner.graphs.graphs if str(key[0]) == "main"} == {1, 3}
    outs = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == base[0] and llm.get_metrics()["num_accepted_tokens"] > 0


def test_graph_mode_pads_requests_without_a_match(trained):
    """At batch > 1 some requests find a match and some do not: the step still runs as one graph (the others
    padded to 1+k tokens whose KV is dropped), and the output is the target model's."""
    prompts = repeating_prompts() + [[2, 9, 30, 17, 41, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base, _ = run(trained, None, prompts, params)
    llm = LLM(trained, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, enforce_eager=False,
              graph_batch_sizes=[8])
    runner, shapes = llm.engine.runner, []
    forward = runner.forward

    def recording(what, rows, *args, **kwargs):
        if all(len(r.token_ids) <= 3 for r in rows):   # decode / verify steps (prompts are longer)
            shapes.append((sorted({len(r.token_ids) for r in rows}), runner.graphs.fits(what, rows)))
        return forward(what, rows, *args, **kwargs)

    runner.forward = recording
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base
    assert shapes and all(fits for _, fits in shapes)
    assert any(sizes == [3] for sizes, _ in shapes)   # padded (or all-matching) verify steps ran
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
