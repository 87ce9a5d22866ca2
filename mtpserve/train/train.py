"""`mtpserve train`: train a DeepSeek-V3-architecture model with D sequential MTP modules.

    python -m mtpserve.train.train --out DIR [--steps N] [--max-minutes M] [--threads 1] ...

Loss ``L = L_main + lambda / D * sum_k L_mtp_k`` (see loss.py). AdamW, linear warmup, cosine decay to
10% of the peak; the schedule follows progress = max(step / steps, elapsed / max_minutes), so a run
cut short by its time budget still ends annealed. Writes to ``--run-dir`` the token caches,
``metrics.csv`` (step, losses, held-out eval), ``curve.png`` and ``final_eval.json``; writes the
checkpoint (HF DeepSeek-V3 format, bf16 safetensors) and the tokenizer files to ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
from pathlib import Path

import torch

from mtpserve.train import data, loss as loss_mod, model_setup, plot
from mtpserve.train import tokenizer as tok_mod


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, help="checkpoint directory to write (config, weights, tokenizer)")
    g.add_argument("--run-dir", default=None, help="logs/caches (default: runs/train-<basename of --out>)")
    g = p.add_argument_group("data")
    g.add_argument("--corpus", choices=["stdlib", "projects"], default="stdlib",
                   help="stdlib: this Python's standard library, split by file; projects: many projects' "
                        "source, split by project (train/corpus.py; pip install -e '.[train]')")
    g.add_argument("--corpus-root", default=None, help="directory of .py files (default: this Python's stdlib)")
    g.add_argument("--max-files", type=int, default=None, help="use only the first N train files (tests)")
    g.add_argument("--tokenizer", default=None, help="directory with tokenizer.json to reuse (default: train one)")
    g.add_argument("--vocab-size", type=int, default=4096)
    g = p.add_argument_group("model")
    g.add_argument("--init", default=None, help="start from this checkpoint directory (needed by --freeze-main)")
    g.add_argument("--grow-layers", type=int, default=0,
                   help="depth up-scale the --init model to this many main layers (train/grow.py)")
    g.add_argument("--grow-first-dense", type=int, default=2, help="first_k_dense_replace of the grown model")
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--intermediate-size", type=int, default=768)
    g.add_argument("--kv-lora-rank", type=int, default=64)
    g.add_argument("--q-lora-rank", type=int, default=0, help="0: no query compression")
    g.add_argument("--qk-nope-head-dim", type=int, default=32)
    g.add_argument("--qk-rope-head-dim", type=int, default=16)
    g.add_argument("--v-head-dim", type=int, default=32)
    g.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (0: dense model)")
    g.add_argument("--experts-per-tok", type=int, default=2)
    g.add_argument("--moe-intermediate-size", type=int, default=256)
    g.add_argument("--first-dense", type=int, default=2, help="first_k_dense_replace")
    g.add_argument("--n-group", type=int, default=1, help="expert groups (group-limited routing when > 1)")
    g.add_argument("--topk-group", type=int, default=1, help="groups a token's experts may come from")
    g.add_argument("--mtp-depth", type=int, default=2, help="D, the number of MTP modules")
    g.add_argument("--max-position-embeddings", type=int, default=2048)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=2000)
    g.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget for the training loop")
    g.add_argument("--seq-len", type=int, default=256, help="T: positions scored per depth")
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--mtp-lambda", type=float, default=0.3)
    g.add_argument("--bias-update-speed", type=float, default=1e-3,
                   help="aux-loss-free MoE balancing: gamma for e_score_correction_bias")
    g.add_argument("--freeze-main", action="store_true", help="train only the MTP modules (needs --init)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="torch (and tokenizer) CPU threads")
    g = p.add_argument_group("logging")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--save-every-minutes", type=float, default=None,
                   help="also write the checkpoint to --out this often (a long run leaves a usable model)")
    g.add_argument("--eval-every", type=int, default=200)
    g.add_argument("--eval-windows", type=int, default=64, help="held-out windows per evaluation")
    g.add_argument("--final-eval-windows", type=int, default=1024,
                   help="held-out windows (evenly spaced) for the final evaluation")
    return p


def lr_at(args, step: int, progress: float) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def train_row(step: int, t0: float, lr: float, o) -> dict:
    row = {"step": step, "elapsed_s": round(time.time() - t0, 1), "lr": f"{lr:.3e}",
           "loss": round(o.loss.item(), 4), "main_loss": round(o.main_loss, 4)}
    row.update({f"mtp{k + 1}_loss": round(v, 4) for k, v in enumerate(o.mtp_losses)})
    return row


def prepare_data(args, run_dir: Path):
    """Tokenizer (trained or loaded) and the train / held-out token streams."""
    tok_dir = args.tokenizer or args.init
    if args.corpus == "projects":
        from mtpserve.train import corpus
        if not tok_dir:
            raise SystemExit("--corpus projects keeps an existing tokenizer: pass --tokenizer or --init")
        train_docs, held_by_project = corpus.train_and_heldout()
        train_texts = [d.text for d in train_docs]
        held_texts = [d.text for p in corpus.HELDOUT_PROJECTS for d in held_by_project[p]]
        source = {"corpus": "projects", "train_projects": corpus.TRAIN_PROJECTS,
                  "heldout_projects": corpus.summary(held_by_project)}
    else:
        root = Path(args.corpus_root) if args.corpus_root else data.stdlib_root()
        train_files, held_files = data.split_files(data.list_files(root))
        if args.max_files:
            train_files = train_files[:args.max_files]
        if not held_files:  # tiny corpora (tests): hold out the last train file
            train_files, held_files = train_files[:-1], train_files[-1:]
        train_texts = list(data.iter_texts(root, train_files))
        held_texts = list(data.iter_texts(root, held_files))
        source = {"corpus_root": str(root)}
    tok = tok_mod.load_tokenizer(tok_dir) if tok_dir else tok_mod.train_tokenizer(train_texts, args.vocab_size)
    train_bin, held_bin = run_dir / "train.bin", run_dir / "heldout.bin"
    n_train = data.tokenize_texts_to_file(tok, train_texts, train_bin)
    n_held = data.tokenize_texts_to_file(tok, held_texts, held_bin)
    vocab = tok.get_vocab_size()
    info = {**source, "train_files": len(train_texts), "heldout_files": len(held_texts),
            "train_tokens": n_train, "heldout_tokens": n_held, "vocab_size": vocab}
    return tok, data.load_tokens(train_bin, vocab), data.load_tokens(held_bin, vocab), info


def run_train(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    if args.freeze_main and not args.init:
        raise SystemExit("--freeze-main needs --init DIR (the checkpoint whose main model is kept)")
    if args.grow_layers and not args.init:
        raise SystemExit("--grow-layers needs --init DIR (the checkpoint to grow)")
    torch.manual_seed(args.seed)
    out = Path(args.out)
    run_dir = Path(args.run_dir or Path("runs") / f"train-{out.name}")
    run_dir.mkdir(parents=True, exist_ok=True)
    tok, train_tokens, held_tokens, info = prepare_data(args, run_dir)
    model = model_setup.build_model(args, tok)
    depth = model.num_mtp_layers
    if depth < 1:
        raise SystemExit("the model has no MTP modules (--mtp-depth must be >= 1)")
    params = model_setup.trainable_params(model, args.freeze_main)
    opt = model_setup.make_optimizer(params, args)
    balancer = model_setup.ExpertBalancer(model, args.bias_update_speed)
    window = args.seq_len + depth + 1
    batches = data.Batches(train_tokens, args.seq_len, args.batch_size, depth + 1, seed=args.seed)
    eval_set = data.eval_windows(held_tokens, window, args.eval_windows)
    info.update(model_setup.param_counts(model))
    print(json.dumps(info), flush=True)
    (run_dir / "data_info.json").write_text(json.dumps(info, indent=2) + "\n")

    cols = (["step", "elapsed_s", "lr", "loss", "main_loss"] + [f"mtp{k}_loss" for k in range(1, depth + 1)]
            + ["eval_main_loss", "eval_main_acc"]
            + [f"eval_mtp{k}_{m}" for k in range(1, depth + 1) for m in ("loss", "acc")])
    csv_path = run_dir / "metrics.csv"
    f_csv = open(csv_path, "w", newline="")
    writer = csv.DictWriter(f_csv, fieldnames=cols)
    writer.writeheader()
    budget = args.max_minutes * 60 if args.max_minutes else None
    t0 = time.time()
    last_save = t0
    model.train()
    step = 0
    while step < args.steps:
        elapsed = time.time() - t0
        if budget is not None and elapsed >= budget:
            break
        progress = max(step / args.steps, elapsed / budget if budget else 0.0)
        lr = lr_at(args, step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = batches.next()
        balancer.reset()
        o = loss_mod.mtp_objective(model, ids, depth, args.mtp_lambda, freeze_main=args.freeze_main)
        opt.zero_grad(set_to_none=True)
        o.loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        balancer.update()
        step += 1
        row = None
        if step % args.log_every == 0 or step == 1 or step % args.eval_every == 0:
            row = train_row(step, t0, lr, o)
        if step % args.eval_every == 0:
            last_eval = loss_mod.evaluate(model, eval_set, depth)
            row.update({f"eval_{k}": round(v, 4) for k, v in last_eval.items()})
        if args.save_every_minutes and time.time() - last_save >= args.save_every_minutes * 60:
            model_setup.save(model, tok, out, args.max_position_embeddings)
            last_save = time.time()
            print(f"saved {out} at step {step}", flush=True)
        if row:
            writer.writerow(row)
            f_csv.flush()
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    train_seconds = time.time() - t0
    final = loss_mod.evaluate(model, data.eval_windows(held_tokens, window, args.final_eval_windows), depth)
    if step % args.eval_every != 0:  # end the curve with an eval point (same windows as the others)
        row = train_row(step, t0, lr, o)
        last = loss_mod.evaluate(model, eval_set, depth)
        row.update({f"eval_{k}": round(v, 4) for k, v in last.items()})
        writer.writerow(row)
    f_csv.close()
    plot.plot_curves(csv_path, run_dir / "curve.png",
                     title=f"{out.name}: {info['total_params'] / 1e6:.1f}M params, D={depth}, {step} steps")
    result = {"steps": step, "train_seconds": round(train_seconds, 1), "seed": args.seed,
              "heldout_windows": len(data.eval_windows(held_tokens, window, args.final_eval_windows)),
              "final_eval": final, **info}
    (run_dir / "final_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    torch.save(model.state_dict(), run_dir / "model_fp32.pt")   # fallback if the export below fails
    model_setup.save(model, tok, out, args.max_position_embeddings)
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="mtpserve train", description=__doc__.split("\n\n")[0])
    add_train_args(p)
    return run_train(p.parse_args(argv))


train_main = main

if __name__ == "__main__":
    main()
