"""SFT data: formats -> messages, built-in templates with explicit assistant masks, bad rows."""

import pytest

from loongforge.core.errors import UserError
from loongforge.llm.sft import BUILTIN_TEMPLATES, BadSample, SFTTokenizer, to_messages
from loongforge.llm.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def _trained_text(tok, sample):
    return tok.decode([t for t in sample["labels"] if t != -100])


def test_formats_to_messages():
    a = to_messages({"instruction": "add", "input": "one and two", "output": "three", "system": "be brief", "history": [["hi", "hello"]]}, "alpaca")
    assert [m["role"] for m in a] == ["system", "user", "assistant", "user", "assistant"]
    assert a[3]["content"] == "add\none and two"
    s = to_messages({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, "sharegpt")
    assert s == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    s2 = to_messages({"chat": [{"speaker": "user", "text": "q"}, {"speaker": "assistant", "text": "a"}]}, "sharegpt",
                     {"messages": "chat", "role": "speaker", "content": "text"})
    assert s2[1]["content"] == "a"
    o = to_messages({"messages": [{"role": "user", "content": "weather?"},
                                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                                  {"role": "tool", "content": "sunny", "tool_call_id": "1"}, {"role": "assistant", "content": "sunny"}]}, "openai")
    assert o[1]["tool_calls"] and o[2]["role"] == "tool"


@pytest.mark.parametrize("row,fmt,reason", [
    ({"instruction": "x"}, "alpaca", "missing_field"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "sharegpt", "unknown_role"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}, "openai", "empty_assistant_turn"),
    ({"messages": [{"role": "user", "content": "q"}]}, "openai", "no_assistant_turn"),
])
def test_bad_rows_have_reasons(row, fmt, reason):
    with pytest.raises(BadSample) as e:
        to_messages(row, fmt)
    assert e.value.reason == reason


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_loss_only_on_assistant_tokens(tok, name):
    st = SFTTokenizer(tok, template=name)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one plus two"}, {"role": "assistant", "content": "is three."},
            {"role": "user", "content": "and two plus two"}, {"role": "assistant", "content": "is four."}]
    s = st(msgs)
    assert len(s["input_ids"]) == len(s["labels"])
    text = _trained_text(tok, s)
    assert "is three." in text and "is four." in text
    assert "one plus two" not in text and "be brief" not in text and "user" not in text
    last = _trained_text(tok, SFTTokenizer(tok, template=name, last_turn_only=True)(msgs))
    assert "is four." in last and "is three." not in last
    full = SFTTokenizer(tok, template=name, train_on_prompt=True)(msgs)
    assert all(t != -100 for t in full["labels"])


def test_tokenize_rows_counts_and_policies(tok):
    rows = [{"instruction": "a", "output": "b"}, {"instruction": "a"}, {"instruction": "a" * 3000, "output": "b"}, {"instruction": "c", "output": "d"}]
    st = SFTTokenizer(tok, template="qwen2", max_length=256)
    kept = list(st.tokenize_rows(rows, "alpaca"))
    assert len(kept) == 2 and st.stats == {"kept": 2, "missing_field": 1, "over_long": 1}
    with pytest.raises(UserError, match="row 1: missing_field"):
        list(SFTTokenizer(tok, template="qwen2").tokenize_rows(rows, "alpaca", on_bad_sample="error"))
    with pytest.raises(UserError, match="all labels masked"):
        list(SFTTokenizer(tok, template="qwen2").tokenize_rows([{"instruction": "a"}], "alpaca"))


def test_template_errors(tok):
    with pytest.raises(UserError, match="no chat template"):
        SFTTokenizer(tok)
    with pytest.raises(UserError, match="unknown chat template 'chatml2'"):
        SFTTokenizer(tok, template="chatml2")
