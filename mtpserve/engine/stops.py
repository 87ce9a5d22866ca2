"""When a request stops. EOS, stop token ids and max_tokens are checked as a step's tokens are taken (the next
schedule needs them); stop strings as the tokens are detokenised, which with overlap happens while the next step
runs. Both go token by token, so a stop ends the request at the token that completes it."""
from mtpserve.engine.detokenizer import detokenize_incrementally
from mtpserve.request import Request


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
