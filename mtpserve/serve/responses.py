"""OpenAI responses and stream chunks, as plain functions building JSON dicts, and what one choice shows."""
import time
import uuid

from mtpserve.serve import tools


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(index: int, text: str, finish_reason, token_ids=None, logprobs=None) -> dict:
    c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = list(token_ids)
    return c


def chat_choice(index: int, text: str | None, finish_reason, token_ids=None, logprobs=None,
                tool_calls: list | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    c = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = list(token_ids)
    return c


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)   # (JSON has no -inf; vLLM's convention)


def completion_logprobs(token_ids: list[int], entries: list, token_text, offset: int = 0) -> dict:
    """OpenAI's completions logprobs: entries[i] is {token: Logprob} for token_ids[i], or None (the first
    prompt token). offset: text_offset of the first token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, entry in zip(token_ids, entries):
        text = token_text(t, None if entry is None else entry[t])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if entry is None else _finite(entry[t].logprob))
        top = None
        if entry is not None:   # (tokens with one text, e.g. partial UTF-8 bytes: the scored one's, then the likeliest)
            top = {}
            for i, lp in entry.items():
                top.setdefault(token_text(i, lp), _finite(lp.logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(token_ids: list[int], entries: list, token_text, top_n: int) -> dict:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the top_n most likely."""
    def item(t, lp):
        text = token_text(t, lp)
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode("utf-8"))}
    content = []
    for t, entry in zip(token_ids, entries):
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top_n]
        content.append(item(t, entry[t]) | {"top_logprobs": [item(i, lp) for i, lp in top]})
    return {"content": content, "refusal": None}


def completion_response(rid: str, model: str, choices: list, use: dict, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use}


def stream_chunk(rid: str, model: str, created: int, chat: bool, index: int, text: str | None,
                 finish_reason=None, role: bool = False, token_ids=None, logprobs=None, tool_calls=None) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        if tool_calls:   # (tools.CallStream's deltas, each with its call's index)
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": use}


class ChoiceView:
    """What one choice shows of an engine output: with echo the prompt first, with echo_only nothing
    generated; its logprobs in the endpoint's format, from the `start`-th token shown."""

    def __init__(self, req, chat: bool, tokenizer):
        self.req, self.chat, self.tokenizer = req, chat, tokenizer
        self.top_n = req.sampling.get("logprobs")

    def token_text(self, t: int, lp=None) -> str:
        """Token t's text in logprobs: its Logprob's decoded_token (the engine's) when it has one."""
        if self.req.tokens_as_ids or self.tokenizer is None:
            return f"token_id:{t}"
        return lp.decoded_token if lp is not None and lp.decoded_token is not None else self.tokenizer.decode([t])

    def prompt_text(self, out) -> str:
        if out.prompt is not None:
            return out.prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(out.prompt_token_ids)

    @property
    def holds_text(self) -> bool:
        """Tool calls may be in the text: it is read for them (tools.py)."""
        return self.req.tools is not None and self.req.tools.choice != "none"

    def message(self, out, c) -> tuple[str | None, list, str | None]:
        """Chat: (content, tool calls, finish reason); a text that does not parse as calls stays content."""
        text = self.text(out, c)
        if not self.holds_text or c.finish_reason not in ("stop", "length"):
            return text, [], c.finish_reason
        try:
            content, calls = tools.tool_calls(self.req.tools, text)
        except (ValueError, KeyError, TypeError):   # (cut by max_tokens mid-call)
            return text, [], c.finish_reason
        return content, calls, "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason

    def text(self, out, c) -> str:
        generated = "" if self.req.echo_only else c.text
        return self.prompt_text(out) + generated if self.req.echo else generated

    def tokens(self, out, c) -> tuple[list[int], list | None]:
        ids = [] if self.req.echo_only else list(c.token_ids)
        entries = None if c.logprobs is None else ([] if self.req.echo_only else c.logprobs)
        if self.req.echo:
            ids = list(out.prompt_token_ids) + ids
            entries = None if entries is None else list(out.prompt_logprobs or []) + entries
        return ids, entries

    def logprobs(self, out, c, start: int = 0, offset: int = 0) -> dict | None:
        ids, entries = self.tokens(out, c)
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(ids[start:], entries[start:], self.token_text, self.top_n)
        return completion_logprobs(ids[start:], entries[start:], self.token_text, offset)
