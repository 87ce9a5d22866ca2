"""From a step's results to what callers get: logprobs taken into the request, RequestOutputs built."""
from mtpserve.request import CompletionOutput, Logprob, Request, RequestOutput


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
