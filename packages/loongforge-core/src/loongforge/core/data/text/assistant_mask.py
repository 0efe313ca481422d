"""Which tokens of a rendered conversation are the assistant's, for any chat template.

A template with `{% generation %}` blocks says so itself (HF's `return_assistant_tokens_mask`).
Any other template is rendered incrementally: assistant turn i spans from the end of the
conversation before it rendered with the generation prompt (so the assistant header stays
out; where the generation prompt also prefills text the turn does not start with, as DeepSeek-V3's
`<think>`, from where the two part) to the end of the conversation up to and including it (its
content, end-of-turn token and the separator the template puts after it). That is exact only when the template is
prefix-stable on the conversation (each partial rendering a prefix of the whole one); a template
that renders earlier turns differently once later ones exist (Qwen3's published template drops
the reasoning of turns before the last user message) is not, and is refused for that row.
"""

from __future__ import annotations

import os
from typing import Callable

from loongforge.core.data.text.formats import BadSample


class NotPrefixStable(Exception):
    """The template renders assistant turn `index` differently once later turns follow."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def assistant_spans(
    render: Callable[[list, bool], str], messages: list[dict], turns: str = "all", exclude: tuple[str, str] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """(the whole rendering, [(start, end) character spans of the assistant turns]), where
    `render(messages, add_generation_prompt)` renders a conversation. `turns="last"` finds the last
    assistant turn only (which needs prefix stability up to that turn only). `exclude` = (open,
    close): the first open...close block of a turn and the newlines after it stay out (a turn's
    reasoning), splitting its span in two."""
    full = render(messages, False)
    index = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if turns == "last":
        index = index[-1:]
    spans = []
    for i in index:
        upto = render(messages[: i + 1], False)
        if not full.startswith(upto):
            raise NotPrefixStable(i)
        spans += _without_block(upto, _turn_start(render, messages, i, upto), len(upto), exclude)
    return full, spans


def _turn_start(render, messages: list[dict], i: int, upto: str) -> int:
    """Where assistant turn i's own text starts in `upto`: after the generation prompt, or, where
    that prompt prefills what the turn does not start with, after the header the turn shares with
    any other assistant turn in its place (two probe turns that differ from their first character);
    NotPrefixStable where even the conversation before the turn is not a prefix of `upto`."""
    head = render(messages[:i], True)
    if upto.startswith(head):
        return len(head)
    base = render(messages[:i], False) if i else ""
    if not upto.startswith(base):
        raise NotPrefixStable(i)
    start = len(os.path.commonprefix([head, upto]))
    probes = [render(messages[:i] + [{"role": "assistant", "content": c}], False) for c in ("\x01", "\x02")]
    return max(len(base), min(start, len(os.path.commonprefix(probes))))


def _without_block(text: str, start: int, end: int, block: tuple[str, str] | None) -> list[tuple[int, int]]:
    if block is None:
        return [(start, end)]
    a = text.find(block[0], start, end)
    b = text.find(block[1], a + len(block[0]), end) if a >= 0 else -1
    if b < 0:
        return [(start, end)]
    b += len(block[1])
    while b < end and text[b] == "\n":
        b += 1
    return [(x, y) for x, y in ((start, a), (b, end)) if y > x]


def token_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(input ids of `text` as apply_chat_template tokenizes it, 1 where a token starts inside a
    span)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def incremental_mask(
    tokenizer, template: str, messages: list[dict], tools=None, turns: str = "all", exclude: tuple[str, str] | None = None, **kwargs
) -> tuple[list, list]:
    """(input ids, assistant mask) of `messages` under `template` (`kwargs`: its variables), by
    incremental rendering. Raises NotPrefixStable, or BadSample("template_error") where the
    template itself refuses the conversation (its `raise_exception`)."""

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, chat_template=template, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs)

    try:
        text, spans = assistant_spans(render, messages, turns, exclude)
    except NotPrefixStable:
        raise
    except Exception as e:  # the template's own checks (jinja2's TemplateError and what it raises)
        raise BadSample("template_error", str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return token_mask(tokenizer, text, spans)


def marked_text(tokenizer, input_ids: list[int], trained: list[bool], marks: tuple[str, str] = ("[[", "]]")) -> str:
    """The sample's text with each run of trained tokens between `marks` (what a dry run shows)."""
    out, run, on = [], [], False
    for t, m in zip(input_ids, trained):
        if bool(m) != on and run:
            text = tokenizer.decode(run)
            out.append(f"{marks[0]}{text}{marks[1]}" if on else text)
            run = []
        on = bool(m)
        run.append(t)
    if run:
        text = tokenizer.decode(run)
        out.append(f"{marks[0]}{text}{marks[1]}" if on else text)
    return "".join(out)
