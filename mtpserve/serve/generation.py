"""From a parsed OpenAI request to engine requests, and from engine outputs to OpenAI responses/chunks."""
import asyncio
from contextlib import aclosing
import json
import logging
import re
import time

from mtpserve.engine.async_engine import EngineDeadError, EngineError, QueueFullError
from mtpserve.sampling_params import SamplingParams
from mtpserve.serve import protocol, responses, tools
from mtpserve.serve.protocol import APIError

logger = logging.getLogger(__name__)

_FIELD_NAMES = sorted(list(protocol.SAMPLING_FIELDS) + ["stop", "prompt_token_ids", "prompt"], key=len,
                      reverse=True)


def guess_param(message: str, default: str | None = None) -> str | None:
    """The request field an engine/SamplingParams error message names ('temperature = -1: ...'): the one it
    starts with, else the longest it mentions."""
    first = re.match(r"\w+", message)
    if first and first.group(0) in _FIELD_NAMES:
        return "prompt" if first.group(0) == "prompt_token_ids" else first.group(0)
    for name in _FIELD_NAMES:
        if re.search(rf"\b{name}\b", message):
            return "prompt" if name == "prompt_token_ids" else name
    return default


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_request(raw: bytes, chat: bool, tool_parser: str | None = None) -> protocol.GenerationRequest:
    """The checked request; chat: its tools (tools.py), whose named / required choice becomes its grammar."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError("malformed JSON body: nested too deeply")
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON body: {e}")
    if not chat:
        return protocol.parse_completion_request(body)
    req = protocol.parse_chat_request(body)
    req.tools = tools.parse_tools(body, tool_parser)
    forced = req.tools and tools.constraint(req.tools)
    if forced:
        if req.structured_field is not None:
            raise APIError(f"'{req.structured_field}' and 'tool_choice' both constrain the output: give one",
                           param="tool_choice")
        req.sampling["structured_outputs"], req.structured_field = forced, "tools"
    if req.tools and req.tools.choice == "auto":   # (the parser reads the model's special tokens)
        req.sampling.setdefault("skip_special_tokens", False)
    return req


def encode(tokenizer, text: str, max_model_len: int, field: str, **kwargs) -> list[int]:
    """The token ids of text. A text far longer than any prompt that fits is tokenised from its start only
    first: if that part alone is too long, its ids (enough to refuse the prompt) are returned."""
    try:
        cut = 16 * max_model_len
        if len(text) > cut:
            ids = tokenizer.encode(text[:cut], **kwargs)
            if len(ids) >= max_model_len:
                return ids
        return tokenizer.encode(text, **kwargs)
    except Exception as e:   # a string the tokenizer cannot take
        raise APIError(f"'{field}' could not be tokenised ({type(e).__name__})", param=field)


def engine_failure(e: Exception, request_id: str) -> APIError:
    """A request the engine failed: a server fault, logged in full; the client gets no internal text."""
    logger.error("request %s failed in the engine: %s", request_id, e)
    return APIError(f"the engine failed while running this request (request id {request_id}; details in the "
                    "server log)", status=500, type="internal_server_error", code="engine_error")


def prepare_prompts(req: protocol.GenerationRequest, tokenizer, max_model_len: int, chat: bool) -> list:
    """[(prompt text or None, prompt token ids)]; checks each prompt against max_model_len."""
    if chat:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; use /v1/completions", param="messages")
        try:
            shown = None if req.tools is None else [{"type": "function", "function": f} for f in req.tools.tools]
            text = tokenizer.apply_chat_template(req.messages, tokenize=False, tools=shown,
                                                 add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=req.continue_final_message,
                                                 chat_template=req.chat_template, **req.chat_template_kwargs)
        except Exception as e:
            raise APIError(f"'messages' could not be rendered by the chat template: {e}", param="messages")
        prompts = [(text, encode(tokenizer, text, max_model_len, "messages",
                                 add_special_tokens=bool(req.add_special_tokens)))]
    else:
        prompts = []
        special = True if req.add_special_tokens is None else req.add_special_tokens
        for p in req.prompts:
            if isinstance(p, str):
                if tokenizer is None:
                    raise APIError("this model has no tokenizer: send 'prompt' as token ids", param="prompt")
                prompts.append((p, encode(tokenizer, p, max_model_len, "prompt", add_special_tokens=special)))
            else:
                prompts.append((None, list(p)))
    keep = req.sampling.get("truncate_prompt_tokens")
    if keep is not None:   # (the prompt's text no longer matches its ids: echo decodes them)
        prompts = [(text if len(ids) <= keep else None, ids[-keep:]) for text, ids in prompts]
    field = "messages" if chat else "prompt"
    for _, ids in prompts:
        if len(ids) >= max_model_len:
            raise APIError(f"'{field}' has {len(ids)} tokens; this model's maximum context length is "
                           f"{max_model_len} tokens (prompt + completion)", param=field)
    return prompts


def make_params(req: protocol.GenerationRequest, num_prompt_tokens: int, max_model_len: int,
                chat: bool) -> SamplingParams:
    kwargs = dict(req.sampling)
    if req.echo and kwargs.get("logprobs") is not None:   # the echoed prompt's logprobs too
        kwargs.setdefault("prompt_logprobs", kwargs["logprobs"])
    room = max_model_len - num_prompt_tokens
    max_tokens = kwargs.get("max_tokens")
    if max_tokens is None:   # OpenAI's defaults: 16 for completions, the rest of the context for chat
        kwargs["max_tokens"] = room if chat else min(16, room)
    elif max_tokens > room and max_tokens >= 1:
        raise APIError(f"'max_tokens' = {max_tokens} is too large: the prompt has {num_prompt_tokens} tokens "
                       f"and this model's maximum context length is {max_model_len}", param="max_tokens")
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param=req.structured_field if str(e).startswith("structured_outputs")
                       else guess_param(str(e)))


async def start_requests(async_engine, request_id: str, prompts: list, params: list, add=None) -> list:
    """Adds one engine request per prompt (add: how, see AsyncEngine.add_request); on any failure aborts those
    already added."""
    streams = []
    try:
        for i, ((text, ids), p) in enumerate(zip(prompts, params)):
            streams.append(await async_engine.add_request(f"{request_id}-{i}", text, ids, p, add))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, ValueError):
            raise APIError(str(e), param=guess_param(str(e), "prompt"))
        if isinstance(e, QueueFullError):
            raise APIError(str(e), status=503, type="service_unavailable_error", code="queue_full",
                           headers={"Retry-After": "1"})
        if isinstance(e, EngineDeadError):   # nothing will serve this request: the client should go elsewhere
            raise APIError(str(e), status=503, type="service_unavailable_error", code="engine_dead")
        if isinstance(e, EngineError):
            raise engine_failure(e, request_id)
        raise
    return streams


async def merge(streams):
    """(stream index, output) from several RequestStreams as they come."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()   # raises EngineError
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()


def _finished_usage(finals: dict, req: protocol.GenerationRequest) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals.values())
    completion = 0 if req.echo_only else sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
    return responses.usage(prompt, completion, sum(o.num_cached_tokens for o in finals.values()))


async def collect(streams, req: protocol.GenerationRequest, request_id: str, model: str, chat: bool,
                  tokenizer=None) -> dict:
    finals = {}
    try:
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                finals[i] = out
    except (EngineError, EngineDeadError) as e:
        raise engine_failure(e, request_id)
    n = req.sampling.get("n", 1)
    view = responses.ChoiceView(req, chat, tokenizer)
    choices = []
    for i in sorted(finals):
        for c in finals[i].outputs:
            ids = c.token_ids if req.return_token_ids else None
            if chat:
                content, calls, finish = view.message(finals[i], c)
                choices.append(responses.chat_choice(i * n + c.index, content, finish, ids,
                                                     view.logprobs(finals[i], c), calls))
            else:
                choices.append(responses.completion_choice(i * n + c.index, view.text(finals[i], c),
                                                           c.finish_reason, ids, view.logprobs(finals[i], c)))
    choices.sort(key=lambda c: c["index"])
    return responses.completion_response(request_id, model, choices, _finished_usage(finals, req), chat)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sendable(text: str, finished: bool, holdback: int) -> str:
    """Text safe to stream: while a choice runs, keep back what a stop string may still cut off, and a
    trailing replacement character (an incomplete UTF-8 sequence)."""
    if finished:
        return text
    text = text[:max(len(text) - holdback, 0)]
    return text.rstrip("\ufffd")


class _ChoiceState:
    """What has been streamed of each choice so far."""

    def __init__(self, req, request_id, model, chat, created, tokenizer):
        self.req, self.request_id, self.model, self.chat, self.created = req, request_id, model, chat, created
        self.view = responses.ChoiceView(req, chat, tokenizer)
        self.holdback = max((len(s) for s in req.sampling.get("stop") or []), default=1) - 1
        self.sent_chars, self.sent_ids, self.sent_tokens, self.done = {}, {}, {}, set()
        self.sent_offset = {}   # completions logprobs: the text_offset of the next token sent
        self.calls = {}         # chat with tools: what each choice has streamed of its calls

    def chunks(self, idx: int, out, c, usage: dict | None = None) -> list[str]:
        """The chunk this output adds to choice idx (none, or one); usage: the usage so far, to carry."""
        if idx in self.done:
            return []
        finished = c.finish_reason is not None
        text = _sendable(self.view.text(out, c), finished, self.holdback)
        calls, finish = [], c.finish_reason
        if self.view.holds_text:   # the content and the calls as they grow (tools.CallStream)
            stream = self.calls.setdefault(idx, tools.CallStream(self.req.tools))
            delta, calls = stream.update(text, finished)
            finish = "tool_calls" if stream.ids and finish == "stop" else finish
        else:
            delta = text[self.sent_chars.get(idx, 0):]
            self.sent_chars[idx] = max(self.sent_chars.get(idx, 0), len(text))
        ids = None
        if self.req.return_token_ids:
            ids = c.token_ids[self.sent_ids.get(idx, 0):]
            self.sent_ids[idx] = len(c.token_ids)
        logprobs, sent = None, self.sent_tokens.get(idx, 0)
        _, entries = self.view.tokens(out, c)
        if entries is not None and len(entries) > sent:
            logprobs = self.view.logprobs(out, c, sent, self.sent_offset.get(idx, 0))
            self.sent_tokens[idx] = len(entries)
            if not self.chat:
                self.sent_offset[idx] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        if finished:
            self.done.add(idx)
        if not (delta or finished or ids or logprobs or calls):
            return []
        chunk = responses.stream_chunk(self.request_id, self.model, self.created, self.chat, idx, delta,
                                       finish if finished else None, token_ids=ids, logprobs=logprobs,
                                       tool_calls=calls)
        return [_sse(chunk if usage is None else chunk | {"usage": usage})]

    def usage(self, outs: dict) -> dict:
        return _finished_usage(outs, self.req)


async def stream_sse(streams, req: protocol.GenerationRequest, request_id: str, model: str, chat: bool,
                     tokenizer=None):
    """SSE lines in OpenAI's chunk format, ending with `data: [DONE]`. continuous_usage_stats: each chunk
    carries the usage so far."""
    created = int(time.time())
    n = req.sampling.get("n", 1)
    state = _ChoiceState(req, request_id, model, chat, created, tokenizer)
    finals, latest = {}, {}
    if chat:
        for idx in range(len(streams) * n):
            yield _sse(responses.stream_chunk(request_id, model, created, chat, idx, None, role=True))
    try:
        async with aclosing(merge(streams)) as outputs:
            async for i, out in outputs:
                latest[i] = out
                for c in out.outputs:
                    usage = state.usage(latest) if req.continuous_usage_stats else None
                    for line in state.chunks(i * n + c.index, out, c, usage):
                        yield line
                if out.finished:
                    finals[i] = out
    except (EngineError, EngineDeadError) as e:
        yield _sse(protocol.error_body(engine_failure(e, request_id)))
    finally:
        for s in streams:
            s.abort()
    if req.include_usage and len(finals) == len(streams):
        yield _sse(responses.usage_chunk(request_id, model, created, chat, state.usage(finals)))
    yield "data: [DONE]\n\n"
