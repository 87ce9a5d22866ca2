"""Prefill/decode disaggregation: a request prefilled (with MTP prefill and first drafts) on one engine and
decoded on another gives exactly what one engine gives, and both engines end with all KV blocks free."""
import pytest

from mtpserve import SamplingParams
from mtpserve.engine.disagg import add_prefilled, prefill
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


@pytest.mark.parametrize("spec", [None, {"num_speculative_tokens": 2}], ids=["plain", "mtp-k2"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_disaggregated_equals_single_engine(ckpt, spec, params):
    import torch
    prompts = pattern_batch(torch.Generator().manual_seed(0), 3, 9).tolist()
    single = LLMEngine.from_kwargs(ckpt, spec)
    for i, p in enumerate(prompts):
        single.add_request(str(i), None, p, params)
    want = run_to_end(single)
    prefill_engine = LLMEngine.from_kwargs(ckpt, spec)
    decode_engine = LLMEngine.from_kwargs(ckpt, spec)
    for i, p in enumerate(prompts):
        add_prefilled(decode_engine, prefill(prefill_engine, str(i), None, p, params))
        pbm = prefill_engine.block_manager
        assert pbm.num_free_blocks == pbm.num_blocks
    assert run_to_end(decode_engine) == want
    dbm = decode_engine.block_manager
    assert dbm.num_free_blocks == dbm.num_blocks


def test_handoff_refused_when_engines_differ(ckpt):
    p = SamplingParams(temperature=0.0, max_tokens=5)
    handoff = prefill(LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 1}), "a", None, [3, 4, 5], p)
    with pytest.raises(ValueError, match="handoff: .*(KV caches|num_speculative_tokens)"):
        add_prefilled(LLMEngine.from_kwargs(ckpt, None), handoff)


def test_handoff_refused_when_k_differs(ckpt):
    p = SamplingParams(temperature=0.0, max_tokens=5)
    handoff = prefill(LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 3}), "a", None, [3, 4, 5], p)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        add_prefilled(LLMEngine.from_kwargs(ckpt, {"num_speculative_tokens": 2}), handoff)
