"""The assistant mask of a template without `{% generation %}` blocks, by incremental rendering:
the same tokens as the generation-block mask where a template has both, a refusal where the
template is not prefix-stable, and the template's own errors as bad rows."""

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
        {"role": "assistant", "content": "", "tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]},
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


@pytest.mark.parametrize("template", ["qwen2", "qwen3", "llama3"])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_incremental_mask_equals_the_generation_block_mask(tok, template, case):
    messages = CONVERSATIONS[case]
    with_blocks = BUILTIN_TEMPLATES[template]
    ids, want = _generation_mask(tok, with_blocks, messages)
    got_ids, got = incremental_mask(tok, _without_generation_blocks(with_blocks), messages)
    assert got_ids == ids
    assert got == want, (template, case)
    assert sum(want) > 0


def test_mask_covers_content_end_of_turn_and_separator(tok):
    ids, mask = incremental_mask(tok, _without_generation_blocks(BUILTIN_TEMPLATES["qwen2"]), CONVERSATIONS["single turn"])
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
    strict = "{%- if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{%- endif %}" + (
        _without_generation_blocks(BUILTIN_TEMPLATES["qwen2"])
    )
    with pytest.raises(BadSample) as e:
        incremental_mask(tok, strict, CONVERSATIONS["single turn"])
    assert e.value.reason == "template_error" and "a system message comes first" in str(e.value)


def test_tokenizer_template_without_generation_blocks_trains(tok):
    import copy

    from loongforge.core.data.text import SFTTokenizer

    own = copy.deepcopy(tok)
    own.chat_template = _without_generation_blocks(BUILTIN_TEMPLATES["qwen2"])
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
    from loongforge.core.data.text import SFTTokenizer
    from loongforge.core.errors import UserError

    messages = [
        {"role": "user", "content": "one plus two?"},
        {"role": "assistant", "reasoning_content": "count up from one", "content": "three."},
    ]
    with_r = SFTTokenizer(tok, template="qwen3_thinking")(messages)
    without = SFTTokenizer(tok, template="qwen3_thinking", train_on_reasoning=False)(messages)
    assert with_r["input_ids"] == without["input_ids"]  # the same text either way

    def trained(s):
        return tok.decode([t for t in s["labels"] if t != -100])

    assert trained(with_r) == "<think>\ncount up from one\n</think>\n\nthree.<|im_end|>\n"
    assert trained(without) == "three.<|im_end|>\n"
    with pytest.raises(UserError, match="train_on_reasoning=false.*qwen3_thinking"):
        SFTTokenizer(tok, train_on_reasoning=False)
