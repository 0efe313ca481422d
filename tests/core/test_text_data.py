"""Text data (loongforge.core.data.text): SFT formats -> messages, built-in templates with explicit
assistant masks, bad rows."""

import pytest
from loongforge.core.data.text import BUILTIN_TEMPLATES, BadSample, SFTTokenizer, load_tokenizer, to_messages
from loongforge.core.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def _trained_text(tok, sample):
    return tok.decode([t for t in sample["labels"] if t != -100])


def test_formats_to_messages():
    a = to_messages(
        {"instruction": "add", "input": "one and two", "output": "three", "system": "be brief", "history": [["hi", "hello"]]}, "alpaca"
    )
    assert [m["role"] for m in a] == ["system", "user", "assistant", "user", "assistant"]
    assert a[3]["content"] == "add\none and two"
    s = to_messages({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, "sharegpt")
    assert s == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    s2 = to_messages(
        {"chat": [{"speaker": "user", "text": "q"}, {"speaker": "assistant", "text": "a"}]},
        "sharegpt",
        {"messages": "chat", "role": "speaker", "content": "text"},
    )
    assert s2[1]["content"] == "a"
    o = to_messages(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "1"},
                {"role": "assistant", "content": "sunny"},
            ]
        },
        "openai",
    )
    assert o[1]["tool_calls"] and o[2]["role"] == "tool"


@pytest.mark.parametrize(
    "row,fmt,reason",
    [
        ({"instruction": "x"}, "alpaca", "missing_field"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "sharegpt", "unknown_role"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}, "openai", "empty_assistant_turn"),
        ({"messages": [{"role": "user", "content": "q"}]}, "openai", "no_assistant_turn"),
    ],
)
def test_bad_rows_have_reasons(row, fmt, reason):
    with pytest.raises(BadSample) as e:
        to_messages(row, fmt)
    assert e.value.reason == reason


@pytest.mark.parametrize("name", sorted(set(BUILTIN_TEMPLATES) - {"qwen3"}))
def test_loss_only_on_assistant_tokens(tok, name):
    st = SFTTokenizer(tok, template=name)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one plus two"},
        {"role": "assistant", "content": "is three."},
        {"role": "user", "content": "and two plus two"},
        {"role": "assistant", "content": "is four."},
    ]
    if name == "gemma":  # Gemma's template has no system role
        msgs = msgs[1:]
    s = st(msgs)
    assert len(s["input_ids"]) == len(s["labels"])
    text = _trained_text(tok, s)
    assert "is three." in text and "is four." in text
    assert "one plus two" not in text and "be brief" not in text and "user" not in text
    last = _trained_text(tok, SFTTokenizer(tok, template=name, last_turn_only=True)(msgs))
    assert "is four." in last and "is three." not in last
    full = SFTTokenizer(tok, template=name, train_on_prompt=True)(msgs)
    assert all(t != -100 for t in full["labels"])


def test_qwen3_multi_turn_needs_last_turn_only(tok):
    """Qwen3's published template puts the think block only on turns after the last user message,
    so an earlier turn renders differently once later turns follow: refused by name, and trained
    on its last turn with last_turn_only."""
    msgs = [
        {"role": "user", "content": "one plus two"},
        {"role": "assistant", "content": "is three."},
        {"role": "user", "content": "and two plus two"},
        {"role": "assistant", "content": "is four."},
    ]
    with pytest.raises(UserError, match="the built-in template 'qwen3' is not prefix-stable.*last_turn_only"):
        SFTTokenizer(tok, template="qwen3")(msgs)
    last = _trained_text(tok, SFTTokenizer(tok, template="qwen3", last_turn_only=True)(msgs))
    assert last == "<think>\n\n</think>\n\nis four.<|im_end|>\n"


def test_tokenize_rows_counts_and_policies(tok):
    rows = [
        {"instruction": "a", "output": "b"},
        {"instruction": "a"},
        {"instruction": "a" * 3000, "output": "b"},
        {"instruction": "c", "output": "d"},
    ]
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


TOOL_ROW = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "2", "content": "warm"},
        {"role": "assistant", "content": "It is sunny."},
    ]
}
# The published chat formats of Qwen2.5 (tool calls in <tool_call>, results grouped in one user
# turn) and Llama 3.1, written out by hand.
EXPECTED = {
    "qwen2": (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n",
        # trained: each answer, its end-of-turn token and the newline after it
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\nIt is sunny.<|im_end|>\n',
    ),
    # Llama 3.1: the date header, the call as JSON with "parameters", the results as ipython turns
    # rendered as JSON (so a string result comes out quoted)
    "llama3.1": (
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "be brief<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"warm"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nIt is sunny.<|eot_id|>',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>It is sunny.<|eot_id|>',
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_templates_render_tool_calls_exactly(tok, name):
    st = SFTTokenizer(tok, template=name)
    msgs = to_messages(TOOL_ROW, "openai")
    text, trained = EXPECTED[name]
    assert tok.apply_chat_template(msgs, chat_template=st.template, tokenize=False) == text
    assert _trained_text(tok, st(msgs)) == trained


def test_bad_tool_calls_are_counted(tok):
    bad = {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
        ]
    }
    st = SFTTokenizer(tok, template="qwen2")
    assert list(st.tokenize_rows([bad, TOOL_ROW], "openai")) and st.stats == {"bad_tool_call": 1, "kept": 1}


def test_append_eos_is_trained(tok):
    msgs = to_messages({"instruction": "hi", "output": "hello"}, "alpaca")
    plain = SFTTokenizer(tok, template="qwen2")(msgs)
    eos = SFTTokenizer(tok, template="qwen2", append_eos=True)(msgs)
    assert eos["input_ids"] == plain["input_ids"] + [tok.eos_token_id]
    assert eos["labels"][-1] == tok.eos_token_id
