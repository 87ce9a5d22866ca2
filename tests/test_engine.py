"""Engine core: greedy equals transformers, chunked prefill, preemption, seeds, leaks, bad input."""
import functools

import pytest
import torch

from mtpserve import LLM, SamplingParams
from tiny_models import random_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 53)), [3, 4], list(range(100, 119)), [42]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("engine"))


@functools.lru_cache(maxsize=None)
def _hf_greedy(path, prompt, n):
    from transformers import DeepseekV3ForCausalLM
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy(path, prompt, n):
    return _hf_greedy(path, tuple(prompt), n)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(max_num_batched_tokens=8),                                    # chunked prefill mixed with decodes
    dict(max_num_batched_tokens=24),   # chunks longer than a decode row beside decodes: they attend apart
    dict(max_num_batched_tokens=8, num_kv_blocks=13, block_size=4),     # preemption by recompute
], ids=["plain", "chunked", "chunked-long", "preempt"])
def test_greedy_matches_transformers(ckpt, engine_kwargs):
    llm = LLM(ckpt, enforce_eager=True, **engine_kwargs)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(ckpt, prompt, 12)
        assert out.outputs[0].finish_reason == "length"
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if "num_kv_blocks" in engine_kwargs:
        assert sum(r.num_preemptions for r in engine.scheduler.running) == 0  # all gone
        assert not engine.requests


def test_preemption_happens(ckpt):
    llm = LLM(ckpt, max_num_batched_tokens=8, num_kv_blocks=13, block_size=4, enforce_eager=True)
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), None, p, GREEDY)
    preempted = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        preempted = max(preempted, sum(r.num_preemptions for r in llm.engine.requests.values()))
    assert preempted > 0


def test_seeded_sampling_reproducible_and_batch_independent(ckpt):
    llm = LLM(ckpt, enforce_eager=True)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)
    mixed = llm.generate(prompt_token_ids=[PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         sampling_params=[others, p, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    again = LLM(ckpt, max_num_batched_tokens=4, enforce_eager=True).generate(prompt_token_ids=[PROMPTS[0]],
                                                                             sampling_params=p, use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone


def test_n_stop_tokens_and_max_tokens(ckpt):
    llm = LLM(ckpt, enforce_eager=True)
    greedy = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, use_tqdm=False)[0]
    tokens = greedy.outputs[0].token_ids
    stop_at = tokens[4]
    p = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop_at) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_at
    p = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=p, use_tqdm=False)[0].outputs
    assert [o.index for o in outs] == [0, 1, 2] and all(len(o.token_ids) == 5 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_eos_stops_unless_ignored(ckpt):
    llm = LLM(ckpt, enforce_eager=True)
    tokens = llm.generate(prompt_token_ids=[PROMPTS[3]], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.eos_token_ids = {tokens[2]}
    p = SamplingParams(temperature=0.0, max_tokens=12)
    out = llm.generate(prompt_token_ids=[PROMPTS[3]], sampling_params=p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(tokens[2]) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("bad, field", [
    (dict(prompt_token_ids=[[]]), "prompt"),
    (dict(prompt_token_ids=[[1, 2, 100000]]), "prompt_token_ids"),
    (dict(prompt_token_ids=[[1] * 500], sampling_params=SamplingParams(max_tokens=100)), "max_tokens"),
    (dict(prompt_token_ids=[[1] * 512]), "max_model_len"),
])
def test_bad_input_raises_and_others_finish(ckpt, bad, field):
    llm = LLM(ckpt, enforce_eager=True)
    llm.engine.add_request("good", None, PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=field):
        llm.generate(use_tqdm=False, **bad)
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"] and len(finished[0].outputs[0].token_ids) == 12
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"), (dict(n=0), "n"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_abort_frees_blocks_and_many_requests_leak_nothing(ckpt):
    llm = LLM(ckpt, num_kv_blocks=40, block_size=4, max_num_batched_tokens=16, enforce_eager=True)
    engine = llm.engine
    for i in range(30):
        engine.add_request(f"r{i}", None, PROMPTS[i % len(PROMPTS)],
                           SamplingParams(temperature=0.7, max_tokens=3 + i % 5, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 3:
            engine.abort_request("r0")
            engine.abort_request("r29")
    assert engine.block_manager.num_free_blocks == 40 and not engine.requests


def test_failed_generate_leaves_nothing_behind(ckpt):
    llm = LLM(ckpt, enforce_eager=True)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompt_token_ids=[[1, 2], [3]], sampling_params=[GREEDY, {"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompt_token_ids=[[1, 2], []], sampling_params=GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


def test_a_request_that_breaks_the_step_fails_alone(ckpt):
    """A request whose parameters make the sampling step raise (here: top_k changed, after validation, to a
    value no tensor holds) fails with its own error; the others in its batch finish exactly as without it."""
    llm = LLM(ckpt, enforce_eager=True)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    params = [GREEDY, sampled] * 3
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    base = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), None, p, sp)
    engine.add_request("poison", None, [7, 8], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    engine.requests["poison"].params.top_k = 2**70
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    failed = finals.pop("poison")
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))] == base
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in finals.values())
    assert failed.outputs[0].finish_reason == "error" and "Overflow" in failed.error
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests


def test_cpu_threads_is_applied_and_checked(ckpt):
    before = torch.get_num_threads()
    try:
        LLM(ckpt, cpu_threads=before + 1, enforce_eager=True)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match=r"cpu_threads = 0: must be an integer >= 1"):
        LLM(ckpt, cpu_threads=0, enforce_eager=True)
