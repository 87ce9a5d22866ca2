"""A/B of the eager few-row linear choice (model/layers.py, _by_columns): two engines on the shipped model in one
process, timed in turns. A: weight @ x.T for every 1-8 rows (the choice before 2026-12-04); B: the kernel this
CPU times faster. Prints tokens/s of each, B/A, and whether the greedy tokens are the same.

    python scripts/ab_linear_choice.py --dtype float32 --k 0 --batch 1
"""
import argparse
import statistics
import time

import torch

from mtpserve import LLM, SamplingParams
from mtpserve.model import layers

PROMPTS = ["def parse_header(line):", "class LRUCache:\n    def __init__(self, capacity):",
           "import json\n\ndef load(path):", "def merge_sorted(a, b):"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=0, help="MTP drafts (0: no speculation)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    timed = layers._by_columns
    print("timed choice (1 row, 2-8 rows by columns):", timed())
    choice = {"A": lambda: (True, True), "B": timed}
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "adaptive": False} if args.k else None
    engines = {name: LLM(None, dtype=args.dtype, speculative_config=spec, max_model_len=512) for name in choice}
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    speed, tokens = {"A": [], "B": []}, {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            layers._by_columns = choice[name]
            prompts = (PROMPTS * args.batch)[r % 4:r % 4 + args.batch]
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            speed[name].append(args.batch * 128 / (time.perf_counter() - start))
            tokens[name].append([o.outputs[0].token_ids for o in outs])
    a, b = statistics.median(speed["A"]), statistics.median(speed["B"])
    print(f"eager {args.dtype} k={args.k} batch {args.batch}: A {a:.0f} tok/s, B {b:.0f} tok/s, B/A {b / a:.2f}x, "
          f"same tokens: {tokens['A'] == tokens['B']}")


if __name__ == "__main__":
    main()
