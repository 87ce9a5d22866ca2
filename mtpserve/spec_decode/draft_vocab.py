"""A frequency-ranked draft vocabulary (FR-Spec, Zhao et al. 2025): the MTP's output head scores only the
most frequent tokens.

On DeepSeek-V3 the shared output head (129,280 x 7,168, bf16: 1.85 GB) outweighs everything else an MTP
pass reads at small batch, so drafting over the 32K most frequent tokens cuts most of a draft's weight reads.
It stays lossless: a draft is only a proposal. Greedy verification compares it with the target's argmax;
rejection sampling is given the distribution the draft was really drawn from (the restricted softmax, zero
outside the draft vocabulary). Only acceptance can drop: a token outside the draft vocabulary is never drafted.

Token counts live next to the checkpoint in `token_frequencies.json` ({"source": ..., "counts": [one count
per token id]}); `mtpserve draft-vocab` writes it by tokenizing a corpus with the checkpoint's tokenizer.
"""
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from mtpserve.config import check_int_in_range

FREQUENCIES_FILE = "token_frequencies.json"


def count_tokens(token_streams: Iterable[list[int]], vocab_size: int) -> list[int]:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_streams:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return counts.tolist()


def write_frequencies(model_dir: str, counts: list[int], source: str) -> str:
    path = os.path.join(model_dir, FREQUENCIES_FILE)
    with open(path, "w") as f:
        json.dump({"source": source, "num_tokens": sum(counts), "counts": counts}, f)
    return path


def read_counts(model_dir: str, vocab_size: int) -> list[int]:
    path = os.path.join(model_dir, FREQUENCIES_FILE)
    rewrite = f"write them with `mtpserve draft-vocab --model {model_dir} --corpus FILE_OR_DIR ...`"
    if not os.path.exists(path):
        raise ValueError(f"speculative_config.draft_vocab_size needs token counts in {path}: {rewrite}")
    with open(path) as f:
        counts = json.load(f).get("counts")
    if not isinstance(counts, list) or len(counts) != vocab_size or not any(counts):
        found = f"{len(counts)} counts" if isinstance(counts, list) else "no 'counts' list"
        raise ValueError(f"{path}: {found} (need {vocab_size}, one per token id, not all zero); {rewrite}")
    return counts


def top_tokens(counts: list[int], size: int) -> torch.Tensor:
    """Ids of the `size` most frequent tokens (ties: the lower id first), in ascending id order."""
    vocab = len(counts)
    check_int_in_range("speculative_config.draft_vocab_size", size, 1, vocab, "the vocabulary size")
    order = sorted(range(vocab), key=lambda t: (-counts[t], t))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


def load_draft_vocab(model_dir: str, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """(token ids, the share of the counted tokens they cover)."""
    counts = read_counts(model_dir, vocab_size)
    ids = top_tokens(counts, size)
    return ids, sum(counts[t] for t in ids.tolist()) / max(sum(counts), 1)


def corpus_texts(paths: list[str], pattern: str):
    """Each file named, and every file matching `pattern` under each directory named, that reads as UTF-8."""
    for p in map(Path, paths):
        if not p.exists():
            raise ValueError(f"draft-vocab --corpus: {p} does not exist")
        for f in sorted(p.rglob(pattern)) if p.is_dir() else [p]:
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, IsADirectoryError):
                continue


def add_draft_vocab_args(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--corpus", nargs="*", default=[], help="text files or directories to count tokens in")
    p.add_argument("--pattern", default="*.py", help="file name pattern inside --corpus directories")
    p.add_argument("--stdlib", action="store_true",
                   help="count the training split of the standard library (the v1 default model's training data)")
    p.add_argument("--projects", action="store_true",
                   help="count the v2 training corpus (train/corpus.py; what the default model is trained on)")


def run_draft_vocab(args) -> None:
    from tokenizers import Tokenizer

    from mtpserve import default_model_path
    from mtpserve.config import ModelConfig
    from mtpserve.train import data
    model_dir = args.model or default_model_path()
    if not args.corpus and not args.stdlib and not args.projects:
        raise ValueError("draft-vocab: give --corpus FILE_OR_DIR ... and/or --stdlib or --projects")
    tokenizer_file = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
        raise ValueError(f"draft-vocab --model: {tokenizer_file} not found (the counts use the checkpoint's tokenizer)")
    tok = Tokenizer.from_file(tokenizer_file)
    texts = list(corpus_texts(args.corpus, args.pattern))
    sources = [f"{args.pattern} under {', '.join(args.corpus)}"] if args.corpus else []
    if args.stdlib:
        root = data.stdlib_root()
        texts += list(data.iter_texts(root, data.split_files(data.list_files(root))[0]))
        sources.append("the training split of the standard library (mtpserve.train.data)")
    if args.projects:
        from mtpserve.train import corpus
        texts += [d.text for d in corpus.train_and_heldout()[0]]
        sources.append("the v2 training corpus: many projects' source (mtpserve.train.corpus)")
    streams = (e.ids for e in tok.encode_batch(texts, add_special_tokens=False))
    counts = count_tokens(streams, ModelConfig.from_pretrained(model_dir).vocab_size)
    if not any(counts):
        raise ValueError(f"draft-vocab: no tokens counted (no file matching --pattern {args.pattern!r} under "
                         "--corpus reads as UTF-8 text)")
    path = write_frequencies(model_dir, counts, "; ".join(sources))
    print(f"{sum(counts)} tokens from {len(texts)} files counted into {path}")
