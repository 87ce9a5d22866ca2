"""Tool calls on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` (OpenAI's, as vLLM serves them).

- "none": the tools are shown to the chat template, the answer is text.
- a named function, or "required": the output is constrained by a JSON schema built from the functions'
  parameter schemas (the grammar engine, sampling/grammar.py), so it always parses into calls:
      named f:   the arguments object of f                   -> [f(arguments)]
      required:  [{"name": "f", "parameters": {...}}, ...]   -> one call per item (one item unless
                 parallel_tool_calls)
- "auto" (the default when tools are given): the model decides; its text is parsed for calls in its own
  format by --tool-call-parser (needs --enable-auto-tool-choice, as vLLM). deepseek_v3's format:
      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...
"""
import json
import re
import uuid
from dataclasses import dataclass, field

from mtpserve.serve.protocol import APIError

PARSERS = ("deepseek_v3",)


@dataclass
class ToolRequest:
    tools: list[dict]                     # [{"name", "description", "parameters"}]
    choice: str                           # "none" | "auto" | "required" | "named"
    name: str | None = None               # the named function
    parallel: bool = True
    parser: str | None = None             # auto: how the model's text is read
    schemas: dict = field(default_factory=dict)


def parse_tools(body: dict, auto_parser: str | None) -> ToolRequest | None:
    """The body's tools, checked (400s name tools / tool_choice); None when it has none."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise APIError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError("'tools' must be a list", param="tools")
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param="tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(f"'tools[{i}].function.parameters' must be a JSON schema object", param="tools")
        functions.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    req = ToolRequest(functions, "auto", parallel=parallel, schemas={f["name"]: f["parameters"] for f in functions})
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in req.schemas:
            raise APIError(f"'tool_choice' names a function that is not in 'tools': {name!r}", param="tool_choice")
        req.choice, req.name = "named", name
    elif choice in ("none", "auto", "required"):
        req.choice = choice
    elif choice is not None:
        raise APIError("'tool_choice' must be \"none\", \"auto\", \"required\" or a named function",
                       param="tool_choice")
    if req.choice == "auto":
        if auto_parser is None:
            raise APIError("'tool_choice' \"auto\" needs the server started with --enable-auto-tool-choice and "
                           "--tool-call-parser", param="tool_choice")
        req.parser = auto_parser
    return req


def constraint(req: ToolRequest) -> dict | None:
    """StructuredOutputsParams fields that make the output a call (named, required), else None."""
    if req.choice == "named":
        return {"json": req.schemas[req.name]}
    if req.choice != "required":
        return None
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                         "parameters": schema},
                        "required": ["name", "parameters"], "additionalProperties": False}
                       for name, schema in req.schemas.items()]}
    return {"json": {"type": "array", "items": calls, "minItems": 1, **({} if req.parallel else {"maxItems": 1})}}


def tool_calls(req: ToolRequest, text: str) -> tuple[str | None, list[dict]]:
    """(the message's content, its tool calls) from the generated text."""
    if req.choice == "named":
        return None, [_call(req.name, text)]
    if req.choice == "required":
        return None, [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
    if req.choice == "auto":
        return parse_deepseek_v3(text)
    return text, []


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(?P<name>[^\n]*)\n```(?:json)?\n"
                      r"(?P<args>.*?)\n```<｜tool▁call▁end｜>", re.S)
_DS_BEGIN = "<｜tool▁calls▁begin｜>"


def parse_deepseek_v3(text: str) -> tuple[str | None, list[dict]]:
    """DeepSeek-V3's tool-call format: the text before the calls is the content."""
    start = text.find(_DS_BEGIN)
    if start < 0:
        return text, []
    calls = [_call(m["name"].strip(), m["args"]) for m in _DS_CALL.finditer(text, start)]
    if not calls:   # (a malformed block: left as text)
        return text, []
    return text[:start] or None, calls


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
