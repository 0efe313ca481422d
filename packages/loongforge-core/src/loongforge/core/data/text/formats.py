"""Rows of the common SFT formats -> a list of chat messages {"role", "content"[, "tool_calls"]}."""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant", "tool")
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


class BadSample(Exception):
    """A row that cannot become a training sample; `reason` is the counter's key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _text(row: dict, key: str, required: bool = True) -> str:
    v = row.get(key)
    if v is None:
        if required:
            raise BadSample("missing_field", key)
        return ""
    if not isinstance(v, str):
        raise BadSample("bad_field_type", f"{key} is {type(v).__name__}, expected str")
    return v


def alpaca(row: dict, keys: dict) -> list[dict]:
    k = {"instruction": "instruction", "input": "input", "output": "output", "system": "system", "history": "history", **keys}
    msgs = []
    system = _text(row, k["system"], required=False)
    if system:
        msgs.append({"role": "system", "content": system})
    for turn in row.get(k["history"]) or []:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise BadSample("bad_history", "each history entry must be [prompt, response]")
        msgs += [{"role": "user", "content": str(turn[0])}, {"role": "assistant", "content": str(turn[1])}]
    prompt = _text(row, k["instruction"])
    extra = _text(row, k["input"], required=False)
    msgs.append({"role": "user", "content": f"{prompt}\n{extra}" if extra else prompt})
    msgs.append({"role": "assistant", "content": _text(row, k["output"])})
    return msgs


def sharegpt(row: dict, keys: dict) -> list[dict]:
    k = {"messages": "conversations", "role": "from", "content": "value", "system": "system", **keys}
    turns = row.get(k["messages"])
    if not isinstance(turns, list) or not turns:
        raise BadSample("missing_field", k["messages"])
    msgs = []
    system = _text(row, k["system"], required=False)
    if system:
        msgs.append({"role": "system", "content": system})
    for t in turns:
        role = SHAREGPT_ROLES.get(str(t.get(k["role"])))
        if role is None:
            raise BadSample("unknown_role", str(t.get(k["role"])))
        msgs.append({"role": role, "content": _text(t, k["content"])})
    return msgs


def openai(row: dict, keys: dict) -> list[dict]:
    k = {"messages": "messages", **keys}
    turns = row.get(k["messages"])
    if not isinstance(turns, list) or not turns:
        raise BadSample("missing_field", k["messages"])
    msgs = []
    for t in turns:
        role = t.get("role")
        if role not in ROLES:
            raise BadSample("unknown_role", str(role))
        m: dict[str, Any] = {"role": role, "content": t.get("content") or ""}
        if t.get("tool_calls"):
            m["tool_calls"] = [_tool_call(c) for c in t["tool_calls"]]
        if role == "tool" and t.get("tool_call_id"):
            m["tool_call_id"] = t["tool_call_id"]
        msgs.append(m)
    return msgs


def _tool_call(call) -> dict:
    """An OpenAI tool call ({"type": "function", "function": {"name", "arguments": JSON text}})
    as chat templates take it: {"name", "arguments": dict}."""
    import json

    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadSample("bad_tool_call", "a tool call needs a function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise BadSample("bad_tool_call", f"arguments of {fn['name']} are not JSON") from None
    return {"name": fn["name"], "arguments": args}


FORMATS = {"alpaca": alpaca, "sharegpt": sharegpt, "openai": openai}


def to_messages(row: dict, fmt: str, keys: dict | None = None) -> list[dict]:
    """Messages of one row; raises BadSample for rows that cannot be trained on."""
    msgs = FORMATS[fmt](row, keys or {})
    assistants = [m for m in msgs if m["role"] == "assistant"]
    if not assistants:
        raise BadSample("no_assistant_turn")
    if any(not m["content"].strip() and not m.get("tool_calls") for m in assistants):
        raise BadSample("empty_assistant_turn")
    return msgs
