"""Overlap (EngineConfig.overlap): each step runs on a model thread while the engine finishes the step before
(detokenisation, stop strings, outputs). The same outputs as without it, stop strings that hit while the next
step runs, aborts mid-step, sampling still drawn from the model's distribution; nothing leaks."""
import json
import os
import threading

import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.engine.engine import LLMEngine
from test_spec_decode import assert_follows, exact_joint, prompts_for
from tiny_models import PATTERN_VOCAB, random_checkpoint, trained_checkpoint

SPEC = {"num_speculative_tokens": 2, "adaptive": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny trained MTP checkpoint (drafts mostly accepted: several tokens per step) with a word-level
    tokenizer (token i reads " w{i}"), so that stop strings can end a request inside a step's tokens."""
    path = trained_checkpoint(tmp_path_factory.mktemp("overlap"), num_mtp_layers=1)
    vocab = {f"w{i}": i for i in range(PATTERN_VOCAB)}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                 "decoder": {"type": "Metaspace", "replacement": "_", "prepend_scheme": "never", "split": True},
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}}
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}, f)
    return path


def requests(base_texts: list[str]) -> list[SamplingParams]:
    """Greedy and seeded sampling; stop strings taken from the middle of each greedy text, max_tokens, a stop
    token id, n = 2."""
    stops = [t[len(t) // 2:len(t) // 2 + 4] for t in base_texts]
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stops[0]]),
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stops[1], "zz"]),
            SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True, stop_token_ids=[5]),
            SamplingParams(temperature=0.8, seed=9, max_tokens=20, ignore_eos=True, stop=[stops[4]]),
            SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=16, ignore_eos=True)]


def summary(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("copies, kw", [(1, {}), (2, dict(max_num_batched_tokens=8, num_kv_blocks=15, block_size=4))],
                         ids=["plain", "chunked-preempted"])
def test_same_outputs_as_without_overlap(ckpt, copies, kw):
    prompts = prompts_for()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base_texts = [o.outputs[0].text for o in LLM(ckpt, speculative_config=SPEC, enforce_eager=True).generate(
        prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)]
    prompts, params = prompts * copies, requests(base_texts) * copies
    runs = {}
    for overlap in (False, True):
        llm = LLM(ckpt, speculative_config=SPEC, overlap=overlap, enforce_eager=True, **kw)
        runs[overlap] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        engine = llm.engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.requests
        assert not engine.has_unfinished_requests()
        if kw:
            assert engine.scheduler.num_preemptions > 0
        llm.engine.shutdown()
    assert summary(runs[True]) == summary(runs[False])
    reasons = [c.stop_reason for o in runs[True] for c in o.outputs]
    assert isinstance(reasons[0], str) and isinstance(reasons[1], str)   # the stop strings did hit
    assert all(len(c.token_ids) < 24 for c in runs[True][0].outputs + runs[True][1].outputs)


def test_stop_string_inside_a_step_drops_the_tokens_after_it(ckpt):
    """A stop string completed by a token that is not its step's last: the tokens after it are dropped, and
    the step that ran meanwhile (scheduled before the text was checked) is discarded."""
    prompt = prompts_for()[2]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = LLMEngine.from_kwargs(ckpt, speculative_config=SPEC, overlap=True, enforce_eager=True)
    engine.add_request("full", None, prompt, greedy)
    step_ends = []   # output length after each step
    while engine.has_unfinished_requests():
        for out in engine.step():
            step_ends.append(len(out.outputs[0].token_ids))
    full = out.outputs[0]
    cut, stop = None, None
    for i in range(4, 20):   # token i completes a stop string that first occurs there, and is not a step's last
        text = engine.tokenizer.decode(full.token_ids[:i + 1])
        if i + 1 not in step_ends and full.text.find(text[-3:]) == len(text) - 3:
            cut, stop = i, text[-3:]
            break
    assert cut is not None
    engine.add_request("r", None, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    got = final.outputs[0]
    assert got.token_ids == full.token_ids[:cut + 1] and got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == full.text[:full.text.index(stop)]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.requests
    engine.shutdown()


def test_abort_while_its_step_runs(ckpt, caplog):
    """Aborted between steps, while the model thread runs a step holding it (held back here until the abort is
    done, so the step reads the request after it): the step reads its own copy, nothing fails; the others
    finish exactly as without it and every block comes back."""
    prompts = prompts_for()
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(ckpt, speculative_config=SPEC, enforce_eager=True).generate(
        prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)]
    engine = LLMEngine.from_kwargs(ckpt, speculative_config=SPEC, overlap=True, enforce_eager=True)
    aborted, execute = threading.Event(), engine.executor.execute

    def held_back_execute(scheduled):
        if any(s.req.request_id == "1" for s in scheduled) and steps == 3:
            assert aborted.wait(timeout=30)
        return execute(scheduled)
    engine.executor.execute = held_back_execute
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, p, greedy)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        if steps == 3:
            flight = engine.overlap.in_flight
            assert flight is not None and any(s.req.request_id == "1" for s in flight.plan.scheduled)
            engine.abort_request("1")
            aborted.set()
    assert "1" not in finals
    assert {rid: o.outputs[0].token_ids for rid, o in finals.items()} == {
        str(i): t for i, t in enumerate(base) if i != 1}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.requests
    assert "failed in a step" not in caplog.text
    engine.shutdown()


def test_sampling_lossless_with_overlap(tmp_path_factory):
    """Chi-square of the first two tokens against the model's exact distribution, unseeded requests (the
    engine's generator, drawn on the model thread), MTP k=2, overlap on."""
    path = random_checkpoint(tmp_path_factory.mktemp("v6o"), vocab_size=6, eos_token_id=None, bos_token_id=None)
    prompt, num = [1, 4, 2], 3000
    params = SamplingParams(temperature=1.3, top_p=0.95, max_tokens=2, ignore_eos=True)
    joint = exact_joint(path, prompt, params, 2)
    llm = LLM(path, speculative_config=SPEC, max_num_seqs=512, max_num_batched_tokens=4096, seed=12, overlap=True,
              enforce_eager=True)
    outs = []
    for _ in range(3):
        outs += llm.generate(prompt_token_ids=[prompt] * (num // 3), sampling_params=params, use_tqdm=False)
    assert_follows(outs, joint)
    assert llm.get_metrics()["num_draft_tokens"] > 0
    llm.engine.shutdown()


def test_overlap_refused_across_processes_and_with_disaggregation(ckpt):
    with pytest.raises(ValueError, match="overlap"):
        LLMEngine.from_kwargs(ckpt, overlap=True, tensor_parallel_size=2, enforce_eager=True)
    from mtpserve.disagg.offline import single_process
    engine = LLMEngine.from_kwargs(ckpt, speculative_config=SPEC, overlap=True, enforce_eager=True)
    with pytest.raises(ValueError, match="overlap"):
        single_process(engine)
    engine.shutdown()
