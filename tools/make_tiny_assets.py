"""Regenerate the tiny demo assets (for the demo and tests): the pretraining corpus shipped in
loongforge-llm, the tokenizer and the SFT set shipped in loongforge-core's text data.

The corpus is synthetic, deterministic English-like text with learnable structure (templated
facts, counting, simple arithmetic); the tokenizer is a byte-level BPE trained on it; the SFT
set is alpaca-format questions about the same facts.

    python tools/make_tiny_assets.py
"""

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLM_ASSETS = ROOT / "packages/loongforge-llm/src/loongforge/llm/assets"  # tiny_corpus.jsonl
TEXT_ASSETS = ROOT / "packages/loongforge-core/src/loongforge/core/data/text/assets"  # tiny_tokenizer/, tiny_sft.jsonl

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
THINGS = ["apple", "book", "lamp", "river", "stone", "garden", "train", "letter", "violin", "kite"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
PLACES = ["the market", "the library", "the hill", "the station", "the harbor", "the school"]
VERBS = ["found", "painted", "carried", "lost", "repaired", "sold", "opened", "watched"]
NUMS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def document(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        n, t, c, p, v = rng.choice(NAMES), rng.choice(THINGS), rng.choice(COLORS), rng.choice(PLACES), rng.choice(VERBS)
        return f"{n} {v} a {c} {t} at {p}. The {t} was {c}. Later {n} went home from {p} with the {c} {t}."
    if kind == 1:
        start = rng.randrange(0, 6)
        return "Counting: " + ", ".join(NUMS[start : start + 5]) + "."
    if kind == 2:
        a, b = rng.randrange(0, 6), rng.randrange(0, 5)
        return f"{NUMS[a]} plus {NUMS[b]} is {NUMS[a + b]}. {NUMS[a + b]} minus {NUMS[b]} is {NUMS[a]}."
    n1, n2 = rng.sample(NAMES, 2)
    t = rng.choice(THINGS)
    return f"{n1} gave the {t} to {n2}. Now {n2} has the {t} and {n1} has no {t}."


def sft_rows(rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(600):
        if rng.random() < 0.5:
            a, b = rng.randrange(0, 6), rng.randrange(0, 5)
            rows.append({"instruction": f"What is {NUMS[a]} plus {NUMS[b]}?", "output": f"{NUMS[a]} plus {NUMS[b]} is {NUMS[a + b]}."})
        else:
            n1, n2 = rng.sample(NAMES, 2)
            t = rng.choice(THINGS)
            rows.append({"instruction": f"{n1} gave the {t} to {n2}. Who has the {t}?", "output": f"{n2} has the {t}."})
    return rows


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    docs = [document(rng) for _ in range(4000)]
    LLM_ASSETS.mkdir(parents=True, exist_ok=True)
    TEXT_ASSETS.mkdir(parents=True, exist_ok=True)
    with open(LLM_ASSETS / "tiny_corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(TEXT_ASSETS / "tiny_tokenizer"))
    sft = sft_rows(random.Random(1))
    with open(TEXT_ASSETS / "tiny_sft.jsonl", "w") as f:
        for r in sft:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(docs)} documents to {LLM_ASSETS}, {len(sft)} SFT rows and a {tok.get_vocab_size()}-token tokenizer to {TEXT_ASSETS}")


if __name__ == "__main__":
    main()
