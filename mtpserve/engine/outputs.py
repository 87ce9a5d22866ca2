"""From a step's tokens to what callers get. When a request stops: EOS, stop token ids and max_tokens are checked
as a step's tokens are taken (the next schedule needs them); stop strings as the tokens are detokenised, which with
overlap happens while the next step runs. Both go token by token, so a stop ends the request at the token that
completes it. Detokenization is incremental: only the newest tokens are decoded each step, with a few tokens of
left context so that multi-byte characters and leading spaces come out right. Then logprobs are taken into the
request and RequestOutputs built."""
from mtpserve.request import CompletionOutput, Logprob, Request, RequestOutput

CONTEXT_TOKENS = 5   # (detokenize_incrementally) tokens of left context decoded with the newest ones


def take_tokens(req: Request, tokens: list[int], eos_token_ids: set[int]) -> tuple[int, str | None]:
    """Appends a step's tokens one at a time until EOS, a stop id or max_tokens. -> (how many it appended, the
    finish reason or None)."""
    p = req.params
    for n, t in enumerate(tokens, 1):
        req.output_token_ids.append(t)
        if not p.ignore_eos and t in eos_token_ids:
            return n, "stop"
        if t in p.stop_token_ids:
            req.stop_reason = t
            return n, "stop"
        if len(req.output_token_ids) >= req.max_tokens:
            return n, "length"
    return len(tokens), None


def detokenize_until_stop_string(tokenizer, req: Request, num_new: int) -> int | None:
    """Detokenises req's newest `num_new` tokens one at a time. When a stop string completes (and the token that
    completes it did not end the request already: EOS or a stop id), cuts req.text before it, sets stop_reason
    and returns how many output tokens to keep; else None."""
    if tokenizer is None:
        return None
    total = len(req.output_token_ids)
    stopped_by_id = req.finish_reason == "stop"   # (at its last token: EOS or a stop id, kept out of the text
    shown = total - (stopped_by_id and not req.params.include_stop_str_in_output)   # unless asked, as vLLM)
    for end in range(total - num_new + 1, shown + 1):
        new_text = detokenize_incrementally(tokenizer, req, end)
        if (new_text and req.params.stop and not (end == total and stopped_by_id)
                and _cut_at_stop_string(req, len(new_text))):
            return end
    return None


def _cut_at_stop_string(req: Request, new_len: int) -> bool:
    """True (req.text cut before it, stop_reason set) if a stop string ends in the newest `new_len` characters."""
    longest = max(len(s) for s in req.params.stop)
    search_from = max(0, len(req.text) - new_len - longest + 1)
    hits = [(req.text.find(s, search_from), s) for s in req.params.stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return False
    index, stop = min(hits)
    req.text, req.stop_reason = req.text[:index + (len(stop) if req.params.include_stop_str_in_output else 0)], stop
    return True


def detokenize_incrementally(tokenizer, req: Request, end: int | None = None) -> str:
    """Appends the text of req's output tokens up to `end` (default: all) to req.text; returns the new text."""
    if tokenizer is None:
        return ""
    ids = req.output_token_ids
    end = len(ids) if end is None else end
    options = dict(skip_special_tokens=req.params.skip_special_tokens)
    if not req.params.spaces_between_special_tokens:   # (a slow tokenizer's option; fast ones join without them)
        options["spaces_between_special_tokens"] = False
    prefix = tokenizer.decode(ids[req.detok_prefix_offset:req.detok_read_offset], **options)
    full = tokenizer.decode(ids[req.detok_prefix_offset:end], **options)
    if full.endswith("\ufffd") or len(full) <= len(prefix):
        return ""   # an incomplete UTF-8 sequence: wait for the next token
    new_text = full[len(prefix):]
    req.text += new_text
    req.detok_read_offset = end
    req.detok_prefix_offset = max(0, end - CONTEXT_TOKENS)
    return new_text


def logprob_dicts(entries: list, tokenizer) -> list[dict[int, Logprob]]:
    """[(token, logprob, rank), top...] rows (sampling/logprobs.py) -> vLLM's {token: Logprob} per row, the
    scored token first."""
    def text(t):
        return None if tokenizer is None else tokenizer.decode([t])
    return [{t: Logprob(lp, rank, text(t)) for t, lp, rank in entry} for entry in entries]


def take_prompt_logprobs(req: Request, result, tokenizer) -> None:
    """Appends the prompt logprobs a step computed that req does not hold yet (a resumed request recomputes
    its prompt). Entry e of the result is prompt token result.prompt_logprobs_start + e's."""
    if not result.prompt_logprobs:
        return
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)   # the first prompt token: nothing before it
    skip = len(req.prompt_logprobs) - result.prompt_logprobs_start
    if skip >= 0:
        req.prompt_logprobs += logprob_dicts(result.prompt_logprobs[skip:], tokenizer)


def request_output(parent_id: str, kids: list[Request]) -> RequestOutput:
    """The parent's output. best_of > n: nothing until every completion ends, then the n of highest cumulative
    logprob, best first."""
    params = kids[0].params
    finished = all(r.is_finished for r in kids)
    chosen = kids
    if len(kids) > params.n:
        chosen = sorted(kids, key=lambda r: -_cumulative(r))[:params.n] if finished else []
    outs = []
    for index, r in enumerate(chosen):
        shown = params.logprobs is not None and not params.hidden_logprobs
        outs.append(CompletionOutput(index, r.text, list(r.output_token_ids), r.finish_reason, r.stop_reason,
                                     list(r.logprobs) if shown else None, _cumulative(r) if shown else None))
    error = next((r.error for r in kids if r.error), None)
    return RequestOutput(parent_id, kids[0].prompt, kids[0].prompt_token_ids, outs, finished, kids[0].metrics, error,
                         num_cached_tokens=min(r.num_cached_tokens for r in kids),
                         prompt_logprobs=list(kids[0].prompt_logprobs) if params.prompt_logprobs is not None else None)


def _cumulative(req: Request) -> float:
    return sum(d[t].logprob for d, t in zip(req.logprobs, req.output_token_ids))
