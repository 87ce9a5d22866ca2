"""A/B of how linear weights are stored on the CPU (model/layers.py, by_columns): two engines on the shipped model
in one process, timed in turns. A: [out, in] weights stored row by row (as in the checkpoint); B: stored by
columns, as fuse_for_inference keeps them. Prints tokens/s of each, B/A, and whether the greedy tokens are the same.

    python scripts/ab_weight_layout.py --k 1 --batch 32 [--graph-mode] [--dtype float32]
"""
import argparse
import statistics
import time

import torch

from mtpserve import LLM, SamplingParams
from mtpserve.bench.common import make_prompts
from mtpserve.model import layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=0, help="MTP drafts, fixed (0: no speculation)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--graph-mode", action="store_true", help="graphs of the batch size compiled at start-up")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "adaptive": False} if args.k else None
    engines = {}
    for name, by_columns in (("A", False), ("B", True)):
        layers.BY_COLUMNS = by_columns   # read as the engine's model is fused for inference
        engines[name] = LLM(None, dtype=args.dtype, speculative_config=spec, enforce_eager=not args.graph_mode,
                            graph_batch_sizes=[args.batch], cpu_threads=1)
    prompts = make_prompts(args.batch, 32, 4096, engines["A"].get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    speed, tokens = {"A": [], "B": []}, {"A": [], "B": []}
    for r in range(args.rounds + 1):   # round 0 warms up, untimed
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            start = time.perf_counter()
            outs = engines[name].generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            if r:
                speed[name].append(args.batch * 128 / (time.perf_counter() - start))
            tokens[name].append([o.outputs[0].token_ids for o in outs])
    a, b = statistics.median(speed["A"]), statistics.median(speed["B"])
    mode = "graph" if args.graph_mode else "eager"
    print(f"{mode} {args.dtype} k={args.k} batch {args.batch}: A (rows) {a:.0f} tok/s, B (columns) {b:.0f} tok/s, "
          f"B/A {b / a:.3f}x, same tokens: {tokens['A'] == tokens['B']}")


if __name__ == "__main__":
    main()
