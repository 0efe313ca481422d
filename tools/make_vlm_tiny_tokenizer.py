"""Regenerate the tiny vision-language tokenizer shipped in loongforge-vlm (for the demo and tests):
core's tiny BPE tokenizer (`loongforge.core.data.text.TINY_TOKENIZER`) plus Qwen2-VL's special
tokens, and Qwen2-VL / Qwen2.5-VL's published chat template (the one in Qwen2-VL-2B-Instruct's and
Qwen2.5-VL-*-Instruct's tokenizer_config.json). Like those tokenizers, EOS is `<|im_end|>`, PAD
`<|endoftext|>`, and there is no BOS.

    python tools/make_vlm_tiny_tokenizer.py
"""

import json
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE_TOKENIZER = ROOT / "packages/loongforge-core/src/loongforge/core/data/text/assets/tiny_tokenizer"
OUT = ROOT / "packages/loongforge-vlm/src/loongforge/vlm/assets/tiny_tokenizer"

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

# keys that save_pretrained records about where it loaded from, not what the tokenizer is
LOAD_KEYS = ("is_local", "local_files_only", "name_or_path")


def main() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(CORE_TOKENIZER))
    added = tok.add_tokens(SPECIAL_TOKENS, special_tokens=True)
    assert added == len(SPECIAL_TOKENS), f"{len(SPECIAL_TOKENS) - added} of the special tokens were already there"
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.bos_token = None
    tok.chat_template = CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        config = Path(tmp) / "tokenizer_config.json"
        meta = json.loads(config.read_text())
        config.write_text(json.dumps({k: v for k, v in meta.items() if k not in LOAD_KEYS}, indent=2, ensure_ascii=False) + "\n")
        shutil.rmtree(OUT, ignore_errors=True)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, OUT)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    print(f"wrote a {len(tok)}-token tokenizer to {OUT}: {ids}")


if __name__ == "__main__":
    main()
