"""Training corpus: the running interpreter's standard library, as token batches.

Corpus = every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, recursively, except
directories named in ``EXCLUDED_DIRS``:
  * ``site-packages`` / ``dist-packages``: third-party code, not the standard library;
  * ``test`` / ``tests`` / ``idle_test``: the test suites (repetitive, half of the bytes);
  * ``pydoc_data`` (one 750 KB generated file of documentation text) and ``encodings``
    (generated character-map tables): data, not code.
  * ``__pycache__``.
Each file is one document.  The split is by relative path: a file is held out when the first
byte of sha1(relative path) falls in the lowest ~2% (``sha1[0] < 5`` of 256), so the split does
not depend on the file order, the machine or the random seed.

Token stream: ``<|bos|> doc <|endoftext|> <|bos|> doc <|endoftext|> ...`` stored as a flat
uint16/uint32 array on disk (``np.memmap``); training batches are random windows of it, so memory
stays at one batch no matter how large the corpus is.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test",
                 "pydoc_data", "encodings", "__pycache__"}
HELDOUT_BYTE_LIMIT = 5  # sha1(path)[0] < 5  ->  5/256 ~ 2% of files held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path | None = None) -> list[str]:
    """Relative paths (posix, sorted) of the corpus files under ``root``."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(out)


def is_heldout(rel_path: str) -> bool:
    return hashlib.sha1(rel_path.encode()).digest()[0] < HELDOUT_BYTE_LIMIT


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout) by hash of the relative path."""
    train = [f for f in files if not is_heldout(f)]
    held = [f for f in files if is_heldout(f)]
    return train, held


def read_text(root: Path, rel: str) -> str | None:
    """File contents; None for files that are not UTF-8 (a handful of stdlib test fixtures)."""
    try:
        return (Path(root) / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def iter_texts(root: Path, files: list[str]):
    for rel in files:
        text = read_text(root, rel)
        if text:
            yield text


def tokenize_to_file(tokenizer, root: Path, files: list[str], path: Path) -> int:
    """Encode ``files`` (under ``root``) as one bos/eos-delimited stream into ``path``. Returns #tokens."""
    return tokenize_texts_to_file(tokenizer, iter_texts(root, files), path)


def tokenize_texts_to_file(tokenizer, texts, path: Path, batch_docs: int = 64) -> int:
    """Encode the documents ``texts`` as one bos/eos-delimited stream into ``path`` (raw array).

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (fast, no special tokens added by encode)."""
    bos = tokenizer.token_to_id("<|bos|>")
    eos = tokenizer.token_to_id("<|endoftext|>")
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 65536 else np.uint32
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n, batch = 0, []
    with open(tmp, "wb") as f:
        def flush():
            nonlocal n
            for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray([bos] + enc.ids + [eos], dtype=dtype)
                f.write(ids.tobytes())
                n += len(ids)
            batch.clear()
        for text in texts:
            batch.append(text)
            if len(batch) == batch_docs:
                flush()
        flush()
    os.replace(tmp, path)
    return n


def load_tokens(path: Path, vocab_size: int) -> np.ndarray:
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    return np.memmap(path, dtype=dtype, mode="r")


@dataclass
class Batches:
    """Random windows of ``seq_len + extra`` tokens from a token stream (extra = 1 + MTP depth)."""
    tokens: np.ndarray
    seq_len: int
    batch_size: int
    extra: int
    seed: int = 0

    def __post_init__(self):
        self.window = self.seq_len + self.extra
        if len(self.tokens) < self.window + 1:
            raise ValueError(f"token stream has {len(self.tokens)} tokens, need > {self.window}")
        self.rng = np.random.default_rng(self.seed)

    def next(self) -> torch.Tensor:
        starts = self.rng.integers(0, len(self.tokens) - self.window + 1, size=self.batch_size)
        rows = [np.asarray(self.tokens[s:s + self.window], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))

    def __iter__(self):
        while True:
            yield self.next()


def eval_windows(tokens: np.ndarray, window: int, max_windows: int) -> list[torch.Tensor]:
    """Deterministic, non-overlapping windows over a held-out stream (evenly spaced)."""
    n_total = len(tokens) // window
    n = min(n_total, max_windows)
    if n == 0:
        raise ValueError(f"held-out stream too short ({len(tokens)} tokens) for window {window}")
    idx = np.linspace(0, n_total - 1, n).round().astype(np.int64)
    return [torch.from_numpy(np.asarray(tokens[i * window:(i + 1) * window], dtype=np.int64))
            for i in idx]
