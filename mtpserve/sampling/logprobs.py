"""Logprobs of the tokens a step emits and of the prompt tokens it computes, for the requests that ask.

They are the target model's raw log-softmax (vLLM's default, logprobs_mode "raw_logprobs": before temperature,
processors and top-k/top-p), read at the positions whose token was emitted. Request "a" at 5, pending t5,
drafts [d6, d7], d6 accepted, e7 emitted: rows 5 and 6 of its query give the logprobs of d6 and e7, the very
rows a step without speculation would have computed one at a time. An entry is
[(token, logprob, rank), (top-1 token, logprob, 1), ...]: the scored token first, then the top N.
"""
import torch


def read(model, scheduled, hidden: torch.Tensor, offsets: list[int], new_tokens: list[list[int]]) -> list[dict]:
    """Per request, the logprobs it asks for from this step: {"logprobs": an entry per new token} for one that
    sampled, {"prompt_logprobs": entries, "prompt_logprobs_start": the prompt index of the first} for one whose
    prompt tokens this step's chunk predicts (StepResult's fields)."""
    rows, targets, owners = [], [], []   # owners: (request index, "logprobs" or "prompt_logprobs")
    for i, s in enumerate(scheduled):
        p, req = s.req.params, s.req
        if p.logprobs is not None and s.samples and new_tokens[i]:
            first = offsets[i] + s.num_query_tokens - len(s.draft_token_ids) - 1
            for j, token in enumerate(new_tokens[i]):
                rows.append(first + j)
                targets.append(token)
                owners.append((i, "logprobs"))
        if p.prompt_logprobs is not None:
            prompt = req.prompt_token_ids
            for pos in range(s.start, min(s.start + s.num_new_tokens, len(prompt) - 1)):   # predicts pos + 1
                rows.append(offsets[i] + pos - s.start)
                targets.append(prompt[pos + 1])
                owners.append((i, "prompt_logprobs"))
    found = [{} for _ in scheduled]
    if not rows:
        return found
    logprobs = model.compute_logits(hidden[rows]).float().log_softmax(-1)
    top_n = max(_wanted(scheduled[i].req.params, kind) for i, kind in owners)
    entries = table(logprobs, torch.tensor(targets, device=logprobs.device), top_n)
    for (i, kind), entry in zip(owners, entries):
        found[i].setdefault(kind, []).append(entry[:1 + _wanted(scheduled[i].req.params, kind)])
        if kind == "prompt_logprobs":
            found[i].setdefault("prompt_logprobs_start", scheduled[i].start + 1)
    return found


def _wanted(params, kind: str) -> int:
    return params.logprobs if kind == "logprobs" else params.prompt_logprobs


def table(logprobs: torch.Tensor, targets: torch.Tensor, top_n: int) -> list[list[tuple]]:
    """logprobs [M, V] (log-softmax), targets [M] -> per row [(target, logprob, rank), (top ids...)], rank =
    1 + the tokens strictly more likely. One host transfer."""
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks = (logprobs > chosen).sum(-1) + 1
    top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (chosen[:, :0], targets.unsqueeze(1)[:, :0])
    out = []
    for t, lp, rank, ids, values in zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                        top_values.tolist()):
        out.append([(t, lp, rank)] + [(tid, v, n + 1) for n, (tid, v) in enumerate(zip(ids, values))])
    return out
