"""The assistant mask of a template without `{% generation %}` blocks, by incremental rendering:
the same tokens as the generation-block mask where a template has both, a refusal where the
template is not prefix-stable, the template's own errors as bad rows, and the reasoning trained
or masked."""

import copy
import re

import pytest
from loongforge.core.data.text import load_tokenizer
from loongforge.core.data.text.assistant_mask import NotPrefixStable, incremental_mask
from loongforge.core.data.text.formats import BadSample
from loongforge.core.data.text.templates import BUILTIN_TEMPLATES

CONVERSATIONS = {
    "single turn": [{"role": "user", "content": "Who has the kite?"}, {"role": "assistant", "content": "Ben has the kite."}],
    "system and two turns": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is one plus two?"},
        {"role": "assistant", "content": "three."},
        {"role": "user", "content": "And two plus two?"},
        {"role": "assistant", "content": "four."},
    ],
    "tool call and result": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees."},
    ],
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def _generation_mask(tok, template, messages):
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _without_generation_blocks(template: str) -> str:
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


# Templates that mark their assistant text with {% generation %} blocks (content, end of turn and
# separator, as the mask convention has it): ChatML with Qwen's tool calls, and Llama 3's format.
_CALL = "{%- set c = call.function if call.function is defined else call %}"
WITH_BLOCKS = {
    "chatml": (
        "{%- for m in messages %}"
        "{%- if m['role'] == 'assistant' %}"
        "<|im_start|>assistant\n{% generation %}{{ m['content'] }}"
        "{%- for call in m.get('tool_calls') or [] %}"
        + _CALL
        + "{{ '\n' if (m['content'] or not loop.first) }}<tool_call>\n{\"name\": \"{{ c['name'] }}\", \"arguments\": {{ c['arguments'] | tojson }}}\n</tool_call>"
        "{%- endfor %}<|im_end|>{{ '\\n' }}{% endgeneration %}"
        "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>{{ '\\n' }}"
        "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{{ '\\n' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}"
    ),
    "llama3": (
        "{{- bos_token }}"
        "{%- for m in messages %}"
        "{%- if m['role'] == 'assistant' %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% generation %}{{ m['content'] | trim }}"
        "{%- for call in m.get('tool_calls') or [] %}"
        + _CALL
        + '{"name": "{{ c[\'name\'] }}", "parameters": {{ c[\'arguments\'] | tojson }}}'
        "{%- endfor %}<|eot_id|>{% endgeneration %}"
        "{%- else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{{ '\\n' }}{%- endif %}"
    ),
}


@pytest.mark.parametrize("template", sorted(WITH_BLOCKS))
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_incremental_mask_equals_the_generation_block_mask(tok, template, case):
    messages = CONVERSATIONS[case]
    with_blocks = WITH_BLOCKS[template]
    ids, want = _generation_mask(tok, with_blocks, messages)
    got_ids, got = incremental_mask(tok, _without_generation_blocks(with_blocks), messages)
    assert got_ids == ids
    assert got == want, (template, case)
    assert sum(want) > 0


def test_mask_covers_content_end_of_turn_and_separator(tok):
    ids, mask = incremental_mask(tok, BUILTIN_TEMPLATES["qwen2"], CONVERSATIONS["single turn"])
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "Ben has the kite.<|im_end|>\n"


# A template that marks the final assistant turn differently from earlier ones (as Qwen3's
# published template renders reasoning only after the last user message).
UNSTABLE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.last %}<a final>{{ m['content'] }}</a>"
    "{%- elif m['role'] == 'assistant' %}<a>{{ m['content'] }}</a>"
    "{%- else %}<u>{{ m['content'] }}</u>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<a final>{%- endif %}"
)


def test_not_prefix_stable_is_refused_naming_the_turn_and_last_turn_only_works(tok):
    messages = CONVERSATIONS["system and two turns"][1:]
    with pytest.raises(NotPrefixStable) as e:
        incremental_mask(tok, UNSTABLE, messages)
    assert e.value.index == 1
    ids, mask = incremental_mask(tok, UNSTABLE, messages, turns="last")
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "four.</a>"


def test_template_errors_are_bad_rows(tok):
    strict = (
        "{%- if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{%- endif %}"
        + (BUILTIN_TEMPLATES["qwen2"])
    )
    with pytest.raises(BadSample) as e:
        incremental_mask(tok, strict, CONVERSATIONS["single turn"])
    assert e.value.reason == "template_error" and "a system message comes first" in str(e.value)


def test_tokenizer_template_without_generation_blocks_trains(tok):
    import copy

    from loongforge.core.data.text import SFTTokenizer

    own = copy.deepcopy(tok)
    own.chat_template = BUILTIN_TEMPLATES["qwen2"]
    messages = CONVERSATIONS["system and two turns"]
    got = SFTTokenizer(own)(messages)
    want = SFTTokenizer(tok, template="qwen2")(messages)
    assert got == want


def test_not_prefix_stable_tokenizer_template_is_refused_by_name(tok):
    import copy

    from loongforge.core.data.text import SFTTokenizer
    from loongforge.core.errors import UserError

    own = copy.deepcopy(tok)
    own.chat_template = UNSTABLE
    messages = CONVERSATIONS["system and two turns"][1:]
    with pytest.raises(UserError, match="the tokenizer's chat template is not prefix-stable.*data.last_turn_only=true"):
        SFTTokenizer(own)(messages)
    sample = SFTTokenizer(own, last_turn_only=True)(messages)
    assert tok.decode([t for t in sample["labels"] if t != -100]) == "four.</a>"


def test_reasoning_trained_or_masked_by_option(tok):
    """Qwen3's published template: the reasoning in a <think> block before the answer, trained
    with it or (train_on_reasoning=false) not; with enable_thinking=false the empty block the
    generation prompt prefills stays out of the trained text."""
    from loongforge.core.data.text import SFTTokenizer
    from loongforge.core.errors import UserError

    messages = [
        {"role": "user", "content": "one plus two?"},
        {"role": "assistant", "reasoning_content": "count up from one", "content": "three."},
    ]
    with_r = SFTTokenizer(tok, template="qwen3")(messages)
    without = SFTTokenizer(tok, template="qwen3", train_on_reasoning=False)(messages)
    assert with_r["input_ids"] == without["input_ids"]  # the same text either way

    def trained(s):
        return tok.decode([t for t in s["labels"] if t != -100])

    assert trained(with_r) == "<think>\ncount up from one\n</think>\n\nthree.<|im_end|>\n"
    assert trained(without) == "three.<|im_end|>\n"
    plain = [messages[0], {"role": "assistant", "content": "three."}]
    assert trained(SFTTokenizer(tok, template="qwen3")(plain)) == "<think>\n\n</think>\n\nthree.<|im_end|>\n"
    no_think = SFTTokenizer(tok, template="qwen3", template_kwargs={"enable_thinking": False})(plain)
    assert trained(no_think) == "three.<|im_end|>\n"
    assert tok.decode(no_think["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nthree.<|im_end|>\n")
    own = copy.deepcopy(tok)
    own.chat_template = WITH_BLOCKS["chatml"]
    with pytest.raises(UserError, match="train_on_reasoning=false.*generation"):
        SFTTokenizer(own, train_on_reasoning=False)
