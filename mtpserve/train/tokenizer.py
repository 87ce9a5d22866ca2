"""Byte-level BPE tokenizer for the default model, trained with HF ``tokenizers``.

Byte-level means every string (any Unicode, any whitespace) encodes and decodes back exactly.
Special tokens: ``<|endoftext|>`` (id 0; eos, also used as pad) and ``<|bos|>`` (id 1).
Encoding with special tokens (the default, as in DeepSeek-V3's tokenizer) prepends ``<|bos|>``;
``decode(ids, skip_special_tokens=True)`` drops it again, so
``decode(encode(x), skip_special_tokens=True) == x`` and, without specials,
``decode(encode(x, add_special_tokens=False)) == x``.

Saved as ``tokenizer.json`` + ``tokenizer_config.json``, loadable with
``transformers.AutoTokenizer.from_pretrained(dir)``.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"
BOS = "<|bos|>"
SPECIAL_TOKENS = [EOS, BOS]  # ids 0, 1


def train_tokenizer(texts, vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on an iterable of documents (strings)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
    }


def save_tokenizer(tok: Tokenizer, out_dir, model_max_length: int) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(model_max_length), f, indent=2)
        f.write("\n")


def load_tokenizer(dir_or_file) -> Tokenizer:
    p = Path(dir_or_file)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def special_ids(tok: Tokenizer) -> dict:
    return {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}


def main(argv=None) -> None:
    """python -m mtpserve.train.tokenizer OUT_DIR [--vocab-size N]: train on the stdlib train split."""
    import argparse

    from mtpserve.train import data
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("out")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--model-max-length", type=int, default=4096)
    args = ap.parse_args(argv)
    root = data.stdlib_root()
    train, held = data.split_files(data.list_files(root))
    tok = train_tokenizer(data.iter_texts(root, train), args.vocab_size)
    save_tokenizer(tok, args.out, args.model_max_length)
    texts = list(data.iter_texts(root, held))
    n_chars = sum(len(t) for t in texts)
    n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    print(f"{len(train)} train / {len(held)} held-out files; vocab {tok.get_vocab_size()}; "
          f"held-out {n_chars / max(n_tok, 1):.2f} chars/token")


if __name__ == "__main__":
    main()
