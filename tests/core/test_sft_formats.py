"""SFT rows -> Conversation (loongforge.core.data.text.formats): reasoning, tools, OpenAI roles and
content parts, tool results and arguments, ShareGPT function calls, and every malformed row a
BadSample with its reason."""

import itertools
import json

import pytest
from loongforge.core.data.text import BadSample, SFTTokenizer, load_rows, load_tokenizer, to_messages
from loongforge.core.data.text.formats import Conversation

USER = {"role": "user", "content": "q"}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def _oa(*msgs, **row):
    return {"messages": [USER, *msgs], **row}


def _bad(row, fmt="openai") -> str:
    with pytest.raises(BadSample) as e:
        to_messages(row, fmt)
    return e.value.reason


# 1. reasoning_content, <think> splitting, tools


def test_reasoning_content_kept():
    conv = to_messages(_oa({"role": "assistant", "content": "four", "reasoning_content": "2+2"}), "openai")
    assert conv == Conversation([USER, {"role": "assistant", "content": "four", "reasoning_content": "2+2"}], None)
    assert _bad(_oa({"role": "assistant", "content": "four", "reasoning_content": ["2+2"]})) == "bad_field_type"


@pytest.mark.parametrize(
    "content,reasoning,answer",
    [
        ("<think>\nadd them\n</think>\n\nfour", "add them", "four"),
        ("<think>add them</think>four", "add them", "four"),
        ("<think>\n\n</think>\n\nfour", "", "four"),
        ("\n<think>\nline one\nline two\n\n</think>\nfour\n", "line one\nline two", "four\n"),
    ],
)
def test_think_block_split_into_reasoning(content, reasoning, answer):
    conv = to_messages(_oa({"role": "assistant", "content": content}), "openai")
    assert conv.messages[-1] == {"role": "assistant", "content": answer, "reasoning_content": reasoning}


def test_think_block_not_split_when_reasoning_given_or_not_leading():
    given = {"role": "assistant", "content": "<think>x</think>four", "reasoning_content": "r"}
    assert to_messages(_oa(given), "openai").messages[-1] == given
    mid = {"role": "assistant", "content": "so <think>x</think> four"}
    assert to_messages(_oa(mid), "openai").messages[-1] == mid
    unclosed = {"role": "assistant", "content": "<think>x four"}
    assert to_messages(_oa(unclosed), "openai").messages[-1] == unclosed


def test_tools_returned_alongside_messages():
    bare = {"name": "lookup", "description": "look up", "parameters": {"type": "object", "properties": {}}}
    conv = to_messages(_oa({"role": "assistant", "content": "a"}, tools=[WEATHER, bare]), "openai")
    assert conv.messages == [USER, {"role": "assistant", "content": "a"}]
    assert conv.tools == [WEATHER, {"type": "function", "function": bare}]
    assert to_messages(_oa({"role": "assistant", "content": "a"}, tools=json.dumps([WEATHER])), "openai").tools == [WEATHER]
    assert to_messages(_oa({"role": "assistant", "content": "a"}, tools=[]), "openai").tools is None
    # a table holding both shapes fills the other shape's keys with None
    filled = [{"type": None, "function": None, **bare, "strict": None}]
    assert to_messages(_oa({"role": "assistant", "content": "a"}, tools=filled), "openai").tools == [{"type": "function", "function": bare}]
    # the Responses API's flat tool {"type": "function", "name", ...}
    flat = [{"type": "function", **bare}]
    assert to_messages(_oa({"role": "assistant", "content": "a"}, tools=flat), "openai").tools == [{"type": "function", "function": bare}]
    assert to_messages(_oa({"role": "assistant", "content": "a"}), "openai").tools is None


@pytest.mark.parametrize(
    "tools",
    [
        {"function": {"name": "f"}},
        ["f"],
        [{"type": "function", "function": {"description": "no name"}}],
        [{"type": "function", "function": {"name": ""}}],
        [{"type": "code_interpreter"}],
        [WEATHER, None],
        "[not json",
        '{"name": "f"}',
        3,
    ],
)
def test_bad_tools(tools):
    assert _bad(_oa({"role": "assistant", "content": "a"}, tools=tools)) == "bad_tools"


def test_conversation_reads_as_its_messages():
    conv = to_messages(_oa({"role": "assistant", "content": "a"}), "openai")
    assert len(conv) == 2 and conv[1]["content"] == "a" and [m["role"] for m in conv] == ["user", "assistant"]
    assert conv == [USER, {"role": "assistant", "content": "a"}]
    assert to_messages(_oa({"role": "assistant", "content": "a"}, tools=[WEATHER]), "openai") != conv.messages


# 2. developer and function roles


def test_developer_and_function_roles():
    row = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            USER,
            {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"role": "function", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "sunny"},
        ]
    }
    assert to_messages(row, "openai").messages == [
        {"role": "system", "content": "be brief"},
        USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "name": "get_weather"},
        {"role": "assistant", "content": "sunny"},
    ]
    assert _bad({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "a"}]}) == "unknown_role"
    assert _bad({"messages": [{"role": ["user"], "content": "x"}, {"role": "assistant", "content": "a"}]}) == "unknown_role"


# 3. content parts


def test_text_parts_joined_in_every_role():
    parts = lambda *ts: [{"type": "text", "text": t} for t in ts]  # noqa: E731
    row = {
        "messages": [
            {"role": "system", "content": parts("be ", "brief")},
            {"role": "user", "content": parts("one ", "plus ", "two")},
            {"role": "assistant", "content": parts("is ", "three")},
            {"role": "user", "content": []},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no."}]},
        ]
    }
    assert to_messages(row, "openai").messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one plus two"},
        {"role": "assistant", "content": "is three"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "no."},
    ]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
        {"type": "image", "image": "a.png"},
        {"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}},
    ],
)
def test_non_text_parts(part):
    row = _oa({"role": "assistant", "content": "a"})
    row["messages"][0] = {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}
    with pytest.raises(BadSample) as e:
        to_messages(row, "openai")
    assert e.value.reason == "non_text_content" and str(e.value) == f"non_text_content: {part['type']}"


@pytest.mark.parametrize(
    "content",
    [3, True, {"text": "a"}, ["a", "b"], [{"text": "no type"}], [{"type": "text", "text": 3}], [{"type": "text"}]],
)
def test_bad_content_types(content):
    assert _bad(_oa({"role": "assistant", "content": content})) == "bad_field_type"
    assert _bad({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a"}]}) == "bad_field_type"


# 4. tool results


@pytest.mark.parametrize(
    "content,text",
    [
        ({"temp": 21, "sky": "ensoleillé"}, '{"temp": 21, "sky": "ensoleillé"}'),
        ([1, 2], "[1, 2]"),
        ([{"city": "Paris"}], '[{"city": "Paris"}]'),
        ([], "[]"),
        (21.5, "21.5"),
        (0, "0"),
        (True, "true"),
        ("sunny", "sunny"),
        (None, ""),
        ([{"type": "text", "text": "sun"}, {"type": "text", "text": "ny"}], "sunny"),
    ],
)
def test_tool_results_as_json_text(content, text):
    row = _oa(
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": content},
        {"role": "assistant", "content": "ok"},
    )
    assert to_messages(row, "openai").messages[2] == {"role": "tool", "content": text, "tool_call_id": "call_1"}


def test_bad_tool_results():
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w"}}]}
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert _bad(_oa(call, {"role": "tool", "content": image}, {"role": "assistant", "content": "ok"})) == "non_text_content"
    assert _bad(_oa(call, {"role": "tool", "content": {"a": {1, 2}}}, {"role": "assistant", "content": "ok"})) == "bad_field_type"
    assert (
        _bad(_oa(call, {"role": "tool", "content": "x", "tool_call_id": ["1"]}, {"role": "assistant", "content": "ok"})) == "bad_field_type"
    )


# 5. tool-call arguments


@pytest.mark.parametrize(
    "args,expected",
    [('{"city": "Paris"}', {"city": "Paris"}), ({"city": "Paris"}, {"city": "Paris"}), ("", {}), (None, {}), ("  ", {})],
)
def test_tool_call_arguments(args, expected):
    calls = [{"type": "function", "function": {"name": "w", "arguments": args}}, {"function": None, "name": "bare", "arguments": {"n": 1}}]
    msg = to_messages(_oa({"role": "assistant", "content": "", "tool_calls": calls}), "openai").messages[-1]
    assert msg == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "w", "arguments": expected}},
            {"type": "function", "function": {"name": "bare", "arguments": {"n": 1}}},
        ],
    }


@pytest.mark.parametrize(
    "call",
    [
        {"function": {"name": "w", "arguments": "[1,2]"}},
        {"function": {"name": "w", "arguments": "3"}},
        {"function": {"name": "w", "arguments": '"x"'}},
        {"function": {"name": "w", "arguments": "{oops"}},
        {"function": {"name": "w", "arguments": [1, 2]}},
        {"function": {"name": "w", "arguments": 3}},
        {"function": {"arguments": "{}"}},
        {"function": {"name": 3}},
        {"function": "w"},
        "w",
    ],
)
def test_bad_tool_call_arguments(call):
    assert _bad(_oa({"role": "assistant", "content": "", "tool_calls": [call]})) == "bad_tool_call"


def test_bad_tool_calls_field():
    assert _bad(_oa({"role": "assistant", "content": "", "tool_calls": "w()"})) == "bad_tool_call"
    assert _bad(_oa({"role": "assistant", "content": "", "function_call": "w()"})) == "bad_tool_call"


# 6. ShareGPT function_call / observation / tools

SG_TOOLS = [{"name": "get_weather", "description": "weather of a city", "parameters": {"type": "object", "properties": {}}}]


def _sg(*turns, **row):
    return {"conversations": [{"from": "human", "value": "weather in Paris?"}, *turns], **row}


def test_sharegpt_function_calls_and_observations():
    row = _sg(
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"sky": "sunny"}'},
        {"from": "gpt", "value": "It is sunny."},
        tools=json.dumps(SG_TOOLS),
    )
    conv = to_messages(row, "sharegpt")
    assert conv.messages == [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"sky": "sunny"}'},
        {"role": "assistant", "content": "It is sunny."},
    ]
    assert conv.tools == [{"type": "function", "function": SG_TOOLS[0]}]
    assert to_messages({**row, "tools": SG_TOOLS}, "sharegpt").tools == conv.tools
    assert to_messages({**row, "tools": ""}, "sharegpt").tools is None


def test_sharegpt_parallel_calls_and_json_observation():
    calls = [{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": {"x": 1}}]
    conv = to_messages(
        _sg(
            {"from": "function_call", "value": json.dumps(calls)},
            {"from": "observation", "value": {"x": 1}},
            {"from": "gpt", "value": "done"},
        ),
        "sharegpt",
    )
    assert conv.messages[1:3] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "a", "arguments": {}}},
                {"type": "function", "function": {"name": "b", "arguments": {"x": 1}}},
            ],
        },
        {"role": "tool", "content": '{"x": 1}'},
    ]


@pytest.mark.parametrize(
    "value,reason",
    [
        ("{not json", "bad_tool_call"),
        ('{"arguments": {}}', "bad_tool_call"),
        ('{"name": "f", "arguments": [1]}', "bad_tool_call"),
        ('{"name": "f", "arguments": "{oops"}', "bad_tool_call"),
        ("[]", "bad_tool_call"),
        ('"f"', "bad_tool_call"),
        (3, "bad_tool_call"),
        (None, "missing_field"),
    ],
)
def test_sharegpt_bad_function_calls(value, reason):
    row = _sg({"from": "function_call", "value": value}, {"from": "observation", "value": "x"}, {"from": "gpt", "value": "ok"})
    assert _bad(row, "sharegpt") == reason


def test_sharegpt_bad_tools_and_turns():
    ok = ({"from": "gpt", "value": "ok"},)
    assert _bad(_sg(*ok, tools="[oops"), "sharegpt") == "bad_tools"
    assert _bad(_sg(*ok, tools=[{"description": "no name"}]), "sharegpt") == "bad_tools"
    assert _bad(_sg("gpt: ok"), "sharegpt") == "bad_field_type"
    assert _bad(_sg({"from": "gpt", "value": 3}), "sharegpt") == "bad_field_type"


# 7. conversation shape and rows


@pytest.mark.parametrize(
    "row,fmt,reason",
    [
        ({"messages": [USER]}, "openai", "no_assistant_turn"),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "tool", "content": "x"}]}, "openai", "no_assistant_turn"),
        (_oa({"role": "assistant", "content": "a"}, {"role": "user", "content": "and?"}), "openai", "no_final_assistant"),
        (
            _oa({"role": "assistant", "content": "", "tool_calls": [{"name": "w"}]}, {"role": "tool", "content": "x"}),
            "openai",
            "no_final_assistant",
        ),
        (_sg({"from": "gpt", "value": "a"}, {"from": "human", "value": "and?"}), "sharegpt", "no_final_assistant"),
        (_oa({"role": "assistant", "content": " \n"}), "openai", "empty_assistant_turn"),
        (_oa({"role": "assistant", "content": None}), "openai", "empty_assistant_turn"),
        (
            _oa({"role": "assistant", "content": ""}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}),
            "openai",
            "empty_assistant_turn",
        ),
        (_oa({"role": "assistant", "content": "<think>only thinking</think>"}), "openai", "empty_assistant_turn"),
        (_sg({"from": "gpt", "value": ""}), "sharegpt", "empty_assistant_turn"),
        ({"instruction": "q", "output": ""}, "alpaca", "empty_assistant_turn"),
        (["user", "q"], "openai", "bad_row"),
        ("q", "sharegpt", "bad_row"),
        (None, "alpaca", "bad_row"),
        (_oa("assistant: a"), "openai", "bad_field_type"),
        ({"messages": "q"}, "openai", "missing_field"),
        ({"instruction": "q", "output": "a", "history": 3}, "alpaca", "bad_history"),
        ({"instruction": "q", "output": "a", "history": [["only one"]]}, "alpaca", "bad_history"),
        ({"instruction": ["q"], "output": "a"}, "alpaca", "bad_field_type"),
    ],
)
def test_conversation_shape_and_bad_rows(row, fmt, reason):
    assert _bad(row, fmt) == reason


# End to end: a file of good and malformed rows through SFTTokenizer.tokenize_rows


def test_tokenize_rows_keeps_good_rows_and_counts_bad_ones(tmp_path):
    good = [
        _oa({"role": "assistant", "content": "<think>\nadd\n</think>\n\nfour"}, tools=[WEATHER]),
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
                },
                {"role": "tool", "tool_call_id": "1", "content": {"sky": "sunny"}},
                {"role": "assistant", "content": "It is sunny."},
            ]
        },
    ]
    bad = {
        "bad_tools": _oa({"role": "assistant", "content": "a"}, tools=[{"type": "function"}]),
        "non_text_content": {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "content": "a"},
            ]
        },
        "bad_field_type": _oa({"role": "assistant", "content": "a", "reasoning_content": 3}),
        "bad_tool_call": _oa({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": "[1,2]"}}]}),
        "no_final_assistant": _oa({"role": "assistant", "content": "a"}, {"role": "user", "content": "and?"}),
        "no_assistant_turn": {"messages": [USER]},
        "empty_assistant_turn": _oa({"role": "assistant", "content": ""}),
        "unknown_role": _oa({"role": "robot", "content": "a"}),
    }
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good[0], *bad.values(), good[1]]))
    tok = load_tokenizer("tiny")
    st = SFTTokenizer(tok, template="qwen2")
    # A line that is not a JSON object does not load through load_rows (Arrow), so bad_row comes from an iterator.
    rows = itertools.chain(load_rows([str(path)]), [["not", "a", "row"]])
    samples = list(st.tokenize_rows(rows, "openai"))
    assert dict(st.stats) == {"kept": 2, "bad_row": 1, **{reason: 1 for reason in bad}}
    trained = [tok.decode([t for t in s["labels"] if t != -100]) for s in samples]
    assert "four" in trained[0] and "<think>" not in trained[0]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in trained[1] and "It is sunny." in trained[1]
    assert "sunny" not in trained[1].replace("It is sunny.", "")
    assert samples[1]["input_ids"] == st(to_messages(good[1], "openai"))["input_ids"]
