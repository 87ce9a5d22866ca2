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
import uuid
from dataclasses import dataclass, field

from mtpserve.serve.protocol import APIError
from mtpserve.serve.tool_text import read_calls

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
    """(the message's content, its tool calls) from the whole generated text; ValueError: a call is cut short
    (max_tokens), and the caller keeps the text as content."""
    read = read_calls(req.choice, req.name, text, finished=True)
    if not read.complete:
        raise ValueError("a tool call is not closed")
    return read.content or None, [new_call(name, args) for name, args in read.calls]


class CallStream:
    """What one streamed choice has sent: `update(text)` -> (the content delta, the tool_calls deltas): a call's
    first delta names it (with its id), the next ones carry its arguments as they grow."""

    def __init__(self, req: ToolRequest):
        self.req, self.sent_content, self.sent_args, self.ids = req, 0, [], []

    def update(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        read = read_calls(self.req.choice, self.req.name, text, finished)
        content, self.sent_content = read.content[self.sent_content:], max(self.sent_content, len(read.content))
        deltas = []
        for j, (name, args) in enumerate(read.calls):
            if j == len(self.ids):
                self.ids.append(call_id())
                self.sent_args.append(0)
                deltas.append({"index": j, "id": self.ids[j], "type": "function",
                               "function": {"name": name, "arguments": ""}})
            if len(args) > self.sent_args[j]:
                deltas.append({"index": j, "function": {"arguments": args[self.sent_args[j]:]}})
                self.sent_args[j] = len(args)
        return content, deltas


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
