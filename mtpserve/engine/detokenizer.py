"""Incremental detokenization: only the newest tokens are decoded each step, with a few tokens of
left context so that multi-byte characters and leading spaces come out right."""
from mtpserve.request import Request

CONTEXT_TOKENS = 5


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
