"""Structured outputs with speculation: every output follows its grammar (JSON schema, JSON object, regex,
choice, EBNF), greedy output is identical with MTP on and off, sampled output follows the masked target's
closed-form distribution (chi-square), preemption mid-object, bad grammars refused by name."""
import itertools
import json
import os
import re

import jsonschema
import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.model.loader import load_model
from test_server import write_checkpoint
from test_spec_decode import assert_follows
from tiny_models import peaked_checkpoint

SPECS = {"off": None,
         "k1": {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False},
         "k3": {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False},
         "k3-adaptive": {"method": "mtp", "num_speculative_tokens": 3}}

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "enum": ["fib", "fox", "test"]},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb"]}, "maxItems": 3},
    "inner": {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 22, 333]}}, "required": ["n"],
              "additionalProperties": False}},
    "required": ["name", "ok", "tags", "inner"], "additionalProperties": False}
REGEX = r"(yes|no)-[a-f]{2}[0-9]"
CHOICES = ["hello world", "quick brown fox", "tiny"]
EBNF = 'root ::= "def " name "(" name ")"\nname ::= [a-z] [a-z]? [a-z]?'
GRAMMARS = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES},
            "grammar": {"grammar": EBNF}}


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"def [a-z]{1,3}\([a-z]{1,3}\)", text) is not None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("structured")))


@pytest.fixture(scope="module")
def engines(ckpt):
    return {name: LLM(ckpt, speculative_config=spec, max_model_len=256, block_size=4,
                      enforce_eager=True) for name, spec in SPECS.items()}


PROMPTS = ["hello", "def fib(n):", "The quick brown fox", "this is"]


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_outputs_follow_the_grammar_and_mtp_changes_nothing(engines, kind):
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=GRAMMARS[kind])
    outs = {name: llm.generate(PROMPTS, params, use_tqdm=False) for name, llm in engines.items()}
    for o in outs["off"]:
        assert o.outputs[0].finish_reason == "stop" and valid(kind, o.outputs[0].text), o.outputs[0].text
    for name in ("k1", "k3", "k3-adaptive"):
        assert [o.outputs[0].token_ids for o in outs[name]] == [o.outputs[0].token_ids for o in outs["off"]]
    sampled = SamplingParams(temperature=1.0, seed=4, max_tokens=80, structured_outputs=GRAMMARS[kind])
    for o in engines["k3"].generate(PROMPTS * 4, sampled, use_tqdm=False):   # 100% valid when sampling too
        assert o.outputs[0].finish_reason == "stop" and valid(kind, o.outputs[0].text), o.outputs[0].text
    for llm in engines.values():
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_masked_drafts_raise_acceptance_and_preemption_keeps_the_object(ckpt, engines):
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs={"json": SCHEMA})
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    k3 = engines["k3"]
    k3.engine.reset_stats()
    k3.generate(PROMPTS, plain, use_tqdm=False)
    free_rate = k3.get_metrics()["acceptance_rate"]
    k3.engine.reset_stats()
    want = [o.outputs[0].token_ids for o in k3.generate(PROMPTS, params, use_tqdm=False)]
    assert k3.get_metrics()["acceptance_rate"] > free_rate + 0.2   # forced tokens ({"name": ...) are drafted
    small = LLM(ckpt, speculative_config=SPECS["k3"], max_model_len=256, block_size=4, num_kv_blocks=30,
                max_num_batched_tokens=16, enforce_eager=True)
    got = small.generate(PROMPTS * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want * 2
    assert small.engine.scheduler.num_preemptions > 0


def test_bad_grammars_are_refused_by_name(engines):
    llm = engines["off"]
    for bad in ({"json": '{"type": "object"'}, {"regex": "(unclosed"}, {"grammar": "root ::= undefined_rule"}):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_bad_words_and_stop_strings_with_a_tokenizer(engines):
    """bad_words (tokenised with and without a leading space) and a stop string ending inside an accepted draft
    block (kept with include_stop_str_in_output): greedy output identical with MTP on and off."""
    plain = engines["off"].generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                    use_tqdm=False)
    tok = engines["off"].get_tokenizer()
    word = next(w for o in plain for t in o.outputs[0].token_ids for w in [tok.decode([t]).strip()]
                if w.isalpha() and tok.encode(w, add_special_tokens=False) == [t])   # a whole word the output has
    stop = plain[2].outputs[0].text[6:9]
    for params in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[word], logprobs=1),
                   SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                  include_stop_str_in_output=True, logprobs=1)):
        outs = {name: llm.generate(PROMPTS, params, use_tqdm=False) for name, llm in engines.items()}
        for name in ("k1", "k3", "k3-adaptive"):
            assert [o.outputs[0].token_ids for o in outs[name]] == [o.outputs[0].token_ids for o in outs["off"]]
            assert [o.outputs[0].text for o in outs[name]] == [o.outputs[0].text for o in outs["off"]]
        for o in outs["off"]:
            assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)
        if params.bad_words:
            variants = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
            assert all(o.outputs[0].token_ids[i:i + len(ids)] != ids for o in outs["off"] for ids in variants
                       for i in range(len(o.outputs[0].token_ids)))
            assert [o.outputs[0].token_ids for o in outs["off"]] != [o.outputs[0].token_ids for o in plain]
        else:
            assert outs["off"][2].outputs[0].text.endswith(stop) and outs["off"][2].outputs[0].finish_reason == "stop"


def char_tokenizer(path: str) -> None:
    """Six one-character tokens, id 0 the EOS, as a Hugging Face tokenizer in `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "e": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}, f)


def test_sampled_output_follows_the_masked_distribution(tmp_path):
    """Vocabulary of 6 (EOS, a..e), grammar [abc][cde]: the first two tokens, sampled with MTP k = 2 (drafts
    from the masked draft distribution, verified against the masked target), follow the closed-form masked
    joint distribution; the third token is always EOS."""
    path = peaked_checkpoint(tmp_path, vocab_size=6, eos_token_id=0, bos_token_id=None)
    char_tokenizer(path)
    prompt = [1, 4, 2]
    model = load_model(path)
    first, second = [1, 2, 3], [3, 4, 5]
    joint = {}
    with torch.no_grad():
        for a, b in itertools.product(range(6), repeat=2):
            p = 1.0
            for j, (t, allowed) in enumerate(((a, first), (b, second))):
                ids = prompt + [a][:j]
                logits = model.compute_logits(model.forward_dense(torch.tensor([ids])))[0, -1].double() / 1.3
                probs = logits.masked_fill(~torch.isin(torch.arange(6), torch.tensor(allowed)), float("-inf"))
                p *= float(probs.softmax(-1)[t])
            joint[(a, b)] = p
    params = SamplingParams(temperature=1.3, max_tokens=5, structured_outputs={"regex": "[abc][cde]"})
    llm = LLM(path, speculative_config={"num_speculative_tokens": 2, "adaptive": False}, max_num_seqs=512,
              max_num_batched_tokens=4096, seed=11, enforce_eager=True)
    outs = llm.generate(prompt_token_ids=[prompt] * 2000, sampling_params=params, use_tqdm=False)
    assert all(o.outputs[0].token_ids[2:] == [0] and o.outputs[0].finish_reason == "stop" for o in outs)
    for o in outs:
        o.outputs[0].token_ids = o.outputs[0].token_ids[:2]
    assert_follows(outs, joint)
    assert llm.get_metrics()["num_accepted_tokens"] > 0
