"""Frequency-ranked draft vocabulary: the MTP drafts only from the most frequent tokens, and the output is
still exactly the target model's (greedy identical; sampling lossless in test_spec_decode)."""
import json
import os
import re
import shutil

import pytest
import torch

from mtpserve import LLM, SamplingParams, default_model_path
from mtpserve.config import SpeculativeConfig
from mtpserve.spec_decode.draft_vocab import FREQUENCIES_FILE, top_tokens, write_frequencies
from tiny_models import PATTERN_VOCAB, trained_checkpoint
from test_spec_decode import GREEDY, check_metrics, prompts_for, run

FREQUENT = list(range(2, 2 + PATTERN_VOCAB // 2))   # the tokens the tests' counts make most frequent


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = trained_checkpoint(tmp_path_factory.mktemp("dv"), num_mtp_layers=1)
    counts = [100 if t in FREQUENT else t % 3 for t in range(PATTERN_VOCAB)]
    write_frequencies(path, counts, "test counts")
    return path


def test_top_tokens_by_count_then_lower_id():
    assert top_tokens([5, 1, 5, 0, 3], 3).tolist() == [0, 2, 4]
    assert top_tokens([1, 1, 1, 1], 2).tolist() == [0, 1]
    for bad in [0, 5, 2.5]:
        with pytest.raises(ValueError, match="draft_vocab_size"):
            top_tokens([5, 1, 5, 0], bad)


def test_bad_draft_vocab_size_is_refused(trained, tmp_path):
    for bad in [0, -3, "64", True]:
        with pytest.raises(ValueError, match="draft_vocab_size"):
            SpeculativeConfig.from_dict({"num_speculative_tokens": 1, "adaptive": False, "draft_vocab_size": bad})
    with pytest.raises(ValueError, match=r"draft_vocab_size = 49: must be an integer in \[1, 48\]"):
        LLM(trained, speculative_config={"num_speculative_tokens": 1, "adaptive": False,
                                         "draft_vocab_size": PATTERN_VOCAB + 1}, enforce_eager=True)
    no_counts = tmp_path / "no_counts"
    shutil.copytree(trained, no_counts)
    os.remove(no_counts / FREQUENCIES_FILE)
    spec = {"num_speculative_tokens": 1, "adaptive": False, "draft_vocab_size": 8}
    with pytest.raises(ValueError, match=FREQUENCIES_FILE):
        LLM(str(no_counts), speculative_config=spec, enforce_eager=True)
    for counts, found in [([1] * 5, "5 counts"), ([0] * PATTERN_VOCAB, "48 counts")]:
        write_frequencies(str(no_counts), counts, "bad counts")
        with pytest.raises(ValueError, match=f"{found} \\(need 48, one per token id, not all zero\\)"):
            LLM(str(no_counts), speculative_config=spec, enforce_eager=True)


@pytest.mark.parametrize("k, size", [(1, 24), (3, 24), (2, 1)])
def test_greedy_identical_and_drafts_from_the_draft_vocab(trained, k, size):
    prompts = prompts_for()
    base, _ = run(trained, None, prompts)
    spec = {"num_speculative_tokens": k, "adaptive": False, "draft_vocab_size": size}
    llm = LLM(trained, speculative_config=spec, max_num_batched_tokens=16, enforce_eager=True)
    allowed = set(top_tokens(json.load(open(os.path.join(trained, FREQUENCIES_FILE)))["counts"], size).tolist())
    drafted = []
    execute = llm.engine.runner.execute

    def recording(scheduled):   # (every step's drafts: the fused decode steps' and the separate path's)
        results = execute(scheduled)
        drafted.extend(t for r in results if r.next_drafts for t in r.next_drafts)
        return results

    llm.engine.runner.execute = recording
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base
    assert drafted and set(drafted) <= allowed
    m = llm.get_metrics()
    check_metrics(m, k)
    if size > 1:   # drafts inside the vocabulary are still accepted
        assert m["accepted_per_position"][0] > 0.2 * m["num_drafts"]


def test_greedy_requests_unchanged_next_to_sampling_ones(trained):
    prompts = prompts_for()
    base, _ = run(trained, None, prompts)
    llm = LLM(trained, speculative_config={"num_speculative_tokens": 2, "adaptive": False, "draft_vocab_size": 24},
              enforce_eager=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(prompts))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[::2]] == base[::2]


def test_sampled_drafts_carry_their_distribution_over_the_whole_vocabulary(trained):
    llm = LLM(trained, speculative_config={"num_speculative_tokens": 2, "adaptive": False, "draft_vocab_size": 24},
              enforce_eager=True)
    results = []
    execute = llm.engine.runner.execute

    def recording(scheduled):
        out = execute(scheduled)
        results.extend(r for r in out if r.next_drafts)
        return out

    llm.engine.runner.execute = recording
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    llm.generate(prompt_token_ids=prompts_for()[:3], sampling_params=params, use_tqdm=False)
    outside = [t for t in range(PATTERN_VOCAB) if t not in FREQUENT]
    assert results
    for r in results:
        probs = r.next_draft_probs   # [k, vocab]
        assert probs.shape == (2, PATTERN_VOCAB)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2))
        assert probs[:, outside].abs().max() == 0
        assert all(probs[j, t] > 0 for j, t in enumerate(r.next_drafts))


def test_cli_counts_the_corpus_with_the_checkpoints_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer

    from mtpserve.cli import main
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ["config.json", "tokenizer.json"]:
        shutil.copy(os.path.join(default_model_path(), name), model_dir)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"]
    for i, text in enumerate(texts):
        (corpus / f"m{i}.py").write_text(text)
    (corpus / "skip.txt").write_text("not matched by the pattern")
    main(["draft-vocab", "--model", str(model_dir), "--corpus", str(corpus)])
    saved = json.load(open(model_dir / FREQUENCIES_FILE))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [0] * tok.get_vocab_size()
    for text in texts:
        for t in tok.encode(text, add_special_tokens=False).ids:
            expected[t] += 1
    assert saved["counts"] == expected and saved["num_tokens"] == sum(expected)
    for argv, error in [(["--corpus", str(corpus), "--pattern", "*.rs"], "no tokens counted"),
                        (["--corpus", str(tmp_path / "missing")], "--corpus: .* does not exist")]:
        with pytest.raises(SystemExit):
            main(["draft-vocab", "--model", str(model_dir)] + argv)
        assert re.search(error, capsys.readouterr().err)
