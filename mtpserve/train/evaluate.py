"""Evaluate a saved checkpoint on the held-out split (numbers for docs/DEFAULT_MODEL.md).

    python -m mtpserve.train.evaluate CKPT_DIR [--seq-len 256] [--prompts 8 --new-tokens 96]
    python -m mtpserve.train.evaluate CKPT_DIR --corpus projects [--seq-len 1024] [--windows 24]

Reports held-out loss / top-1 accuracy of the main head and of each MTP depth (teacher forced), and a
*prediction* of greedy MTP acceptance: the model greedily continues held-out prompts (plain decoding),
then, on that continuation, draft k at position p is counted accepted when drafts 1..k all equal the
greedy tokens -- what token-level greedy verification accepts. It is computed densely, in float32
on the bf16 weights, so it is a cross-check for the engine's measured rate, not a replacement.

``--corpus projects``: the loss, accuracy and draft/main agreement of every held-out and unseen project of
train/corpus.py, separately (``--windows`` evenly spaced windows of each); the engine measures acceptance
(train/acceptance.py).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from mtpserve.train import data, loss
from mtpserve.train import tokenizer as tok_mod


@torch.no_grad()
def greedy_continue(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        h = model.forward_dense(torch.tensor([ids]))
        ids.append(int(model.compute_logits(h[:, -1]).argmax(-1)))
    return ids


@torch.no_grad()
def greedy_acceptance(model, seq: list[int], start: int, depth: int) -> list[list[bool]]:
    """For each position p >= start-1 of a greedy sequence (t[p+1] is the main model's argmax):
    accepted[k-1] = drafts 1..k at p all equal t[p+2..p+k+1]."""
    ids = torch.tensor([seq])
    L = len(seq)
    h = model.forward_dense(ids)
    prev, hits = h, []
    for k in range(1, depth + 1):
        g = model.mtp_forward_dense(k - 1, ids[:, k:L], prev[:, :L - k])
        pred = model.mtp_logits(k - 1, g).argmax(-1)[0]        # depth k at p predicts t[p+k+1]
        hits.append(pred[:L - k - 1] == ids[0, k + 1:L])        # positions p = 0 .. L-k-2
        prev = g
    out = []
    for p in range(start - 1, L - depth - 1):
        ok, row = True, []
        for k in range(depth):
            ok = ok and bool(hits[k][p])
            row.append(ok)
        out.append(row)
    return out


@torch.no_grad()
def heldout_agreement(model, windows: list[torch.Tensor], depth: int) -> list[float]:
    """Teacher forced on real text: the fraction of positions p where, for every k' <= k, depth k''s
    draft (for t[p+k'+1]) equals the main model's argmax at p+k' (which also predicts t[p+k'+1])."""
    hits, total = [0] * depth, 0
    for w in windows:
        ids = w[None]
        L = ids.shape[1]
        h = model.forward_dense(ids)
        main_pred = model.compute_logits(h).argmax(-1)[0]          # [L], main at p predicts t[p+1]
        prev, ok = h, None
        n = L - depth - 1
        for k in range(1, depth + 1):
            g = model.mtp_forward_dense(k - 1, ids[:, k:L], prev[:, :L - k])
            pred = model.mtp_logits(k - 1, g).argmax(-1)[0]
            agree = pred[:n] == main_pred[k:k + n]
            ok = agree if ok is None else ok & agree
            hits[k - 1] += int(ok.sum())
            prev = g
        total += n
    return [x / total for x in hits]


def heldout_prompts(tok, n: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """n prompts: <|bos|> + the first prompt_tokens tokens of held-out files (cycling if needed)."""
    root = data.stdlib_root()
    _, held = data.split_files(data.list_files(root))
    texts = [t for t in data.iter_texts(root, held)]
    bos = tok.token_to_id(tok_mod.BOS)
    prompts = []
    for i in range(n):
        ids = tok.encode(texts[i % len(texts)], add_special_tokens=False).ids
        off = (i // len(texts)) * prompt_tokens
        prompts.append([bos] + ids[off:off + prompt_tokens])
    return prompts


def project_eval(model, tok, seq_len: int, max_windows: int) -> dict:
    from mtpserve.train import corpus
    depth = model.num_mtp_layers
    _, held = corpus.train_and_heldout()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for split, projects in (("heldout", held), ("unseen", corpus.build(corpus.UNSEEN_PROJECTS))):
            for project, docs in projects.items():
                path = Path(tmp) / f"{project}.bin"
                n_tok = data.tokenize_texts_to_file(tok, [d.text for d in docs], path)
                windows = data.eval_windows(data.load_tokens(path, tok.get_vocab_size()), seq_len + depth + 1,
                                            max_windows)
                res = {"split": split, "files": len(docs), "tokens": n_tok, "windows": len(windows),
                       **loss.evaluate(model, windows, depth)}
                for k, v in enumerate(heldout_agreement(model, windows, depth)):
                    res[f"agree_with_main_upto_depth{k + 1}"] = v
                out[project] = res
                print(project, json.dumps(res), flush=True)
    return out


def main(argv=None) -> dict:
    from mtpserve.model.loader import load_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--corpus", choices=["stdlib", "projects"], default="stdlib")
    ap.add_argument("--windows", type=int, default=24, help="(projects) windows per project")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.ckpt, dtype=torch.bfloat16)
    model = model.float().eval()                     # bf16 weights, float32 arithmetic
    depth = model.num_mtp_layers
    tok = tok_mod.load_tokenizer(args.ckpt)
    if args.corpus == "projects":
        res = project_eval(model, tok, args.seq_len, args.windows)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        return res
    root = data.stdlib_root()
    _, held = data.split_files(data.list_files(root))
    with tempfile.TemporaryDirectory() as tmp:
        n_tok = data.tokenize_to_file(tok, root, held, Path(tmp) / "heldout.bin")
        tokens = data.load_tokens(Path(tmp) / "heldout.bin", tok.get_vocab_size())
        windows = data.eval_windows(tokens, args.seq_len + depth + 1, 100_000)
        res = {"heldout_files": len(held), "heldout_tokens": n_tok, "windows": len(windows),
               "seq_len": args.seq_len, **loss.evaluate(model, windows, depth)}
    for k, v in enumerate(heldout_agreement(model, windows, depth)):
        res[f"agree_with_main_upto_depth{k + 1}"] = v
    accepted = []
    for prompt in heldout_prompts(tok, args.prompts, args.prompt_tokens):
        seq = greedy_continue(model, prompt, args.new_tokens)
        accepted += greedy_acceptance(model, seq, len(prompt), depth)
    for k in range(depth):
        res[f"greedy_accept_upto_depth{k + 1}"] = sum(r[k] for r in accepted) / len(accepted)
    res["greedy_positions"] = len(accepted)
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
