"""Every field of vLLM's completion and chat request models, sorted: sampling fields, fields honoured in
parsing, fields refused unless neutral; and the fields that ask for a structured output."""
from mtpserve.serve.errors import APIError

# Sampling fields (request name -> SamplingParams name) with their JSON types.
_NUM = (int, float)
SAMPLING_FIELDS = {
    "temperature": ("temperature", _NUM), "top_p": ("top_p", _NUM), "top_k": ("top_k", int),
    "min_p": ("min_p", _NUM), "max_tokens": ("max_tokens", int), "min_tokens": ("min_tokens", int),
    "n": ("n", int), "best_of": ("best_of", int), "seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", _NUM), "frequency_penalty": ("frequency_penalty", _NUM),
    "presence_penalty": ("presence_penalty", _NUM), "logit_bias": ("logit_bias", dict),
    "allowed_token_ids": ("allowed_token_ids", list), "bad_words": ("bad_words", list),
    "stop_token_ids": ("stop_token_ids", list), "ignore_eos": ("ignore_eos", bool),
    "include_stop_str_in_output": ("include_stop_str_in_output", bool),
    "skip_special_tokens": ("skip_special_tokens", bool),
    "spaces_between_special_tokens": ("spaces_between_special_tokens", bool),
    "truncate_prompt_tokens": ("truncate_prompt_tokens", int), "prompt_logprobs": ("prompt_logprobs", int),
}
# Fields honoured elsewhere in parsing (not SamplingParams fields), or that carry no instruction (user: an
# end-user id for the provider's records; model: checked against the served names).
OTHER_FIELDS = {"model", "prompt", "messages", "stream", "stream_options", "stop", "cache_salt", "logprobs",
                "top_logprobs", "echo", "max_completion_tokens", "return_token_ids", "return_tokens_as_token_ids",
                "kv_transfer_params", "add_special_tokens", "chat_template", "chat_template_kwargs",
                "add_generation_prompt", "continue_final_message", "user", "response_format", "structured_outputs",
                "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools", "tool_choice",
                "parallel_tool_calls"}
# Where a structured output can be asked for: the field -> how its value becomes StructuredOutputsParams fields.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
# Fields accepted only at their neutral values: anything else is refused with a 400 that names the field.
UNSUPPORTED_UNLESS = {
    "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none"),
    "guided_decoding_backend": (None, "xgrammar", "auto"), "guided_whitespace_pattern": (None,),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "priority": (None, 0),
    "logits_processors": (None, []), "vllm_xargs": (None, {}), "prompt_embeds": (None,), "documents": (None, []),
    "mm_processor_kwargs": (None, {}), "request_id": (None,), "reasoning_effort": (None,), "prediction": (None,),
    "audio": (None,), "modalities": (None, ["text"]), "web_search_options": (None,), "metadata": (None,),
    "store": (None, False), "service_tier": (None, "auto", "default"), "verbosity": (None,),
}


def parse_structured(body: dict) -> dict | None:
    """StructuredOutputsParams fields from whichever of STRUCTURED_FIELDS the body uses (one at most)."""
    given = [n for n in STRUCTURED_FIELDS if body.get(n) is not None and body[n] != {"type": "text"}]
    if len(given) > 1:
        raise APIError(f"'{given[1]}': give one of {', '.join(given)}", param=given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name == "response_format":
        if not isinstance(value, dict) or value.get("type") not in ("json_object", "json_schema"):
            raise APIError("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                           param=name)
        if value["type"] == "json_object":
            return {"json_object": True}
        schema = (value.get("json_schema") or {}).get("schema") if isinstance(value.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise APIError("'response_format': json_schema needs {\"json_schema\": {\"schema\": {...}}}", param=name)
        return {"json": schema}
    if name == "structured_outputs":
        if not isinstance(value, dict) or not set(value) <= {"json", "json_object", "regex", "choice", "grammar"}:
            raise APIError("'structured_outputs' must be an object with one of json, json_object, regex, choice, "
                           "grammar", param=name)
        return value
    kind = name.removeprefix("guided_")
    types = {"json": (dict, str), "regex": str, "choice": list, "grammar": str}[kind]
    if not isinstance(value, types):
        raise APIError(f"'{name}' has the wrong type", param=name)
    return {kind: value}


def structured_field(body: dict) -> str | None:
    """The field a request asked for its structured output with (a 400 about the grammar names it)."""
    return next((n for n in STRUCTURED_FIELDS if body.get(n) is not None and body[n] != {"type": "text"}), None)
