"""OpenAI request parsing, as plain functions over JSON dicts (responses: responses.py).

Parsing never trusts the body: each field is type-checked here, and ranges are checked here (the limits
below) and by SamplingParams.validate() and the engine (top_k and token ids against the vocabulary); any
problem raises APIError naming the field and the limit (HTTP 400 in OpenAI's error format). Every field of
vLLM's request models is honoured or refused (fields.py: SAMPLING_FIELDS, OTHER_FIELDS, UNSUPPORTED_UNLESS);
a field in none of them is refused too, never accepted and ignored.
"""
import math
from dataclasses import dataclass, field

from mtpserve.sampling_params import MAX_LOGPROBS
from mtpserve.serve.errors import APIError, error_body  # noqa: F401 (the names callers use)
from mtpserve.serve.fields import (OTHER_FIELDS, SAMPLING_FIELDS, UNSUPPORTED_UNLESS,  # noqa: F401
                                   parse_structured, structured_field)


# Limits (OpenAI's where it documents one).
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEQUENCES_PER_REQUEST = 256   # prompts x n


def check_text(name: str, text: str) -> str:
    """A string that can be encoded (JSON admits lone surrogates, which no tokenizer or UTF-8 output takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"'{name}' is not valid Unicode (it holds a lone surrogate)", param=name.split("[")[0])
    return text


def _check_type(name: str, value, types):
    if isinstance(value, bool) and types is not bool:
        raise APIError(f"'{name}' must be a number, got {value!r}", param=name)
    if not isinstance(value, types):
        expected = {bool: "a boolean", int: "an integer", list: "a list", dict: "an object"}.get(types, "a number")
        raise APIError(f"'{name}' must be {expected}, got {value!r}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(f"'{name}' must be finite, got {value!r}", param=name)


@dataclass
class GenerationRequest:
    """What a /v1/completions or /v1/chat/completions body asks for, checked."""
    model: str | None
    sampling: dict                      # SamplingParams keyword arguments (only the fields given)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False      # extension (as vLLM's): token ids in each choice
    kv_transfer_params: dict | None = None   # disaggregated prefill/decode (vLLM's field; mtpserve/disagg/)
    prompts: list = field(default_factory=list)   # completions: each a str or a list of token ids
    messages: list = field(default_factory=list)  # chat: [{"role", "content": str}]
    echo: bool = False                  # completions: the prompt before the completion (with its logprobs)
    echo_only: bool = False             # echo with max_tokens 0: score the prompt, generate nothing
    continuous_usage_stats: bool = False   # streaming: usage in every chunk
    tokens_as_ids: bool = False         # return_tokens_as_token_ids: logprob tokens as "token_id:N"
    add_special_tokens: bool | None = None   # None: completions True, chat False
    chat_template: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    structured_field: str | None = None    # the field that asked for a structured output
    tools: object = None                   # chat: a ToolRequest (tools.py)


def parse_sampling(body: dict, chat: bool) -> dict:
    out = {}
    for name, (target, types) in SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is not None:
            _check_type(name, value, types)
            out[target] = value
    if "seed" in out and not -2**63 <= out["seed"] < 2**63:
        raise APIError("'seed' must be in [-2^63, 2^63)", param="seed")
    if "temperature" in out and not 0 <= out["temperature"] <= MAX_TEMPERATURE:
        raise APIError(f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], got {out['temperature']!r}",
                       param="temperature")
    if chat and body.get("max_completion_tokens") is not None:
        _check_type("max_completion_tokens", body["max_completion_tokens"], int)
        out["max_tokens"] = body["max_completion_tokens"]
    if "stop_token_ids" in out and not all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in out["stop_token_ids"]):
        raise APIError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    if len(out.get("stop_token_ids", [])) > MAX_STOP_TOKEN_IDS:
        raise APIError(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError("'stop' must be a string or a list of strings", param="stop")
        if any(s == "" for s in stop):
            raise APIError("'stop' strings must not be empty", param="stop")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise APIError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                           "characters each", param="stop")
        stop = [check_text("stop", s) for s in stop]
        out["stop"] = stop
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise APIError(f"'cache_salt' must be a non-empty string, got {salt!r}", param="cache_salt")
        out["cache_salt"] = check_text("cache_salt", salt)
    if isinstance(out.get("logit_bias"), dict):   # JSON object keys are strings: {"50256": -100}
        try:
            out["logit_bias"] = {int(t): b for t, b in out["logit_bias"].items()}
        except ValueError:
            raise APIError("'logit_bias' keys must be token ids", param="logit_bias")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:   # logprobs: a boolean; top_logprobs: how many
        _check_type("logprobs", logprobs if logprobs is not None else False, bool)
        if top is not None:
            _check_type("top_logprobs", top, int)
            if not logprobs:
                raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if logprobs:
            out["logprobs"] = top or 0
    else:
        if top is not None:
            raise APIError("'top_logprobs' is a chat field; completions take 'logprobs': N", param="top_logprobs")
        if logprobs is not None:
            _check_type("logprobs", logprobs, int)
            out["logprobs"] = logprobs
    if "logprobs" in out and not 0 <= out["logprobs"] <= MAX_LOGPROBS:
        raise APIError(f"'{'top_logprobs' if chat else 'logprobs'}' must be in [0, {MAX_LOGPROBS}]",
                       param="top_logprobs" if chat else "logprobs")
    for name, neutral in UNSUPPORTED_UNLESS.items():
        if name in body and body[name] not in neutral:
            raise APIError(f"'{name}' is not supported", param=name)
    structured = parse_structured(body)
    if structured is not None:
        out["structured_outputs"] = structured
    return out


def _parse_common(body, chat: bool) -> GenerationRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(SAMPLING_FIELDS) - OTHER_FIELDS - set(UNSUPPORTED_UNLESS))
    if unknown:   # (a field we do not know would otherwise be accepted and ignored)
        raise APIError(f"'{unknown[0]}' is not a field of this API", param=unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    stream = body.get("stream") or False
    _check_type("stream", stream, bool)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    include_usage = bool((opts or {}).get("include_usage", False))
    if opts is not None and not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise APIError("'kv_transfer_params' must be an object", param="kv_transfer_params")
    flags = {}
    for name, types in (("return_token_ids", bool), ("return_tokens_as_token_ids", bool), ("echo", bool),
                        ("add_special_tokens", bool), ("add_generation_prompt", bool),
                        ("continue_final_message", bool), ("chat_template", str), ("chat_template_kwargs", dict)):
        if body.get(name) is not None:
            _check_type(name, body[name], types)
            flags[name] = body[name]
    chat_only = [n for n in ("chat_template", "chat_template_kwargs", "add_generation_prompt",
                             "continue_final_message") if n in flags]
    if chat_only and not chat:
        raise APIError(f"'{chat_only[0]}' is a chat field", param=chat_only[0])
    if chat and flags.get("echo"):
        raise APIError("'echo' is not supported on /v1/chat/completions", param="echo")
    if flags.get("continue_final_message") and flags.get("add_generation_prompt", True):
        raise APIError("'continue_final_message' needs 'add_generation_prompt': false", param="continue_final_message")
    sampling = parse_sampling(body, chat)
    echo_only = bool(flags.get("echo")) and sampling.get("max_tokens") == 0
    if echo_only:   # generate one token, returned to nobody: the prompt's logprobs need a step
        sampling["max_tokens"] = 1
    if sampling.get("best_of", 1) > sampling.get("n", 1) and stream:
        raise APIError("'best_of' > 'n' cannot be streamed (the best are known only at the end)", param="best_of")
    return GenerationRequest(model=model, sampling=sampling, stream=stream,
                             include_usage=include_usage, return_token_ids=flags.get("return_token_ids", False),
                             kv_transfer_params=kv, echo=flags.get("echo", False), echo_only=echo_only,
                             continuous_usage_stats=bool((opts or {}).get("continuous_usage_stats", False)),
                             tokens_as_ids=flags.get("return_tokens_as_token_ids", False),
                             add_special_tokens=flags.get("add_special_tokens"),
                             chat_template=flags.get("chat_template"),
                             chat_template_kwargs=flags.get("chat_template_kwargs", {}),
                             add_generation_prompt=flags.get("add_generation_prompt", True),
                             continue_final_message=flags.get("continue_final_message", False),
                             structured_field=structured_field(body))


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_completion_request(body) -> GenerationRequest:
    req = _parse_common(body, chat=False)
    if body.get("tools") not in (None, []) or body.get("tool_choice") is not None:
        raise APIError("'tools' is a chat field (/v1/chat/completions)", param="tools")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                       "lists of token ids, and not empty", param="prompt")
    if any(len(p) == 0 for p in prompts):
        raise APIError("'prompt' must not be empty", param="prompt")
    n = max(req.sampling.get("n", 1), req.sampling.get("best_of", 1))
    if len(prompts) * n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(f"{len(prompts)} prompts x n = {n} completions: at most {MAX_SEQUENCES_PER_REQUEST} per "
                       "request", param="prompt" if len(prompts) > 1 else "n")
    req.prompts = [check_text("prompt", p) if isinstance(p, str) else p for p in prompts]
    return req


def parse_chat_request(body) -> GenerationRequest:
    req = _parse_common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"'messages[{i}]' must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):   # [{"type": "text", "text": ...}]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"'messages[{i}].content': only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(f"'messages[{i}].content' must be a string or a list of text parts",
                           param="messages")
        message = {"role": check_text(f"messages[{i}].role", m["role"]),
                   "content": check_text(f"messages[{i}].content", content)}
        for key in ("tool_calls", "tool_call_id", "name"):   # (tool turns, for the chat template)
            if m.get(key) is not None:
                message[key] = m[key]
        if "tool_calls" in message and (not isinstance(message["tool_calls"], list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in message["tool_calls"])):
            raise APIError(f"'messages[{i}].tool_calls' must be a list of calls", param="messages")
        out.append(message)
    req.messages = out
    return req
