"""`write_demo_dataset`: a small LLaVA-style vision-language SFT set of coloured shapes, for demos
and tests.

    root = write_demo_dataset(Path("runs/vlm_demo"), samples=64, seed=0)   # root/data.json, root/images/*.png

Sample i is text-only when i % 8 == 7 (a sum of two small numbers, answered in one word);
every other sample is one PNG image of one shape (circle, square or triangle) of one colour (red,
green, blue, yellow) on a plain light background, `W` x `H` pixels with each side one of 56, 84
and 112 (multiples of 28, so Qwen2-VL's processor keeps them as they are), the shape's size
(a square's side, a circle's diameter, a triangle's base and height) between a third and two
thirds of the shorter side, at a random place inside the image. Its conversation asks for the
colour ("What color is the shape?") or the shape ("What shape is this?") and is answered in one
word; one image sample in four asks the other question in a second turn. Everything is drawn
from `random.Random(seed)`, so a seed gives the same files.

The layout: `images/00000.png` ... (the image samples' ids) and `data.json`, a list of
`{"id", "image": "images/<id>.png", "conversations": [{"from": "human", "value": "<image>\\n..."},
{"from": "gpt", "value": "red"}, ...]}` (text-only rows have no "image"). The set is written into a
temporary sibling and renamed into place; an `out_dir` that exists and is not empty is refused
with a UserError (and left as it is).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from loongforge.core.errors import UserError
from loongforge.core.outputs import write_once

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 230), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
SIDES = (56, 84, 112)
BACKGROUND = (245, 245, 240)
COLOR_QUESTION = "What color is the shape?"
SHAPE_QUESTION = "What shape is this?"
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def demo_rows(samples: int = 64, seed: int = 0) -> list[dict]:
    """Each sample's row as written to data.json, plus (image samples) "_draw": what to draw."""
    rng = random.Random(seed)
    rows = []
    for i in range(samples):
        sid = f"{i:05d}"
        if i % 8 == 7:
            a, b = rng.randrange(0, 6), rng.randrange(0, 5)
            turns = [("human", f"What is {NUMBERS[a]} plus {NUMBERS[b]}?"), ("gpt", NUMBERS[a + b])]
            rows.append({"id": sid, "conversations": _turns(turns)})
            continue
        shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        width, height = rng.choice(SIDES), rng.choice(SIDES)
        short = min(width, height)
        size = rng.randint(short // 3, 2 * short // 3)
        left, top = rng.randint(0, width - size), rng.randint(0, height - size)
        first, second = ((COLOR_QUESTION, color), (SHAPE_QUESTION, shape))[:: rng.choice((1, -1))]
        turns = [("human", f"<image>\n{first[0]}"), ("gpt", first[1])]
        if rng.random() < 0.25:
            turns += [("human", second[0]), ("gpt", second[1])]
        draw = {"shape": shape, "color": color, "width": width, "height": height, "box": [left, top, left + size, top + size]}
        rows.append({"id": sid, "image": f"images/{sid}.png", "conversations": _turns(turns), "_draw": draw})
    return rows


def _turns(turns: list[tuple[str, str]]) -> list[dict]:
    return [{"from": who, "value": text} for who, text in turns]


def draw_image(draw: dict):
    """The PIL image of one sample's "_draw" entry."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (draw["width"], draw["height"]), BACKGROUND)
    pen = ImageDraw.Draw(image)
    left, top, right, bottom = draw["box"]
    fill = COLORS[draw["color"]]
    if draw["shape"] == "circle":
        pen.ellipse([left, top, right - 1, bottom - 1], fill=fill)
    elif draw["shape"] == "square":
        pen.rectangle([left, top, right - 1, bottom - 1], fill=fill)
    else:
        pen.polygon([((left + right - 1) / 2, top), (left, bottom - 1), (right - 1, bottom - 1)], fill=fill)
    return image


def write_demo_dataset(out_dir, samples: int = 64, seed: int = 0) -> Path:
    """Write the demo set (module docstring) at `out_dir` and return it as a Path. A UserError if
    `out_dir` exists and is not empty, or `samples` is not a positive int."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise UserError(f"demo dataset: samples must be a positive int, got {samples!r}")
    out = Path(out_dir)

    def refuse(root: Path):
        raise UserError(f"{root} exists and is not empty; choose a new directory for the demo dataset (it was left as it is)")

    def write(tmp: Path) -> None:
        (tmp / "images").mkdir()
        rows = demo_rows(samples, seed)
        for row in rows:
            draw = row.pop("_draw", None)
            if draw is not None:
                draw_image(draw).save(tmp / row["image"], format="PNG")
        (tmp / "data.json").write_text(json.dumps(rows, indent=1) + "\n")

    return write_once(out, write, refuse)
