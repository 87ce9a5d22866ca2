"""Logprobs and logits processors with speculation exactly as without it: logprobs equal to speculation off and
to transformers' teacher-forced log-softmax; greedy output with each processor identical with MTP on and off;
sampled output with processors from the closed-form processed distribution (chi-square); best_of; stops
inside an accepted draft block."""
import itertools

import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.model.loader import load_model
from test_spec_decode import assert_follows
from tiny_models import pattern_batch, peaked_checkpoint, trained_checkpoint

SPECS = {"off": None,
         "k1": {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False},
         "k3": {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False},
         "k3-adaptive": {"method": "mtp", "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("lp"), num_mtp_layers=1)


@pytest.fixture(scope="module")
def engines(trained):
    return {name: LLM(trained, speculative_config=spec, block_size=4,
                      enforce_eager=True) for name, spec in SPECS.items()}


def prompts():
    gen = torch.Generator().manual_seed(5)
    return [p[:n] for p, n in zip(pattern_batch(gen, 5, 24).tolist(), [3, 11, 24, 6, 17])]


def generate(llm, params, prompt_ids=None):
    outs = llm.generate(prompt_token_ids=prompt_ids or prompts(), sampling_params=params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    return outs


def flat(entries):
    """[{token: Logprob}] -> [[(token, logprob, rank)]] in order."""
    return [None if e is None else [(t, lp.logprob, lp.rank) for t, lp in e.items()] for e in entries]


def assert_close(a, b, tol):
    for ea, eb in zip(flat(a), flat(b), strict=True):
        if ea is None or eb is None:
            assert ea is eb
            continue
        assert [t for t, _, _ in ea] == [t for t, _, _ in eb]
        assert max(abs(x - y) for (_, x, _), (_, y, _) in zip(ea, eb)) < tol


def test_logprobs_equal_speculation_off_and_transformers(engines, trained, load_hf):
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    base = generate(engines["off"], params)
    for name in ("k1", "k3", "k3-adaptive"):
        outs = generate(engines[name], params)
        for a, b in zip(base, outs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert_close(a.outputs[0].logprobs, b.outputs[0].logprobs, 1e-5)
            assert_close(a.prompt_logprobs, b.prompt_logprobs, 1e-5)
            assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-4)
        assert engines[name].get_metrics()["num_accepted_tokens"] > 0   # drafts were accepted, not just run
        if name != "k3-adaptive":   # logprobs come from the fused decode step's hidden states too
            assert engines[name].engine.runner.pass_counts["fused"] > 0
    main, _ = load_hf(trained)
    for out in base:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            ref = main(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
        top_ns = [3] * (len(out.prompt_token_ids) - 1) + [5] * len(out.outputs[0].token_ids)
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
        assert len(entries) == len(ids) - 1
        for pos, (token, entry, n) in enumerate(zip(ids[1:], entries, top_ns)):
            assert entry[token].logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
            assert entry[token].rank == int((ref[pos] > ref[pos, token]).sum()) + 1
            assert {t for t, lp in entry.items() if lp.rank <= n} == set(ref[pos].topk(n).indices.tolist())


PROCESSORS = {
    "repetition": dict(repetition_penalty=1.6),
    "frequency-presence": dict(frequency_penalty=1.5, presence_penalty=0.7),
    "logit_bias": dict(logit_bias={7: 6.0, 20: 4.0}),
    "allowed": dict(allowed_token_ids=[5, 9, 13, 17, 30, 31]),
    "min_tokens": dict(logit_bias={1: 9.0}, min_tokens=6, ignore_eos=False),
}


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_processor_greedy_identical_with_speculation(engines, name):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 32, "ignore_eos": True, "logprobs": 2,
                               **PROCESSORS[name]})
    plain = generate(engines["off"], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    base = generate(engines["off"], params)
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in plain]   # it acts
    for spec in ("k3", "k3-adaptive"):
        outs = generate(engines[spec], params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        for a, b in zip(base, outs):
            assert_close(a.outputs[0].logprobs, b.outputs[0].logprobs, 1e-5)
    if name == "allowed":
        assert all(set(o.outputs[0].token_ids) <= set(params.allowed_token_ids) for o in base)
    if name == "min_tokens":   # EOS as soon as allowed, never before
        assert all(len(o.outputs[0].token_ids) == 7 and o.outputs[0].token_ids[-1] == 1 for o in base)


def test_stop_inside_a_draft_block_cuts_tokens_and_logprobs(engines):
    base = generate(engines["off"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    stop = base[2].outputs[0].token_ids[5]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop], logprobs=1)
    for spec in ("off", "k3"):
        out = generate(engines[spec], params)[2].outputs[0]
        assert out.token_ids == base[2].outputs[0].token_ids[:base[2].outputs[0].token_ids.index(stop) + 1]
        assert len(out.logprobs) == len(out.token_ids) and out.finish_reason == "stop"


def test_best_of_returns_the_most_likely_completions(engines):
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3, n=4, logprobs=0)
    every = generate(engines["k3"], sampled, prompts()[:2])
    best = generate(engines["k3"], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3, n=2,
                                                  best_of=4), prompts()[:2])
    for e, b in zip(every, best):
        ranked = sorted(e.outputs, key=lambda c: -c.cumulative_logprob)[:2]
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in ranked]
        assert [c.index for c in b.outputs] == [0, 1] and b.outputs[0].logprobs is None


def test_prompt_logprobs_under_chunking_prefix_cache_and_preemption(trained, engines):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    base = generate(engines["off"], params)
    small = LLM(trained, speculative_config=SPECS["k3"], block_size=4, num_kv_blocks=14, max_num_seqs=5,
                max_num_batched_tokens=12, enforce_eager=True)   # (prompts in chunks of at most 12 tokens)
    for _ in range(2):   # the second time the prompts are cached: prompt logprobs still come (no hit taken)
        outs = generate(small, params)
        for a, b in zip(base, outs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert_close(a.prompt_logprobs, b.prompt_logprobs, 1e-5)
            assert_close(a.outputs[0].logprobs, b.outputs[0].logprobs, 1e-5)
    assert small.engine.scheduler.num_preemptions > 0


def reference_joint(path, prompt, params, n_tokens):
    """P(first n_tokens) under the processed target, written out here from the fields' definitions: logit
    bias, repetition penalty on prompt and generated tokens, frequency and presence penalties on generated
    ones, temperature, then min_p."""
    model = load_model(path)
    vocab = model.config.vocab_size
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n_tokens):
            p_seq = 1.0
            for j in range(n_tokens):
                ids = prompt + list(seq[:j])
                x = model.compute_logits(model.forward_dense(torch.tensor([ids])))[0, -1].double()
                for t, b in params.logit_bias.items():
                    x[t] += b
                for t in set(ids):
                    x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
                for t in set(seq[:j]):
                    x[t] -= params.frequency_penalty * seq[:j].count(t) + params.presence_penalty
                probs = (x / params.temperature).softmax(-1)
                probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
                p_seq *= float(probs[seq[j]] / probs.sum())
            joint[seq] = p_seq
    return joint


@pytest.mark.parametrize("spec", [
    {"num_speculative_tokens": 2, "adaptive": False},
    {"num_speculative_tokens": 2, "adaptive": False, "verification": "block"},
    {"num_speculative_tokens": 1, "adaptive": False, "draft_sampling": "greedy"},
    {"num_speculative_tokens": 2, "adaptive": False, "scorer": "batch_expansion"},
], ids=["token-prob", "block-prob", "token-greedydraft", "batch-expansion"])
def test_sampled_processors_follow_the_processed_distribution(tmp_path, spec):
    path = peaked_checkpoint(tmp_path, vocab_size=6, eos_token_id=None, bos_token_id=None)
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.3, max_tokens=2, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.6, presence_penalty=0.3, logit_bias={3: 1.5}, min_p=0.02)
    joint = reference_joint(path, prompt, params, 2)
    llm = LLM(path, speculative_config=spec, max_num_seqs=512, max_num_batched_tokens=4096, seed=11, enforce_eager=True)
    outs = llm.generate(prompt_token_ids=[prompt] * 3000, sampling_params=params, use_tqdm=False)
    assert_follows(outs, joint)
    m = llm.get_metrics()
    assert m["num_accepted_tokens"] > 100 and m["acceptance_rate"] < 1.0   # both accept and reject paths taken


@pytest.mark.parametrize("fields", [dict(min_p=0.15),
                                    dict(repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=0.7)],
                         ids=["min_p", "penalties"])
def test_fields_of_the_fused_step_follow_their_distribution(tmp_path, fields):
    """min_p and the penalties are applied inside the fused decode step (the other processors are not): its
    steps run fused, and the output follows the closed form (penalties, temperature, then min_p)."""
    path = peaked_checkpoint(tmp_path, vocab_size=6, eos_token_id=None, bos_token_id=None)
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.3, max_tokens=3, ignore_eos=True, logit_bias={}, **fields)
    joint = reference_joint(path, prompt, params, 3)
    llm = LLM(path, speculative_config={"num_speculative_tokens": 1, "adaptive": False}, max_num_seqs=512,
              max_num_batched_tokens=4096, seed=11, enforce_eager=True)
    outs = llm.generate(prompt_token_ids=[prompt] * 3000, sampling_params=params, use_tqdm=False)
    assert_follows(outs, joint)
    assert llm.engine.runner.pass_counts["fused_sampled"] > 0
