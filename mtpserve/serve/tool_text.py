"""Reading tool calls out of a choice's text while it grows: the same reader serves a whole response and a
stream, so that the streamed pieces add up to the response.

    named f     {"city": "Par               -> content "", calls [("f", '{"city": "Par')]
    required    [{"name": "f", "parameters": {"ci      -> content "", calls [("f", '{"ci')]
    deepseek_v3 Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{"ci
                                            -> content "Sure.", calls [("f", '{"ci')]

Text that may still turn into a marker (a partial "<｜tool▁calls▁begin｜>" or the end of the arguments) is held
back until it does or does not; `complete` says the text parsed whole (every call closed)."""
import json
from dataclasses import dataclass, field

DS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALL = "<｜tool▁call▁begin｜>"
DS_SEP = "<｜tool▁sep｜>"
DS_ARGS_END = "\n```<｜tool▁call▁end｜>"


@dataclass
class CallsText:
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)   # (name, arguments so far)
    complete: bool = True


def read_calls(choice: str, name: str | None, text: str, finished: bool) -> CallsText:
    """choice: the request's tool_choice kind ("named", "required", "auto", "none"); name: the named function."""
    if choice == "named":
        return CallsText("", [(name, text)], _parses(text))
    if choice == "required":
        return _read_required(text)
    if choice == "auto":
        return _read_deepseek_v3(text, finished)
    return CallsText(text)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _read_required(text: str) -> CallsText:
    """[{"name": NAME, "parameters": {...}}, ...]: each item's name once its string is closed, its parameters'
    text as far as it goes (their raw text: what the model wrote is what the client gets)."""
    start = text.find("[")
    if start < 0:
        return CallsText(complete=False)
    calls = []
    for _, item_start, item_end in _children(text, start):
        fields = {key: (s, e) for key, s, e in _children(text, item_start)} if text[item_start:item_start + 1] == "{" \
            else {}
        name, params = fields.get("name"), fields.get("parameters")
        if name is None or name[1] is None:
            break
        calls.append((json.loads(text[name[0]:name[1]]), "" if params is None else text[params[0]:params[1]]))
        if item_end is None:
            break
    return CallsText("", calls, _parses(text))


def _children(text: str, start: int) -> list[tuple[str | None, int, int | None]]:
    """The direct children of the JSON object or array that opens at text[start], as far as the text goes:
    [(key, or None in an array; value start; value end, or None while the value is open)].
        {"name": "f", "parameters": {"ci      -> [("name", 9, 12), ("parameters", 28, None)]"""
    out, is_object = [], text[start] == "{"
    depth, in_string, escaped = 1, False, False
    key, string_start, value_start, expect_key = None, None, None, is_object
    for i in range(start + 1, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 1 and expect_key:
                    key, expect_key = json.loads(text[string_start:i + 1]), False
                elif depth == 1:
                    out.append((key, value_start, i + 1))
                    value_start = None
            continue
        if ch == '"':
            in_string = True
            if depth == 1:
                string_start = i
                value_start = None if expect_key else i
        elif ch in "{[":
            value_start = i if depth == 1 else value_start
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 1:
                out.append((key, value_start, i + 1))
                value_start = None
            elif depth == 0:
                if value_start is not None:   # (a number, true, false or null before the close)
                    out.append((key, value_start, i))
                return out
        elif depth == 1 and ch == ",":
            if value_start is not None:
                out.append((key, value_start, i))
            value_start, expect_key = None, is_object
        elif depth == 1 and value_start is None and not expect_key and ch != ":" and not ch.isspace():
            value_start = i
    if value_start is not None:
        out.append((key, value_start, None))
    return out


def _held(text: str, marker: str, finished: bool) -> int:
    """How much of text's end may still become `marker` (nothing once the text is finished)."""
    if finished:
        return 0
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def _read_deepseek_v3(text: str, finished: bool) -> CallsText:
    """DeepSeek-V3's format: content, then <｜tool▁calls▁begin｜> and each call as
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>."""
    begin = text.find(DS_BEGIN)
    if begin < 0:
        return CallsText(text[:len(text) - _held(text, DS_BEGIN, finished)])
    calls, complete, pos = [], True, begin
    while (pos := text.find(DS_CALL, pos)) >= 0:
        sep = text.find(DS_SEP, pos)
        head_end = text.find("\n", sep + len(DS_SEP)) if sep >= 0 else -1
        fence_end = text.find("\n", head_end + 1) if head_end >= 0 else -1
        if fence_end < 0:   # (the name or the fence not written yet)
            complete = False
            break
        name = text[sep + len(DS_SEP):head_end].strip()
        end = text.find(DS_ARGS_END, fence_end + 1)
        if end < 0:
            args = text[fence_end + 1:]
            calls.append((name, args[:len(args) - _held(args, DS_ARGS_END, finished)]))
            complete = False
            break
        calls.append((name, text[fence_end + 1:end]))
        pos = end
    return CallsText(text[:begin], calls, complete and bool(calls))
