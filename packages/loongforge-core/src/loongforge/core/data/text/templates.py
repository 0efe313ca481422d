"""Chat templates with assistant-token masks.

The tokenizer's own Jinja template is used unless `template` names a built-in one. The
built-ins are the published templates themselves, shipped in `assets/chat_templates/` (each
file names its source): `llama3` (Llama 3.0), `llama3.1`, `llama3.2`, `qwen2` (Qwen2.5),
`qwen3`, `deepseek_v3`, `gemma`, so a built-in renders byte for byte what the model's own
tokenizer does. Template variables (`enable_thinking` of Qwen3, `date_string` of Llama 3.1 /
3.2, `tools_in_user_message`) come from `template_kwargs`; the Llama 3.2 built-in pins
`date_string` to its published fallback, 26 Jul 2024, unless told otherwise, so the data do not
change with the day they are tokenized on. DeepSeek-V3's template gets each tool call's
arguments as their JSON text, as it concatenates them.

A template with `{% generation %}` blocks marks the assistant text itself, so HF's
`apply_chat_template(..., return_assistant_tokens_mask=True)` gives the mask; any other template's
mask comes from rendering the conversation incrementally (`assistant_mask`), refused for a
conversation on which the template is not prefix-stable. Either way the trained tokens are each
assistant turn's content, its end-of-turn token and the separator the template puts after it;
`train_on_reasoning=False` takes the `<think>...</think>` block of a turn out of them.
"""

from __future__ import annotations

import re
from collections import Counter
from importlib import resources

from loongforge.core.data.text.assistant_mask import NotPrefixStable, incremental_mask
from loongforge.core.data.text.formats import BadSample, Conversation, arguments_as_text
from loongforge.core.errors import UserError

BUILTIN_NAMES = ("llama3", "llama3.1", "llama3.2", "qwen2", "qwen3", "deepseek_v3", "gemma")
_BUILTIN_KWARGS = {"llama3.2": {"date_string": "26 Jul 2024"}}
_ARGUMENTS_AS_TEXT = {"deepseek_v3"}  # its template concatenates a tool call's arguments as a string


_ASSETS = resources.files("loongforge.core.data.text").joinpath("assets", "chat_templates")
BUILTIN_TEMPLATES = {name: _ASSETS.joinpath(f"{name}.jinja").read_text() for name in BUILTIN_NAMES}


def builtin_template(name: str) -> str:
    """The text of the built-in template `name` (a UserError naming the built-ins otherwise)."""
    if name not in BUILTIN_TEMPLATES:
        raise UserError(f"unknown chat template {name!r}; built-in: {', '.join(BUILTIN_NAMES)}")
    return BUILTIN_TEMPLATES[name]


THINK = ("<think>", "</think>")

IGNORE = -100
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class SFTTokenizer:
    """messages -> (input_ids, labels) with the loss only where the options say.

    `train_on_prompt`: loss on every token. `last_turn_only`: loss on the last assistant turn only.
    `train_on_reasoning=False`: no loss on the reasoning (the `<think>` block) of an assistant turn.
    `template_kwargs`: the template's own variables (e.g. enable_thinking, date_string).
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
        template_kwargs: dict | None = None,
    ):
        self.tok = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.arguments_as_text = template in _ARGUMENTS_AS_TEXT
        if template is not None:
            self.template, self.template_name = builtin_template(template), f"the built-in template {template!r}"
            self.template_kwargs = {**_BUILTIN_KWARGS.get(template, {}), **self.template_kwargs}
        elif getattr(tokenizer, "chat_template", None):
            self.template, self.template_name = tokenizer.chat_template, "the tokenizer's chat template"
            if not _GENERATION.search(self.template) and not getattr(tokenizer, "is_fast", False):
                raise UserError(
                    "the tokenizer's chat template has no {% generation %} blocks and the tokenizer gives no character "
                    f"offsets (not a fast tokenizer), so no assistant mask can be derived; set a built-in template ({', '.join(BUILTIN_TEMPLATES)})"
                )
        else:
            raise UserError(f"the tokenizer has no chat template; set a built-in one ({', '.join(BUILTIN_TEMPLATES)})")
        if not train_on_reasoning and _GENERATION.search(self.template):
            raise UserError(
                f"data.train_on_reasoning=false: {self.template_name} marks its trained text with {{% generation %}} blocks, "
                "which decide the mask themselves; drop the option or use a template without them"
            )
        self.train_on_reasoning = train_on_reasoning
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
        if self.arguments_as_text:
            messages = arguments_as_text(messages)
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
                messages,
                chat_template=self.template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **extra,
                **self.template_kwargs,
            )
            return list(out["input_ids"]), list(out["assistant_masks"])
        try:
            return incremental_mask(
                self.tok,
                self.template,
                messages,
                tools,
                turns="last" if self.last_turn_only else "all",
                exclude=None if self.train_on_reasoning else THINK,
                **self.template_kwargs,
            )
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
