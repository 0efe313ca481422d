"""Rows of the common SFT formats -> a Conversation: chat messages as HF chat templates take them
({"role", "content"[, "tool_calls", "reasoning_content", "tool_call_id", "name"]}) and the row's
tool schemas. A row that cannot be trained on raises BadSample(reason), never another error."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loongforge.core.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
# OpenAI roles -> the roles chat templates know: `developer` is the newer name of `system`, and
# `function` the result of the legacy function-calling API.
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool", "function": "tool"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
# Content-part types whose text the text stack trains on; any other part (image, image_url,
# input_audio, video, file, ...) makes the row non_text_content.
# (OpenAI's `refusal` part is an assistant's text under the key "refusal".)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
# Part types that mark a tool result's list as content parts rather than JSON data.
KNOWN_PARTS = (*TEXT_PARTS, "image", "image_url", "input_image", "input_audio", "audio", "video", "video_url", "file", "input_file")


class BadSample(Exception):
    """A row that cannot become a training sample; `reason` is the counter's key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(eq=False)
class Conversation:
    """One row's messages and its tools (OpenAI schemas {"type": "function", "function": {...}}, or None).

    It reads as the list of its messages too (iteration, indexing, len, == a list when it has no
    tools), and HF's apply_chat_template takes it as it is (it reads `.messages`)."""

    messages: list[dict]
    tools: list[dict] | None = None

    def __iter__(self):
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, i):
        return self.messages[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, Conversation):
            return self.messages == other.messages and self.tools == other.tools
        if isinstance(other, list):
            return self.tools is None and self.messages == other
        return NotImplemented

    __hash__ = None  # mutable, like the list it stands for


def _type(v) -> str:
    return type(v).__name__


def _text(row: dict, key: str, required: bool = True) -> str:
    v = row.get(key)
    if v is None:
        if required:
            raise BadSample("missing_field", key)
        return ""
    if not isinstance(v, str):
        raise BadSample("bad_field_type", f"{key} is {_type(v)}, expected str")
    return v


def _turn(t, where: str) -> dict:
    if not isinstance(t, dict):
        raise BadSample("bad_field_type", f"{where} is {_type(t)}, expected an object")
    return t


def _parts(parts: list, where: str) -> str:
    """Text of a list of content parts; a non-text part is non_text_content."""
    texts = []
    for p in parts:
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise BadSample("bad_field_type", f"{where}: a content part must be an object with a type")
        if p["type"] not in TEXT_PARTS:
            raise BadSample("non_text_content", p["type"])
        text = p.get(TEXT_PARTS[p["type"]])
        if not isinstance(text, str):
            raise BadSample("bad_field_type", f"{where}: a {p['type']} part's text is {_type(text)}, expected str")
        texts.append(text)
    return "".join(texts)


def _content(v, where: str, tool: bool = False) -> str:
    """A message's content as text: str, None (""), or a list of content parts. A tool result may
    also be JSON data (object, array, number, bool), which is rendered as JSON text."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if tool:
        is_parts = isinstance(v, list) and v and all(isinstance(p, dict) and p.get("type") in KNOWN_PARTS for p in v)
        if is_parts:
            return _parts(v, where)
        if isinstance(v, (dict, list, int, float, bool)):
            try:
                return json.dumps(v, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise BadSample("bad_field_type", f"{where} is not JSON data: {e}") from None
    elif isinstance(v, list):
        return _parts(v, where)
    raise BadSample("bad_field_type", f"{where} is {_type(v)}, expected str or a list of content parts")


class Arguments(dict):
    """A tool call's arguments: the JSON object (what HF chat templates take) and, in `text`, its
    JSON text (the row's own, where it gave text), for templates that take the text instead
    (DeepSeek-V3's published one concatenates it as a string)."""

    def __init__(self, value: dict, text: str | None = None):
        super().__init__(value)
        self.text = json.dumps(value, ensure_ascii=False) if text is None else text


def arguments_as_text(messages: list[dict]) -> list[dict]:
    """The messages with each tool call's arguments as their JSON text."""

    def text(a):
        return a.text if isinstance(a, Arguments) else json.dumps(a, ensure_ascii=False)

    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": text(c["function"]["arguments"])}} for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _arguments(name: str, args) -> Arguments:
    text = None
    if args is None or (isinstance(args, str) and not args.strip()):
        return Arguments({})
    if isinstance(args, str):
        text = args
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise BadSample("bad_tool_call", f"arguments of {name} are not JSON") from None
    if not isinstance(args, dict):
        raise BadSample("bad_tool_call", f"arguments of {name} are {_type(args)}, expected a JSON object")
    return Arguments(args, text)


def _function(v):
    """The function of an OpenAI tool / tool call {"type": "function", "function": {...}}, or a bare
    (or Responses-API flat) one without its "type"; keys of None (as a table holding both shapes
    fills the other shape's keys) count as absent."""
    if not isinstance(v, dict):
        return None
    if v.get("function") is not None:
        return v["function"]
    return {k: x for k, x in v.items() if x is not None and k not in ("type", "function")}


def _tool_call(call) -> dict:
    """An OpenAI tool call ({"type": "function", "function": {"name", "arguments": JSON text}}) or a
    bare {"name", "arguments"}, in the form every published template reads (HF's):
    {"type": "function", "function": {"name", "arguments": Arguments}}."""
    fn = _function(call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadSample("bad_tool_call", "a tool call needs a function name")
    return {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn["name"], fn.get("arguments"))}}


def _tool_calls(calls) -> list[dict]:
    if not isinstance(calls, list):
        raise BadSample("bad_tool_call", f"tool_calls is {_type(calls)}, expected a list")
    return [_tool_call(c) for c in calls]


def _tools(v) -> list[dict] | None:
    """A row's tools: a list (or its JSON text) of OpenAI tool schemas or bare function schemas,
    returned as OpenAI tool schemas; None when there are none."""
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise BadSample("bad_tools", "tools are not JSON") from None
    if not isinstance(v, list):
        raise BadSample("bad_tools", f"tools is {_type(v)}, expected a list")
    tools = []
    for t in v:
        fn = _function(t)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadSample("bad_tools", "each tool needs a function name")
        tools.append({"type": "function", "function": fn})
    return tools or None


def alpaca(row: dict, keys: dict) -> Conversation:
    k = {"instruction": "instruction", "input": "input", "output": "output", "system": "system", "history": "history", **keys}
    msgs = []
    system = _text(row, k["system"], required=False)
    if system:
        msgs.append({"role": "system", "content": system})
    history = row.get(k["history"]) or []
    if not isinstance(history, (list, tuple)):
        raise BadSample("bad_history", f"{k['history']} is {_type(history)}, expected a list")
    for turn in history:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise BadSample("bad_history", "each history entry must be [prompt, response]")
        msgs += [{"role": "user", "content": str(turn[0])}, {"role": "assistant", "content": str(turn[1])}]
    prompt = _text(row, k["instruction"])
    extra = _text(row, k["input"], required=False)
    msgs.append({"role": "user", "content": f"{prompt}\n{extra}" if extra else prompt})
    msgs.append({"role": "assistant", "content": _text(row, k["output"])})
    return Conversation(msgs)


def _sharegpt_calls(value) -> list[dict]:
    """A function_call turn's value: JSON text (or the object) {"name", "arguments"}, or a list of them."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise BadSample("bad_tool_call", "a function_call turn is not JSON") from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise BadSample("bad_tool_call", "a function_call turn has no call")
    return [_tool_call(c) for c in calls]


def sharegpt(row: dict, keys: dict) -> Conversation:
    k = {"messages": "conversations", "role": "from", "content": "value", "system": "system", "tools": "tools", **keys}
    turns = row.get(k["messages"])
    if not isinstance(turns, list) or not turns:
        raise BadSample("missing_field", k["messages"])
    msgs = []
    system = _text(row, k["system"], required=False)
    if system:
        msgs.append({"role": "system", "content": system})
    for i, t in enumerate(turns):
        t = _turn(t, f"{k['messages']}[{i}]")
        name = str(t.get(k["role"]))
        role = SHAREGPT_ROLES.get(name)
        if role is None:
            raise BadSample("unknown_role", name)
        if name == "function_call":
            if t.get(k["content"]) is None:
                raise BadSample("missing_field", k["content"])
            msgs.append({"role": "assistant", "content": "", "tool_calls": _sharegpt_calls(t[k["content"]])})
        elif role == "tool":
            if t.get(k["content"]) is None:
                raise BadSample("missing_field", k["content"])
            msgs.append({"role": "tool", "content": _content(t[k["content"]], f"{k['messages']}[{i}]", tool=True)})
        else:
            msgs.append({"role": role, "content": _text(t, k["content"])})
    return Conversation(msgs, _tools(row.get(k["tools"])))


def _split_think(content: str) -> tuple[str | None, str]:
    """(reasoning, answer) of content that opens with <think>...</think>, split as Qwen3's template does."""
    if not content.lstrip().startswith("<think>") or "</think>" not in content:
        return None, content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")


def openai(row: dict, keys: dict) -> Conversation:
    k = {"messages": "messages", "tools": "tools", **keys}
    turns = row.get(k["messages"])
    if not isinstance(turns, list) or not turns:
        raise BadSample("missing_field", k["messages"])
    msgs = []
    for i, t in enumerate(turns):
        where = f"{k['messages']}[{i}]"
        t = _turn(t, where)
        given = t.get("role")
        role = OPENAI_ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise BadSample("unknown_role", str(given))
        m: dict[str, Any] = {"role": role, "content": _content(t.get("content"), f"{where}.content", tool=role == "tool")}
        if role == "assistant":
            reasoning = t.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise BadSample("bad_field_type", f"{where}.reasoning_content is {_type(reasoning)}, expected str")
            if reasoning is None:
                reasoning, m["content"] = _split_think(m["content"])
            if reasoning is not None:
                m["reasoning_content"] = reasoning
        if t.get("tool_calls"):
            m["tool_calls"] = _tool_calls(t["tool_calls"])
        elif role == "assistant" and t.get("function_call"):  # the legacy function-calling API
            m["tool_calls"] = [_tool_call(t["function_call"])]
        if role == "tool":
            for key in ("tool_call_id", "name"):
                v = t.get(key)
                if v is None or v == "":
                    continue
                if not isinstance(v, (str, int)) or isinstance(v, bool):
                    raise BadSample("bad_field_type", f"{where}.{key} is {_type(v)}, expected str")
                m[key] = str(v)
        msgs.append(m)
    return Conversation(msgs, _tools(row.get(k["tools"])))


FORMATS = {"alpaca": alpaca, "sharegpt": sharegpt, "openai": openai}


def to_messages(row: dict, fmt: str, keys: dict | None = None) -> Conversation:
    """The Conversation of one row; raises BadSample for rows that cannot be trained on."""
    if fmt not in FORMATS:
        raise UserError(f"unknown SFT format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not isinstance(row, dict):
        raise BadSample("bad_row", f"a row is {_type(row)}, expected an object")
    conv = FORMATS[fmt](row, keys or {})
    assistants = [m for m in conv.messages if m["role"] == "assistant"]
    if not assistants:
        raise BadSample("no_assistant_turn")
    if conv.messages[-1]["role"] != "assistant":
        raise BadSample("no_final_assistant", f"the last message is {conv.messages[-1]['role']}")
    if any(not m["content"].strip() and not m.get("tool_calls") for m in assistants):
        raise BadSample("empty_assistant_turn")
    return conv
