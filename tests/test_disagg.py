"""Prefill/decode disaggregation: a request prefilled (with MTP prefill and first drafts) on one engine and
decoded on another gives exactly what one engine gives, and both engines end with all KV blocks free."""
import pytest

from mtpserve import SamplingParams
from mtpserve.disagg.offline import add_prefilled, prefill
from mtpserve.engine.engine import LLMEngine
from tiny_models import pattern_batch, trained_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("disagg"), num_mtp_layers=1)


def run_to_end(engine):
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return done


@pytest.mark.parametrize("spec", [None, {"num_speculative_tokens": 2, "adaptive": False},
                                  {"num_speculative_tokens": 2}], ids=["plain", "mtp-k2", "mtp-adaptive-k2"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_disaggregated_equals_single_engine(ckpt, spec, params):
    import torch
    prompts = pattern_batch(torch.Generator().manual_seed(0), 3, 9).tolist()
    single = LLMEngine.from_kwargs(ckpt, spec, enforce_eager=True)
    for i, p in enumerate(prompts):
        single.add_request(str(i), None, p, params)
    want = run_to_end(single)
    prefill_engine = LLMEngine.from_kwargs(ckpt, spec, enforce_eager=True)
    decode_engine = LLMEngine.from_kwargs(ckpt, spec, enforce_eager=True)
    for i, p in enumerate(prompts):
        add_prefilled(decode_engine, prefill(prefill_engine, str(i), None, p, params))
        pbm = prefill_engine.block_manager
        assert pbm.num_free_blocks == pbm.num_blocks
    assert run_to_end(decode_engine) == want
    dbm = decode_engine.block_manager
    assert dbm.num_free_blocks == dbm.num_blocks


def test_adaptive_prefill_side_hands_off_the_drafts_it_chose(ckpt, monkeypatch):
    """A prefill engine adapting its k hands off the drafts its policy chose, here none; the MTP KV is a fixed-k
    engine's (a step drafting nothing still writes it), and the decode engine continues to one engine's output."""
    import torch
    from mtpserve.spec_decode.adaptive import AdaptiveK
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fixed = prefill(LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 2, "adaptive": False},
                                          enforce_eager=True), "a", None,
                    [3, 4, 5, 6, 7], p)
    adaptive = LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 2}, enforce_eager=True)
    with monkeypatch.context() as m:
        m.setattr(AdaptiveK, "choose", lambda self, batch, rooms=None: 0)
        handoff = prefill(adaptive, "a", None, [3, 4, 5, 6, 7], p)
    assert handoff.draft_token_ids == [] and len(fixed.draft_token_ids) == 2
    assert all(torch.equal(a, b) for a, b in zip(handoff.kv, fixed.kv, strict=True))
    single = LLMEngine.from_kwargs(ckpt, None, enforce_eager=True)
    single.add_request("a", None, [3, 4, 5, 6, 7], p)
    decode_engine = LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 2, "adaptive": False}, enforce_eager=True)
    add_prefilled(decode_engine, handoff)
    assert run_to_end(decode_engine) == run_to_end(single)


# (graph mode's padded first step through real servers: test_disagg_servers.py)
@pytest.mark.parametrize("k, graphs, temperature", [(1, False, 0.0), (2, False, 0.0), (2, False, 1.0)],
                         ids=["k1-eager", "k2-eager", "k2-seeded"])
def test_scheme2_hidden_state_handoff_equals_single_engine(ckpt, k, graphs, temperature):
    """Scheme 2: the decode engine gets no drafts and no MTP KV for the last prompt position, only the hidden
    state there; it runs that MTP pass as it takes the request in, and its first step is an ordinary step
    without drafts."""
    import torch
    prompts = pattern_batch(torch.Generator().manual_seed(1), 3, 9).tolist()
    params = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=7 if temperature else None)
    spec = {"num_speculative_tokens": k, "adaptive": False}
    mode = dict(enforce_eager=not graphs, graph_batch_sizes=[4])
    single = LLMEngine.from_kwargs(ckpt, spec, enforce_eager=True)
    for i, p in enumerate(prompts):
        single.add_request(str(i), None, p, params)
    want = run_to_end(single)
    prefill_engine = LLMEngine.from_kwargs(ckpt, spec, enforce_eager=True)
    decode_engine = LLMEngine.from_kwargs(ckpt, spec, **mode)
    first_steps, graph_steps = count_first_steps(decode_engine)
    for i, p in enumerate(prompts):
        handoff = prefill(prefill_engine, str(i), None, p, params, scheme="hidden")
        assert handoff.draft_token_ids == [] and handoff.last_hidden is not None
        assert handoff.kv[-1].shape[0] == handoff.kv[0].shape[0] - 1   # the last MTP slot is the decoder's
        add_prefilled(decode_engine, handoff)
    assert run_to_end(decode_engine) == want
    assert first_steps() == 1   # one first step, all three requests in it, none verifying drafts
    if graphs:
        assert graph_steps() > 0
    assert decode_engine.get_metrics()["num_accepted_tokens"] > 0
    dbm = decode_engine.block_manager
    assert dbm.num_free_blocks == dbm.num_blocks


def test_scheme2_import_writes_the_mtp_kv_that_scheme1_ships(ckpt):
    """Scheme 2's decode side runs the MTP pass at the last prompt position from the shipped hidden state: its
    MTP KV there equals what the prefill side computed and scheme 1 ships, and nothing is owed afterwards (the
    request's first step is an ordinary one; the prefix cache registers its blocks like any other's)."""
    import torch
    spec = {"num_speculative_tokens": 1, "adaptive": False}
    prompt = pattern_batch(torch.Generator().manual_seed(2), 1, 9).tolist()[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prefill_engine = LLMEngine.from_kwargs(ckpt, spec, enforce_eager=True)
    drafts, hidden = (prefill(prefill_engine, name, None, prompt, params, scheme)
                      for name, scheme in (("a", "drafts"), ("b", "hidden")))
    assert hidden.kv[-1].shape[0] == drafts.kv[-1].shape[0] - 1
    decode_engine = LLMEngine.from_kwargs(ckpt, spec, enforce_eager=True, enable_prefix_caching=True,
                                          block_size=4)
    add_prefilled(decode_engine, hidden)
    req = decode_engine.requests["b"]
    last = decode_engine.block_manager.slot(req, len(prompt) - 1)
    mtp_cache = decode_engine.runner.mtp_caches[0]
    torch.testing.assert_close(mtp_cache.view(-1, mtp_cache.shape[-1])[last], drafts.kv[-1][-1])
    assert req.draft_token_ids == [] and req.num_computed_tokens == len(prompt)
    decode_engine.step()
    assert len(req.block_hashes) == (len(prompt) + 1 - decode_engine.block_manager.lookahead) // 4
    single = LLMEngine.from_kwargs(ckpt, spec, enforce_eager=True)
    single.add_request("b", None, prompt, params)
    assert run_to_end(decode_engine) == run_to_end(single)


def count_first_steps(engine):
    """(steps running a handed-over request's first decode step, steps run as graphs) so far; a first step
    verifies no drafts (scheme 2 hands over none)."""
    runner, counts = engine.runner, [0, 0]
    execute = runner.execute

    def counting(scheduled):
        first = [s for s in scheduled if s.start == len(s.req.prompt_token_ids)]
        assert all(not s.draft_token_ids for s in first)
        counts[0] += bool(first)
        return execute(scheduled)
    runner.execute = counting
    if runner.graphs is not None:
        run_graph = runner.graphs.run

        def counting_graphs(*a, **kw):
            counts[1] += 1
            return run_graph(*a, **kw)
        runner.graphs.run = counting_graphs
    return (lambda: counts[0]), (lambda: counts[1])


def test_handoff_refused_when_engines_differ(ckpt):
    p = SamplingParams(temperature=0.0, max_tokens=5)
    handoff = prefill(LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 1, "adaptive": False},
                                            enforce_eager=True), "a", None,
                      [3, 4, 5], p)
    with pytest.raises(ValueError, match="handoff: .*(KV caches|num_speculative_tokens)"):
        add_prefilled(LLMEngine.from_kwargs(ckpt, None, enforce_eager=True), handoff)


def test_handoff_refused_when_k_differs(ckpt):
    p = SamplingParams(temperature=0.0, max_tokens=5)
    handoff = prefill(LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 3, "adaptive": False},
                                            enforce_eager=True), "a", None,
                      [3, 4, 5], p)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        add_prefilled(LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 2, "adaptive": False},
                                            enforce_eager=True), handoff)


def test_handoff_survives_the_wire(ckpt):
    """encode/decode (the frames a KV endpoint sends): every tensor bit-exact, bf16 included."""
    import torch
    from mtpserve.disagg.transport import decode, encode
    engine = LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 2, "adaptive": False}, dtype="bfloat16",
                                   enforce_eager=True)
    h = prefill(engine, "a", None, [3, 4, 5, 6], SamplingParams(temperature=0.8, seed=3, max_tokens=5),
                scheme="hidden")
    frames = encode(h)
    back = decode([bytes(f) for f in frames])
    assert back.kv[0].dtype == torch.bfloat16 and len(back.kv) == len(h.kv)
    assert all(torch.equal(a, b) for a, b in zip(back.kv, h.kv))
    assert torch.equal(back.last_hidden, h.last_hidden)
    assert (back.prompt_token_ids, back.output_token_ids, back.identity) == (h.prompt_token_ids, h.output_token_ids,
                                                                            h.identity)


@pytest.mark.parametrize("text, message", [
    ('{"kv_role": "kv_prefill"}', "kv_role = 'kv_prefill': must be one of"),
    ('{"kv_role": "kv_producer", "kv_connector": "P2pNcclConnector"}', "kv_connector = 'P2pNcclConnector'"),
    ('{"kv_role": "kv_consumer", "mtp_handoff": "logits"}', "mtp_handoff = 'logits'"),
    ('{"kv_role": "kv_consumer", "kv_port": 70000}', "kv_port = 70000"),
    ('{"kv_role": "kv_consumer", "kv_pull_timeout": 0}', "kv_pull_timeout = 0"),
    ('{"kv_role": "kv_consumer", "bogus": 1}', "a JSON object with kv_role"),
    ('not json', "not JSON"),
])
def test_kv_transfer_config_errors_name_the_field(text, message):
    from mtpserve.disagg.connector import KVTransferConfig
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        KVTransferConfig.from_json(text)


def test_prefix_cache_on_both_sides_of_a_handoff(ckpt):
    """A prefill engine serves a repeated prompt from its cache (the same hand-off); a decode engine caches the
    blocks it pulled, so the next turn that shares the prompt hits them; the tokens are a single engine's
    without the cache."""
    import torch
    spec = {"num_speculative_tokens": 2, "adaptive": False}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = pattern_batch(torch.Generator().manual_seed(1), 1, 40)[0].tolist()
    next_turn = prompt + [7, 8, 9]
    single = LLMEngine.from_kwargs(ckpt, spec, enable_prefix_caching=False, block_size=4, enforce_eager=True)
    single.add_request("a", None, prompt, params)
    want = run_to_end(single)
    single.add_request("b", None, next_turn, params)
    want.update(run_to_end(single))
    prefill_engine = LLMEngine.from_kwargs(ckpt, spec, block_size=4, enforce_eager=True)
    decode_engine = LLMEngine.from_kwargs(ckpt, spec, block_size=4, enforce_eager=True)
    first = prefill(prefill_engine, "a", None, prompt, params)
    second = prefill(prefill_engine, "a", None, prompt, params)
    assert prefill_engine.block_manager.num_hits >= 32   # the repeated prompt: all but its last block hit
    assert second.draft_token_ids == first.draft_token_ids and second.output_token_ids == first.output_token_ids
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(first.kv, second.kv, strict=True))
    add_prefilled(decode_engine, second)
    got = run_to_end(decode_engine)
    decode_engine.add_request("b", None, next_turn, params)
    got.update(run_to_end(decode_engine))
    assert decode_engine.block_manager.num_hits >= 32 and got == want
    for engine in (prefill_engine, decode_engine):
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
