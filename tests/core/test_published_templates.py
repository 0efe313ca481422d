"""The built-in chat templates are the published ones: each file is the template the model
repositories ship (pinned by the sha256 of its text, the source named in the file's first
comment), and through `SFTTokenizer` they render exactly the published formats, written out below
for the cases that tell them apart (Qwen2.5's default system prompt and tool block, Qwen3's think
block and enable_thinking, Llama 3.1 / 3.2's date header and tool definitions, DeepSeek-V3's tool
calls, Gemma's model turns), with each assistant turn's content, end-of-turn token and separator
trained."""

import hashlib

import pytest
from loongforge.core.data.text import BadSample, SFTTokenizer, load_tokenizer, to_messages
from loongforge.core.data.text.templates import BUILTIN_TEMPLATES
from loongforge.core.errors import UserError

# sha256 of each published template's text (huggingface/trl's chat_templates copies of the model
# repositories' tokenizer_config.json templates)
PUBLISHED_SHA256 = {
    "llama3": "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122",
    "llama3.1": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    "llama3.2": "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",
    "qwen2": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "qwen3": "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
    "deepseek_v3": "563b1ce7d61d50a9b4c7439a912a1116f095b712df5b5e4d3e1116049874eb64",
    "gemma": "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6",
}
HEADER_END = "-#}\n"

W = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def call(city):
    return {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "%s"}' % city}}


CASES = {
    "single": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    "system_multi": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "3."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4."},
        ]
    },
    "tools_parallel": {
        "messages": [
            {"role": "user", "content": "Paris and Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [call("Paris"), call("Rome")]},
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "Sun, rain."},
        ],
        "tools": [W],
    },
    "tool_single": {
        "messages": [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call("Paris")]},
            {"role": "tool", "content": {"sky": "sunny"}},
            {"role": "assistant", "content": "Sunny."},
        ],
        "tools": [W],
    },
    "reasoning": {
        "messages": [{"role": "user", "content": "1+2?"}, {"role": "assistant", "reasoning_content": "one, two, three", "content": "3."}]
    },
    "think_in_content": {
        "messages": [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "<think>\ncount\n</think>\n\n3."}]
    },
}

EXPECTED = [  # (template, case, template_kwargs, last_turn_only, the whole text, the trained text)
    (
        "llama3",
        "single",
        {},
        False,
        "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>",
        "Hello!<|eot_id|>",
    ),
    (
        "llama3",
        "system_multi",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>",
        "3.<|eot_id|>4.<|eot_id|>",
    ),
    (
        "llama3",
        "tools_parallel",
        {},
        False,
        "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\nParis and Rome?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|><|start_header_id|>tool<|end_header_id|>\n\nsunny<|eot_id|><|start_header_id|>tool<|end_header_id|>\n\nrain<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nSun, rain.<|eot_id|>",
        "<|eot_id|>Sun, rain.<|eot_id|>",
    ),
    (
        "llama3",
        "tool_single",
        {},
        False,
        '<|endoftext|><|start_header_id|>user<|end_header_id|>\n\nParis?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|><|start_header_id|>tool<|end_header_id|>\n\n{"sky": "sunny"}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nSunny.<|eot_id|>',
        "<|eot_id|>Sunny.<|eot_id|>",
    ),
    (
        "llama3",
        "reasoning",
        {},
        False,
        "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|>",
        "3.<|eot_id|>",
    ),
    (
        "llama3",
        "think_in_content",
        {},
        False,
        "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|>",
        "3.<|eot_id|>",
    ),
    (
        "llama3.1",
        "single",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>",
        "Hello!<|eot_id|>",
    ),
    (
        "llama3.1",
        "system_multi",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>",
        "3.<|eot_id|>4.<|eot_id|>",
    ),
    (
        "llama3.1",
        "tool_single",
        {},
        False,
        '<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n        "parameters": {\n            "type": "object",\n            "properties": {\n                "city": {\n                    "type": "string"\n                }\n            }\n        }\n    }\n}\n\nParis?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"{\\"sky\\": \\"sunny\\"}"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nSunny.<|eot_id|>',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>Sunny.<|eot_id|>',
    ),
    (
        "llama3.1",
        "reasoning",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|>",
        "3.<|eot_id|>",
    ),
    (
        "llama3.1",
        "think_in_content",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|>",
        "3.<|eot_id|>",
    ),
    (
        "llama3.2",
        "single",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>",
        "Hello!<|eot_id|>",
    ),
    (
        "llama3.2",
        "system_multi",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>",
        "3.<|eot_id|>4.<|eot_id|>",
    ),
    (
        "llama3.2",
        "tool_single",
        {},
        False,
        '<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n        "parameters": {\n            "type": "object",\n            "properties": {\n                "city": {\n                    "type": "string"\n                }\n            }\n        }\n    }\n}\n\nParis?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"{\\"sky\\": \\"sunny\\"}"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nSunny.<|eot_id|>',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>Sunny.<|eot_id|>',
    ),
    (
        "llama3.2",
        "reasoning",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|>",
        "3.<|eot_id|>",
    ),
    (
        "llama3.2",
        "think_in_content",
        {},
        False,
        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n1+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n3.<|eot_id|>",
        "3.<|eot_id|>",
    ),
    (
        "qwen2",
        "single",
        {},
        False,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n",
        "Hello!<|im_end|>\n",
    ),
    (
        "qwen2",
        "system_multi",
        {},
        False,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n3.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n",
        "3.<|im_end|>\n4.<|im_end|>\n",
    ),
    (
        "qwen2",
        "tools_parallel",
        {},
        False,
        '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nParis and Rome?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\nSun, rain.<|im_end|>\n',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\nSun, rain.<|im_end|>\n',
    ),
    (
        "qwen2",
        "tool_single",
        {},
        False,
        '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>\n<|im_start|>assistant\nSunny.<|im_end|>\n',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\nSunny.<|im_end|>\n',
    ),
    (
        "qwen2",
        "reasoning",
        {},
        False,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n3.<|im_end|>\n",
        "3.<|im_end|>\n",
    ),
    (
        "qwen2",
        "think_in_content",
        {},
        False,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n3.<|im_end|>\n",
        "3.<|im_end|>\n",
    ),
    (
        "qwen3",
        "single",
        {},
        False,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n",
        "<think>\n\n</think>\n\nHello!<|im_end|>\n",
    ),
    (
        "qwen3",
        "system_multi",
        {},
        True,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n3.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4.<|im_end|>\n",
        "<think>\n\n</think>\n\n4.<|im_end|>\n",
    ),
    (
        "qwen3",
        "tools_parallel",
        {},
        True,
        '<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nParis and Rome?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nSun, rain.<|im_end|>\n',
        "<think>\n\n</think>\n\nSun, rain.<|im_end|>\n",
    ),
    (
        "qwen3",
        "tool_single",
        {},
        True,
        '<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nSunny.<|im_end|>\n',
        "<think>\n\n</think>\n\nSunny.<|im_end|>\n",
    ),
    (
        "qwen3",
        "reasoning",
        {},
        False,
        "<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n<think>\none, two, three\n</think>\n\n3.<|im_end|>\n",
        "<think>\none, two, three\n</think>\n\n3.<|im_end|>\n",
    ),
    (
        "qwen3",
        "think_in_content",
        {},
        False,
        "<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n<think>\ncount\n</think>\n\n3.<|im_end|>\n",
        "<think>\ncount\n</think>\n\n3.<|im_end|>\n",
    ),
    (
        "deepseek_v3",
        "single",
        {},
        False,
        "<|endoftext|><｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>",
        "Hello!<｜end▁of▁sentence｜>",
    ),
    (
        "deepseek_v3",
        "system_multi",
        {},
        False,
        "<|endoftext|>Be brief.<｜User｜>1+2?<｜Assistant｜>3.<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>4.<｜end▁of▁sentence｜>",
        "3.<｜end▁of▁sentence｜>4.<｜end▁of▁sentence｜>",
    ),
    (
        "deepseek_v3",
        "tools_parallel",
        {},
        False,
        '<|endoftext|><｜User｜>Paris and Rome?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁output▁begin｜>rain<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Sun, rain.<｜end▁of▁sentence｜>',
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>Sun, rain.<｜end▁of▁sentence｜>',
    ),
    (
        "deepseek_v3",
        "tool_single",
        {},
        False,
        '<|endoftext|><｜User｜>Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"sky": "sunny"}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Sunny.<｜end▁of▁sentence｜>',
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>Sunny.<｜end▁of▁sentence｜>',
    ),
    ("deepseek_v3", "reasoning", {}, False, "<|endoftext|><｜User｜>1+2?<｜Assistant｜>3.<｜end▁of▁sentence｜>", "3.<｜end▁of▁sentence｜>"),
    (
        "deepseek_v3",
        "think_in_content",
        {},
        False,
        "<|endoftext|><｜User｜>1+2?<｜Assistant｜>3.<｜end▁of▁sentence｜>",
        "3.<｜end▁of▁sentence｜>",
    ),
    (
        "gemma",
        "single",
        {},
        False,
        "<|endoftext|><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n",
        "Hello!<end_of_turn>\n",
    ),
    (
        "gemma",
        "reasoning",
        {},
        False,
        "<|endoftext|><start_of_turn>user\n1+2?<end_of_turn>\n<start_of_turn>model\n3.<end_of_turn>\n",
        "3.<end_of_turn>\n",
    ),
    (
        "gemma",
        "think_in_content",
        {},
        False,
        "<|endoftext|><start_of_turn>user\n1+2?<end_of_turn>\n<start_of_turn>model\n3.<end_of_turn>\n",
        "3.<end_of_turn>\n",
    ),
    (
        "qwen3",
        "single",
        {"enable_thinking": False},
        False,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n",
        "Hello!<|im_end|>\n",
    ),
    (
        "llama3.1",
        "tool_single",
        {"date_string": "04 Dec 2026"},
        False,
        '<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 04 Dec 2026\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n        "parameters": {\n            "type": "object",\n            "properties": {\n                "city": {\n                    "type": "string"\n                }\n            }\n        }\n    }\n}\n\nParis?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"{\\"sky\\": \\"sunny\\"}"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nSunny.<|eot_id|>',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>Sunny.<|eot_id|>',
    ),
]
REFUSED = [  # (template, case, what the published template says)
    ("llama3.1", "tools_parallel", "This model only supports single tool-cal"),
    ("llama3.2", "tools_parallel", "This model only supports single tool-cal"),
    ("gemma", "system_multi", "System role not supported"),
    ("gemma", "tools_parallel", "Conversation roles must alternate user/a"),
    ("gemma", "tool_single", "Conversation roles must alternate user/a"),
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.mark.parametrize("name", sorted(PUBLISHED_SHA256))
def test_builtins_are_the_published_texts(name):
    text = BUILTIN_TEMPLATES[name]
    header, published = text.split(HEADER_END, 1)
    assert header.startswith("{#- LoongForge built-in chat template") and "huggingface/trl" in header
    assert hashlib.sha256(published.encode()).hexdigest() == PUBLISHED_SHA256[name]
    assert set(BUILTIN_TEMPLATES) == set(PUBLISHED_SHA256)
    covered = {(e[0], e[1]) for e in EXPECTED} | {(r[0], r[1]) for r in REFUSED}
    assert all((n, c) in covered for n in BUILTIN_TEMPLATES for c in CASES)


@pytest.mark.parametrize("name,case,kwargs,last,text,trained", EXPECTED, ids=[f"{e[0]}-{e[1]}-{len(e[2])}" for e in EXPECTED])
def test_renders_the_published_format(tok, name, case, kwargs, last, text, trained):
    """Every built-in on every case it takes: the whole text and the trained text. Qwen3's
    multi-turn cases train on the last turn (its template is not prefix-stable on them)."""
    conv = to_messages(CASES[case], "openai")
    sample = SFTTokenizer(tok, template=name, template_kwargs=kwargs, last_turn_only=last)(conv)
    assert tok.decode(sample["input_ids"]) == text
    assert tok.decode([t for t in sample["labels"] if t != -100]) == trained
    if last:
        with pytest.raises(UserError, match="not prefix-stable"):
            SFTTokenizer(tok, template=name, template_kwargs=kwargs)(conv)
    # the header comment renders nothing: the published text alone gives the same string
    published = BUILTIN_TEMPLATES[name].split(HEADER_END, 1)[1]
    messages = conv.messages
    if name == "deepseek_v3":
        from loongforge.core.data.text.formats import arguments_as_text

        messages = arguments_as_text(messages)
    kw = {**({"date_string": "26 Jul 2024"} if name == "llama3.2" else {}), **kwargs}
    assert tok.apply_chat_template(messages, chat_template=published, tools=conv.tools, tokenize=False, **kw) == text


@pytest.mark.parametrize("name,case,message", REFUSED)
def test_what_a_published_template_refuses_is_a_bad_row(tok, name, case, message):
    with pytest.raises(BadSample) as e:
        SFTTokenizer(tok, template=name)(to_messages(CASES[case], "openai"))
    assert e.value.reason == "template_error" and message in str(e.value)


def test_llama3_2_date_is_pinned_unless_given(tok):
    conv = to_messages(CASES["single"], "openai")
    pinned = tok.decode(SFTTokenizer(tok, template="llama3.2")(conv)["input_ids"])
    dated = tok.decode(SFTTokenizer(tok, template="llama3.2", template_kwargs={"date_string": "04 Dec 2026"})(conv)["input_ids"])
    assert "Today Date: 26 Jul 2024\n" in pinned and "Today Date: 04 Dec 2026\n" in dated
