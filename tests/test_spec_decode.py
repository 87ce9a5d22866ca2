"""MTP speculative decoding is lossless: greedy output identical to no speculation, sampled output drawn
from the target model's own distribution; KV blocks never leak; metrics add up."""
import itertools

import pytest
import torch
from scipy.stats import chisquare

from mtpserve import LLM, SamplingParams
from mtpserve.model.loader import load_model
from mtpserve.spec_decode.draft_vocab import write_frequencies
from tiny_models import pattern_batch, peaked_checkpoint, random_checkpoint, trained_checkpoint


@pytest.fixture(scope="module")
def trained1(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("mtp1"), num_mtp_layers=1)


@pytest.fixture(scope="module")
def trained3(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("mtp3"), num_mtp_layers=3)


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("rand"), num_nextn_predict_layers=1)


def prompts_for(vocab_pattern=True):
    gen = torch.Generator().manual_seed(3)
    prompts = [p[:n] for p, n in zip(pattern_batch(gen, 6, 30).tolist(), [3, 9, 30, 5, 17, 2])]
    return prompts


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def run(path, spec, prompts, params=GREEDY, **kw):
    llm = LLM(path, speculative_config=spec, **(dict(enforce_eager=True) | kw))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


def check_metrics(m, k):
    assert 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"] == k * m["num_drafts"]
    per_pos = m["accepted_per_position"]
    assert len(per_pos) == k and sum(per_pos) == m["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("scorer, verification", [("mqa", "token"), ("batch_expansion", "token"), ("mqa", "block")])
def test_greedy_identical_to_no_speculation(trained1, k, scorer, verification):
    prompts = prompts_for()
    base, _ = run(trained1, None, prompts)
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False, "scorer": scorer,
            "verification": verification}
    out, m = run(trained1, spec, prompts)
    assert out == base
    check_metrics(m, k)
    assert m["acceptance_rate"] > 0.3   # the trained MTP really drafts: accepted paths are exercised


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_chunked_prefill_and_preemption(trained1, k):
    prompts = prompts_for()
    base, _ = run(trained1, None, prompts)
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": k, "adaptive": False}
    out, m = run(trained1, spec, prompts, max_num_batched_tokens=8, num_kv_blocks=18, block_size=4)
    assert out == base
    check_metrics(m, k)


def test_seeded_sampling_same_with_speculation_and_preemption(trained1):
    """A seeded request's draws are keyed on its token positions, and argmax drafts are verified by coupling
    (spec_decode/verify.py): its sampled tokens are those of plain sampling with the same seed, with or without
    speculation, with or without preemption."""
    prompts = prompts_for() * 5   # 30 requests
    params = [SamplingParams(temperature=0.8, top_k=40, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    tight = dict(max_num_batched_tokens=8, num_kv_blocks=18, block_size=4)
    outputs = []
    for spec, kw in [(None, {}), (None, tight), ({"num_speculative_tokens": 2, "adaptive": False}, {}),
                     ({"num_speculative_tokens": 2, "adaptive": False}, tight)]:
        llm = LLM(trained1, speculative_config=spec, enforce_eager=True, **kw)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in outs])
        assert (llm.engine.get_stats()["num_preemptions"] > 0) == bool(kw)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0] and outputs[3] == outputs[0]
    assert len({tuple(o) for o in outputs[0]}) >= 10   # really sampled


@pytest.mark.parametrize("k", [2, 3, 4])
def test_three_mtp_layers(trained3, k):
    prompts = prompts_for()
    base, _ = run(trained3, None, prompts)
    out, m = run(trained3, {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}, prompts,
                 max_num_batched_tokens=16)
    assert out == base
    check_metrics(m, k)
    assert m["acceptance_rate"] > 0.3


def fill_mtp_caches_with_noise(llm) -> None:
    """Whatever a pass reads that no pass wrote now changes its drafts."""
    gen = torch.Generator().manual_seed(0)
    for cache in llm.engine.runner.mtp_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen) * 3)


@pytest.mark.parametrize("budget,alone", [(None, False), (8, False), (8, True)],
                         ids=["whole-prompts", "chunked", "chunk-only-steps"])
def test_fewer_mtp_layers_than_k_read_only_what_the_step_wrote(trained3, budget, alone):
    """3 MTP layers, k=4: the depth past the checkpoint's own layers runs layer 0, and prompt chunks must fill
    the own layers' caches too: every MTP cache slot a pass attends to was written by the model, so drafts (and
    acceptance) do not depend on what the MTP caches held before (filled with noise here). (alone: one long
    prompt, so that some steps hold nothing but a prompt chunk.)"""
    prompts = prompts_for()[2:3] if alone else prompts_for()
    runs = []
    for noise in (False, True):
        kw = {"max_num_batched_tokens": budget} if budget else {}
        llm = LLM(trained3, speculative_config={"method": "mtp", "num_speculative_tokens": 4, "adaptive": False},
                  enforce_eager=True, **kw)
        if noise:
            fill_mtp_caches_with_noise(llm)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], llm.get_metrics()["accepted_per_position"]))
    assert runs[0] == runs[1]
    assert runs[0][1][3] > 0   # the 4th draft (layer 0 again) is accepted at times


def test_random_model_and_moe(random_ckpt):
    prompts = [[5, 6, 7], list(range(10, 40)), [9]]
    base, _ = run(random_ckpt, None, prompts)
    for spec in [{"num_speculative_tokens": 2, "adaptive": False},
                 {"num_speculative_tokens": 3, "adaptive": False, "verification": "block", "scorer": "batch_expansion",
                  "draft_sampling": "greedy"}]:
        out, m = run(random_ckpt, spec, prompts, max_num_batched_tokens=8)
        assert out == base


def test_stops_apply_mid_block(trained1):
    prompts = prompts_for()
    base, _ = run(trained1, None, prompts)
    stop = base[0][5]
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    out, _ = run(trained1, {"num_speculative_tokens": 4, "adaptive": False}, prompts[:1], p)
    assert out[0] == base[0][:base[0].index(stop) + 1]
    for n in [1, 2, 3, 7]:
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        out, _ = run(trained1, {"num_speculative_tokens": 4, "adaptive": False}, prompts, p)
        assert out == [b[:n] for b in base]


def exact_joint(path, prompt, params, n_tokens):
    """P(first n_tokens generated tokens) of the target model with the request's sampling transform."""
    from mtpserve.sampling.sampler import logits_to_probs
    model = load_model(path)
    vocab = model.config.vocab_size
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n_tokens):
            ids = torch.tensor([prompt + list(seq[:-1])])
            logits = model.compute_logits(model.forward_dense(ids))[0, len(prompt) - 1:]
            probs = logits_to_probs(logits, torch.full((len(seq),), params.temperature),
                                    torch.full((len(seq),), params.top_k), torch.full((len(seq),), params.top_p))
            joint[seq] = float(torch.prod(probs[torch.arange(len(seq)), torch.tensor(seq)]))
    return joint


def assert_follows(outs, joint):
    """Chi-square of the requests' generated tokens against the exact joint distribution (cells expected
    below 5 pooled)."""
    num = len(outs)
    counts = {seq: 0 for seq in joint}
    for o in outs:
        counts[tuple(o.outputs[0].token_ids)] += 1
    total = sum(joint.values())
    assert abs(total - 1) < 1e-5
    joint = {seq: p / total for seq, p in joint.items()}   # exactly a distribution despite float rounding
    cells = [seq for seq in joint if joint[seq] * num >= 5]
    observed = [counts[s] for s in cells] + [num - sum(counts[s] for s in cells)]
    expected = [joint[s] * num for s in cells] + [num * (1 - sum(joint[s] for s in cells))]
    if expected[-1] < 1e-6:   # every cell is big enough: no remainder cell
        observed, expected = observed[:-1], expected[:-1]
        expected = [e * num / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("spec", [
    {"num_speculative_tokens": 2, "adaptive": False},
    {"num_speculative_tokens": 2, "adaptive": False, "seeded": True},
    {"num_speculative_tokens": 2, "adaptive": False, "verification": "block"},
    {"num_speculative_tokens": 1, "adaptive": False, "draft_sampling": "greedy"},
    {"num_speculative_tokens": 2, "adaptive": False, "draft_sampling": "greedy", "verification": "block"},
    {"num_speculative_tokens": 2, "adaptive": False, "draft_vocab_size": 3},
    {"method": "ngram", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "verification": "block"},
], ids=["token-prob", "coupled-prob-seeded", "block-prob", "token-greedydraft", "block-greedydraft", "token-prob-draftvocab", "token-ngram",
        "block-ngram"])
def test_sampling_is_lossless(tmp_path_factory, spec):
    """Chi-square of the first two generated tokens over many seeded requests against the exact joint
    distribution computed from the model itself (vocab 6, so 36 cells). "seeded": every request has its own
    seed (coupled verification of sampled drafts, spec_decode/verify.py), else all draw from the engine's generator."""
    spec = dict(spec)
    seeded = spec.pop("seeded", False)
    # (peaked target and draft distributions tell a wrong rule from a right one; n-gram drafts from a prompt this
    # short are all rejected by a peaked model, so those runs keep a near-uniform one)
    checkpoint = random_checkpoint if spec.get("method") == "ngram" else peaked_checkpoint
    path = checkpoint(tmp_path_factory.mktemp("v6"), vocab_size=6, eos_token_id=None, bos_token_id=None)
    if "draft_vocab_size" in spec:   # drafts from tokens 0, 2, 4 only
        write_frequencies(path, [5, 1, 4, 2, 6, 3], "test counts")
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.3, top_p=0.95, max_tokens=2, ignore_eos=True)
    joint = exact_joint(path, prompt, params, 2)
    num = 3000
    llm = LLM(path, speculative_config=spec, max_num_seqs=512, max_num_batched_tokens=4096, seed=11, enforce_eager=True)
    each = [SamplingParams(**{**vars(params), "seed": i}) for i in range(num)] if seeded else params
    outs = llm.generate(prompt_token_ids=[prompt] * num, sampling_params=each, use_tqdm=False)
    assert_follows(outs, joint)
    m = llm.get_metrics()
    check_metrics(m, spec["num_speculative_tokens"])
    assert 0.05 < m["acceptance_rate"] < 1.0    # both accept and reject paths were taken


@pytest.mark.parametrize("spec", [{}, {"verification": "block"}, {"verification": "block", "draft_sampling": "greedy"}],
                         ids=["token", "block", "block-greedydraft"])
def test_fused_sampled_graph_step_is_lossless(tmp_path_factory, monkeypatch, spec):
    """Graph mode's fused step with sampling requests (spec_decode/fused.py: verification, the next drafts and
    their distributions inside one graph): the first three tokens (the second and third verified, the third's
    draft drawn, in fused steps) follow the exact joint distribution. Half the requests are seeded (coupled
    verification), half draw from the engine's generator (token-wise rejection sampling or block verification),
    in the same batches."""
    from mtpserve.spec_decode import fused
    methods, verify_tokens = [], fused.verify_tokens   # (both rules are lossless: which one the graph runs)

    def recording_verify_tokens(*args):
        methods.append(args[5])
        return verify_tokens(*args)
    monkeypatch.setattr(fused, "verify_tokens", recording_verify_tokens)
    path = peaked_checkpoint(tmp_path_factory.mktemp("v6f"), vocab_size=6, eos_token_id=None, bos_token_id=None)
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.3, top_p=0.95, max_tokens=3, ignore_eos=True)
    joint = exact_joint(path, prompt, params, 3)
    num = 2048
    llm = LLM(path, speculative_config={"num_speculative_tokens": 2, "adaptive": False, **spec}, max_num_seqs=64,
              max_num_batched_tokens=4096, seed=11, enforce_eager=False, graph_batch_sizes=[64], max_model_len=16)
    each = [SamplingParams(**{**vars(params), "seed": i if i % 2 else None}) for i in range(num)]
    outs = []
    for wave in range(0, num, 64):   # (in waves: a decode batch is not mixed with prompts, so it runs fused)
        outs += llm.generate(prompt_token_ids=[prompt] * 64, sampling_params=each[wave:wave + 64], use_tqdm=False)
    assert_follows(outs, joint)
    assert set(methods) == {spec.get("verification", "token")}
    assert llm.engine.runner.pass_counts["fused_sampled"] >= num // 64
    m = llm.get_metrics()
    assert 0.05 < m["acceptance_rate"] < 1.0
    seeded = each[1:128:2]   # the same tokens as sampling without speculation (eager)
    plain = LLM(path, max_num_seqs=64, enforce_eager=True).generate(prompt_token_ids=[prompt] * 64,
                                                                    sampling_params=seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs[1:128:2]]


def test_mtp_output_index_equals_full_pass(random_ckpt):
    """The drafting pass computes attention and MoE only for the wanted token of each request; its outputs and
    the MTP KV it writes equal the full pass's."""
    from mtpserve.runner.batch import build_batch
    from mtpserve.step import Row
    model = load_model(random_ckpt)
    dim = model.config.kv_cache_dim
    rows = [Row([3, 4, 5, 6], 0, [0, 1]), Row([7, 8], 5, [2, 3]), Row([9], 2, [4])]
    hidden = torch.randn(7, model.config.hidden_size)
    outs, caches = [], []
    for index in [None, torch.tensor([3, 5, 6])]:
        cache = torch.zeros(6, 4, dim)
        cache[:5] = 0.5   # stale entries before each row's start
        ids, pos, meta = build_batch(rows, 4, "cpu")
        with torch.no_grad():
            outs.append(model.mtp_forward(0, ids, pos, hidden, meta, cache, index))
        caches.append(cache)
    torch.testing.assert_close(outs[1], outs[0][[3, 5, 6]])
    torch.testing.assert_close(caches[1], caches[0])


def test_synthetic_acceptance_rate_is_what_was_asked(random_ckpt):
    """Measurement mode: each draft passes with the given probability, greedy requests included."""
    spec = {"num_speculative_tokens": 2, "synthetic_acceptance": 0.5, "allow_lossy_measurement": True}
    llm = LLM(random_ckpt, speculative_config=spec, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.generate(prompt_token_ids=[[5, 6, 7]] * 16, sampling_params=params, use_tqdm=False)
    m = llm.get_metrics()
    first, second = (a / m["num_drafts"] for a in m["accepted_per_position"])
    assert 0.4 < first < 0.6 and 0.15 < second < 0.35



def test_synthetic_acceptance_needs_its_explicit_opt_in(random_ckpt):
    """A lossy measurement mode is refused by LLM (and serve, which builds the same config) unless asked for."""
    with pytest.raises(ValueError, match="synthetic_acceptance: a benchmark measurement mode .*allow_lossy_measurement"):
        LLM(random_ckpt, speculative_config={"num_speculative_tokens": 2, "synthetic_acceptance": 0.5},
            enforce_eager=True)


def dense_drafts(model, tokens: list[int], k: int) -> list[int]:
    """Greedy drafts after `tokens` from a dense recomputation: depth j+1 at position p takes the embedding of
    t[p+j+1] and depth j's output at p (depth 0: the main model's hidden state); the last position's output
    is the draft, which the next depth reads as its newest token."""
    n = len(tokens) - 1   # positions whose main hidden state exists
    with torch.no_grad():
        prev = model.forward_dense(torch.tensor([tokens[:n]]))
        seq = list(tokens)
        for j in range(k):
            prev = model.mtp_forward_dense(j, torch.tensor([seq[j + 1:j + 1 + n]]), prev)
            seq.append(int(model.mtp_logits(j, prev[0, -1]).argmax()))
    return seq[len(tokens):]


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "separate"])
def test_chained_drafts_equal_dense_recomputation(trained3, fused):
    """Each depth with a layer of its own runs over the accepted positions, fed the previous depth's outputs
    (the last depth only at the position read): every step's drafts are those of the dense formula, in the
    fused decode step (spec_decode/fused.py, eager) as in the separate path (spec_decode/mtp.py)."""
    llm = LLM(trained3, speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False,
                                            "fused_graph_step": fused}, enforce_eager=True)
    runner, checked, fused_steps = llm.engine.runner, [], []
    execute, fused_step = runner.execute, runner._fused_step

    def recording(scheduled):
        results = execute(scheduled)
        for s, r in zip(scheduled, results):
            if r.next_drafts is not None:
                context = s.req.all_token_ids + r.new_token_ids
                checked.append(r.next_drafts == dense_drafts(runner.model, context, 3))
        return results

    runner.execute = recording
    runner._fused_step = lambda what, scheduled: fused_steps.append(what) or fused_step(what, scheduled)
    llm.generate(prompt_token_ids=prompts_for()[:3], sampling_params=GREEDY, use_tqdm=False)
    assert len(checked) > 10 and all(checked)
    assert (len(fused_steps) > 5) == fused
