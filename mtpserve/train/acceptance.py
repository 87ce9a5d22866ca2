"""The engine's MTP acceptance on held-out standard-library code (for the model card).

python -m mtpserve.train.acceptance [--model DIR] [--num-prompts 32] [--prompt-tokens 64] [--max-tokens 128]
"""
import argparse
import json

import torch

from mtpserve import LLM, SamplingParams, default_model_path
from mtpserve.train.evaluate import heldout_prompts
from mtpserve.train.tokenizer import load_tokenizer


def measure(model: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    rows = []
    cases = [(k, 0.0, "probabilistic") for k in (1, 2, 3)]
    cases += [(k, 1.0, drafts) for k in (1, 2) for drafts in ("probabilistic", "greedy")]
    for k, temperature, drafts in cases:
        llm = LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": k, "draft_sampling": drafts})
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        m = llm.get_metrics()
        per_pos = [a / m["num_drafts"] for a in m["accepted_per_position"]]
        rows.append(dict(k=k, temperature=temperature, draft_sampling=drafts, acceptance_rate=m["acceptance_rate"],
                         mean_acceptance_length=m["mean_acceptance_length"], per_position=per_pos))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    tok = load_tokenizer(model)
    return measure(model, heldout_prompts(tok, args.num_prompts, args.prompt_tokens), args.max_tokens)


if __name__ == "__main__":
    main()
