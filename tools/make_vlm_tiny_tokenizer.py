"""Regenerate the tiny vision-language tokenizers shipped in loongforge-vlm (for the demo and tests),
both core's tiny BPE tokenizer (`loongforge.core.data.text.TINY_TOKENIZER`) plus special tokens and a
published chat template:

- `assets/tiny_tokenizer/`: Qwen2-VL's special tokens and Qwen2-VL / Qwen2.5-VL's chat template (the
  one in Qwen2-VL-2B-Instruct's and Qwen2.5-VL-*-Instruct's tokenizer_config.json);
- `assets/tiny_llava_tokenizer/`: `<|im_start|>`, `<|im_end|>`, `<image>`, `<video>` and
  LLaVA-OneVision's chat template (the one transformers' `convert_llava_onevision_weights_to_hf.py`
  gives the llava-hf LLaVA-OneVision processors: each message's images, then its videos, then its
  text, the assistant's text in `{% generation %}` blocks).

Like the Qwen2 tokenizers those models use, EOS is `<|im_end|>`, PAD `<|endoftext|>`, and there is
no BOS. The LLaVA one is written beside `OUT` (`OUT.parent / LLAVA_NAME`).

    python tools/make_vlm_tiny_tokenizer.py
"""

import json
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE_TOKENIZER = ROOT / "packages/loongforge-core/src/loongforge/core/data/text/assets/tiny_tokenizer"
OUT = ROOT / "packages/loongforge-vlm/src/loongforge/vlm/assets/tiny_tokenizer"
LLAVA_NAME = "tiny_llava_tokenizer"

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAVA_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<image>", "<video>"]

# transformers' convert_llava_onevision_weights_to_hf.py `chat_template`, character for character
# (its "\n" are newlines inside the Jinja string literals, as in the llava-hf chat_template.json)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# keys that save_pretrained records about where it loaded from, not what the tokenizer is
LOAD_KEYS = ("is_local", "local_files_only", "name_or_path")


def write_tokenizer(out: Path, special_tokens: list[str], chat_template: str) -> dict:
    """Core's tiny tokenizer with `special_tokens` added and `chat_template`, saved at `out`
    (replaced); the added tokens' ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(CORE_TOKENIZER))
    added = tok.add_tokens(special_tokens, special_tokens=True)
    assert added == len(special_tokens), f"{len(special_tokens) - added} of the special tokens were already there"
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.bos_token = None
    tok.chat_template = chat_template
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        config = Path(tmp) / "tokenizer_config.json"
        meta = json.loads(config.read_text())
        config.write_text(json.dumps({k: v for k, v in meta.items() if k not in LOAD_KEYS}, indent=2, ensure_ascii=False) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in special_tokens}
    print(f"wrote a {len(tok)}-token tokenizer to {out}: {ids}")
    return ids


def main() -> None:
    write_tokenizer(OUT, SPECIAL_TOKENS, CHAT_TEMPLATE)
    write_tokenizer(OUT.parent / LLAVA_NAME, LLAVA_SPECIAL_TOKENS, LLAVA_CHAT_TEMPLATE)


if __name__ == "__main__":
    main()
