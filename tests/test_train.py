"""Training pipeline: corpus split, tokenizer round trip, MTP loss slicing, a few real training steps."""
import csv
import shutil

import pytest
import torch
import torch.nn.functional as F

from mtpserve.train import data, loss, train
from mtpserve.train import tokenizer as tok_mod

SMALL_STDLIB_FILES = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "glob.py", "fnmatch.py",
                      "textwrap.py", "heapq.py"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few small stdlib files, plus decoys that the corpus must skip."""
    root = tmp_path_factory.mktemp("corpus")
    src = data.stdlib_root()
    for name in SMALL_STDLIB_FILES:
        shutil.copy(src / name, root / name)
    for skipped in ("site-packages", "test", "pkg/tests", "__pycache__"):
        (root / skipped).mkdir(parents=True, exist_ok=True)
        (root / skipped / "skip_me.py").write_text("x = 1\n")
    (root / "pkg" / "mod.py").write_text("def f(x):\n\treturn x  # tab, trailing spaces   \r\n")
    (root / "notes.txt").write_text("not python")
    return root


def test_corpus_files_and_split(corpus):
    files = data.list_files(corpus)
    assert files == sorted(SMALL_STDLIB_FILES + ["pkg/mod.py"])
    train_files, held = data.split_files(files)
    assert sorted(train_files + held) == files and not set(train_files) & set(held)
    assert data.split_files(list(reversed(files))) == (list(reversed(train_files)), list(reversed(held)))
    real = data.list_files()   # the real corpus: ~2% held out, no test suites or site-packages
    _, real_held = data.split_files(real)
    assert 0.005 < len(real_held) / len(real) < 0.05
    assert not any(p.startswith(("test/", "site-packages/")) or "/tests/" in p for p in real)


def test_tokenizer_round_trip_and_autotokenizer(corpus, tmp_path):
    from transformers import AutoTokenizer
    texts = list(data.iter_texts(corpus, data.list_files(corpus)))
    tok = tok_mod.train_tokenizer(texts, vocab_size=400)
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|bos|>") == 1
    tok_mod.save_tokenizer(tok, tmp_path, model_max_length=1024)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.bos_token_id, hf.eos_token_id, hf.model_max_length) == (1, 0, 1024)
    samples = texts + ["", "x", "  \t\n\r\n", 'print("héllo wörld 🙂 \\u00e9")\n', "\x00\x7f ~`"]
    for text in samples:
        ids = hf(text)["input_ids"]
        assert ids[0] == 1                                  # <|bos|> first, like DeepSeek's tokenizer
        assert hf.decode(ids, skip_special_tokens=True) == text
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
        assert tok.encode(text, add_special_tokens=False).ids == ids[1:]


class ShiftModel(torch.nn.Module):
    """A fake model whose hidden state is the token id: the main head predicts id + 1; MTP module i
    records its inputs, and its head predicts (its input token) + 1. On ids = 0, 1, 2, ... every head
    is right iff the objective slices inputs and targets as DeepSeek-V3's MTP does."""
    vocab = 64

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.calls = []

    def _onehot_next(self, h):
        return 50.0 * F.one_hot(h.squeeze(-1).long() + 1, self.vocab).float() + self.w

    def forward_dense(self, ids):
        return ids.float().unsqueeze(-1)

    def compute_logits(self, h):
        return self._onehot_next(h)

    def mtp_forward_dense(self, i, ids, prev):
        self.calls.append((i, ids.clone(), prev.squeeze(-1).long().clone()))
        return ids.float().unsqueeze(-1)

    def mtp_logits(self, i, g):
        return self._onehot_next(g)


def test_mtp_objective_slicing():
    model = ShiftModel()
    T, D = 10, 3
    ids = torch.arange(T + D + 1).repeat(2, 1)
    out = loss.evaluate(model, [ids[0], ids[1]], D)
    assert out["main_acc"] == 1.0 and out["main_loss"] < 1e-6
    for k in range(1, D + 1):
        assert out[f"mtp{k}_acc"] == 1.0 and out[f"mtp{k}_loss"] < 1e-6
    L = T + D
    for i, in_ids, prev in model.calls:
        k = i + 1
        assert in_ids.shape[1] == L - k >= T
        assert torch.equal(in_ids[0], torch.arange(k, L))            # embedding of t[p + k]
        assert torch.equal(prev[0], torch.arange(k - 1, L - 1))      # previous depth's state at p
    o = loss.mtp_objective(model, ids, D, mtp_lambda=0.3)
    assert o.loss.requires_grad and len(o.mtp_losses) == D


def _losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    keys = ["main_loss", "mtp1_loss", "mtp2_loss"]
    return {k: [float(r[k]) for r in rows] for k in keys}, rows


def test_training_lowers_main_and_mtp_losses_and_exports(corpus, tmp_path):
    from transformers import AutoTokenizer

    from mtpserve.model.loader import load_model
    out, run_dir = tmp_path / "ckpt", tmp_path / "run"
    common = ["--corpus-root", str(corpus), "--vocab-size", "320", "--hidden-size", "48", "--heads", "2",
              "--layers", "2", "--intermediate-size", "96", "--moe-intermediate-size", "32", "--experts", "4",
              "--first-dense", "1", "--kv-lora-rank", "16", "--qk-nope-head-dim", "16",
              "--qk-rope-head-dim", "8", "--v-head-dim", "16", "--mtp-depth", "2", "--seq-len", "32",
              "--batch-size", "8", "--warmup", "5", "--log-every", "1", "--eval-every", "20",
              "--eval-windows", "4", "--threads", "1", "--max-position-embeddings", "128"]
    result = train.main(common + ["--out", str(out), "--run-dir", str(run_dir), "--steps", "40",
                                  "--lr", "1e-2", "--seed", "1"])
    losses, rows = _losses(run_dir)
    for key, values in losses.items():
        assert sum(values[-5:]) / 5 < sum(values[:5]) / 5 - 0.5, (key, values)
    assert rows[-1]["eval_main_loss"] and (run_dir / "curve.png").stat().st_size > 0
    assert result["steps"] == 40 and set(result["final_eval"]) >= {"main_acc", "mtp1_acc", "mtp2_acc"}

    model = load_model(str(out))
    assert model.num_mtp_layers == 2 and model.config.vocab_size == 320
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.eos_token_id == model.config.eos_token_id == 0
    assert hf_tok.bos_token_id == model.config.bos_token_id == 1

    # --freeze-main: only the MTP modules move.
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out2, run2 = tmp_path / "ckpt2", tmp_path / "run2"
    train.main(common + ["--out", str(out2), "--run-dir", str(run2), "--steps", "5", "--lr", "1e-2",
                         "--init", str(out), "--freeze-main"])
    after = load_model(str(out2)).state_dict()
    for name, t in after.items():
        shared = name.endswith(("embed_tokens.weight", "shared_head.head.weight"))
        if name.startswith("mtp_layers.") and not shared:
            continue
        assert torch.equal(t, before[name]), name
    mtp_moved = [n for n in after if n.startswith("mtp_layers.") and "eh_proj" in n
                 and not torch.equal(after[n], before[n])]
    assert len(mtp_moved) == 2


def test_greedy_acceptance_prediction():
    from mtpserve.train.evaluate import greedy_acceptance, greedy_continue

    class WrongDepth2(ShiftModel):
        def mtp_logits(self, i, g):
            return self._onehot_next(g + i)   # depth 2 predicts t + 2: always rejected

    for model, expect in ((ShiftModel(), [True, True]), (WrongDepth2(), [True, False])):
        seq = greedy_continue(model, [3, 4, 5], 12)
        assert seq == list(range(3, 18))
        rows = greedy_acceptance(model, seq, 3, 2)
        assert len(rows) == len(seq) - 3 - 2 and all(r == expect for r in rows)


def test_grow_layers_plan_and_function_preserved(tmp_path):
    """Depth up-scaling: old layers keep their order and kind, each new layer copies its nearest earlier
    layer of the same kind with zeroed output projections, so the grown model computes the same logits
    (main and MTP); a checkpoint round trip keeps the new layer count and dense/MoE split."""
    import json

    from mtpserve.model.loader import load_model
    from mtpserve.train import grow
    from tiny_models import random_checkpoint

    assert grow.layer_plan(4, 2, 12, 4) == [(0, False), (0, True), (1, False), (1, True), (2, False), (2, True),
                                            (2, True), (2, True), (3, False), (3, True), (3, True), (3, True)]
    assert grow.slot_sources(3, 3) == [0, 1, 2] and grow.slot_sources(2, 3) == [0, 1, 1]
    with pytest.raises(ValueError):
        grow.slot_sources(3, 2)

    path = random_checkpoint(tmp_path / "base", num_hidden_layers=3, first_k_dense_replace=1,
                             num_nextn_predict_layers=2)
    base = load_model(path, torch.float32)
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())
    grown, grown_cfg = grow.grow(base, cfg, new_layers=7, new_dense=2)
    assert grown.config.num_hidden_layers == 7 and grown.config.first_k_dense_replace == 2
    assert [grown.config.is_moe_layer(i) for i in range(7)] == [False, False] + [True] * 5
    zeroed = grown.model.layers[1].mlp.down_proj.weight
    assert torch.count_nonzero(zeroed) == 0 and torch.count_nonzero(grown.model.layers[0].mlp.down_proj.weight)
    ids = torch.randint(2, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h_base, h_grown = base.forward_dense(ids), grown.forward_dense(ids)
        assert torch.equal(base.compute_logits(h_base), grown.compute_logits(h_grown))
        for d in range(2):
            m_base, m_grown = base.mtp_forward_dense(d, ids, h_base), grown.mtp_forward_dense(d, ids, h_grown)
            assert torch.equal(base.mtp_logits(d, m_base), grown.mtp_logits(d, m_grown))
    # training on it moves the new layers away from identity
    from mtpserve.train import loss as loss_mod
    grown.train()
    loss_mod.mtp_objective(grown, ids, 2, 0.3).loss.backward()
    assert grown.model.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_project_corpus_split_dedup_and_filters(tmp_path, monkeypatch):
    """Whole projects are held out; a file repeated in another project (vendored copy) is kept once, by the first
    project; test suites, data tables and generated files are skipped; each project stops at its byte cap."""
    from mtpserve.train import corpus
    shared = "def shared(x):\n    return x + 1\n"
    files = {
        "alpha": {"core.py": "import os\n\n\ndef f():\n    return os.sep\n", "util.py": shared,
                  "tests/test_core.py": "def test(): pass\n", "big.py": "x = 1\n" * 5000},
        "beta": {"mod.py": "class B:\n    pass\n", "vendored.py": shared.replace("    ", "    "),
                 "table.py": "T = [" + "1, " * 2000 + "]\n", "gen.py": "# DO NOT EDIT: generated\nx = 1\n",
                 "test_mod.py": "def test_b(): pass\n"},
    }
    for project, tree in files.items():
        for rel, text in tree.items():
            path = tmp_path / project / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    monkeypatch.setattr(corpus, "project_root", lambda p: tmp_path / p)
    monkeypatch.setattr(corpus, "TRAIN_PROJECTS", ["alpha"])
    monkeypatch.setattr(corpus, "HELDOUT_PROJECTS", ["beta"])
    train, held = corpus.train_and_heldout(byte_cap=10_000)
    assert {d.path for d in train} == {"core.py", "util.py"}          # big.py would pass the 10 kB cap
    assert all(d.project == "alpha" for d in train)
    assert [d.path for d in held["beta"]] == ["mod.py"]               # copy, table, generated, test: skipped
    assert corpus.train_and_heldout(byte_cap=10_000) == (train, held)  # deterministic
    assert corpus.summary(held) == {"beta": {"files": 1, "bytes": len(files["beta"]["mod.py"])}}


def test_declared_projects_are_disjoint_and_pinned():
    import re
    from pathlib import Path
    from mtpserve.train import corpus
    assert not set(corpus.TRAIN_PROJECTS) & set(corpus.HELDOUT_PROJECTS + corpus.UNSEEN_PROJECTS)
    assert not set(corpus.HELDOUT_PROJECTS) & set(corpus.UNSEEN_PROJECTS)
    extra = Path(__file__).resolve().parents[1].joinpath("pyproject.toml").read_text().split("train = [")[1]
    pins = re.findall(r'"([A-Za-z0-9_.-]+)==[^"]+"', extra.split("]")[0])
    assert len(pins) >= len(corpus.TRAIN_PROJECTS) + len(corpus.HELDOUT_PROJECTS) - 1   # every package, exact
