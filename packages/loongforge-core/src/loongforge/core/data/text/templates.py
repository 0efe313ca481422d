"""Chat templates with assistant-token masks.

The tokenizer's own Jinja template is used when it has one; the built-in templates serve
tokenizers that have none. A template with `{% generation %}` blocks (every built-in one) marks
the assistant text itself, so HF's `apply_chat_template(..., return_assistant_tokens_mask=True)`
gives the mask; any other template's mask comes from rendering the conversation incrementally
(`assistant_mask`), refused for a conversation on which the template is not prefix-stable.
Either way the trained tokens are each assistant turn's content, its end-of-turn token and the
separator the template puts after it.
"""

from __future__ import annotations

import re
from collections import Counter

from loongforge.core.data.text.assistant_mask import NotPrefixStable, incremental_mask
from loongforge.core.data.text.formats import BadSample, Conversation
from loongforge.core.errors import UserError

# A tool call, as HF chat templates take it: {"name", "arguments"} or {"function": {...}}.
_CALL = "{%- set c = call.function if call.function is defined else call %}"
_IM = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{THINK}{{ m['content'] }}"
    "{%- for call in m.get('tool_calls') or [] %}"
    + _CALL
    + "{{ '\n' if (m['content'] or not loop.first) }}<tool_call>\n{\"name\": \"{{ c['name'] }}\", \"arguments\": {{ c['arguments'] | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>{{ '\\n' }}{% endgeneration %}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{%- endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}{%- endif %}"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{{ '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}"
)

_REASONING = "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"


def _im(think: str, train_think: bool = True) -> str:
    """The ChatML template with `think` before each answer, inside the trained span or not."""
    gen = "{% generation %}"
    return _IM.replace("{THINK}", gen + think if train_think else think + gen)


BUILTIN_TEMPLATES = {
    "qwen2": _im(""),
    # Qwen3 without thinking: an empty think block precedes every answer.
    "qwen3": _im("<think>\n\n</think>\n\n"),
    # Qwen3 with thinking: the reasoning, when a message carries it, is trained on too
    # (data.train_on_reasoning=false: REASONING_MASKED's variant).
    "qwen3_thinking": _im(_REASONING),
    # Llama 3.1: a tool call is the assistant's JSON {"name", "parameters"}; results come back as `ipython`.
    "llama3": (
        "{{- bos_token }}"
        "{%- for m in messages %}"
        "{%- if m['role'] == 'assistant' %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% generation %}{{ m['content'] | trim }}"
        "{%- for call in m.get('tool_calls') or [] %}"
        + _CALL
        + '{"name": "{{ c[\'name\'] }}", "parameters": {{ c[\'arguments\'] | tojson }}}'
        "{%- endfor %}<|eot_id|>{% endgeneration %}"
        "{%- elif m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
        "{%- else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{{ '\\n' }}{%- endif %}"
    ),
}
# the same text, the reasoning outside the trained span
REASONING_MASKED = {"qwen3_thinking": _im(_REASONING, train_think=False)}

IGNORE = -100
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class SFTTokenizer:
    """messages -> (input_ids, labels) with the loss only where the options say.

    `train_on_prompt`: loss on every token. `last_turn_only`: loss on the last assistant turn only.
    `train_on_reasoning=False`: no loss on the reasoning (`<think>` block) of a built-in template.
    `append_eos`: the tokenizer's EOS follows the sample (trained on) unless it already ends it.
    Over-long samples raise BadSample("over_long"); `stats` counts kept and bad rows by reason.
    """

    def __init__(
        self,
        tokenizer,
        template: str | None = None,
        max_length: int = 4096,
        train_on_prompt: bool = False,
        last_turn_only: bool = False,
        append_eos: bool = False,
        train_on_reasoning: bool = True,
    ):
        self.tok = tokenizer
        if template is not None:
            if template not in BUILTIN_TEMPLATES:
                raise UserError(f"unknown chat template {template!r}; built-in: {', '.join(BUILTIN_TEMPLATES)}")
            chosen = BUILTIN_TEMPLATES if train_on_reasoning else {**BUILTIN_TEMPLATES, **REASONING_MASKED}
            self.template, self.template_name = chosen[template], f"the built-in template {template!r}"
        elif not train_on_reasoning:
            raise UserError(
                "data.train_on_reasoning=false masks the reasoning where a built-in template renders it: "
                f"set data.template to one ({', '.join(REASONING_MASKED)})"
            )
        elif getattr(tokenizer, "chat_template", None):
            self.template, self.template_name = tokenizer.chat_template, "the tokenizer's chat template"
            if not _GENERATION.search(self.template) and not getattr(tokenizer, "is_fast", False):
                raise UserError(
                    "the tokenizer's chat template has no {% generation %} blocks and the tokenizer gives no character "
                    f"offsets (not a fast tokenizer), so no assistant mask can be derived; set a built-in template ({', '.join(BUILTIN_TEMPLATES)})"
                )
        else:
            raise UserError(f"the tokenizer has no chat template; set a built-in one ({', '.join(BUILTIN_TEMPLATES)})")
        self.max_length = max_length
        self.train_on_prompt = train_on_prompt
        self.last_turn_only = last_turn_only
        if append_eos and tokenizer.eos_token_id is None:
            raise UserError("data.append_eos=true but the tokenizer has no EOS token")
        self.append_eos = append_eos
        self.stats: Counter = Counter()

    def __call__(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        if isinstance(messages, Conversation):
            messages, tools = messages.messages, messages.tools if tools is None else tools
        ids, mask = self._masked(messages, tools)
        if self.append_eos and ids[-1] != self.tok.eos_token_id:
            ids.append(self.tok.eos_token_id)
            mask.append(1)
        if len(ids) > self.max_length:
            raise BadSample("over_long", f"{len(ids)} > {self.max_length} tokens")
        if self.train_on_prompt:
            mask = [1] * len(ids)
        elif self.last_turn_only:
            starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
            mask = [m if starts and i >= starts[-1] else 0 for i, m in enumerate(mask)]
        labels = [t if m else IGNORE for t, m in zip(ids, mask)]
        return {"input_ids": ids, "labels": labels}

    def _masked(self, messages: list[dict], tools) -> tuple[list[int], list[int]]:
        """(input ids, assistant mask): from the template's `{% generation %}` blocks where it has
        them, else by incremental rendering (`assistant_mask`)."""
        if _GENERATION.search(self.template):
            extra = {"tools": tools} if tools is not None else {}
            out = self.tok.apply_chat_template(
                messages, chat_template=self.template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **extra
            )
            return list(out["input_ids"]), list(out["assistant_masks"])
        try:
            return incremental_mask(self.tok, self.template, messages, tools, turns="last" if self.last_turn_only else "all")
        except NotPrefixStable as e:
            raise UserError(
                f"{self.template_name} is not prefix-stable on this conversation: it renders assistant turn {e.index} "
                "differently once later turns follow (as templates that drop earlier turns' reasoning do), so its "
                "tokens cannot be masked exactly; set data.last_turn_only=true, or a template with {% generation %} blocks"
            ) from None

    def tokenize_rows(self, rows, fmt: str, keys: dict | None = None, on_bad_sample: str = "skip", require_trained: bool = True):
        """Yield tokenized samples; count bad rows by reason; error on the first with
        on_bad_sample="error", and (`require_trained`) when no sample has a trained token."""
        from loongforge.core.data.text.formats import to_messages

        if on_bad_sample not in ("skip", "error"):
            raise UserError(f"on_bad_sample={on_bad_sample!r}: choose skip or error")
        trained = 0
        for n, row in enumerate(rows):
            try:
                conv = to_messages(row, fmt, keys)
                sample = self(conv.messages, tools=conv.tools)
            except BadSample as e:
                self.stats[e.reason] += 1
                if on_bad_sample == "error":
                    raise UserError(f"row {n}: {e} (set on_bad_sample=skip to drop such rows)") from None
                continue
            self.stats["kept"] += 1
            trained += sum(1 for x in sample["labels"] if x != IGNORE)
            yield sample
        if trained == 0 and require_trained:
            raise UserError(f"no sample has a token to train on (all labels masked); bad rows: {dict(self.stats)}")
