"""The engine's greedy MTP acceptance, per project, on code the model never trained on (model card).

python -m mtpserve.train.acceptance [--model DIR] [--corpus projects|stdlib] [--num-prompts 24]
    [--prompt-tokens 64] [--max-tokens 128] [--json FILE]

``projects``: every held-out project and every unseen project of train/corpus.py, one row per project
and k in 1..3 (greedy, temperature 0). ``stdlib``: the held-out standard-library files, and also
temperature-1 rows. Prompts are ``<|bos|>`` + ``prompt_tokens`` tokens of a file, starting at a line
picked deterministically inside it (not always the licence header at the top), or at its top
(``--prompt-from start``).
"""
import argparse
import hashlib
import json

import torch

from mtpserve import LLM, SamplingParams, default_model_path
from mtpserve.train import corpus
from mtpserve.train.evaluate import heldout_prompts
from mtpserve.train.tokenizer import BOS, load_tokenizer


def measure(model: str, prompts: list[list[int]], max_tokens: int, cases) -> list[dict]:
    rows = []
    for k, temperature, drafts in cases:
        llm = LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": k, "draft_sampling": drafts,
                                          "adaptive": False}, enforce_eager=True)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        m = llm.get_metrics()
        per_pos = [a / m["num_drafts"] for a in m["accepted_per_position"]]
        rows.append(dict(k=k, temperature=temperature, draft_sampling=drafts, acceptance_rate=m["acceptance_rate"],
                         mean_acceptance_length=m["mean_acceptance_length"], per_position=per_pos))
    return rows


def project_prompts(tok, docs: list[corpus.Document], n: int, prompt_tokens: int,
                    inside: bool = True) -> list[list[int]]:
    """n prompts from the project's files (largest first, cycling), each from a line start inside the file
    (inside=False: from the file's first line)."""
    docs = sorted(docs, key=lambda d: (-len(d.text), d.path))
    bos = tok.token_to_id(BOS)
    prompts = []
    for i in range(n):
        doc = docs[i % len(docs)]
        lines = doc.text.splitlines(keepends=True)
        h = int(hashlib.sha1(f"{doc.path}/{i}".encode()).hexdigest(), 16)
        start = h % max(1, len(lines) * 3 // 4) if inside else 0
        ids = tok.encode("".join(lines[start:]), add_special_tokens=False).ids
        prompts.append([bos] + ids[:prompt_tokens])
    return prompts


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--corpus", choices=["projects", "stdlib"], default="projects")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-from", choices=["inside", "start"], default="inside",
                   help="(projects) prompts from a line inside each file, or from its first line")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()
    tok = load_tokenizer(model)
    if args.corpus == "stdlib":
        cases = [(k, 0.0, "probabilistic") for k in (1, 2, 3)]
        cases += [(k, 1.0, drafts) for k in (1, 2) for drafts in ("probabilistic", "greedy")]
        rows = measure(model, heldout_prompts(tok, args.num_prompts, args.prompt_tokens), args.max_tokens, cases)
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        _, held = corpus.train_and_heldout()
        unseen = corpus.build(corpus.UNSEEN_PROJECTS)
        rows = []
        for kind, projects in (("heldout", held), ("unseen", unseen)):
            for project, docs in projects.items():
                prompts = project_prompts(tok, docs, args.num_prompts, args.prompt_tokens, args.prompt_from == "inside")
                for r in measure(model, prompts, args.max_tokens, [(k, 0.0, "probabilistic") for k in (1, 2, 3)]):
                    rows.append({"project": project, "split": kind, **r})
                    print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
